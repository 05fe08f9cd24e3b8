"""The `logprobs` of an API choice, in OpenAI's shapes, from the entries the ring returns
(`TokenLogprob`: token, logprob, top ids and logprobs; p2pk3/agent/logprobs.py does the formatting).

    v = Vocab.of(tok)                                   # every id's bytes (once per tokenizer)
    chat_choice(gen, v)                                 # {"content": [...], "refusal": None} or None
    completion_choice(gen, v, echo, offset0)            # {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    chat_delta(entries, v) / completion_delta(...)       # the same for the entries of one stream chunk

Completions with `echo`: the prompt's entries first (its first token has logprob null and top_logprobs
null, as OpenAI and what lm-eval's `local-completions` reads: `token_logprobs[ctxlen:-1]`), then the
answer's.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pk3.agent.logprobs import TokenLogprobs, chat_logprobs, completion_logprobs
from p2pk3.agent.vocab import token_bytes

__all__ = ["Vocab", "chat_choice", "completion_choice", "chat_delta", "completion_delta"]


@dataclass(frozen=True)
class Vocab:
    tokens: list[bytes]

    @classmethod
    def of(cls, tok) -> Vocab:
        return cls(token_bytes(tok)[0])


def chat_delta(entries, vocab: Vocab) -> dict:
    return chat_logprobs(TokenLogprobs.of(entries), vocab.tokens)


def completion_delta(entries, vocab: Vocab, offset0: int = 0) -> dict:
    return completion_logprobs(TokenLogprobs.of(entries), vocab.tokens, offset0)


def chat_choice(gen, vocab: Vocab) -> dict | None:
    """A chat choice's logprobs (None when the request did not ask)."""
    if gen.params.logprobs is None:
        return None
    return chat_delta(gen.logprobs, vocab)


def completion_choice(gen, vocab: Vocab, echo: bool, offset0: int = 0) -> dict | None:
    """A completions choice's logprobs (None when not asked); with echo the prompt's entries first."""
    if gen.params.logprobs is None:
        return None
    entries = list(gen.logprobs)
    if echo:
        entries = list(gen.prompt_logprobs or []) + entries
    return completion_delta(entries, vocab, offset0)
