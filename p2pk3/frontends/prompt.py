"""The one prompt path of every front end. `p2pk3 generate`, `p2pk3 local --prompt`, the chat REPL
(frontends/repl.py) and the OpenAI API (p2pk3/api) all turn a request into prompt ids and sampling
parameters here, so the same question gets the same prompt, stop ids and defaults whichever way it comes.

    prompts = PromptBuilder.from_pretrained(model_dir)
    p = prompts.chat([{"role": "user", "content": "What is a tuple?"}], SamplingOverrides(temperature=0.7))
    p.ids, p.params                                       # prompt ids; SamplingParams with the stop ids
    p = prompts.text("The with statement", SamplingOverrides())       # plain completion: BOS + the text
    p = prompts.tokens([4064, 17, 9], SamplingOverrides())            # token ids as given
    prompts.answer_text(reply.tokens)      # the answer as text: stop ids and special tokens dropped

* ids: chat messages through the checkpoint's own chat template (`ChatTokenizer`, tokenizer/chat.py);
  plain text after the model's BOS token; token ids checked against the vocabulary.
* stop ids: the checkpoint's (`ChatTokenizer.stop_ids`: generation_config eos ids, eos_token, the
  template's end-of-turn token); none with `ignore_eos`.
* sampling: what the user set in `SamplingOverrides`; every field left None comes from the checkpoint's
  `generation_config.json` (`GenerationDefaults`): temperature, top_p, top_k, the penalties (repetition,
  frequency, presence; off where the file has none), min_p, and the new tokens
  (`max_new_tokens`, else `max_length` minus the prompt, else `DEFAULT_MAX_TOKENS`), capped to the
  context left after the prompt. Asking for more tokens than fit is refused.

Mistakes raise `PromptError`; its `field` ("prompt", "max_tokens", "temperature", ...) is the request
field at fault, which each front end names in its own terms (`--prompt` or `messages`, `--max-tokens` or
`max_completion_tokens`). The ranges checked here (`MAX_TEMPERATURE`, ...) are the ones the CLI's options
and the API's schema declare.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from p2pk3.params import (
    DEFAULT_DRAFT,
    MAX_DRAFT,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_TEMPERATURE,
    SPEC_METHODS,
    SamplingParams,
)

__all__ = ["PromptBuilder", "Prompt", "SamplingOverrides", "PromptError", "DEFAULT_CONTEXT", "context_length"]

DEFAULT_CONTEXT = 1 << 20  # a config.json without max_position_embeddings


class PromptError(ValueError):
    """A request that cannot be turned into a prompt; `field` names the request field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingOverrides:
    """What the user set; None: the checkpoint's generation_config default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None
    speculate: str = "off"
    draft_tokens: int = DEFAULT_DRAFT
    ignore_eos: bool = False  # no stop ids: generate until max_tokens (the API's vLLM extension)
    # issue 24 (p2pk3/params.py): penalties (None: generation_config's value, off when it has none),
    # logit_bias as (id, bias) pairs, logprobs / prompt_logprobs (top N), grammar (a token mask)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: dict | None = None

    def __post_init__(self) -> None:
        checks = (
            ("temperature", lambda v: 0 <= v <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]"),
            ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
            ("top_k", lambda v: v >= 0, ">= 0 (0: off)"),
            ("max_tokens", lambda v: v >= 0, ">= 0"),
            ("seed", lambda v: 0 <= v <= MAX_SEED, f"in [0, {MAX_SEED}]"),
            ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("repetition_penalty", lambda v: 0 < v <= 1e6, "> 0 (1: off)"),
            ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
        )
        for name, ok, what in checks:
            v = getattr(self, name)
            if v is not None and not ok(v):
                raise PromptError(name, f"{name} must be {what}, got {v}")
        if self.speculate not in SPEC_METHODS:
            raise PromptError(
                "speculate", f"speculate must be one of {', '.join(SPEC_METHODS)}, got {self.speculate!r}"
            )
        if not 1 <= self.draft_tokens <= MAX_DRAFT:
            raise PromptError("draft_tokens", f"draft_tokens must be in [1, {MAX_DRAFT}], got {self.draft_tokens}")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    params: SamplingParams  # stop ids included


def context_length(model_dir: str | Path) -> int:
    """Prompt + generated tokens at most: config.json's max_position_embeddings (top level or text_config)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        n = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
        return int(n or DEFAULT_CONTEXT)
    except (OSError, ValueError, TypeError, AttributeError):
        return DEFAULT_CONTEXT


class PromptBuilder:
    """Requests -> `Prompt` for one checkpoint (see the module doc)."""

    def __init__(self, tokenizer, context_len: int = DEFAULT_CONTEXT):
        """tokenizer: a `p2pk3.tokenizer.ChatTokenizer`."""
        self.tok = tokenizer
        self.context_len = context_len

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> PromptBuilder:
        from p2pk3.tokenizer import ChatTokenizer

        return cls(ChatTokenizer.from_pretrained(model_dir), context_length(model_dir))

    # -- prompt ids --------------------------------------------------------------------------------------
    def chat_ids(
        self, messages: Sequence[Mapping], tools: Sequence[dict] | None = None, template_vars: Mapping | None = None
    ) -> list[int]:
        """The conversation through the checkpoint's chat template, ending with the generation prompt;
        template_vars: more template variables (the API's `reasoning_effort`)."""
        from p2pk3.tokenizer import ChatTemplateError

        try:
            ids = self.tok.apply_chat_template(
                messages, add_generation_prompt=True, tools=tools, **dict(template_vars or {})
            )
        except ChatTemplateError as e:
            raise PromptError("prompt", f"the chat template refused the messages: {e}") from None
        return self._nonempty(ids)

    def text_ids(self, text: str) -> list[int]:
        """Plain completion: the model's BOS token (when it has one), then the text."""
        if not text:
            raise PromptError("prompt", "the prompt is empty")
        bos = [self.tok.bos_id] if self.tok.bos_id is not None else []
        return self._nonempty(bos + self.tok.encode(text))

    def token_ids(self, ids: Sequence[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.tok.vocab_size]
        if bad:
            raise PromptError("prompt", f"token ids {bad[:5]} are outside the vocabulary 0..{self.tok.vocab_size - 1}")
        return self._nonempty(list(ids))

    @staticmethod
    def _nonempty(ids: list[int]) -> list[int]:
        if not ids:
            raise PromptError("prompt", "the prompt is empty")
        return ids

    # -- sampling ----------------------------------------------------------------------------------------
    def sampling(self, asked: SamplingOverrides, n_prompt: int) -> SamplingParams:
        """The sampling parameters of a prompt of `n_prompt` tokens: the user's, else the checkpoint's."""
        room = self.context_len - n_prompt
        if room < 1:
            raise PromptError("prompt", f"the prompt has {n_prompt} tokens; the model's context is {self.context_len}")
        if asked.max_tokens is not None and asked.max_tokens > room:
            raise PromptError(
                "max_tokens",
                f"{asked.max_tokens} tokens do not fit: the prompt has {n_prompt} "
                f"tokens and the model's context is {self.context_len}",
            )
        d = self.tok.generation_defaults
        max_tokens = asked.max_tokens if asked.max_tokens is not None else max(1, min(d.max_tokens(n_prompt), room))
        bad = [t for t, _ in asked.logit_bias if not 0 <= t < self.tok.vocab_size]
        if bad:
            raise PromptError(
                "logit_bias", f"logit_bias token ids {bad[:5]} are outside the vocabulary 0..{self.tok.vocab_size - 1}"
            )

        def pick(v, default):
            return default if v is None else float(v)

        extra = dict(
            frequency_penalty=pick(asked.frequency_penalty, d.frequency_penalty),
            presence_penalty=pick(asked.presence_penalty, d.presence_penalty),
            repetition_penalty=pick(asked.repetition_penalty, d.repetition_penalty),
            min_p=pick(asked.min_p, d.min_p),
            logit_bias=asked.logit_bias,
            logprobs=asked.logprobs,
            prompt_logprobs=asked.prompt_logprobs,
            grammar=asked.grammar,
        )
        return SamplingParams(
            temperature=d.temperature if asked.temperature is None else float(asked.temperature),
            top_p=d.top_p if asked.top_p is None else float(asked.top_p),
            top_k=d.top_k if asked.top_k is None else asked.top_k,
            seed=asked.seed,
            max_tokens=max_tokens,
            stop_ids=() if asked.ignore_eos else self.tok.stop_ids,
            speculate=asked.speculate,
            draft_tokens=asked.draft_tokens,
            **extra,
        )

    # -- whole requests ----------------------------------------------------------------------------------
    def chat(
        self,
        messages: Sequence[Mapping],
        asked: SamplingOverrides,
        tools: Sequence[dict] | None = None,
        template_vars: Mapping | None = None,
    ) -> Prompt:
        ids = self.chat_ids(messages, tools, template_vars)
        return Prompt(ids, self.sampling(asked, len(ids)))

    def question(self, text: str, asked: SamplingOverrides) -> Prompt:
        """One user message (what `generate --prompt` and `local --prompt` ask)."""
        if not text.strip():
            raise PromptError("prompt", "the prompt is empty")
        return self.chat([{"role": "user", "content": text}], asked)

    def text(self, text: str, asked: SamplingOverrides) -> Prompt:
        ids = self.text_ids(text)
        return Prompt(ids, self.sampling(asked, len(ids)))

    def tokens(self, ids: Sequence[int], asked: SamplingOverrides) -> Prompt:
        ids = self.token_ids(ids)
        return Prompt(ids, self.sampling(asked, len(ids)))

    # -- answers -----------------------------------------------------------------------------------------
    def answer_text(self, tokens: Sequence[int], stop_ids: Sequence[int] | None = None) -> str:
        """The generated tokens as text, as the stream decoders show it: stop ids and special tokens dropped."""
        stops = set(self.tok.stop_ids if stop_ids is None else stop_ids)
        return self.tok.decode([t for t in tokens if t not in stops], skip_special=True)
