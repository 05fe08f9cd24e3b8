"""Dense matmul against an MXFP8 or MXFP4 weight, torch reference (the specification of `mx_linear.py`).

y[m, n] = sum_k x[m, k] * W[n, k], with W held as
  "mxfp8": data u8 [N, Kp]   = E4M3 bytes,                              scale u8 [N, Kp/32] (E8M0)
  "mxfp4": data u8 [N, Kp/2] = E2M1 nibbles (low nibble = even column), scale u8 [N, Kp/32] (E8M0)
W[n, k] = element(n, k) * 2^(scale[n, k // 32] - 127) (0xFF scale -> NaN; E4M3 0x7F / 0xFF -> NaN).
Kp is K rounded up to 32; the padded columns are ignored (x has K columns). fp32 math: the weight is
dequantized exactly to fp32 and the activations upcast, so the only rounding is the fp32 accumulation and
the final cast to x.dtype (the output dtype).
"""

from __future__ import annotations

import torch

from .mxfp4_moe_ref import dequant_mxfp4

FORMATS = ("mxfp8", "mxfp4")


def dequant_mxfp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[N, Kp] u8 E4M3 + [N, Kp/32] u8 E8M0 -> [N, Kp] fp32 (scale 0xFF -> NaN)."""
    vals = data.view(torch.float8_e4m3fn).float()
    s = torch.exp2(scale.float() - 127.0)
    s = torch.where(scale == 255, torch.full_like(s, float("nan")), s)
    return (vals.view(*scale.shape, -1) * s.unsqueeze(-1)).reshape(vals.shape)


def check_args(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[int, int, int]:
    """(M, N, K) after checking shapes and dtypes (shared with the Triton version)."""
    if fmt not in FORMATS:
        raise ValueError(f"mx_linear: format must be one of {FORMATS}, got {fmt!r}")
    if x.dim() != 2 or data.dim() != 2 or scale.dim() != 2:
        raise ValueError(
            f"mx_linear: x [M, K], data and scale 2-D, got {tuple(x.shape)}, {tuple(data.shape)}, {tuple(scale.shape)}"
        )
    if data.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"mx_linear: data and scale must be uint8, got {data.dtype} and {scale.dtype}")
    M, K = x.shape
    N, G = scale.shape
    per_byte = 1 if fmt == "mxfp8" else 2
    if data.shape != (N, G * 32 // per_byte) or -(-K // 32) != G:
        raise ValueError(
            f"mx_linear {fmt}: x {tuple(x.shape)} needs scale [N, {-(-K // 32)}] and data "
            f"[N, {-(-K // 32) * 32 // per_byte}], got scale {tuple(scale.shape)}, data {tuple(data.shape)}"
        )
    return M, N, K


def mx_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16) times the MX weight [N, K] transposed -> y [M, N] in x.dtype."""
    M, N, K = check_args(x, data, scale, fmt)
    w = dequant_mxfp8(data, scale) if fmt == "mxfp8" else dequant_mxfp4(data, scale)
    return (x.float() @ w[:, :K].T).to(x.dtype)
