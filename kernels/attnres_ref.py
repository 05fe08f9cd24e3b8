"""Attention-Residual mix, torch reference (spec 4.2).

out[n] = sum_j p_j[n] * V_j[n],  p[n] = softmax_j( rsqrt(mean_d V_j[n]^2 + eps) * (V_j[n] . w) )
over the candidates V = [bank_0, ..., bank_{R-1}, prefix]. Scoring and mixing in fp32, output in the
dtype of `prefix`.
"""

from __future__ import annotations

import torch


def attnres_mix(bank: torch.Tensor, prefix: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """bank [R, N, D] (R >= 0), prefix [N, D], w [D] (= norm.weight * proj.weight) -> [N, D]."""
    v = torch.cat([bank, prefix.unsqueeze(0)], 0).float()  # [R+1, N, D]
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)  # [R+1, N]
    score = r * (v @ w.float())  # [R+1, N]
    p = torch.softmax(score, dim=0)
    return (p.unsqueeze(-1) * v).sum(0).to(prefix.dtype)
