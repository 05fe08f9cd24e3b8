"""Kimi Delta Attention, torch reference (spec 2.1-2.3).

Inputs are the raw projections; the ops apply the pieces K3 runs "in kernel": L2 norm of q and k
(eps 1e-6 on the sum of squares), the gate (bounded sigmoid gate with `lower_bound`, or Kimi Linear's
softplus gate when `lower_bound` is None), sigmoid(beta), scale. States are fp32 [S, H, K, V]
(key-major, fla's default layout) in a pool indexed by `rows`, updated in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """a [..., H, K] raw gate logits -> log-decay g [..., H, K] fp32 (g <= 0)."""
    H, K = a.shape[-2:]
    x = a.float() + dt_bias.float().view(H, K)
    A = A_log.float()[:H].view(H, 1)
    if lower_bound is None:
        return -A.exp() * F.softplus(x)
    return lower_bound * torch.sigmoid(A.exp() * x)


def kda_decode(q, k, v, a, b, A_log, dt_bias, state, rows, scale: float, lower_bound: float | None) -> torch.Tensor:
    """One recurrent step for a batch of sequences.

    q, k, a [B, H, K]; v [B, H, V]; b [B, H] (beta logits); state [S, H, K, V] fp32; rows [B] int.
    Returns o [B, H, V] fp32; state[rows] is advanced in place.
    """
    g = kda_gate(a, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.float())
    q, k, v = l2norm(q) * scale, l2norm(k), v.float()
    idx = rows.long()
    S = state[idx] * g.exp().unsqueeze(-1)  # decay rows
    err = v - torch.einsum("bhk,bhkv->bhv", k, S)  # read with the decayed state
    S = S + torch.einsum("bhk,bhv->bhkv", beta.unsqueeze(-1) * k, err)
    o = torch.einsum("bhk,bhkv->bhv", q, S)  # read after the write
    state[idx] = S
    return o


def _chunk_one(q, k, v, g, beta, S, chunk: int):
    """One sequence, fp32, already normalised/gated. q,k,g [T,H,K], v [T,H,V], beta [T,H], S [H,K,V]."""
    T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(T, H, V, dtype=torch.float32, device=q.device)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        C = e - s
        qc, kc, vc = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # [H,C,*]
        bc = beta[s:e].transpose(0, 1)  # [H,C]
        G = g[s:e].transpose(0, 1).cumsum(1)  # [H,C,K] cumulative log decay
        diff = G.unsqueeze(2) - G.unsqueeze(1)  # [H,C(i),C(j),K] = G_i - G_j
        lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
        incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), 0)
        # A[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j), j < i (masked before exp: no overflow)
        dk = torch.where(lower[None, :, :, None], diff, torch.full_like(diff, -float("inf"))).exp()
        # (broadcast product + sum == einsum "hid,hjd,hijd->hij"; the 3-operand einsum lowers to many tiny bmm
        # calls whose backward is ~2.5x slower on CPU)
        A = (kc.unsqueeze(2) * kc.unsqueeze(1) * dk).sum(-1) * bc.unsqueeze(-1)
        # (I + A)^-1 by forward substitution
        Tm = torch.linalg.solve_triangular(
            torch.eye(C, device=q.device) + A,
            torch.eye(C, device=q.device).expand(H, C, C),
            upper=False,
            unitriangular=True,
        )
        w = Tm @ (bc.unsqueeze(-1) * (G.exp() * kc))  # [H,C,K]
        u = Tm @ (bc.unsqueeze(-1) * vc)  # [H,C,V]
        v_new = u - w @ S  # [H,C,V]
        dq = torch.where(incl[None, :, :, None], diff, torch.full_like(diff, -float("inf"))).exp()
        Aqk = (qc.unsqueeze(2) * kc.unsqueeze(1) * dq).sum(-1)
        o[s:e] = ((qc * G.exp()) @ S + Aqk @ v_new).transpose(0, 1)
        GC = G[:, -1:, :]  # [H,1,K]
        S = S * GC.transpose(1, 2).exp() + ((GC - G).exp() * kc).transpose(1, 2) @ v_new
    return o, S


CHUNK = 64  # default chunk of the prefill recurrence; any size gives the same result up to rounding (the
#            training script uses a smaller one: the [H, C, C, K] decay tensors cost O(C) per token)
FOLD_ELEMS = 1 << 20


def kda_prefill(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    state,
    cu_seqlens,
    rows,
    scale: float,
    lower_bound: float | None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Chunked prefill for packed variable-length sequences.

    q, k, a [N, H, K]; v [N, H, V]; b [N, H]; cu_seqlens [B+1] (token offsets); rows [B].
    Sequence i covers tokens cu_seqlens[i]:cu_seqlens[i+1] and continues from state[rows[i]].
    Returns o [N, H, V] fp32; states are advanced in place.
    Sequences of equal length run as one batch: heads are independent, so n sequences of H heads are one
    sequence of n*H heads (the same arithmetic per head, one Python loop over the chunks instead of n), n
    capped so that the [n*H, C, C, K] decay tensors stay near FOLD_ELEMS elements (beyond that they leave the
    CPU caches and the folded run is slower than the sequences one by one).
    """
    chunk_size = chunk_size or CHUNK
    g = kda_gate(a, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.float())
    qn, kn, vf = l2norm(q) * scale, l2norm(k), v.float()
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    cu = [int(x) for x in cu_seqlens]
    rws = [int(r) for r in rows]
    by_len: dict[int, list[int]] = {}
    for i in range(len(rws)):
        if cu[i + 1] > cu[i]:
            by_len.setdefault(cu[i + 1] - cu[i], []).append(i)
    H = q.shape[1]
    K = q.shape[2]
    n_max = max(1, FOLD_ELEMS // (H * min(chunk_size, max(by_len, default=1)) ** 2 * K))
    groups = [(L, seqs[j : j + n_max]) for L, seqs in by_len.items() for j in range(0, len(seqs), n_max)]
    for L, seqs in groups:

        def fold(x, seqs=seqs, L=L):  # [N, H, *] -> [L, n*H, *]
            return torch.stack([x[cu[i] : cu[i] + L] for i in seqs], 1).flatten(1, 2)

        S0 = torch.cat([state[rws[i]] for i in seqs], 0)
        oo, S = _chunk_one(fold(qn), fold(kn), fold(vf), fold(g), fold(beta), S0.float().clone(), chunk_size)
        oo = oo.unflatten(1, (len(seqs), H))
        for j, i in enumerate(seqs):
            o[cu[i] : cu[i] + L] = oo[:, j]
            state[rws[i]] = S[j * H : (j + 1) * H]
    return o
