"""Dense matmul against an MXFP8 or MXFP4 weight with the dequant in the kernel, Triton (same contract as
`mx_linear_ref.mx_linear`): y [M, N] = x [M, K] @ W^T, W [N, K] held as
  "mxfp8": data u8 [N, Kp]   E4M3 bytes,                              scale u8 [N, Kp/32] E8M0
  "mxfp4": data u8 [N, Kp/2] E2M1 nibbles (low nibble = even column), scale u8 [N, Kp/32] E8M0
(Kp = K rounded up to 32; p2pk3.quant.formats writes these for the non-expert matrices.)

One program per (M-tile, N-tile, K-split). Per BK step it loads a [BM, BK] tile of x, the [BK, BN] weight
bytes through strides (no copy, no dequantized weight anywhere in memory) and their [BN, BK/32] scales,
decodes the elements with integer bit placement (E4M3: exponent + 120 into the fp32 exponent field, the
subnormals as m * 2^-9; E2M1: as in mxfp4_moe, x split into even / odd columns so the nibbles need no
interleave), multiplies by 2^(s-127) and accumulates with tl.dot in fp32:
  * bf16 activations: the decoded weight is cast to bf16 (exact: E4M3 / E2M1 values times a power of two
    have <= 4 significant bits) and tl.dot runs bf16 x bf16 -> fp32 (tensor cores);
  * fp32 / fp16 activations: fp32 operands, IEEE fp32 dot (no tf32), so a float32 model is not rounded.
Every product is therefore exact and the result differs from the reference only by fp32 summation order
(and the final cast to x.dtype). Columns >= K (the padding) are masked on both operands.
Split-K (GPU, few output tiles: decode) writes fp32 partials [S, M, N] that a fixed-order torch sum
reduces (deterministic, no atomics). No host sync: grids come from shapes only (CUDA-graph safe).
Block sizes are untuned (no GPU when written); `split_k` can be forced for tests.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .mx_linear_ref import check_args
from .mxfp4_moe import _e2m1_bits, _e8m0_to_f32

_POISON = False  # tests: fill the output / partials with NaN so an unwritten element shows up


@triton.jit
def _e4m3_to_f32(b):
    """E4M3 bytes (int32 0..255) -> fp32 values; 0x7F / 0xFF -> NaN. Integer ops only (interpreter-safe)."""
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # 2^(e-7) * (1 + m/8)
    sub = (b & 7).to(tl.float32) * 0.001953125  # e == 0: m * 2^-9
    v = tl.where((mag >> 3) == 0, sub, normal)
    v = tl.where(mag == 0x7F, (mag * 0 + 0x7FC00000).to(tl.float32, bitcast=True), v)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def _mx_linear_kernel(
    x_ptr,
    stride_xm,
    stride_xk,
    w_ptr,
    stride_wn,
    stride_wk,
    s_ptr,
    stride_sn,
    stride_sk,
    y_ptr,
    stride_ys,
    stride_ym,
    M,
    N,
    K,
    K_SPLIT,
    FP4: tl.constexpr,
    F32: tl.constexpr,
    DOT_F32: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = offs_m < M
    n_mask = offs_n < N
    G = (K + 31) // 32
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    offs_ks = tl.arange(0, BK // 32)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 // 32 + offs_ks
        ws = tl.load(
            s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + ks[None, :] * stride_sk,
            mask=n_mask[:, None] & (ks < G)[None, :],
            other=127,
        )  # [BN, BK/32]
        sf = _e8m0_to_f32(tl.trans(ws).to(tl.int32))  # [BK/32, BN]
        offs_k = k0 + tl.arange(0, BK)
        k_mask = offs_k < k_hi
        x = tl.load(x_rows[:, None] + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if F32:
            x = x.to(tl.float32)
        if FP4:
            kp = k0 // 2 + tl.arange(0, BK // 2)
            wq = tl.load(
                w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + kp[:, None] * stride_wk,
                mask=(kp * 2 < k_hi)[:, None] & n_mask[None, :],
                other=0,
            )  # [BK/2, BN]
            sfh = tl.reshape(tl.broadcast_to(sf[:, None, :], (BK // 32, 16, BN)), (BK // 2, BN))
            wi = wq.to(tl.int32)
            # E2M1 placed as 2^-126 * value (see mxfp4_moe._e2m1_bits), times 2^126, times the block scale
            w_lo = (_e2m1_bits(wi) * 8.507059173023462e37) * sfh
            w_hi = (_e2m1_bits(wi >> 4) * 8.507059173023462e37) * sfh
            # an odd K: the high nibble of the last byte is column K (padding): x is 0 there, but a garbage
            # weight must not be inf / NaN either -- E2M1 has none, so 0 * w = 0
            xe, xo = tl.split(tl.reshape(x, (BM, BK // 2, 2)))  # even / odd input columns
            if F32:
                acc = tl.dot(xe, w_lo, acc, input_precision="ieee")
                acc = tl.dot(xo, w_hi, acc, input_precision="ieee")
            elif DOT_F32:  # interpreter: tl.dot on bf16 operands multiplies their raw uint16 bits
                acc = tl.dot(xe.to(tl.float32), w_lo, acc)
                acc = tl.dot(xo.to(tl.float32), w_hi, acc)
            else:
                acc = tl.dot(xe, w_lo.to(tl.bfloat16), acc)
                acc = tl.dot(xo, w_hi.to(tl.bfloat16), acc)
        else:
            wb = tl.load(
                w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk,
                mask=k_mask[:, None] & n_mask[None, :],
                other=0,
            )  # [BK, BN]
            sfull = tl.reshape(tl.broadcast_to(sf[:, None, :], (BK // 32, 32, BN)), (BK, BN))
            w = _e4m3_to_f32(wb.to(tl.int32)) * sfull
            if F32:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            elif DOT_F32:
                acc = tl.dot(x.to(tl.float32), w, acc)
            else:
                acc = tl.dot(x, w.to(tl.bfloat16), acc)
    y = y_ptr + pid_k.to(tl.int64) * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cfg(M: int, N: int, K: int, device: torch.device):
    """(BM, BN, BK, num_warps, num_stages). Untuned."""
    if device.type != "cuda":
        return 16 if M <= 16 else 32, max(16, min(64, triton.next_power_of_2(N))), 64, 4, 1
    BM = 16 if M <= 16 else (64 if M <= 64 else 128)
    return BM, 64, 128, 4, 3


def _pick_split(M, N, K, BM, BN, BK, device) -> int:
    """K-splits so that a decode-sized matmul still fills the GPU (~2 programs per SM); 1 otherwise."""
    if device.type != "cuda":
        return 1
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, tiles), triton.cdiv(K, BK * 4), 16))


def mx_linear(
    x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, fmt: str, *, split_k: int | None = None
) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) times the MX weight [N, K] transposed -> y [M, N] in x.dtype."""
    M, N, K = check_args(x, data, scale, fmt)
    dev = x.device
    if M == 0 or N == 0:
        return torch.empty(M, N, dtype=x.dtype, device=dev)
    if K == 0:
        return torch.zeros(M, N, dtype=x.dtype, device=dev)
    BM, BN, BK, nw, ns = _cfg(M, N, K, dev)
    S = _pick_split(M, N, K, BM, BN, BK, dev) if split_k is None else max(1, int(split_k))
    k_split = triton.cdiv(triton.cdiv(K, S), BK) * BK
    S = triton.cdiv(K, k_split)
    alloc = torch.full if _POISON else (lambda s, v, **kw: torch.empty(s, **kw))
    if S == 1:
        out = alloc((1, M, N), float("nan"), dtype=x.dtype, device=dev)
    else:
        out = alloc((S, M, N), float("nan"), dtype=torch.float32, device=dev)
    F32 = x.dtype != torch.bfloat16
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN), S)
    _mx_linear_kernel[grid](
        x,
        x.stride(0),
        x.stride(1),
        data,
        data.stride(0),
        data.stride(1),
        scale,
        scale.stride(0),
        scale.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        M,
        N,
        K,
        k_split,
        FP4=fmt == "mxfp4",
        F32=F32,
        DOT_F32=interpreting(),
        BM=BM,
        BN=BN,
        BK=BK,
        num_warps=nw,
        num_stages=ns,
    )
    if S == 1:
        return out[0]
    return out.sum(0).to(x.dtype)
