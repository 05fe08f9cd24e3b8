"""Token sampling: greedy, or temperature / min_p / top-k / top-p with a per-session seeded generator.
(`SamplingParams`, the request schema, is defined in p2pk3/params.py and re-exported here; penalties,
logit_bias and the grammar mask are applied to the logits before, by p2pk3/engine/sampler.py.)"""

from __future__ import annotations

import torch

from p2pk3.agent.penalties import apply_min_p
from p2pk3.params import SamplingParams


def sample_at(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Sample the token at `position` of a session. Deterministic in (seed, position): the random stream
    is derived from both, so a replayed session, or the last stage of a ring, draws the same token as the
    single-process engine. Greedy when temperature == 0."""
    p = params
    x = logits.detach().float().cpu()
    if p.temperature == 0:
        return int(torch.argmax(x))
    x = x / p.temperature
    if p.min_p > 0:  # after the temperature (vLLM's order); relative to the likeliest id, so before top-k
        x = apply_min_p(x.clone()[None], [p.min_p])[0]
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


__all__ = ["SamplingParams", "sample_at", "fresh_seed"]
