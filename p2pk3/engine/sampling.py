"""Token sampling: greedy, or temperature / top-k / top-p with a per-session seeded generator."""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class Sampler:
    """Sampling state of one session (its generator advances once per sampled token, so a replay with
    the same seed and history reproduces the same tokens)."""

    params: SamplingParams
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(self.params.seed if self.params.seed is not None else torch.seed())

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] (any float dtype, any device) -> token id."""
        p = self.params
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
        return int(torch.multinomial(probs, 1, generator=self.generator))
