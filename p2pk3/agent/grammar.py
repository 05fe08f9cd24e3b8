"""Structured outputs: the OpenAI `response_format` as a token mask, over llguidance.

    gtok = GrammarTokenizer(chat_tokenizer, vocab_size=model_vocab)   # once per tokenizer (~3 s at 160k ids)
    m = GrammarMatcher(gtok, {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}, "strict": True}})
    m.apply(logits)            # logits[..., id] = -inf for every id the grammar forbids next (in place)
    m.advance(token_id)        # after sampling; GrammarViolation if the token was not allowed
    m.validate(draft_ids)      # how many of a speculative draft the grammar allows (verify under the mask)
    m.rollback(k); m.reset()   # undo k tokens (rejected draft tokens, replay after a takeover); start over
    m.done                     # a stop token was accepted, or the grammar allows nothing more

Engine: llguidance (chosen over xgrammar, figures in docs/benchmarks.md "Grammar engines"): it builds a
schema's grammar lazily, so a new schema per request costs 2-10 ms where xgrammar compiles 10-20 ms on the
embedded 4k vocabulary and 0.25-1 s on a 160k one (K3's size); per-token mask times are of the same order
(tens of µs median; llguidance faster at 160k in most cases, xgrammar at 4k); it rolls back natively. There
is no pure-Python fallback: without the engine `GrammarTokenizer` raises GrammarEngineMissing naming
`pip install llguidance`.

Whitespace between JSON tokens is bounded (at most 32 whitespace characters in a row), so a model that
prefers whitespace (the adversarial random-logits model of the tests) cannot pad forever. Strings without
`maxLength` are unbounded: only `max_tokens` ends those; the output then is cut, as with any engine.
`strict: true` compiles the schema exactly and refuses a keyword the engine cannot enforce; without strict,
such keywords are ignored (the output still follows the rest of the schema).

Called by (next session) the last pipeline stage, which samples under `apply` and calls `advance` with every
accepted token (also replayed ones after a takeover, and verified draft tokens), and by the API, which
builds one matcher per request with `response_format` (and for `tool_choice` required / named: a json_schema
of the tool's parameters).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch

from .vocab import token_bytes

__all__ = [
    "GrammarTokenizer",
    "GrammarMatcher",
    "matcher_for",
    "GrammarError",
    "GrammarViolation",
    "GrammarEngineMissing",
    "response_format_schema",
    "unpack_bitmask",
    "json_options",
    "MAX_WHITESPACE",
]

MAX_WHITESPACE = 32
ENGINE_INSTALL = "pip install llguidance"


class GrammarError(ValueError):
    """The response_format (or its schema) is invalid or uses what the engine cannot enforce."""


class GrammarViolation(RuntimeError):
    """A token the grammar does not allow was fed to `advance` (the sampler did not apply the mask)."""


class GrammarEngineMissing(ImportError):
    """llguidance is not installed."""


def _engine():
    try:
        import llguidance
    except ImportError as e:
        raise GrammarEngineMissing(
            f"structured outputs need the grammar engine llguidance: {ENGINE_INSTALL} ({e})"
        ) from e
    return llguidance


def response_format_schema(response_format: Mapping | None) -> tuple[dict | None, bool]:
    """(JSON schema, strict) of an OpenAI response_format; (None, False) for none / {"type": "text"}.
    json_object is the schema {"type": "object"}."""
    if response_format is None:
        return None, False
    if not isinstance(response_format, Mapping):
        raise GrammarError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None, False
    if kind == "json_object":
        return {"type": "object"}, False
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        schema = spec.get("schema", {})
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarError(f"response_format json_schema.schema must be a JSON schema object, got {schema!r}")
        return (dict(schema) if isinstance(schema, Mapping) else schema), bool(spec.get("strict", False))
    raise GrammarError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}')


def json_options(strict: bool) -> dict:
    """llguidance's JSON compile options: bounded whitespace; strict refuses unimplemented keywords."""
    return {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_WHITESPACE}}}", "lenient": not strict}


def unpack_bitmask(bitmask: torch.Tensor, n: int) -> torch.Tensor:
    """int32 bitmask (..., ceil(n/32)) (bit j of word w = id 32w+j allowed) -> bool (..., n)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :n]


class _Wrapper:
    """llguidance's TokenizerWrapper protocol over p2pk3's tokenizer (special tokens: a leading 0xFF byte)."""

    def __init__(self, tokenizer, tokens: list[bytes], special: set[int], eos: int):
        self._tok = tokenizer
        self.tokens = [b"\xff" + (t or b"<|unused|>") if i in special else t for i, t in enumerate(tokens)]
        self.special_token_ids = sorted(special)
        self.eos_token_id, self.bos_token_id = eos, getattr(tokenizer, "bos_id", None)
        self.is_tokenizer_wrapper = True

    def __call__(self, s: str | bytes) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return list(self._tok.encode(s))


class GrammarTokenizer:
    """The engine's view of one tokenizer: every id's bytes, the stop ids, the model's logits width.
    Build once per tokenizer and share across requests."""

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_ids: Sequence[int] | None = None):
        """tokenizer: a p2pk3 `Tokenizer` or `ChatTokenizer`; vocab_size: the logits width (>= the
        tokenizer's; ids past the tokenizer are never allowed); stop_ids: ids that end the output once the
        grammar is complete (default: the tokenizer's stop_ids / eos_ids)."""
        ll = _engine()
        tokens, special = token_bytes(tokenizer)
        n = vocab_size or len(tokens)
        if n < len(tokens):
            raise GrammarError(f"vocab_size {n} is smaller than the tokenizer's {len(tokens)} ids")
        special |= set(range(len(tokens), n))
        tokens += [b""] * (n - len(tokens))
        stop = list(
            stop_ids if stop_ids is not None else getattr(tokenizer, "stop_ids", None) or sorted(tokenizer.eos_ids)
        )
        if not stop:
            raise GrammarError("the tokenizer has no stop id: pass stop_ids= (the ids that end a response)")
        self.vocab_size, self.stop_ids = n, tuple(stop)
        self.special: dict[str, int] = dict(getattr(tokenizer, "special", {}))  # text -> id
        self.ll_tokenizer = ll.LLTokenizer(_Wrapper(tokenizer, tokens, special, stop[0]), n_vocab=n, eos_token=stop)
        self.words = (n + 31) // 32


class GrammarMatcher:
    """The grammar state of one request: next-token mask, advance, rollback, reset (module doc)."""

    def __init__(
        self,
        gtok: GrammarTokenizer,
        response_format: Mapping | None = None,
        *,
        lark: str | None = None,
        what: str = "response_format",
    ):
        """One of: response_format (OpenAI's object), or lark (an llguidance Lark grammar, e.g. from
        `toolgrammar.tool_call_grammar`); `what` names the grammar in errors."""
        ll = _engine()
        self.schema, self.strict = None, True
        if lark is None:
            self.schema, self.strict = response_format_schema(response_format)
            if self.schema is None:
                raise GrammarError("response_format of type text needs no grammar (build no matcher)")
            try:
                grammar = ll.LLMatcher.grammar_from_json_schema(
                    json.dumps(self.schema), overrides=json_options(self.strict)
                )
            except ValueError as e:
                raise GrammarError(f"{what} schema: {e}") from e
        else:
            grammar = ll.LLMatcher.grammar_from_lark(lark)
        is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, gtok.ll_tokenizer)
        if is_error:
            raise GrammarError(f"{what} cannot be enforced: {'; '.join(messages)}")
        self.gtok = gtok
        self._m = ll.LLMatcher(gtok.ll_tokenizer, grammar, log_level=0)
        self._check()
        self._bitmask = torch.zeros((1, gtok.words), dtype=torch.int32)
        self.tokens: list[int] = []  # every accepted id, in order (replay and audits)
        self._counted: list[bool] = []  # per token: in the engine's own history (rollback counts these)

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"grammar engine: {self._m.get_error()}")

    # -- the mask ----------------------------------------------------------------------------------------
    def bitmask(self) -> torch.Tensor:
        """The next token's allowed ids as an int32 bitmask (1, ceil(V/32)) on the CPU (a reused buffer:
        copy it to keep it)."""
        v = self._bitmask[0]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)
        self._check()
        return self._bitmask

    def allowed(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The next token's allowed ids as a bool tensor (V,)."""
        bm = self.bitmask()
        return unpack_bitmask(bm.to(device) if device is not None else bm, self.gtok.vocab_size)[0]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of forbidden ids to -inf in place and return them. logits: (V',) or (1, V') on
        any device; V' may exceed the grammar's V (the extra ids are forbidden)."""
        allowed = self.allowed(logits.device)
        row = logits if logits.dim() == 1 else logits.view(-1, logits.shape[-1])
        v = min(row.shape[-1], allowed.numel())
        row[..., :v].masked_fill_(~allowed[:v], float("-inf"))
        row[..., v:] = float("-inf")
        return logits

    # -- the state -----------------------------------------------------------------------------------------
    def advance(self, token_id: int) -> None:
        """Accept the sampled token. Raises GrammarViolation (the state does not change) if not allowed."""
        t = int(token_id)
        if t in self.gtok.stop_ids:  # the engine's validate_tokens does not count a stop token
            allowed = self._m.is_accepting() and not (self.tokens and self.tokens[-1] in self.gtok.stop_ids)
        else:
            allowed = 0 <= t < self.gtok.vocab_size and self._m.validate_tokens([t]) == 1
        if not allowed:
            raise GrammarViolation(
                f"token {t} is not allowed by the grammar here (after {len(self.tokens)} "
                "tokens): sample under GrammarMatcher.apply"
            )
        counted = not self._m.is_stopped()  # a stop token after a finished grammar is not in the engine's history
        if counted and not self._m.consume_token(t):
            self._check()
        self.tokens.append(t)
        self._counted.append(counted)

    def validate(self, draft: Sequence[int]) -> int:
        """How many leading tokens of `draft` the grammar allows from here (the state does not change)."""
        return self._m.validate_tokens([int(t) for t in draft])

    def rollback(self, k: int) -> None:
        """Undo the last k accepted tokens."""
        if not 0 <= k <= len(self.tokens):
            raise ValueError(f"cannot roll back {k} tokens: {len(self.tokens)} accepted")
        n = sum(self._counted[len(self._counted) - k :]) if k else 0
        if n and not self._m.rollback(n):
            self._check()
            raise GrammarError(f"grammar engine refused to roll back {k} tokens")
        del self.tokens[len(self.tokens) - k :], self._counted[len(self._counted) - k :]

    def reset(self) -> None:
        """Back to the start (no token accepted)."""
        self._m.reset()
        self.tokens.clear()
        self._counted.clear()

    @property
    def done(self) -> bool:
        """A stop token was accepted, or nothing more can follow (only a stop token is allowed)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete value of the grammar (a stop token may come now)."""
        return self._m.is_accepting()

    def __repr__(self) -> str:
        return f"<GrammarMatcher {len(self.tokens)} tokens done={self.done}>"


def matcher_for(gtok: GrammarTokenizer, grammar: Mapping) -> GrammarMatcher:
    """The matcher of a `SamplingParams.grammar` map: {"type": "lark", "lark": TEXT} (e.g. from
    `toolgrammar.tool_call_grammar`, for tool_choice) or an OpenAI response_format (json_object /
    json_schema). GrammarError names what is wrong."""
    if grammar.get("type") == "lark":
        return GrammarMatcher(gtok, lark=grammar.get("lark"), what=str(grammar.get("what", "tool_choice")))
    return GrammarMatcher(gtok, grammar)
