"""Kimi Delta Attention, Triton (same contract as `kda_ref`: raw projections in, gate / sigmoid(beta) /
q,k L2 norm / scale applied in the kernel, fp32 states [S, H, K, V] in a pool whose `rows` (one per
sequence) are updated in place).

Per head and token (spec 2.1): S <- Diag(exp g) S;  err = v - S^T k;  S <- S + beta k err^T;  o = S^T (q * scale).
The V columns of S are independent, so both kernels split V into tiles and every program owns a [K, BV] slice of
one state (read once, written once); q, k, the gate and beta are recomputed per V-tile (K values: cheap).

* `kda_decode`: one step for a batch, grid (batch, head, V-tile).
* `kda_prefill`: packed variable-length sequences, grid (sequence, head, V-tile); each program runs the exact
  recurrence token by token with its state slice in registers (the next token's inputs are prefetched while the
  current one is computed). This is exact for any gate (no exp(+G) factors as in the chunked form, so Kimi
  Linear's unbounded softplus gate is as safe as K3's bounded one) but sequential in T. `chunk_size` is accepted
  for signature compatibility and ignored.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gate(a, dtb, A, lower_bound, HAS_LB: tl.constexpr):
    x = a + dtb
    if HAS_LB:  # K3: g = lb * sigmoid(exp(A_log) * (a + dt_bias))
        return lower_bound * _sigmoid(A * x)
    else:  # Kimi Linear: g = -exp(A_log) * softplus(a + dt_bias) (torch's threshold 20)
        sp = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
        return -A * tl.where(x > 20.0, x, sp)


@triton.jit
def _load_tok(q_ptr, k_ptr, a_ptr, v_ptr, b_ptr, offs_k, km, offs_v, vm, t, t_end):
    # token t is loaded only if t < t_end (masks built as vectors: the interpreter rejects vector & scalar masks)
    km = km & ((offs_k * 0 + t) < t_end)
    vm = vm & ((offs_v * 0 + t) < t_end)
    q = tl.load(q_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs_v, mask=vm, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs_k * 0, mask=(offs_k == 0) & km, other=0.0).to(tl.float32)
    return q, k, a, v, tl.sum(b, 0)


@triton.jit
def _step(S, q, k, a, v, b, dtb, A, scale, lower_bound, HAS_LB: tl.constexpr):
    g = _gate(a, dtb, A, lower_bound, HAS_LB)
    beta = _sigmoid(b)
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    S = S * tl.exp(g)[:, None]  # decay rows
    err = v - tl.sum(k[:, None] * S, 0)  # read with the decayed state
    S = S + (beta * k)[:, None] * err[None, :]
    o = tl.sum(q[:, None] * S, 0)  # read after the write
    return S, o


@triton.jit
def _kda_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    alog_ptr,
    dtb_ptr,
    st_ptr,
    row_ptr,
    o_ptr,
    sq_b,
    sq_h,
    sk_b,
    sk_h,
    sv_b,
    sv_h,
    sa_b,
    sa_h,
    sb_b,
    sb_h,
    ss_s,
    ss_h,
    ss_k,
    ss_v,
    so_b,
    so_h,
    K,
    V,
    scale,
    lower_bound,
    HAS_LB: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    ib = tl.program_id(0).to(tl.int64)
    ih = tl.program_id(1)
    iv = tl.program_id(2)
    offs_k = tl.arange(0, BK)
    km = offs_k < K
    offs_v = iv * BV + tl.arange(0, BV)
    vm = offs_v < V
    q, k, a, v, b = _load_tok(
        q_ptr + ib * sq_b + ih * sq_h,
        k_ptr + ib * sk_b + ih * sk_h,
        a_ptr + ib * sa_b + ih * sa_h,
        v_ptr + ib * sv_b + ih * sv_h,
        b_ptr + ib * sb_b + ih * sb_h,
        offs_k,
        km,
        offs_v,
        vm,
        0,
        1,
    )
    dtb = tl.load(dtb_ptr + ih * K + offs_k, mask=km, other=0.0).to(tl.float32)
    A = tl.exp(tl.load(alog_ptr + ih).to(tl.float32))
    row = tl.load(row_ptr + ib).to(tl.int64)
    sp = st_ptr + row * ss_s + ih * ss_h + offs_k[:, None] * ss_k + offs_v[None, :] * ss_v
    smask = km[:, None] & vm[None, :]
    S = tl.load(sp, mask=smask, other=0.0)
    S, o = _step(S, q, k, a, v, b, dtb, A, scale, lower_bound, HAS_LB)
    tl.store(sp, S, mask=smask)
    tl.store(o_ptr + ib * so_b + ih * so_h + offs_v, o, mask=vm)


@triton.jit
def _kda_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    alog_ptr,
    dtb_ptr,
    st_ptr,
    row_ptr,
    cu_ptr,
    o_ptr,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sa_t,
    sa_h,
    sb_t,
    sb_h,
    ss_s,
    ss_h,
    ss_k,
    ss_v,
    so_t,
    so_h,
    K,
    V,
    scale,
    lower_bound,
    HAS_LB: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    iseq = tl.program_id(0)
    ih = tl.program_id(1)
    iv = tl.program_id(2)
    t0 = tl.load(cu_ptr + iseq).to(tl.int64)
    t1 = tl.load(cu_ptr + iseq + 1).to(tl.int64)
    if t1 <= t0:
        return
    offs_k = tl.arange(0, BK)
    km = offs_k < K
    offs_v = iv * BV + tl.arange(0, BV)
    vm = offs_v < V
    dtb = tl.load(dtb_ptr + ih * K + offs_k, mask=km, other=0.0).to(tl.float32)
    A = tl.exp(tl.load(alog_ptr + ih).to(tl.float32))
    row = tl.load(row_ptr + iseq).to(tl.int64)
    sp = st_ptr + row * ss_s + ih * ss_h + offs_k[:, None] * ss_k + offs_v[None, :] * ss_v
    smask = km[:, None] & vm[None, :]
    S = tl.load(sp, mask=smask, other=0.0)
    q_h = q_ptr + ih * sq_h
    k_h = k_ptr + ih * sk_h
    a_h = a_ptr + ih * sa_h
    v_h = v_ptr + ih * sv_h
    b_h = b_ptr + ih * sb_h
    o_h = o_ptr + ih * so_h
    q, k, a, v, b = _load_tok(
        q_h + t0 * sq_t,
        k_h + t0 * sk_t,
        a_h + t0 * sa_t,
        v_h + t0 * sv_t,
        b_h + t0 * sb_t,
        offs_k,
        km,
        offs_v,
        vm,
        t0,
        t1,
    )
    for t in range(t0, t1):
        # prefetch token t+1 (masked off past the end) before the dependent math of token t
        tn = t + 1
        nq, nk, na, nv, nb = _load_tok(
            q_h + tn * sq_t,
            k_h + tn * sk_t,
            a_h + tn * sa_t,
            v_h + tn * sv_t,
            b_h + tn * sb_t,
            offs_k,
            km,
            offs_v,
            vm,
            tn,
            t1,
        )
        S, o = _step(S, q, k, a, v, b, dtb, A, scale, lower_bound, HAS_LB)
        tl.store(o_h + t * so_t + offs_v, o, mask=vm)
        q, k, a, v, b = nq, nk, na, nv, nb
    tl.store(sp, S, mask=smask)


def _lastdim_contig(*ts):
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def _cfg(K: int, V: int, device: torch.device):
    BK = triton.next_power_of_2(K)
    if device.type != "cuda":
        return BK, min(64, triton.next_power_of_2(V)), 4
    return BK, min(32, triton.next_power_of_2(V)), 4


def _check(q, k, v, a, b, state):
    H, K = q.shape[-2:]
    V = v.shape[-1]
    assert k.shape == q.shape and a.shape == q.shape and v.shape[:-1] == q.shape[:-1] and b.shape == q.shape[:-1]
    assert state.dtype == torch.float32 and state.shape[1:] == (H, K, V), "state must be fp32 [S, H, K, V]"
    return H, K, V


def _prep(q, k, v, a, b, A_log, dt_bias, state):
    """Shape checks and the layouts both KDA launches need."""
    H, K, V = _check(q, k, v, a, b, state)
    q, k, v, a = _lastdim_contig(q, k, v, a)
    return H, K, V, q, k, v, a, A_log.reshape(-1).contiguous(), dt_bias.reshape(-1).contiguous()


def _kda_decode(q, k, v, a, b, A_log, dt_bias, state, rows, scale, lower_bound, out=None):
    H, K, V, q, k, v, a, alog, dtb = _prep(q, k, v, a, b, A_log, dt_bias, state)
    B = q.shape[0]
    if out is None:
        out = torch.empty(B, H, V, dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    BK, BV, nw = _cfg(K, V, q.device)
    _kda_decode_kernel[(B, H, triton.cdiv(V, BV))](
        q,
        k,
        v,
        a,
        b,
        alog,
        dtb,
        state,
        rows,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        *state.stride(),
        out.stride(0),
        out.stride(1),
        K,
        V,
        float(scale),
        float(lower_bound if lower_bound is not None else 0.0),
        HAS_LB=lower_bound is not None,
        BK=BK,
        BV=BV,
        num_warps=nw,
    )
    return out


def _kda_prefill(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, rows, scale, lower_bound, out=None):
    H, K, V, q, k, v, a, alog, dtb = _prep(q, k, v, a, b, A_log, dt_bias, state)
    N = q.shape[0]
    if out is None:
        out = torch.empty(N, H, V, dtype=torch.float32, device=q.device)
    nseq = rows.shape[0]
    if N == 0 or nseq == 0:
        return out
    BK, BV, nw = _cfg(K, V, q.device)
    _kda_prefill_kernel[(nseq, H, triton.cdiv(V, BV))](
        q,
        k,
        v,
        a,
        b,
        alog,
        dtb,
        state,
        rows,
        cu_seqlens,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        *state.stride(),
        out.stride(0),
        out.stride(1),
        K,
        V,
        float(scale),
        float(lower_bound if lower_bound is not None else 0.0),
        HAS_LB=lower_bound is not None,
        BK=BK,
        BV=BV,
        num_warps=nw,
    )
    return out


def kda_decode(q, k, v, a, b, A_log, dt_bias, state, rows, scale: float, lower_bound: float | None) -> torch.Tensor:
    """One recurrent step for a batch of sequences.

    q, k, a [B, H, K]; v [B, H, V]; b [B, H] (beta logits); state [S, H, K, V] fp32; rows [B] int.
    Returns o [B, H, V] fp32; state[rows] is advanced in place.
    """
    return _kda_decode(q, k, v, a, b, A_log, dt_bias, state, rows, scale, lower_bound)


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
    chunk_size: int = 64,
) -> torch.Tensor:
    """Packed variable-length prefill (exact token recurrence; `chunk_size` is ignored).

    q, k, a [N, H, K]; v [N, H, V]; b [N, H]; cu_seqlens [B+1] (token offsets); rows [B].
    Sequence i covers tokens cu_seqlens[i]:cu_seqlens[i+1] and continues from state[rows[i]].
    Returns o [N, H, V] fp32; states are advanced in place.
    """
    return _kda_prefill(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, rows, scale, lower_bound)
