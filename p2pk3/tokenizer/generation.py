"""Generation defaults of a checkpoint, from its `generation_config.json` (Hugging Face format).

    g = load_generation_defaults(model_dir)        # missing file: GenerationDefaults() (greedy, no limits)
    g.temperature, g.top_p, g.top_k, g.max_tokens(prompt_tokens=len(ids))

Front ends do not read these themselves: p2pk3/frontends/prompt.py fills in what a request leaves unset.

Fields are in the engine's terms (`p2pk3.engine.sampling.SamplingParams`): `temperature` 0 means greedy,
`top_k` 0 means off. Reading the file:
* `do_sample: false` -> temperature 0 (greedy), whatever `temperature` says (as transformers does);
* `do_sample: true` -> the file's temperature, 1.0 when it has none;
* no `do_sample`: the file's temperature if it has one (as vLLM uses generation_config), else greedy;
* `top_k` missing -> 0 (off; transformers would use 50 when sampling), `top_p` missing -> 1.0;
* `repetition_penalty` (> 0, missing -> 1.0, off) and `min_p` (0..1, missing -> 0.0, off), as transformers
  and vLLM read them;
* `frequency_penalty` / `presence_penalty` (-2..2, missing -> 0.0, off): OpenAI's penalties over the output
  only, a p2pk3 extension of the file (transformers and vLLM ignore the keys). Unlike `repetition_penalty`,
  which also counts the prompt, they leave copying a name from the question alone (docs/quality.md);
* `eos_token_id` may be an int or a list of ints; `max_new_tokens` / `max_length` are kept as given
  (max_length counts the prompt too, see `max_tokens`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from p2pk3.params import DEFAULT_MAX_TOKENS

__all__ = ["GenerationDefaults", "load_generation_defaults"]


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: int | None = None
    max_length: int | None = None
    eos_token_id: tuple[int, ...] = ()
    do_sample: bool | None = None  # as the file says; None: not given
    source: str | None = None  # the file read, None for built-in defaults

    def max_tokens(self, prompt_tokens: int = 0, default: int = DEFAULT_MAX_TOKENS) -> int:
        """New tokens to allow: `max_new_tokens`, else `max_length - prompt_tokens`, else `default`."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is not None:
            return max(0, self.max_length - prompt_tokens)
        return default


def _ids(v, where: str) -> tuple[int, ...]:
    if v is None:
        return ()
    vs = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in vs):
        raise ValueError(f"{where}: eos_token_id must be an int or a list of ints, got {v!r}")
    return tuple(vs)


def load_generation_defaults(model_dir: str | Path) -> GenerationDefaults:
    """`generation_config.json` of `model_dir` as GenerationDefaults (see the module doc)."""
    p = Path(model_dir) / "generation_config.json"
    if not p.exists():
        return GenerationDefaults()
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object, got {type(cfg).__name__}")

    def num(key, kind, ok, what):
        v = cfg.get(key)
        if v is None:
            return None
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or (kind is int and not isinstance(v, int))
            or not ok(v)
        ):
            raise ValueError(f"{p}: {key} must be {what}, got {v!r}")
        return kind(v)

    do_sample = cfg.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ValueError(f"{p}: do_sample must be true or false, got {do_sample!r}")
    temp = num("temperature", float, lambda v: v >= 0, "a number >= 0")
    if do_sample is False:
        temperature = 0.0
    elif do_sample is True:
        temperature = 1.0 if temp is None else temp
    else:
        temperature = 0.0 if temp is None else temp
    top_p = num("top_p", float, lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = num("top_k", int, lambda v: v >= 0, "an int >= 0")
    rep = num("repetition_penalty", float, lambda v: v > 0, "a number > 0 (1.0: off)")
    min_p = num("min_p", float, lambda v: 0 <= v <= 1, "in [0, 1]")
    freq = num("frequency_penalty", float, lambda v: -2 <= v <= 2, "in [-2, 2] (0: off)")
    pres = num("presence_penalty", float, lambda v: -2 <= v <= 2, "in [-2, 2] (0: off)")
    return GenerationDefaults(
        temperature=temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None else top_k,
        repetition_penalty=1.0 if rep is None else rep,
        min_p=0.0 if min_p is None else min_p,
        frequency_penalty=0.0 if freq is None else freq,
        presence_penalty=0.0 if pres is None else pres,
        max_new_tokens=num("max_new_tokens", int, lambda v: v >= 0, "an int >= 0"),
        max_length=num("max_length", int, lambda v: v > 0, "an int > 0"),
        eos_token_id=_ids(cfg.get("eos_token_id"), str(p)),
        do_sample=do_sample,
        source=str(p),
    )
