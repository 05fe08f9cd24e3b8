"""Sampling penalties and biases on a batch of logits rows, each row with its own parameters, vectorised.

    p = [Penalties(frequency_penalty=0.5, logit_bias=parse_logit_bias({"42": 5}, V)), Penalties()]
    apply_penalties(logits, p, prompt_ids=[[...], [...]], output_ids=[[...], [...]])   # (B, V), in place
    apply_min_p(logits / temperature, [0.05, 0.0])                                      # after temperature

Semantics, and the order they apply in (vLLM's sampler order):
1. `logit_bias` (OpenAI): {token id as a string: bias}, biases clamped to -100..100, added to the logits.
2. `repetition_penalty` (vLLM / HF extension, > 0, 1 = off): for every id in prompt + output, a positive
   logit is divided by it, a negative one multiplied by it.
3. `frequency_penalty` and `presence_penalty` (OpenAI, -2..2): over the *generated* ids only,
   logit -= frequency_penalty * count(id) + presence_penalty * (count(id) > 0).
4. (the sampler divides by the temperature)
5. `min_p` (vLLM extension, 0..1): ids whose probability is below min_p times the most likely id's are
   removed (-inf); done on logits as the ratio exp(l - l_max) so no softmax is taken.

Everything is tensor work over the batch: ids are padded into one (B, L) tensor and counted with
scatter_add; there is no Python loop over tokens or vocabulary ids (only over rows to pad their id lists).
Rows whose parameters are all neutral are left bit-identical.

Called by (next session) the last pipeline stage before sampling (and before the grammar mask); the API
validates the request's fields with `Penalties.from_request`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Penalties", "parse_logit_bias", "apply_penalties", "apply_min_p", "PenaltyError"]

BIAS_LIMIT = 100.0


class PenaltyError(ValueError):
    """A sampling parameter out of its range (the message names the field and the range)."""


def parse_logit_bias(bias: Mapping | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias ({"id": bias}, string keys as JSON has them) as {id: clamped bias}."""
    if not bias:
        return {}
    if not isinstance(bias, Mapping):
        raise PenaltyError(f"logit_bias must be an object of token id -> bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise PenaltyError(f"logit_bias key {k!r} is not a token id (an integer as a string)") from None
        if not 0 <= t < vocab_size:
            raise PenaltyError(f"logit_bias token id {t} is outside the vocabulary 0..{vocab_size - 1}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise PenaltyError(f"logit_bias[{k!r}] must be a number, got {v!r}")
        out[t] = max(-BIAS_LIMIT, min(BIAS_LIMIT, float(v)))
    return out


@dataclass(frozen=True)
class Penalties:
    """One row's parameters (neutral defaults)."""

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise PenaltyError(f"{name} must be between -2 and 2, got {v}")
        if not self.repetition_penalty > 0:
            raise PenaltyError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise PenaltyError(f"min_p must be between 0 and 1, got {self.min_p}")

    @classmethod
    def from_request(cls, body: Mapping, vocab_size: int) -> Penalties:
        """From an OpenAI / vLLM request body (missing or null fields are neutral)."""

        def num(name, default):
            v = body.get(name)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise PenaltyError(f"{name} must be a number, got {v!r}")
            return float(v)

        return cls(
            num("frequency_penalty", 0.0),
            num("presence_penalty", 0.0),
            num("repetition_penalty", 1.0),
            num("min_p", 0.0),
            parse_logit_bias(body.get("logit_bias"), vocab_size),
        )

    @property
    def neutral(self) -> bool:
        return (
            self.frequency_penalty == 0
            and self.presence_penalty == 0
            and self.repetition_penalty == 1
            and self.min_p == 0
            and not self.logit_bias
        )


def _counts(ids: Sequence, batch: int, vocab: int, device) -> torch.Tensor:
    """(B, V) float32 counts of each id per row; ids: per row a list / 1-D tensor of ids."""
    rows = [torch.as_tensor(r, dtype=torch.long, device=device).reshape(-1) for r in ids]
    if len(rows) != batch:
        raise ValueError(f"{len(rows)} id lists for {batch} logits rows")
    counts = torch.zeros((batch, vocab + 1), dtype=torch.float32, device=device)
    if any(r.numel() for r in rows):
        padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=vocab)  # pad -> column V
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[Penalties],
    prompt_ids: Sequence | None = None,
    output_ids: Sequence | None = None,
) -> torch.Tensor:
    """Steps 1-3 of the module doc on logits (B, V), in place; returns logits. prompt_ids / output_ids: per
    row the prompt's and the generated ids (lists or 1-D tensors); None = none."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
    b, v = logits.shape
    if len(params) != b:
        raise ValueError(f"{len(params)} Penalties for {b} logits rows")
    dev = logits.device
    active = [not p.neutral for p in params]
    if not any(active):
        return logits
    biased = [(i, t, x) for i, p in enumerate(params) for t, x in p.logit_bias.items()]
    if biased:
        r, c, x = zip(*biased)
        idx = (torch.tensor(r, device=dev), torch.tensor(c, device=dev))
        logits.index_put_(idx, torch.tensor(x, dtype=logits.dtype, device=dev), accumulate=True)
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    out_counts = _counts(output_ids if output_ids is not None else [[]] * b, b, v, dev)
    work = logits.float()
    if bool((rep != 1).any()):
        seen = out_counts > 0
        if prompt_ids is not None:
            seen |= _counts(prompt_ids, b, v, dev) > 0
        seen &= rep != 1
        work = torch.where(seen, torch.where(work > 0, work / rep, work * rep), work)
    if bool((freq != 0).any() or (pres != 0).any()):
        work = work - freq * out_counts - pres * (out_counts > 0).float()
    rows = torch.tensor(active, device=dev)
    logits[rows] = work[rows].to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Step 5: per row, -inf where exp(l - max l) < min_p (in place; rows with min_p 0 unchanged)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
    mp = torch.as_tensor(min_p, dtype=torch.float32, device=logits.device).reshape(-1, 1)
    if mp.shape[0] != logits.shape[0]:
        raise ValueError(f"{mp.shape[0]} min_p values for {logits.shape[0]} logits rows")
    if not bool((mp > 0).any()):
        return logits
    work = logits.float()
    top = work.max(dim=-1, keepdim=True).values
    drop = (work - top) < torch.log(mp)  # log(0) = -inf: nothing dropped
    logits.masked_fill_(drop, float("-inf"))
    return logits
