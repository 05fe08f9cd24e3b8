"""Weight-absorbed MLA decode over a paged latent cache, Triton (same contract as `mla_decode_ref`).

Cache rows are [c (R = kv_lora_rank) ; k_pe (P)] (576 values for K3), one row per token, in blocks of
`block_size` rows: kv_cache [num_blocks, block_size, R + P]; block_table [B, max_blocks]; seq_lens [B].
All H query heads share the cache row (MQA after absorption), so a program takes a group of BLOCK_H heads
and every cache tile it reads serves all of them.

Flash-decoding (split-KV), two kernels:
  1. `_mla_split_kernel`, grid (batch, head-group, split): online softmax (exp2, running max / denominator)
     over its slice of the sequence; writes the normalised partial z [B, H, S, R] and its log2-sum-exp [B, H, S]
     (-inf for an empty slice).
  2. `_mla_reduce_kernel`, grid (batch, head): merges the splits with the logsumexp rule; a sequence of length
     0 gives z = 0 (as the reference).
The number of splits depends only on shapes (block_table width, batch, heads), never on seq_lens values, so no
host sync happens and the launch can be captured in a CUDA graph. Output z [B, H, R] fp32.
Matmuls run in the cache dtype (q is rounded to it when the cache is 16-bit) with fp32 accumulation.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

_POISON = False  # tests: fill the partials with NaN so an unwritten element shows up
LOG2E = 1.4426950408889634


@triton.jit
def _mla_split_kernel(
    ql_ptr,
    qp_ptr,
    kv_ptr,
    bt_ptr,
    sl_ptr,
    po_ptr,
    pl_ptr,
    sql_b,
    sql_h,
    sqp_b,
    sqp_h,
    skv_blk,
    skv_tok,
    sbt_b,
    spo_b,
    spo_h,
    spo_s,
    spl_b,
    spl_h,
    H,
    R,
    P,
    BLOCK_SIZE,
    SPLIT_LEN,
    sm_scale_log2,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BR: tl.constexpr,
    BP: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    ib = tl.program_id(0).to(tl.int64)
    ig = tl.program_id(1)
    isp = tl.program_id(2)
    L = tl.load(sl_ptr + ib)
    t_start = isp * SPLIT_LEN
    t_end = tl.minimum(t_start + SPLIT_LEN, L)
    offs_h = ig * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs_h < H
    offs_r = tl.arange(0, BR)
    rm = offs_r < R
    offs_p = tl.arange(0, BP)
    pm = offs_p < P
    kv_dt = kv_ptr.dtype.element_ty
    ql = tl.load(
        ql_ptr + ib * sql_b + offs_h[:, None] * sql_h + offs_r[None, :], mask=hm[:, None] & rm[None, :], other=0.0
    )
    qp = tl.load(
        qp_ptr + ib * sqp_b + offs_h[:, None] * sqp_h + offs_p[None, :], mask=hm[:, None] & pm[None, :], other=0.0
    )
    if DOT_F32:  # interpreter: no bf16 tl.dot (round to the cache dtype, multiply in fp32)
        ql = ql.to(kv_dt).to(tl.float32)
        qp = qp.to(kv_dt).to(tl.float32)
    else:
        ql = ql.to(kv_dt)
        qp = qp.to(kv_dt)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BR), dtype=tl.float32)
    for t in range(t_start, t_end, BLOCK_T):
        offs_t = t + tl.arange(0, BLOCK_T)
        tm = offs_t < t_end
        blk = tl.load(bt_ptr + ib * sbt_b + offs_t // BLOCK_SIZE, mask=tm, other=0).to(tl.int64)
        row = kv_ptr + blk * skv_blk + (offs_t % BLOCK_SIZE).to(tl.int64) * skv_tok
        c = tl.load(row[:, None] + offs_r[None, :], mask=tm[:, None] & rm[None, :], other=0.0)  # [T, R]
        pe = tl.load(row[:, None] + R + offs_p[None, :], mask=tm[:, None] & pm[None, :], other=0.0)  # [T, P]
        if DOT_F32:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
        s = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(pe))  # [BLOCK_H, T]
        s = s * sm_scale_log2
        s = tl.where(tm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = tl.dot(p.to(kv_dt).to(tl.float32), c, acc * alpha[:, None])
        else:
            acc = tl.dot(p.to(kv_dt), c, acc * alpha[:, None])
        m_i = m_new
    has = l_i > 0
    z = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        po_ptr + ib * spo_b + offs_h[:, None] * spo_h + isp * spo_s + offs_r[None, :], z, mask=hm[:, None] & rm[None, :]
    )
    tl.store(pl_ptr + ib * spl_b + offs_h * spl_h + isp, lse, mask=hm)


@triton.jit
def _mla_reduce_kernel(
    po_ptr, pl_ptr, out_ptr, spo_b, spo_h, spo_s, spl_b, spl_h, so_b, so_h, R, NUM_SPLITS, BR: tl.constexpr
):
    ib = tl.program_id(0).to(tl.int64)
    ih = tl.program_id(1)
    offs_r = tl.arange(0, BR)
    rm = offs_r < R
    m = tl.full((), float("-inf"), dtype=tl.float32)
    den = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BR,), dtype=tl.float32)
    for s in range(0, NUM_SPLITS):
        lse = tl.load(pl_ptr + ib * spl_b + ih * spl_h + s)  # -inf: empty split (its z is 0)
        z = tl.load(po_ptr + ib * spo_b + ih * spo_h + s * spo_s + offs_r, mask=rm, other=0.0)
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use)
        acc = acc * a + w * z
        den = den * a + w
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + ib * so_b + ih * so_h + offs_r, out, mask=rm)


def _num_splits(B: int, n_groups: int, max_len: int, block_t: int, device: torch.device) -> int:
    if device.type != "cuda":
        target, min_len = 4, block_t  # interpreter: a few splits, enough to exercise the merge
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        target, min_len = 2 * sms, 256
    want = triton.cdiv(target, max(1, B * n_groups))
    return max(1, min(want, triton.cdiv(max_len, min_len)))


def _mla_decode(q_lat, q_pe, kv_cache, block_table, seq_lens, scale, out=None, num_splits=None):
    B, H, R = q_lat.shape
    P = q_pe.shape[-1]
    NBLK, bs, RP = kv_cache.shape
    assert RP == R + P and q_pe.shape[:2] == (B, H)
    dev = q_lat.device
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    if out is None:
        out = torch.empty(B, H, R, dtype=torch.float32, device=dev)
    if B == 0:
        return out
    interp = dev.type != "cuda"
    BLOCK_H = 16
    BLOCK_T = 16 if interp else 32
    BR = triton.next_power_of_2(R)
    BP = max(16, triton.next_power_of_2(P))
    n_groups = triton.cdiv(H, BLOCK_H)
    max_len = block_table.shape[1] * bs
    S = num_splits or _num_splits(B, n_groups, max_len, BLOCK_T, dev)
    split_len = triton.cdiv(triton.cdiv(max_len, S), BLOCK_T) * BLOCK_T
    S = max(1, triton.cdiv(max_len, split_len))
    alloc = torch.full if _POISON else (lambda shape, fill, **kw: torch.empty(shape, **kw))
    po = alloc((B, H, S, R), float("nan"), dtype=torch.float32, device=dev)
    pl = alloc((B, H, S), float("nan"), dtype=torch.float32, device=dev)
    _mla_split_kernel[(B, n_groups, S)](
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        seq_lens,
        po,
        pl,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pl.stride(0),
        pl.stride(1),
        H,
        R,
        P,
        bs,
        split_len,
        float(scale) * LOG2E,
        BLOCK_H=BLOCK_H,
        BLOCK_T=BLOCK_T,
        BR=BR,
        BP=BP,
        DOT_F32=interp,
        num_warps=4,
        num_stages=2,
    )
    _mla_reduce_kernel[(B, H)](
        po,
        pl,
        out,
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pl.stride(0),
        pl.stride(1),
        out.stride(0),
        out.stride(1),
        R,
        S,
        BR=BR,
        num_warps=4,
    )
    return out


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_lat [B, H, R]; q_pe [B, H, P]; kv_cache [num_blocks, block_size, R + P];
    block_table [B, max_blocks] int (block ids of each sequence in order); seq_lens [B] (tokens to attend,
    the current one included). Returns z [B, H, R] fp32."""
    return _mla_decode(q_lat, q_pe, kv_cache, block_table, seq_lens, scale)
