"""Routed experts straight from packed MXFP4 weights, Triton (same contract as `mxfp4_moe_ref.mxfp4_moe`).

Layout (compressed-tensors `mxfp4-pack-quantized`, stacked over the local experts, used as is):
  w1/w3 packed [E, I, W/2] u8 (low nibble = even input column), scale [E, I, W/32] u8 (E8M0)
  w2    packed [E, W, I/2] u8,                                   scale [E, W, I/32] u8
These bytes are exactly the rhs of `tl.dot_scaled(..., "e2m1")`: the rhs is logically [K, N] packed along K
(tile [BK/2, BN] loaded through strides, no copy) and its scale is [N, K/32] *not* transposed.

Pipeline (no dequantized weight copy anywhere, no host sync, so it can be captured in a CUDA graph):
  1. torch index prep: the N*k (token, choice) pairs are sorted by expert (ids < 0 go last and are never
     touched); expert groups are cut into M-blocks of BLOCK_M rows; a fixed upper bound of blocks is launched
     (P // BLOCK_M + min(P, E)) and surplus programs exit at once.
  2. `_moe_gate_up_kernel`, grid (block, I-tile): h = act(x W1^T, x W3^T) for the rows of one expert block,
     stored bf16 in sorted order [P, I].
  3. `_moe_down_kernel`, grid (block, W-tile): y[pair] = topk_weight * (h W2^T) in fp32, one row per pair.
  4. `_moe_combine_kernel`, grid (token, W-tile): u[n] = sum over valid choices j of y[n*k + j] (fixed order,
     deterministic; no float atomics).

Matmul variants (constexpr MODE):
  0 "dot_scaled" (default on sm_100 / sm_120 and under the interpreter): tl.dot_scaled(x_bf16, None, "bf16", w_e2m1, w_scale, "e2m1"). Native MX
     MMA on sm_100; elsewhere Triton upcasts the weight tile to bf16 itself (sm_90: wgmma with the weight as the
     64-row operand; sm_120: mma.sync bf16).
  1 "dequant" (default on sm_90 and older): the Hopper-style path: e2m1 nibbles + E8M0 scales decoded to bf16 in registers (bit placement, no
     table), x split into even / odd columns so the nibbles need no interleave, tl.dot.
  3 "dequant_f16": BK = 32 so one E8M0 scale per column and step: nibbles placed in fp16 bits (x 2^14, exact),
     fp16 tl.dot (x rounded to fp16 instead of bf16), the scale applied to the fp32 partial product.
  2 "w4a8": widen each e2m1 nibble to an e4m3 byte (exact), quantize the activations to MXFP8 on the fly
     (OCP rule: shared exponent floor(log2 amax) - 8, RNE, saturate to 448; the same rule as
     p2pk3.quant.mxfp4.mxfp8_e4m3_fake_quant) and call e4m3 x e4m3 tl.dot_scaled, which lowers to the native
     `mma.sync ... kind::mxf8f6f4.block_scale` on sm_120. This CHANGES NUMERICS (activations rounded to e4m3),
     so it is opt-in: P2PK3_SM120_W4A8=1 on sm_120 (or P2PK3_MXFP4_MODE=w4a8 anywhere).
  4 "dequant_f32": the dequant path with fp32 activations, fp32 intermediate and IEEE fp32 dots (no tf32).
     Always taken for float32 activations, so a float32 model is not rounded to bf16 inside the experts.
`P2PK3_MXFP4_MODE=dot_scaled|dequant|dequant_f16|w4a8` forces a variant for bf16/fp16 activations. Which one is fastest on
sm_90 is unmeasured (no GPU when written; a static count of the sm_90 PTX main loop gives ~12 instructions per
weight nibble for dot_scaled and dequant_f16, ~16 for dequant): tools/bench_kernels.py times all of them.
In modes 0-3 activations are rounded to bf16 (fp16 in mode 3) before the matmuls (the model runs bf16);
accumulation is fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MODES = {"dot_scaled": 0, "dequant": 1, "w4a8": 2, "dequant_f16": 3, "dequant_f32": 4}
_POISON = False  # tests: fill intermediates with NaN so an unwritten element shows up


# --------------------------------------------------------------------------------------------------------------
# element helpers (plain arithmetic only: the interpreter has no libdevice)
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _glu(g, u, beta1, beta2, ACT: tl.constexpr):
    if ACT == 0:  # SiTU-GLU (K3): b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)
        return (beta1 * _tanh(g / beta1) * _sigmoid(g)) * (beta2 * _tanh(u / beta2))
    else:  # SiLU-GLU (Kimi Linear)
        return g * _sigmoid(g) * u


@triton.jit
def _e2m1_bits(c):
    """low nibble of c (int32) -> fp32 whose value is 2^-126 * E2M1(c): the 3 magnitude bits go to the top of the
    fp32 mantissa / bottom of the exponent (code 1 = 0.5 becomes the denormal 2^-127), the sign to bit 31.
    5 integer ops; the caller multiplies by 2^126 (folded into the scale)."""
    return (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_to_f32(s):
    """E8M0 bytes (int32) -> 2^(s-127); 0 -> 2^-127 (denormal), 255 -> NaN (as the reference)."""
    bits = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_e4m3(c):
    """nibble codes (int32) -> e4m3 bytes of the same value (E2M1 is an exact subset of E4M3)."""
    m = c & 7
    mag = tl.where(m >= 2, (m << 2) + 48, tl.where(m == 1, 48, 0))
    return (mag | ((c & 8) << 4)).to(tl.uint8)


@triton.jit
def _round_e4m3(x):
    """fp32 -> nearest-even E4M3 value (still fp32), saturated to +-448, so the later cast is exact. Done with
    integer ops because the interpreter's fp32->fp8 cast drops the rounding carry (1.99 -> 1.0)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & (-2147483648)
    ab = bits & 0x7FFFFFFF
    nrm = (ab + 0x7FFFF + ((ab >> 20) & 1)) & 0x7FF00000  # keep 3 mantissa bits, carry into the exponent
    t = tl.abs(x) * 512.0  # below 2^-6 (E4M3 subnormals): multiples of 2^-9, rounded by the fp32 add
    t = (t + 12582912.0) - 12582912.0
    sub = (t * 0.001953125).to(tl.int32, bitcast=True)
    r = tl.where(ab < (121 << 23), sub, nrm)
    r = tl.minimum(r, 0x43E00000)  # 448
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quant_mxfp8(x, BM: tl.constexpr, BK: tl.constexpr):
    """[BM, BK] -> (e4m3 [BM, BK], E8M0 scale bytes [BM, BK/32]) by the OCP MX rule."""
    xr = tl.reshape(x.to(tl.float32), (BM, BK // 32, 32))
    amax = tl.max(tl.abs(xr), axis=2)
    ebits = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    sbyte = tl.minimum(tl.maximum(ebits - 8, 0), 253)
    inv = ((254 - sbyte) << 23).to(tl.float32, bitcast=True)  # 2^(127 - sbyte)
    xs = _round_e4m3(xr * inv[:, :, None])
    return tl.reshape(xs, (BM, BK)).to(tl.float8e4nv), sbyte.to(tl.uint8)


# --------------------------------------------------------------------------------------------------------------
# one [BM, K] x [K, BN] product against a packed MXFP4 weight slab
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _mx_matmul(
    acc,
    x_rows,
    stride_xk,
    m_mask,
    K,
    w_base,
    s_base,
    offs_n,
    n_mask,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    MODE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """acc[m, n] += sum_k x[m, k] * W[n, k]; x row m starts at pointer x_rows[m]; W packed [N, K/2] at w_base
    with scales [N, K/32] at s_base (strides in elements of u8)."""
    offs_kp = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // 32)
    for k0 in range(0, K, BK):
        kp = k0 // 2 + offs_kp  # packed byte index along K
        kp_mask = kp < K // 2
        wq = tl.load(
            w_base + offs_n[None, :] * stride_wn + kp[:, None] * stride_wk,
            mask=kp_mask[:, None] & n_mask[None, :],
            other=0,
        )  # [BK/2, BN] u8
        if MODE == 3:  # BK == 32: fp16 bit-placement dequant, the E8M0 scale applied to the partial product
            sc = tl.load(s_base + offs_n * stride_sn + (k0 // 32) * stride_sk, mask=n_mask, other=127)
            sf = _e8m0_to_f32(sc.to(tl.int32))  # [BN]
            wi = wq.to(tl.int32)  # [16, BN]
            w_lo = (((wi & 7) << 9) | ((wi & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True) * 16384.0
            w_hi = (((wi & 0x70) << 5) | ((wi & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True) * 16384.0
            offs_k = k0 + tl.arange(0, BK)
            x = tl.load(
                x_rows[:, None] + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0
            ).to(tl.float16)
            xe, xo = tl.split(tl.reshape(x, (BM, BK // 2, 2)))
            if DOT_F32:
                part = tl.dot(xe.to(tl.float32), w_lo.to(tl.float32))
                part = tl.dot(xo.to(tl.float32), w_hi.to(tl.float32), part)
            else:
                part = tl.dot(xe, w_lo)
                part = tl.dot(xo, w_hi, part)
            acc += part * sf[None, :]
        elif MODE == 1 or MODE == 4:
            ks = k0 // 32 + offs_ks
            ws = tl.load(
                s_base + offs_n[:, None] * stride_sn + ks[None, :] * stride_sk,
                mask=n_mask[:, None] & (ks < K // 32)[None, :],
                other=127,
            )  # [BN, BK/32]
            # E8M0 -> fp32 2^(s-127) (0 -> 2^-127, 255 -> NaN), spread over the 16 packed bytes (32 values) each
            # scale covers: [BK/2, BN]
            sf = _e8m0_to_f32(tl.trans(ws).to(tl.int32))
            sf = tl.reshape(tl.broadcast_to(sf[:, None, :], (BK // 32, 16, BN)), (BK // 2, BN))
            wi = wq.to(tl.int32)
            # (2^126 is not folded into sf: 2^(s-1) would overflow fp32 for s > 128)
            w_lo = (_e2m1_bits(wi) * 8.507059173023462e37) * sf
            w_hi = (_e2m1_bits(wi >> 4) * 8.507059173023462e37) * sf
            offs_k = k0 + tl.arange(0, BK)
            x = tl.load(
                x_rows[:, None] + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0
            ).to(tl.float32)
            if MODE == 1:
                w_lo, w_hi, x = w_lo.to(tl.bfloat16), w_hi.to(tl.bfloat16), x.to(tl.bfloat16)
            xe, xo = tl.split(tl.reshape(x, (BM, BK // 2, 2)))  # even / odd input columns
            if MODE == 4:  # fp32 activations (a float32 model): exact fp32 products, no tf32
                acc = tl.dot(xe, w_lo, acc, input_precision="ieee")
                acc = tl.dot(xo, w_hi, acc, input_precision="ieee")
            elif DOT_F32:  # interpreter: tl.dot on bf16 operands multiplies their raw uint16 bits
                acc = tl.dot(xe.to(tl.float32), w_lo.to(tl.float32), acc)
                acc = tl.dot(xo.to(tl.float32), w_hi.to(tl.float32), acc)
            else:
                acc = tl.dot(xe, w_lo, acc)
                acc = tl.dot(xo, w_hi, acc)
        else:
            offs_k = k0 + tl.arange(0, BK)
            x = tl.load(
                x_rows[:, None] + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0
            )
            ks = k0 // 32 + offs_ks
            ws = tl.load(
                s_base + offs_n[:, None] * stride_sn + ks[None, :] * stride_sk,
                mask=n_mask[:, None] & (ks < K // 32)[None, :],
                other=127,
            )  # [BN, BK/32]
            if MODE == 0:
                acc = tl.dot_scaled(x.to(tl.bfloat16), None, "bf16", wq, ws, "e2m1", acc)
            else:
                xq, xs = _quant_mxfp8(x.to(tl.bfloat16), BM, BK)
                wi = wq.to(tl.int32)
                w8 = tl.reshape(
                    tl.permute(tl.join(_e2m1_to_e4m3(wi & 15), _e2m1_to_e4m3(wi >> 4)), (0, 2, 1)), (BK, BN)
                )
                acc = tl.dot_scaled(xq, xs, "e4m3", w8, ws, "e4m3", acc)
    return acc


# --------------------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _moe_gate_up_kernel(
    z_ptr,
    stride_zn,
    stride_zk,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    sw1_e,
    sw1_n,
    sw1_k,
    ss1_e,
    ss1_n,
    ss1_k,
    sw3_e,
    sw3_n,
    sw3_k,
    ss3_e,
    ss3_n,
    ss3_k,
    h_ptr,
    stride_hm,
    pairs_ptr,
    blk_expert_ptr,
    blk_start_ptr,
    blk_rows_ptr,
    TOPK,
    I,
    W,
    beta1,
    beta2,
    ACT: tl.constexpr,
    MODE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_expert_ptr + pid_b)
    if e < 0:
        return
    e = e.to(tl.int64)
    start = tl.load(blk_start_ptr + pid_b)
    rows = tl.load(blk_rows_ptr + pid_b)
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < rows
    pair = tl.load(pairs_ptr + start + offs_m, mask=m_mask, other=0)
    tok = (pair // TOPK).to(tl.int64)
    x_rows = z_ptr + tok * stride_zn
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < I
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    acc_g = _mx_matmul(
        acc_g,
        x_rows,
        stride_zk,
        m_mask,
        W,
        w1_ptr + e * sw1_e,
        s1_ptr + e * ss1_e,
        offs_n,
        n_mask,
        sw1_n,
        sw1_k,
        ss1_n,
        ss1_k,
        MODE,
        BM,
        BN,
        BK,
        DOT_F32,
    )
    acc_u = _mx_matmul(
        acc_u,
        x_rows,
        stride_zk,
        m_mask,
        W,
        w3_ptr + e * sw3_e,
        s3_ptr + e * ss3_e,
        offs_n,
        n_mask,
        sw3_n,
        sw3_k,
        ss3_n,
        ss3_k,
        MODE,
        BM,
        BN,
        BK,
        DOT_F32,
    )
    h = _glu(acc_g, acc_u, beta1, beta2, ACT)
    hrow = (start + offs_m).to(tl.int64) * stride_hm
    tl.store(
        h_ptr + hrow[:, None] + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :]
    )


@triton.jit
def _moe_down_kernel(
    h_ptr,
    stride_hm,
    w2_ptr,
    s2_ptr,
    sw2_e,
    sw2_n,
    sw2_k,
    ss2_e,
    ss2_n,
    ss2_k,
    y_ptr,
    stride_ym,
    tw_ptr,
    pairs_ptr,
    blk_expert_ptr,
    blk_start_ptr,
    blk_rows_ptr,
    I,
    W,
    MODE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_expert_ptr + pid_b)
    if e < 0:
        return
    e = e.to(tl.int64)
    start = tl.load(blk_start_ptr + pid_b)
    rows = tl.load(blk_rows_ptr + pid_b)
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < rows
    pair = tl.load(pairs_ptr + start + offs_m, mask=m_mask, other=0)
    wt = tl.load(tw_ptr + pair, mask=m_mask, other=0.0)
    h_rows = h_ptr + (start + offs_m).to(tl.int64) * stride_hm
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < W
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = _mx_matmul(
        acc,
        h_rows,
        1,
        m_mask,
        I,
        w2_ptr + e * sw2_e,
        s2_ptr + e * ss2_e,
        offs_n,
        n_mask,
        sw2_n,
        sw2_k,
        ss2_n,
        ss2_k,
        MODE,
        BM,
        BN,
        BK,
        DOT_F32,
    )
    acc = acc * wt[:, None]
    yrow = pair.to(tl.int64) * stride_ym
    tl.store(y_ptr + yrow[:, None] + offs_n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, ids_ptr, out_ptr, W, TOPK, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = offs < W
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, TOPK):
        eid = tl.load(ids_ptr + n * TOPK + j)
        keep = (tl.zeros((BLOCK,), dtype=tl.int32) + eid) >= 0  # (vector mask: the interpreter rejects a scalar one)
        v = tl.load(y_ptr + (n * TOPK + j) * W + offs, mask=msk & keep, other=0.0)
        acc += v
    tl.store(out_ptr + n * W + offs, acc, mask=msk)


# --------------------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------------------
def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pick_mode(device: torch.device, act_dtype: torch.dtype = torch.bfloat16) -> int:
    """float32 activations always take the fp32 dequant path (no bf16 rounding of a float32 model);
    otherwise P2PK3_MXFP4_MODE, else the device default."""
    if act_dtype == torch.float32:
        return MODES["dequant_f32"]
    env = os.environ.get("P2PK3_MXFP4_MODE")
    if env:
        if env not in MODES:
            raise ValueError(f"P2PK3_MXFP4_MODE={env!r}: expected one of {sorted(MODES)}")
        return MODES[env]
    if device.type != "cuda":
        return MODES["dot_scaled"]
    major, _ = torch.cuda.get_device_capability(device)
    if major == 12 and os.environ.get("P2PK3_SM120_W4A8") == "1":
        return MODES["w4a8"]
    # native MX MMA from Blackwell on: dot_scaled; Hopper and older have none: in-kernel dequant to bf16
    # (the choice; tools/bench_kernels.py times every variant so the default can follow measurements)
    return MODES["dot_scaled"] if major >= 10 else MODES["dequant"]


def route_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the N*k pairs by expert and cut each expert's rows into blocks of `block_m`, without host sync.

    Returns (pairs [P] i32: pair ids sorted by expert, invalid last; blk_expert [NB] i32 (-1 = no block);
    blk_start [NB] i32: offset into `pairs`; blk_rows [NB] i32) with NB = P // block_m + min(P, E)."""
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).long()
    P = ids.numel()
    E = num_experts
    key = torch.where(ids >= 0, ids, torch.full_like(ids, E))
    pairs = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))[
        :E
    ]  # bincount syncs
    nblk = (counts + block_m - 1) // block_m
    cum_blk = torch.cumsum(nblk, 0)
    cum_cnt_excl = torch.cumsum(counts, 0) - counts
    NB = P // block_m + min(P, E)
    b = torch.arange(NB, device=dev)
    e = torch.searchsorted(cum_blk, b, right=True)  # block b belongs to expert e (E: none)
    ec = e.clamp(max=E - 1)
    j = b - (cum_blk[ec] - nblk[ec])  # block index within the expert
    start = cum_cnt_excl[ec] + j * block_m
    rows = (counts[ec] - j * block_m).clamp(0, block_m)
    valid = e < E
    blk_expert = torch.where(valid, e, torch.full_like(e, -1)).to(torch.int32)
    return pairs, blk_expert, start.to(torch.int32), torch.where(valid, rows, 0).to(torch.int32)


def _cfg(M_rows_per_expert: float, n_dim: int, device: torch.device, mode: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Untuned: no GPU was available when this was written;
    tools/bench_kernels.py times every mode."""
    interp = device.type != "cuda"
    BM = 64 if M_rows_per_expert >= 48 else 16
    BK = 32 if mode == 3 else (64 if interp else 128)
    if interp:
        return BM, max(16, min(64, triton.next_power_of_2(n_dim))), BK, 4, 1
    return BM, 128 if mode == 3 else 64, BK, 4, 4 if mode == 3 else 3


def _launch(
    z,
    w1_packed,
    w1_scale,
    w3_packed,
    w3_scale,
    w2_packed,
    w2_scale,
    topk_ids,
    topk_weights,
    activation,
    beta1,
    beta2,
    mode=None,
    out=None,
):
    N, W = z.shape
    E, I, W2h = w1_packed.shape
    assert W2h * 2 == W and W % 32 == 0 and I % 32 == 0, "W and I must be multiples of 32"
    assert w3_packed.shape == w1_packed.shape and w2_packed.shape == (E, W, I // 2)
    assert w1_scale.shape == (E, I, W // 32) and w2_scale.shape == (E, W, I // 32)
    TOPK = topk_ids.shape[1]
    P = N * TOPK
    dev = z.device
    mode = pick_mode(dev, z.dtype) if mode is None else mode
    if out is None:
        out = torch.empty(N, W, dtype=torch.float32, device=dev)
    if P == 0:
        return out
    BM, BN1, BK, nw, ns = _cfg(P / E, I, dev, mode)
    BN2 = _cfg(P / E, W, dev, mode)[1]
    pairs, blk_e, blk_s, blk_r = route_blocks(topk_ids, E, BM)
    NB = blk_e.numel()
    alloc = (
        (lambda *s, dtype: torch.full(s, float("nan"), dtype=dtype, device=dev))
        if _POISON
        else (lambda *s, dtype: torch.empty(s, dtype=dtype, device=dev))
    )
    h = alloc(P, I, dtype=torch.float32 if mode == 4 else torch.bfloat16)
    y = alloc(P, W, dtype=torch.float32)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    act = 0 if activation == "situ" else 1
    interp = interpreting()
    _moe_gate_up_kernel[(NB, triton.cdiv(I, BN1))](
        z,
        z.stride(0),
        z.stride(1),
        w1_packed,
        w1_scale,
        w3_packed,
        w3_scale,
        *w1_packed.stride(),
        *w1_scale.stride(),
        *w3_packed.stride(),
        *w3_scale.stride(),
        h,
        h.stride(0),
        pairs,
        blk_e,
        blk_s,
        blk_r,
        TOPK,
        I,
        W,
        float(beta1),
        float(beta2),
        ACT=act,
        MODE=mode,
        BM=BM,
        BN=BN1,
        BK=BK,
        DOT_F32=interp,
        num_warps=nw,
        num_stages=ns,
    )
    _moe_down_kernel[(NB, triton.cdiv(W, BN2))](
        h,
        h.stride(0),
        w2_packed,
        w2_scale,
        *w2_packed.stride(),
        *w2_scale.stride(),
        y,
        y.stride(0),
        tw,
        pairs,
        blk_e,
        blk_s,
        blk_r,
        I,
        W,
        MODE=mode,
        BM=BM,
        BN=BN2,
        BK=BK,
        DOT_F32=interp,
        num_warps=nw,
        num_stages=ns,
    )
    CB = min(1024, triton.next_power_of_2(W))
    _moe_combine_kernel[(N, triton.cdiv(W, CB))](y, ids, out, W, TOPK, BLOCK=CB, num_warps=4)
    return out


def mxfp4_moe(
    z: torch.Tensor,
    w1_packed,
    w1_scale,
    w3_packed,
    w3_scale,
    w2_packed,
    w2_scale,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str = "situ",
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """z [N, W]; w1/w3 packed [E, I, W/2] scale [E, I, W/32]; w2 packed [E, W, I/2] scale [E, W, I/32];
    topk_ids [N, k] local expert index or -1; topk_weights [N, k]. Returns u [N, W] fp32."""
    return _launch(
        z,
        w1_packed,
        w1_scale,
        w3_packed,
        w3_scale,
        w2_packed,
        w2_scale,
        topk_ids,
        topk_weights,
        activation,
        beta1,
        beta2,
    )
