"""The KDA prefill reference folds equal-length sequences into one call and takes any chunk size; both must
give the delta-rule recurrence written plainly here, token by token, per sequence (an independent oracle)."""

from __future__ import annotations

import torch

from p2pk3_kernels import kda_ref


def recurrence(q, k, v, a, b, A_log, dt_bias, S, scale, lower_bound):
    """One sequence. S <- diag(exp g_t) S;  S <- S + beta_t k_t (v_t - k_t^T S);  o_t = (scale q_t)^T S."""
    T, H, K = q.shape
    A = torch.exp(A_log[:H]).view(H, 1)
    x = a.float() + dt_bias.view(H, K)
    g = lower_bound * torch.sigmoid(A * x)
    beta = torch.sigmoid(b.float())
    qn = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6) * scale
    kn = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    out = []
    for t in range(T):
        S = S * torch.exp(g[t]).unsqueeze(-1)  # [H, K, V] decayed per key channel
        pred = torch.einsum("hk,hkv->hv", kn[t], S)
        S = S + beta[t].view(H, 1, 1) * kn[t].unsqueeze(-1) * (v[t] - pred).unsqueeze(1)
        out.append(torch.einsum("hk,hkv->hv", qn[t], S))
    return torch.stack(out), S


def test_folded_prefill_matches_the_recurrence_per_sequence():
    torch.manual_seed(0)
    H, K, V = 3, 8, 6
    lens = [12, 12, 5, 12, 5, 1, 12]  # three lengths repeat: folded groups, a singleton, one-token sequence
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    N = int(cu[-1])
    q, k, a = (torch.randn(N, H, K) for _ in range(3))
    v, b = torch.randn(N, H, V), torch.randn(N, H)
    A_log, dt_bias = torch.rand(H) * 2, torch.randn(H * K)
    rows = torch.tensor([6, 0, 3, 1, 5, 2, 4])
    state0 = torch.randn(8, H, K, V) * 0.3
    want = torch.empty(N, H, V)
    want_state = state0.clone()
    for i, r in enumerate(rows.tolist()):
        s, e = int(cu[i]), int(cu[i + 1])
        want[s:e], want_state[r] = recurrence(
            q[s:e], k[s:e], v[s:e], a[s:e], b[s:e], A_log, dt_bias, state0[r].clone(), K**-0.5, -5.0
        )
    for chunk in (4, 5, 16, 64):
        for fold in (1 << 20, 1):  # folded groups, and FOLD_ELEMS so small that every sequence runs alone
            old = kda_ref.FOLD_ELEMS
            kda_ref.FOLD_ELEMS = fold
            try:
                st = state0.clone()
                o = kda_ref.kda_prefill(q, k, v, a, b, A_log, dt_bias, st, cu, rows, K**-0.5, -5.0, chunk_size=chunk)
            finally:
                kda_ref.FOLD_ELEMS = old
            assert (o - want).abs().max() < 1e-4, (chunk, fold, float((o - want).abs().max()))
            assert (st - want_state).abs().max() < 1e-4, (chunk, fold)
            assert torch.equal(st[7], state0[7])  # a row no sequence names is untouched


def test_folding_is_bit_identical_to_one_sequence_at_a_time():
    torch.manual_seed(1)
    H, K, V = 4, 32, 32
    lens = [64, 64, 64, 30]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    N = int(cu[-1])
    q, k, a = (torch.randn(N, H, K) for _ in range(3))
    v, b = torch.randn(N, H, V), torch.randn(N, H)
    A_log, dt_bias = torch.rand(H) * 2, torch.randn(H * K)
    rows = torch.arange(4)
    outs = []
    for fold in (1 << 24, 1):
        old = kda_ref.FOLD_ELEMS
        kda_ref.FOLD_ELEMS = fold
        try:
            st = torch.zeros(4, H, K, V)
            outs.append(
                (kda_ref.kda_prefill(q, k, v, a, b, A_log, dt_bias, st, cu, rows, K**-0.5, -5.0, chunk_size=16), st)
            )
        finally:
            kda_ref.FOLD_ELEMS = old
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
