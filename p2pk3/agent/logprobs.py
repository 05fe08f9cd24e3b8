"""Log probabilities in OpenAI's shapes: chat `logprobs.content`, completions `logprobs`, `echo` prompts.

    lp = token_logprobs(logits, ids, top=5)          # TokenLogprobs: small tensors, what the last stage sends
    chat_logprobs(lp, vocab)                          # {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}
    completion_logprobs(lp, vocab)                    # {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    prompt = prompt_logprobs(prompt_logits, prompt_ids, top=5)   # echo: the first prompt token has None
    completion_logprobs(prompt + lp, vocab)          # the echoed prompt's entries, then the completion's

`logits` (T, V) are the rows that produced the T tokens `ids` (row t is the distribution token t was drawn
from); the log-softmax is taken in float32 whatever the logits' dtype. Only the chosen id's logprob and the
top-k ids and logprobs leave the last stage (`TokenLogprobs`, T * (2k + 2) numbers), never whole rows.
Which logits to pass is the caller's choice; OpenAI's and vLLM's default is the model's own distribution
(before penalties, temperature and masks), so `logprob` answers "how likely did the model find this".
A logprob of -inf (a token the mask forbade) is written as -9999.0, as OpenAI does, since JSON has no -inf.

`vocab` is the list of every id's bytes (`p2pk3.agent.vocab.token_bytes(tokenizer)[0]`): `bytes` is the
token's exact UTF-8 bytes, `token` their text (invalid UTF-8 of a token that splits a character becomes
U+FFFD, as OpenAI shows it). `text_offset` counts characters of the decoded text before each token
(start: `text_offset0`, e.g. the prompt's length when the prompt is not echoed).

Called by (next session) the last pipeline stage (token_logprobs, prompt_logprobs for echo) and the API
(chat_logprobs, completion_logprobs); lm-eval's `local-completions` loglikelihood asks for echo + logprobs.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "TokenLogprobs",
    "token_logprobs",
    "prompt_logprobs",
    "chat_logprobs",
    "completion_logprobs",
    "MAX_TOP_LOGPROBS",
    "NEG_INF_LOGPROB",
]

MAX_TOP_LOGPROBS = 20
NEG_INF_LOGPROB = -9999.0


@dataclass
class TokenLogprobs:
    """Per token: its id, its logprob (None: no distribution, the first prompt token), top-k ids and logprobs."""

    ids: list[int]
    logprobs: list[float | None]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def __add__(self, other: TokenLogprobs) -> TokenLogprobs:
        return TokenLogprobs(
            self.ids + other.ids,
            self.logprobs + other.logprobs,
            self.top_ids + other.top_ids,
            self.top_logprobs + other.top_logprobs,
        )

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, entries) -> TokenLogprobs:
        """From per-token entries as the client library delivers them (`p2pk3.node.client.Reply.logprobs`,
        objects with token, logprob, top_ids, top_logprobs)."""
        es = list(entries)
        return cls(
            [e.token for e in es], [e.logprob for e in es], [list(e.top_ids) for e in es],
            [list(e.top_logprobs) for e in es],
        )


def _finite(x: float) -> float:
    return x if x > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def token_logprobs(logits: torch.Tensor, ids: Sequence[int] | torch.Tensor, top: int = 0) -> TokenLogprobs:
    """Logprobs of `ids` under the rows of `logits` (T, V) (or one row (V,) and one id), plus the top-`top`."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
    rows = logits.unsqueeze(0) if logits.dim() == 1 else logits
    idx = torch.as_tensor(ids, dtype=torch.long, device=rows.device).reshape(-1)
    if rows.dim() != 2 or rows.shape[0] != idx.numel():
        raise ValueError(f"{idx.numel()} ids for logits of shape {tuple(logits.shape)}")
    lsm = torch.log_softmax(rows.float(), dim=-1)
    chosen = lsm.gather(1, idx[:, None])[:, 0]
    if top:
        tv, ti = lsm.topk(min(top, lsm.shape[1]), dim=-1)
        top_ids, top_lp = ti.tolist(), [[_finite(x) for x in r] for r in tv.tolist()]
    else:
        top_ids, top_lp = [[] for _ in range(idx.numel())], [[] for _ in range(idx.numel())]
    return TokenLogprobs(idx.tolist(), [_finite(x) for x in chosen.tolist()], top_ids, top_lp)


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int] | torch.Tensor, top: int = 0) -> TokenLogprobs:
    """Echo: logprobs of the prompt's tokens. logits (P, V) are the prefill rows (row i predicts token i+1;
    the last row, which predicts the first generated token, is not used). The first token has None."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    p = ids.numel()
    if p == 0:
        return TokenLogprobs([], [], [], [])
    if logits.dim() != 2 or logits.shape[0] not in (p, p - 1):
        raise ValueError(f"prompt logits must be ({p} or {p - 1}, V) for {p} prompt ids, got {tuple(logits.shape)}")
    rest = token_logprobs(logits[: p - 1], ids[1:], top) if p > 1 else TokenLogprobs([], [], [], [])
    return TokenLogprobs([int(ids[0])], [None], [[]], [[]]) + rest


def _text(vocab: Sequence[bytes], i: int) -> str:
    return vocab[i].decode("utf-8", errors="replace")


def chat_logprobs(lp: TokenLogprobs, vocab: Sequence[bytes]) -> dict:
    """The chat completion choice's `logprobs` object: {"content": [...]} (refusal None)."""
    content = []
    for i, x, tids, tlps in zip(lp.ids, lp.logprobs, lp.top_ids, lp.top_logprobs):
        content.append(
            {
                "token": _text(vocab, i),
                "logprob": x,
                "bytes": list(vocab[i]),
                "top_logprobs": [
                    {"token": _text(vocab, t), "logprob": y, "bytes": list(vocab[t])} for t, y in zip(tids, tlps)
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(lp: TokenLogprobs, vocab: Sequence[bytes], text_offset0: int = 0) -> dict:
    """The completions choice's `logprobs`: tokens, token_logprobs, top_logprobs (dicts token -> logprob;
    None where the token has no distribution), text_offset."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offset, offsets = text_offset0, []
    for i in lp.ids:
        offsets.append(offset)
        offset += len(dec.decode(vocab[i]))
    tops: list[dict | None] = []
    for x, tids, tlps in zip(lp.logprobs, lp.top_ids, lp.top_logprobs):
        if x is None:
            tops.append(None)
            continue
        d: dict[str, float] = {}
        for t, y in zip(tids, tlps):
            d.setdefault(_text(vocab, t), y)  # two ids with the same text: the likelier one (topk is sorted)
        tops.append(d)
    return {
        "tokens": [_text(vocab, i) for i in lp.ids],
        "token_logprobs": list(lp.logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }
