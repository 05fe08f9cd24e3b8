"""MXFP4 (OCP Microscaling v1.0: E2M1 elements, E8M0 block scales, block 32) and MXFP8 fake-quant.

Layout of the K3 routed experts (compressed-tensors `mxfp4-pack-quantized`, spec 6.2):
* `weight_packed` uint8 [..., out, in/2]: byte j of a row holds element 2j in the LOW nibble and
  element 2j+1 in the HIGH nibble; a nibble is an E2M1 code (magnitude index 0-7 | sign bit 8).
* `weight_scale`  uint8 [..., out, in/32]: E8M0 biased exponent, X = 2^(s - 127), 0xFF = NaN.
* W[o, i] = E2M1[nibble(packed[o, i // 2], i % 2)] * 2^(scale[o, i // 32] - 127).

Everything here is vectorised torch and exact: E2M1 values and powers of two are representable in
float32, and the scale multiply is a power-of-two product (no rounding unless it under/overflows).
"""

from __future__ import annotations

import torch

__all__ = [
    "MXFP4Error",
    "E2M1_VALUES",
    "E2M1_MAX",
    "E4M3_MAX",
    "MX_BLOCK",
    "E8M0_NAN",
    "unpack_fp4",
    "pack_fp4",
    "e8m0_to_float",
    "dequantize_mxfp4",
    "quantize_mxfp4",
    "quantize_e2m1",
    "mxfp8_e4m3_fake_quant",
]


class MXFP4Error(ValueError):
    """Malformed MXFP4 data: NaN (0xFF) scales, disagreeing shapes, wrong dtypes, non-finite input."""


MX_BLOCK = 32
E8M0_NAN = 0xFF
E2M1_MAX = 6.0  # max normal of E2M1; emax_elem = 2
E2M1_EMAX = 2
E4M3_MAX = 448.0  # max normal of E4M3 (S.1111.110); emax_elem = 8
E4M3_EMAX = 8

# code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0.0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# (2 * magnitude) -> magnitude code, for magnitudes on the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}.
_TWICE_MAG_TO_CODE = torch.full((13,), -1, dtype=torch.uint8)
for _code, _twice in enumerate((0, 1, 2, 3, 4, 6, 8, 12)):
    _TWICE_MAG_TO_CODE[_twice] = _code


def _e8m0_table() -> torch.Tensor:
    """float32 value of every E8M0 byte, built from bit patterns so that it is exact:
    s in 1..254 -> a normal float with exponent field s; s = 0 -> 2^-127 (a float32 subnormal);
    s = 0xFF -> NaN."""
    s = torch.arange(256, dtype=torch.int32)
    bits = s << 23
    bits[0] = 0x00400000  # 2^-127 = 2^-126 * 0.5
    bits[255] = 0x7FC00000  # quiet NaN
    return bits.view(torch.float32).clone()


_E8M0_VALUES = _e8m0_table()


# ------------------------------------------------------------------------------------- packing
def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> uint8 codes [..., n]; element 2j is the low nibble of byte j."""
    if packed.dtype != torch.uint8:
        raise MXFP4Error(f"packed FP4 data must be uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (values 0..15, n even) -> packed uint8 [..., n/2] (low nibble = even element)."""
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise MXFP4Error(f"FP4 codes must be an integer tensor, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise MXFP4Error(f"cannot pack an odd number ({codes.shape[-1]}) of FP4 codes per row")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise MXFP4Error(f"FP4 codes must be in 0..15, got range [{int(codes.min())}, {int(codes.max())}]")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def e8m0_to_float(scale_u8: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(s - 127); 0xFF -> NaN; 0 -> 2^-127 (exact, a float32 subnormal)."""
    if scale_u8.dtype != torch.uint8:
        raise MXFP4Error(f"E8M0 scales must be uint8, got {scale_u8.dtype}")
    return _E8M0_VALUES.to(scale_u8.device)[scale_u8.long()]


# ------------------------------------------------------------------------------------- dequant
def _nan_scale_report(scale: torch.Tensor) -> str | None:
    bad = scale == E8M0_NAN
    n = int(bad.sum())
    if not n:
        return None
    where = bad.nonzero()[:4].tolist()
    more = "" if n <= 4 else f" (first 4 of {n} shown)"
    return f"{n} of {scale.numel()} E8M0 scales are 0xFF (NaN) at indices {where}{more}"


def dequantize_mxfp4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed uint8 [..., out, in/2] + scale uint8 [..., out, in/32] -> [..., out, in] in `dtype`.

    Leading dims (e.g. stacked experts [E, out, in/2]) must agree between the two tensors.
    Raises MXFP4Error on a NaN (0xFF) scale or shapes/dtypes that disagree."""
    if weight_packed.dtype != torch.uint8 or weight_scale.dtype != torch.uint8:
        raise MXFP4Error(
            f"weight_packed and weight_scale must be uint8, got {weight_packed.dtype} and {weight_scale.dtype}"
        )
    if weight_packed.dim() < 2 or weight_packed.dim() != weight_scale.dim():
        raise MXFP4Error(
            f"weight_packed {tuple(weight_packed.shape)} and weight_scale {tuple(weight_scale.shape)} "
            "must both be [..., out, cols] with the same number of dims (>= 2)"
        )
    n_in = weight_packed.shape[-1] * 2
    if weight_packed.shape[:-1] != weight_scale.shape[:-1] or weight_scale.shape[-1] * MX_BLOCK != n_in:
        raise MXFP4Error(
            f"shape mismatch: weight_packed {tuple(weight_packed.shape)} holds {n_in} inputs per row, "
            f"so weight_scale must be {tuple(weight_packed.shape[:-1]) + (n_in // MX_BLOCK,)} "
            f"(one scale per {MX_BLOCK}), got {tuple(weight_scale.shape)}"
        )
    msg = _nan_scale_report(weight_scale)
    if msg:
        raise MXFP4Error(msg)
    vals = E2M1_VALUES.to(weight_packed.device)[unpack_fp4(weight_packed).long()]
    vals = vals.view(*weight_scale.shape, MX_BLOCK) * e8m0_to_float(weight_scale).unsqueeze(-1)
    return vals.view(*weight_packed.shape[:-1], n_in).to(dtype)


# ------------------------------------------------------------------------------------- quant
def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(a)) for finite a > 0 (float32), via frexp: a = m * 2^e, m in [0.5, 1)."""
    _, e = torch.frexp(a)
    return e.to(torch.int32) - 1


def quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> E2M1 codes (uint8), round-to-nearest-even on the E2M1 grid, saturating to +-6.
    The sign bit follows the input's sign bit (so tiny negatives give -0, code 8, like ml_dtypes)."""
    x = x.float()
    a = x.abs()
    # grid spacing 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]; torch.round is round-half-to-even, and
    # even multiples of the spacing are exactly the codes with an even mantissa bit.
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    q = q.clamp(max=E2M1_MAX)
    mag = _TWICE_MAG_TO_CODE.to(x.device)[(q * 2).long()]
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., out, in] (in % 32 == 0) -> (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]).

    OCP MX v1.0 as the reference quantizer (microsoft/microxcaling `_quantize_mx`) computes it (spec 6.1):
    shared_exp = floor(log2(max|block|)) - emax_elem (2 for E2M1), clamped below at -127; elements are
    V / 2^shared_exp rounded to nearest (ties to even) on the E2M1 grid and saturated to +-6. The block
    max therefore lands in [4, 8) and anything in [6, 8) * 2^shared_exp saturates to 6. An all-zero block
    gets scale byte 0 (2^-127) and zero codes. (Note: microxcaling's default `round="nearest"` breaks ties
    away from zero; we use ties-to-even as the OCP conversion rule does. The two differ only on exact ties.)
    Non-finite input raises MXFP4Error."""
    if not w.dtype.is_floating_point:
        raise MXFP4Error(f"quantize_mxfp4 needs a floating tensor, got {w.dtype}")
    if w.dim() < 1 or w.shape[-1] % MX_BLOCK:
        raise MXFP4Error(f"the last (input) dim {w.shape[-1] if w.dim() else None} must be a multiple of {MX_BLOCK}")
    x = w.float()
    if not torch.isfinite(x).all():
        raise MXFP4Error(f"cannot quantize non-finite values ({int((~torch.isfinite(x)).sum())} of {x.numel()})")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exp = torch.where(amax > 0, _floor_log2(amax) - E2M1_EMAX, torch.full_like(amax, -127, dtype=torch.int32))
    exp = exp.clamp(min=-127)  # float32 input: floor(log2) <= 127, so exp <= 125 never needs the NaN case
    scaled = blocks * _E8M0_VALUES.to(x.device)[(127 - exp).clamp(max=254).long()].unsqueeze(-1)
    # 1 / 2^exp: exp >= -127 so 127 - exp <= 254 is a normal power of two; exp == -127 -> 2^127 (row 254).
    codes = quantize_e2m1(scaled).reshape(x.shape)
    return pack_fp4(codes), (exp + 127).to(torch.uint8)


# ------------------------------------------------------------------------------------- MXFP8
def mxfp8_e4m3_fake_quant(x: torch.Tensor, block: int = MX_BLOCK) -> torch.Tensor:
    """Quantize-dequantize `x` along its last dim as MXFP8 (E8M0 block scale, E4M3 elements), returning
    the same dtype and shape. shared_exp = floor(log2(max|block|)) - 8, clamped at -127; elements rounded to
    nearest-even E4M3 and saturated to +-448. A ragged last block is zero-padded; a block holding inf/NaN
    becomes NaN (the spec's NaN-scale case). Numerics emulation only (spec 6.4): not used by default."""
    if not x.dtype.is_floating_point:
        raise MXFP4Error(f"mxfp8_e4m3_fake_quant needs a floating tensor, got {x.dtype}")
    if block <= 0:
        raise MXFP4Error(f"block must be positive, got {block}")
    if x.dim() == 0 or x.numel() == 0:
        return x.clone()
    n = x.shape[-1]
    pad = (-n) % block
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // block, block)
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    safe = torch.where(finite & (amax > 0), amax, torch.ones_like(amax))
    exp = torch.where(
        finite & (amax > 0), _floor_log2(safe) - E4M3_EMAX, torch.full_like(amax, -127, dtype=torch.int32)
    )
    exp = exp.clamp(min=-127)
    vals = _E8M0_VALUES.to(x.device)
    inv = vals[(127 - exp).clamp(max=254).long()].unsqueeze(-1)
    fwd = vals[(exp + 127).long()].unsqueeze(-1)
    q = (blocks * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * fwd
    q = torch.where(finite.unsqueeze(-1), q, torch.full_like(q, float("nan")))
    q = q.reshape(xf.shape)
    if pad:
        q = q[..., :n]
    return q.to(x.dtype)
