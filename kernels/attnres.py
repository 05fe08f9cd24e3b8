"""Attention-Residual mix, Triton (same contract as `attnres_ref.attnres_mix`).

out[n] = sum_j p_j V_j[n],  p = softmax_j( rsqrt(mean_d V_j[n]^2 + eps) * (V_j[n] . w) ),
candidates V = [bank_0 .. bank_{R-1}, prefix] (R may be 0).

One program per token (grid over N; the score of a candidate needs its whole row, so D is not split).
A single pass over the candidates: each row is loaded once, its RMS and its projection on w computed, and the
running output is rescaled by an online softmax (running max and denominator), so every candidate is read
exactly once and nothing is materialised. fp32 math, output in the prefix dtype. Rows must have a unit stride
along D (any strides along R and N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attnres_kernel(bank_ptr, pre_ptr, w_ptr, out_ptr, R, D, sb_r, sb_n, sp_n, so_n, eps, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    dm = offs < D
    w = tl.load(w_ptr + offs, mask=dm, other=0.0).to(tl.float32)
    # the prefix first (it always exists), then the bank rows: order does not change a softmax
    v = tl.load(pre_ptr + n * sp_n + offs, mask=dm, other=0.0).to(tl.float32)
    m = tl.rsqrt(tl.sum(v * v, 0) / D + eps) * tl.sum(v * w, 0)
    den = tl.full((), 1.0, dtype=tl.float32)
    acc = v
    for j in range(0, R):
        v = tl.load(bank_ptr + j * sb_r + n * sb_n + offs, mask=dm, other=0.0).to(tl.float32)
        s = tl.rsqrt(tl.sum(v * v, 0) / D + eps) * tl.sum(v * w, 0)
        m_new = tl.maximum(m, s)
        a = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        acc = acc * a + p * v
        den = den * a + p
        m = m_new
    tl.store(out_ptr + n * so_n + offs, (acc / den).to(out_ptr.dtype.element_ty), mask=dm)


def _attnres_mix(bank, prefix, w, eps, out=None):
    R, N, D = bank.shape if bank.dim() == 3 else (0, *prefix.shape)
    assert prefix.shape == (N, D) and w.numel() == D
    if prefix.stride(-1) != 1:
        prefix = prefix.contiguous()
    if R > 0 and bank.stride(-1) != 1:
        bank = bank.contiguous()
    w = w.reshape(-1).contiguous()
    if out is None:
        out = torch.empty(N, D, dtype=prefix.dtype, device=prefix.device)
    if N == 0:
        return out
    bank_arg = bank if R > 0 else prefix  # never read when R == 0
    sb_r, sb_n = (bank.stride(0), bank.stride(1)) if R > 0 else (0, 0)
    BLOCK_D = triton.next_power_of_2(D)
    nw = 4 if BLOCK_D <= 2048 else (8 if BLOCK_D <= 8192 else 16)
    _attnres_kernel[(N,)](
        bank_arg,
        prefix,
        w,
        out,
        R,
        D,
        sb_r,
        sb_n,
        prefix.stride(0),
        out.stride(0),
        float(eps),
        BLOCK_D=BLOCK_D,
        num_warps=nw,
    )
    return out


def attnres_mix(bank: torch.Tensor, prefix: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """bank [R, N, D] (R >= 0), prefix [N, D], w [D] (= norm.weight * proj.weight) -> [N, D]."""
    return _attnres_mix(bank, prefix, w, eps)
