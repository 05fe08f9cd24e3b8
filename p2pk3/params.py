"""`SamplingParams`: what a request asks of the sampler — the one schema shared by the engine (which
samples), the wire protocol (which carries it in `generate` requests and in the segment that the last
stage samples) and the front ends. Plain Python: no torch, no network.

The agent fields (issue 24; applied on the last stage by p2pk3/engine/sampler.py, in this order):
`logit_bias` ((id, bias) pairs, bias clamped to -100..100), `repetition_penalty` (> 0, 1 = off; over prompt
+ output), `frequency_penalty` / `presence_penalty` (-2..2; over the output), `grammar` (the token mask),
the temperature, `min_p` (0..1), then top-k / top-p. `logprobs` (None, or 0..20): every generated token
comes with its logprob and the top-N of the model's own distribution (before penalties, mask and
temperature, as OpenAI and vLLM report them); `prompt_logprobs` (None or 0..20): the same for the prompt's
tokens (the first has none), what `echo` asks. `grammar`: a map `p2pk3.agent.grammar.matcher_for`
compiles: an OpenAI response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{...}}) or {"type": "lark", "lark": GRAMMAR} (what agent/toolgrammar builds for a forced tool_choice).
Every field is absent from the wire map at its default, so frames from before these fields stay valid.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

# wire field -> accepted Python types (bool is never accepted as a number)
_FIELDS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "seed": (int, type(None)),
    "max_tokens": (int,),
    "stop_ids": (list, tuple),
    "speculate": (str,),
    "draft_tokens": (int,),
    "frequency_penalty": (int, float),
    "presence_penalty": (int, float),
    "repetition_penalty": (int, float),
    "min_p": (int, float),
    "logit_bias": (list, tuple),
    "logprobs": (int, type(None)),
    "prompt_logprobs": (int, type(None)),
    "grammar": (dict, type(None)),
}
_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "logit_bias": (),
    "logprobs": None,
    "prompt_logprobs": None,
    "grammar": None,
}
MAX_STOP_IDS = 64
# Speculative decoding (p2pk3/spec): how the entry drafts tokens that the ring verifies in one pass. It never
# changes the output (greedy and seeded sampling give the same tokens with and without it), only the speed.
SPEC_METHODS = ("off", "ngram", "suffix")
MAX_DRAFT = 16  # drafted tokens per pass at most (wire limit of a segment's `draft`)
DEFAULT_DRAFT = 8
# Front-end limits and defaults (CLI and API alike; p2pk3/frontends/prompt.py). The engine samples at any
# temperature >= 0; the front ends accept what OpenAI's API accepts.
MAX_TEMPERATURE = 2.0
MAX_SEED = (1 << 63) - 1
DEFAULT_MAX_TOKENS = 64  # generated tokens when neither the user nor the checkpoint's generation_config says
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit)
MAX_LOGIT_BIAS = 1024  # (id, bias) pairs
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to +-this (OpenAI)
MAX_GRAMMAR_BYTES = 256 << 10  # a grammar's JSON text (it travels in segment headers)
GRAMMAR_TYPES = ("json_object", "json_schema", "lark")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None with temperature > 0: the entry draws one
    max_tokens: int = DEFAULT_MAX_TOKENS  # generated tokens
    stop_ids: tuple[int, ...] = ()
    speculate: str = "off"  # draft proposer at the entry: off | ngram (prompt lookup) | suffix (+ cluster index)
    draft_tokens: int = DEFAULT_DRAFT  # most drafted tokens per pass (the entry adapts below it, 0 included)
    # the agent fields (module doc); neutral defaults leave every token bit-identical
    frequency_penalty: float = 0.0  # OpenAI, -2..2, over the output
    presence_penalty: float = 0.0  # OpenAI, -2..2, over the output
    repetition_penalty: float = 1.0  # vLLM / HF, > 0, 1 = off, over prompt + output
    min_p: float = 0.0  # vLLM, 0..1, after the temperature
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), bias clamped to +-100
    logprobs: int | None = None  # None: none; N: each token's logprob and the top N (0..20)
    prompt_logprobs: int | None = None  # None: none; N: the prompt tokens' logprobs and top N (echo)
    grammar: dict | None = None  # the token mask (module doc); None: unconstrained

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(self.stop_ids)}")
        if self.speculate not in SPEC_METHODS:
            raise ValueError(f"speculate must be one of {', '.join(SPEC_METHODS)}, got {self.speculate!r}")
        if not 0 <= self.draft_tokens <= MAX_DRAFT:
            raise ValueError(f"draft_tokens must be in 0..{MAX_DRAFT}, got {self.draft_tokens}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if self.grammar is not None:
            _check_grammar(self.grammar)

    @property
    def penalized(self) -> bool:
        """Any of the penalties / biases / min_p is set (the sampler then processes the logits)."""
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
            or self.min_p != 0
            or bool(self.logit_bias)
        )

    @property
    def stateful(self) -> bool:
        """The last stage keeps state for the session (the token history that penalties, the grammar and
        prompt logprobs need), so the entry sends the session's token ids with its segments."""
        return (
            self.grammar is not None
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
            or self.prompt_logprobs is not None
        )

    @property
    def needs_prompt_ids(self) -> bool:
        """The last stage's sampler reads the prompt's ids, not only the output's (the repetition penalty counts
        them, prompt logprobs score them). Started at a cached prefix, such a session's first segment carries
        the ids below it (`Segment.history`); prompt logprobs start at position 0 (their rows are computed)."""
        return self.repetition_penalty != 1 or self.prompt_logprobs is not None

    @property
    def speculating(self) -> bool:
        return self.speculate != "off" and self.draft_tokens > 0

    def sampler(self) -> "SamplingParams":
        """What the sampler needs (the speculation options dropped): the map a segment carries."""
        return (
            self
            if self.speculate == "off" and self.draft_tokens == DEFAULT_DRAFT
            else replace(self, speculate="off", draft_tokens=DEFAULT_DRAFT)
        )

    def with_seed(self, seed: int) -> "SamplingParams":
        return replace(self, seed=seed)

    def to_wire(self) -> dict[str, Any]:
        """The wire map (a fresh top-level dict each call)."""
        return dict(self.wire_map())

    def wire_map(self) -> dict[str, Any]:
        """The wire map itself, built once per (frozen) instance and shared (do not modify it): the same
        parameters cross every hop of every pass (`dataclasses.asdict` cost ~50-100 us a segment)."""
        w = self.__dict__.get("_wire")
        if w is None:
            w = {f: getattr(self, f) for f in _FIELDS}
            w["stop_ids"] = list(self.stop_ids)
            for k, v in _DEFAULTS.items():  # the agent fields only when set: older frames stay what they were
                if w[k] == v:
                    del w[k]
            if "logit_bias" in w:
                w["logit_bias"] = [[t, b] for t, b in self.logit_bias]
            if self.speculate == "off":  # the wire stays as it was without speculation
                del w["speculate"]
                if self.draft_tokens == DEFAULT_DRAFT:
                    del w["draft_tokens"]
            object.__setattr__(self, "_wire", w)  # not a field: equality, hash and replace() ignore it
        return w

    @classmethod
    def from_wire(cls, d: Any) -> "SamplingParams":
        """Parse a wire map; raises ValueError naming the field on a wrong type, value or unknown key."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a map, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(_FIELDS)}")
        for k, v in d.items():
            types = _FIELDS[k]
            if isinstance(v, bool) or not isinstance(v, types):
                raise ValueError(f"sampling parameter {k!r} has the wrong type ({type(v).__name__})")
        stops = d.get("stop_ids", ())
        if len(stops) > MAX_STOP_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops
        ):
            raise ValueError(f"stop_ids must be at most {MAX_STOP_IDS} non-negative integers")
        kw = {k: v for k, v in d.items() if k != "stop_ids"}
        for k in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"):
            if k in kw and not math.isfinite(kw[k]):
                raise ValueError(f"sampling parameter {k!r} must be finite, got {kw[k]}")
        if "logit_bias" in kw:
            kw["logit_bias"] = tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in kw["logit_bias"])
        return cls(**kw, stop_ids=tuple(stops))


def _logit_bias(pairs: Any) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs, checked; biases clamped to +-LOGIT_BIAS_LIMIT; one pair per id (the last wins)."""
    if isinstance(pairs, dict):
        pairs = tuple(pairs.items())
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(pairs)} entries, at most {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for p in pairs:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {p!r}")
        t, b = p
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"logit_bias token id must be a non-negative integer, got {t!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise ValueError(f"logit_bias[{t}] must be a finite number, got {b!r}")
        out[t] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b)))
    return tuple(sorted(out.items()))


def _check_grammar(g: Any) -> None:
    """The grammar's shape (its contents are compiled, and refused with the engine's message, where the
    mask is applied: p2pk3.agent.grammar.matcher_for)."""
    if not isinstance(g, dict):
        raise ValueError(f"grammar must be a map, got {type(g).__name__}")
    kind = g.get("type")
    if kind not in GRAMMAR_TYPES:
        raise ValueError(f"grammar type must be one of {', '.join(GRAMMAR_TYPES)}, got {kind!r}")
    if kind == "lark" and not isinstance(g.get("lark"), str):
        raise ValueError('a lark grammar needs "lark": the grammar text')
    if kind == "json_schema" and not isinstance(g.get("json_schema"), dict):
        raise ValueError('a json_schema grammar needs "json_schema": {"name": ..., "schema": {...}}')
    try:
        n = len(json.dumps(g))
    except (TypeError, ValueError) as e:
        raise ValueError(f"grammar must be plain JSON data: {e}") from None
    if n > MAX_GRAMMAR_BYTES:
        raise ValueError(f"grammar is {n} bytes of JSON, at most {MAX_GRAMMAR_BYTES}")


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability as the sampler reports it and the wire carries it (results, token and
    done frames): the token id, its logprob (None: no distribution, the first prompt token) and the top-N
    ids with their logprobs (N = the request's logprobs / prompt_logprobs). Wire: [token, logprob, [ids],
    [logprobs]]; logprobs are finite and <= 0 (p2pk3.agent.logprobs writes -inf as -9999.0)."""

    token: int
    logprob: float | None
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def to_wire(self) -> list:
        return [int(self.token), self.logprob, [int(t) for t in self.top_ids], [float(x) for x in self.top_logprobs]]

    @classmethod
    def from_wire(cls, v: Any) -> "TokenLogprob":
        """Raises ValueError naming what is wrong."""
        if not isinstance(v, (list, tuple)) or len(v) != 4:
            raise ValueError(f"a logprob entry is [token, logprob, [ids], [logprobs]], got {str(v)[:40]}")
        tok, lp, ids, lps = v
        if not _is_int(tok) or tok < 0:
            raise ValueError(f"token must be a non-negative integer, got {tok!r}")
        if lp is not None and not _logprob(lp):
            raise ValueError(f"logprob must be a finite number <= 0 or nil, got {lp!r}")
        if (
            not isinstance(ids, (list, tuple))
            or not isinstance(lps, (list, tuple))
            or len(ids) != len(lps)
            or len(ids) > MAX_LOGPROBS
            or not all(_is_int(t) and t >= 0 for t in ids)
            or not all(_logprob(x) for x in lps)
        ):
            raise ValueError(f"top ids and logprobs must be two lists of equal length, at most {MAX_LOGPROBS}")
        return cls(tok, None if lp is None else float(lp), tuple(ids), tuple(float(x) for x in lps))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _logprob(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 0
