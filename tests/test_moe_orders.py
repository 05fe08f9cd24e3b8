"""The three orders of the dequantized routed experts (kernels/mxfp4_moe_ref.py `dequantized_moe`: expert-major,
gathered, loop over experts) against a by-hand oracle written token by token, choice by choice (spec 5.1
steps 5-6: u[n] = sum_j w[n, j] * W2_e act(W1_e z[n], W3_e z[n])), with choices this stage does not hold
(id -1) skipped."""

from __future__ import annotations

import math

import pytest
import torch

from p2pk3_kernels import mxfp4_moe_ref as ref

E, W, I, K = 16, 48, 40, 2


def situ(g: float, u: float) -> float:
    sig = 1.0 / (1.0 + math.exp(-g))
    return (4.0 * math.tanh(g / 4.0) * sig) * (25.0 * math.tanh(u / 25.0))


def by_hand(z, w1, w3, w2, ids, tw) -> torch.Tensor:
    out = torch.zeros(z.shape[0], W, dtype=torch.float64)
    z, w1, w3, w2 = (t.double() for t in (z, w1, w3, w2))
    for n in range(z.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            if e < 0:
                continue
            g, u = w1[e] @ z[n], w3[e] @ z[n]
            h = torch.tensor([situ(float(g[i]), float(u[i])) for i in range(I)], dtype=torch.float64)
            out[n] += float(tw[n, j]) * (w2[e] @ h)
    return out


def case(n: int, seed: int, pattern: str):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, W, generator=g)
    w1, w3 = (torch.randn(E, I, W, generator=g) * 0.2 for _ in range(2))
    w2 = torch.randn(E, W, I, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    if pattern == "unheld":
        ids[torch.rand(ids.shape, generator=g) < 0.3] = -1
    elif pattern == "one expert":  # every token's first choice on expert 3: the grid would be mostly empty
        ids[:, 0] = 3
        ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
    tw = torch.rand(n, K, generator=g)
    return z, w1, w3, w2, ids, tw


@pytest.mark.parametrize(
    "n,pattern,order",
    [
        (1, "even", "gathered"),
        (16, "even", "expert-major"),
        (16, "unheld", "expert-major"),
        (5, "even", "expert-major"),
        (300, "one expert", "loop"),
        (12, "one expert", "expert-major"),
    ],
)
def test_dequantized_moe_orders_match_the_oracle(n, pattern, order):
    z, w1, w3, w2, ids, tw = case(n, 7 + n, pattern)
    w13 = torch.cat([w1, w3], 1)
    grid = ref.expert_major(z, w13, w2, ids, tw, "situ", 4.0, 25.0)
    assert (grid is not None) == (order == "expert-major")
    if order == "loop":  # too many tokens to gather their experts' weights
        assert not ref.batched_order(ids, E, I, W)
    out = ref.dequantized_moe(z, w13, w2, ids, tw)
    want = by_hand(z, w1, w3, w2, ids, tw)
    err = float((out.double() - want).abs().max() / want.abs().max())
    assert err <= 1e-5, (order, err)
    if grid is not None:
        assert torch.equal(out, grid)


def test_expert_major_with_nothing_held_here_is_zero():
    z, w1, w3, w2, ids, tw = case(6, 1, "even")
    out = ref.dequantized_moe(z, torch.cat([w1, w3], 1), w2, torch.full_like(ids, -1), tw)
    assert torch.equal(out, torch.zeros(6, W))
