"""Token sampling: greedy, or temperature / top-k / top-p with a per-session seeded generator."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 64
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")

    def to_wire(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed,
                "max_tokens": self.max_tokens, "stop_ids": list(self.stop_ids)}

    @classmethod
    def from_wire(cls, d: dict) -> "SamplingParams":
        return cls(temperature=float(d.get("temperature", 0.0)), top_k=int(d.get("top_k", 0)),
                   top_p=float(d.get("top_p", 1.0)), seed=d.get("seed"), max_tokens=int(d.get("max_tokens", 64)),
                   stop_ids=tuple(d.get("stop_ids", ())))


def sample_at(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Sample the token at `position` of a session. Deterministic in (seed, position): the random stream
    is derived from both, so a replayed session, or the last stage of a ring, draws the same token as the
    single-process engine. Greedy when temperature == 0."""
    p = params
    x = logits.detach().float().cpu()
    if p.temperature == 0:
        return int(torch.argmax(x))
    x = x / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, -float("inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = sp.cumsum(0) - sp < p.top_p  # smallest prefix whose mass reaches top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[si[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    g = torch.Generator()
    seed = p.seed if p.seed is not None else 0
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63))
    return int(torch.multinomial(probs, 1, generator=g))


def fresh_seed() -> int:
    return int(torch.randint(0, 1 << 62, (1,)))
