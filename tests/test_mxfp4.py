"""MXFP4 / E8M0 / MXFP8 numerics, checked against ml_dtypes and a scalar pure-Python reference."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pk3.quant.mxfp4 import (  # noqa: E402
    E2M1_VALUES,
    MXFP4Error,
    dequantize_mxfp4,
    e8m0_to_float,
    mxfp8_e4m3_fake_quant,
    pack_fp4,
    quantize_e2m1,
    quantize_mxfp4,
    unpack_fp4,
)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ------------------------------------------------------------------ independent oracles
def ml_e2m1(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def ml_e8m0(scales: np.ndarray) -> np.ndarray:
    return scales.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def ref_e2m1_code(v: float) -> int:
    """Nearest E2M1 grid point, ties to the even code (= even mantissa bit), saturating at 6."""
    a = min(abs(v), 6.0)
    dists = [abs(a - g) for g in GRID]
    best = min(dists)
    cands = [i for i, d in enumerate(dists) if d == best]
    code = cands[0] if len(cands) == 1 else next(i for i in cands if i % 2 == 0)
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def ref_quantize_row(row: list[float]) -> tuple[list[int], list[int]]:
    """Scalar reference of OCP MX quantization (codes unpacked, scale bytes) for one row."""
    codes, scales = [], []
    for b in range(0, len(row), 32):
        blk = row[b : b + 32]
        amax = max(abs(v) for v in blk)
        if amax == 0:
            e = -127
        else:
            e = max(math.frexp(amax)[1] - 1 - 2, -127)
        scales.append(e + 127)
        codes += [ref_e2m1_code(v / 2.0**e) for v in blk]
    return codes, scales


# ------------------------------------------------------------------ tables
def test_e2m1_table_matches_ml_dtypes_all_16_codes():
    ref = ml_e2m1(np.arange(16))
    ours = E2M1_VALUES.double().numpy()
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(np.signbit(ours), np.signbit(ref))  # code 8 is -0.0
    assert E2M1_VALUES[:8].tolist() == GRID


def test_e8m0_all_256_scales_match_ml_dtypes():
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = e8m0_to_float(s).double().numpy()
    ref = ml_e8m0(np.arange(256))
    assert ours.dtype == np.float64 and e8m0_to_float(s).dtype == torch.float32
    np.testing.assert_array_equal(ours[:255], ref[:255])  # exact, incl. 2^-127 (float32 subnormal)
    assert np.isnan(ours[255]) and np.isnan(ref[255])
    assert ours[127] == 1.0 and ours[0] == 2.0**-127 and ours[254] == 2.0**127


def test_e8m0_rejects_non_uint8():
    with pytest.raises(MXFP4Error):
        e8m0_to_float(torch.zeros(3, dtype=torch.int32))


# ------------------------------------------------------------------ packing
def test_unpack_low_nibble_is_even_element():
    assert unpack_fp4(torch.tensor([0x21, 0xF0], dtype=torch.uint8)).tolist() == [1, 2, 0, 15]
    assert pack_fp4(torch.tensor([1, 2, 0, 15], dtype=torch.uint8)).tolist() == [0x21, 0xF0]


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed), codes)
    raw = torch.randint(0, 256, (7, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(raw)), raw)
    with pytest.raises(MXFP4Error):
        pack_fp4(torch.tensor([1, 2, 3], dtype=torch.uint8))
    with pytest.raises(MXFP4Error):
        pack_fp4(torch.tensor([1, 16]))


# ------------------------------------------------------------------ dequantization
HAND_VALUES = [0, 1, 2, 3, 4, 6, 8, 12, -0.0, -1, -2, -3, -4, -6, -8, -12] * 2  # codes 0..15 twice, X = 2
HAND_PACKED = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
HAND_SCALE = 128  # 2^(128-127) = 2


def test_hand_computed_row():
    packed = torch.tensor([HAND_PACKED], dtype=torch.uint8)
    scale = torch.tensor([[HAND_SCALE]], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale)
    assert w.shape == (1, 32)
    assert w[0].tolist() == HAND_VALUES
    # and the quantizer reproduces the exact bytes (block max 12 -> shared_exp = 3 - 2 = 1)
    p, s = quantize_mxfp4(torch.tensor([HAND_VALUES]))
    assert p[0].tolist() == HAND_PACKED and s.tolist() == [[HAND_SCALE]]


def test_dequantize_matches_ml_dtypes_oracle():
    g = torch.Generator().manual_seed(1)
    out, n_in = 6, 128
    packed = torch.randint(0, 256, (out, n_in // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(0, 255, (out, n_in // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    scale[0, 0], scale[1, 1], scale[2, 2] = 0, 254, 127
    pn = packed.numpy()
    codes = np.empty((out, n_in), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = pn & 0x0F, pn >> 4
    ref = ml_e2m1(codes) * np.repeat(ml_e8m0(scale.numpy()), 32, axis=1)
    with np.errstate(over="ignore"):
        ref32 = ref.astype(np.float32)  # 6 * 2^127 overflows float32 in both implementations
    ours = dequantize_mxfp4(packed, scale).numpy()
    np.testing.assert_array_equal(ours, ref32)
    assert dequantize_mxfp4(packed, scale, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_stacked_experts():
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (3, 4, 32), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(120, 135, (3, 4, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    w = dequantize_mxfp4(packed, scale)
    assert w.shape == (3, 4, 64)
    for e in range(3):
        assert torch.equal(w[e], dequantize_mxfp4(packed[e], scale[e]))


def test_dequantize_nan_scale_raises_with_count_and_position():
    packed = torch.zeros((4, 32), dtype=torch.uint8)
    scale = torch.full((4, 2), 127, dtype=torch.uint8)
    scale[2, 1] = 0xFF
    scale[3, 0] = 0xFF
    with pytest.raises(MXFP4Error, match=r"2 of 8 .*0xFF.*\[\[2, 1\], \[3, 0\]\]"):
        dequantize_mxfp4(packed, scale)


@pytest.mark.parametrize(
    "pshape,sshape", [((4, 32), (4, 3)), ((4, 32), (5, 2)), ((2, 4, 32), (3, 4, 2)), ((4, 32), (8,))]
)
def test_dequantize_shape_mismatch(pshape, sshape):
    with pytest.raises(MXFP4Error, match="weight_scale"):
        dequantize_mxfp4(torch.zeros(pshape, dtype=torch.uint8), torch.full(sshape, 127, dtype=torch.uint8))


def test_dequantize_dtype_check():
    with pytest.raises(MXFP4Error, match="uint8"):
        dequantize_mxfp4(torch.zeros((4, 16), dtype=torch.int8), torch.zeros((4, 1), dtype=torch.uint8))


# ------------------------------------------------------------------ quantization
def test_element_rounding_matches_ml_dtypes():
    ties = torch.arange(-32, 33, dtype=torch.float32) / 4  # every multiple of 0.25 in [-8, 8]: all ties
    rnd = torch.randn(2000, generator=torch.Generator().manual_seed(3)) * 3
    x = torch.cat([ties, rnd, torch.tensor([-0.0, 1e-30, -1e-30, 5.999, 6.0, 7.99, 100.0, -100.0])])
    ours = quantize_e2m1(x).numpy()
    ref = x.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)  # RNE, saturating
    np.testing.assert_array_equal(ours, ref)


def test_quantize_matches_scalar_reference():
    g = torch.Generator().manual_seed(4)
    rows = [torch.randn(64, generator=g) * 10.0 ** float(k) for k in (-3, -1, 0, 2, 5)]
    rows.append(torch.cat([torch.zeros(32), torch.randn(32, generator=g)]))  # one all-zero block
    rows.append(torch.arange(64, dtype=torch.float32) / 4 - 8)  # exact ties after scaling
    rows.append(torch.randn(64, generator=g) * 2.0**-130)  # exponent clamps at -127
    rows.append(torch.full((64,), 7.0) * torch.tensor([1.0, -1.0]).repeat(32))  # [6, 8) -> saturate
    w = torch.stack(rows)
    p, s = quantize_mxfp4(w)
    assert p.shape == (w.shape[0], 32) and s.shape == (w.shape[0], 2)
    for r in range(w.shape[0]):
        codes, scales = ref_quantize_row(w[r].tolist())
        assert unpack_fp4(p[r]).tolist() == codes, r
        assert s[r].tolist() == scales, r


def test_quantize_spec_behaviour_block_max_and_saturation():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(32, 256, generator=g) * torch.logspace(-4, 4, 32).unsqueeze(1)
    p, s = quantize_mxfp4(w)
    X = e8m0_to_float(s).double()
    amax = w.double().abs().view(32, 8, 32).amax(-1)
    assert ((amax >= 4 * X) & (amax < 8 * X)).all()  # block max lands in [4, 8) * X
    codes = unpack_fp4(p).view(32, 8, 32)
    ratio = w.double().abs().view(32, 8, 32) / X.unsqueeze(-1)
    sat = ratio >= 6
    assert sat.any()
    assert ((codes & 7) == 7)[sat].all()  # values in [6, 8) * X are stored as +-6
    # error bounds: half a grid step below 6X; below 2X for the saturated range
    err = (dequantize_mxfp4(p, s).double() - w.double()).abs().view(32, 8, 32) / X.unsqueeze(-1)
    bound = torch.where(ratio < 2, 0.25, torch.where(ratio < 4, 0.5, torch.where(ratio < 6, 1.0, 2.0)))
    assert (err <= bound + 1e-12).all()
    assert (err[sat] < 2).all()


def test_quantize_rmse_and_idempotence():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 512, generator=g, dtype=torch.float32).to(torch.bfloat16)
    p, s = quantize_mxfp4(w)  # bf16 input accepted
    d = dequantize_mxfp4(p, s)
    rel = ((d - w.float()).norm() / w.float().norm()).item()
    assert 0.02 < rel < 0.2
    # values already on the MX grid survive a second quantization unchanged
    p2, s2 = quantize_mxfp4(d)
    assert torch.equal(dequantize_mxfp4(p2, s2), d)


def test_quantize_stacked_and_errors():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3, 4, 64, generator=g)
    p, s = quantize_mxfp4(w)
    assert p.shape == (3, 4, 32) and s.shape == (3, 4, 2)
    assert torch.equal(p[1], quantize_mxfp4(w[1])[0])
    with pytest.raises(MXFP4Error, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(MXFP4Error, match="non-finite"):
        quantize_mxfp4(torch.tensor([[float("inf")] + [0.0] * 31]))
    with pytest.raises(MXFP4Error):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32))


# ------------------------------------------------------------------ MXFP8 fake quant
def ref_mxfp8(x: np.ndarray, block: int = 32) -> np.ndarray:
    out = np.empty_like(x, dtype=np.float64)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], block):
            blk = x[r, b : b + block].astype(np.float64)
            amax = np.abs(blk).max()
            e = -127 if amax == 0 else max(math.frexp(amax)[1] - 1 - 8, -127)
            q = np.clip(blk / 2.0**e, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            out[r, b : b + block] = q.astype(np.float64) * 2.0**e
    return out


def test_mxfp8_fake_quant_matches_ml_dtypes_reference():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 96, generator=g) * torch.logspace(-6, 6, 6).unsqueeze(1)
    x[2, :32] = 0
    y = mxfp8_e4m3_fake_quant(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y.double().numpy(), ref_mxfp8(x.numpy()).astype(np.float32).astype(np.float64))
    assert (y[2, :32] == 0).all()
    rel = ((y - x).norm() / x.norm()).item()
    assert rel < 0.05


def test_mxfp8_fake_quant_dtype_ragged_and_nonfinite():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 40, generator=g).to(torch.bfloat16)
    y = mxfp8_e4m3_fake_quant(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # ragged tail is its own (zero-padded) block: same as quantizing it alone
    tail = mxfp8_e4m3_fake_quant(x[..., 32:].float())
    assert torch.equal(y[..., 32:].float(), tail.to(torch.bfloat16).float())
    exact = torch.tensor([[1.0, -2.0, 0.5, 448.0, 3.0] + [0.0] * 27])
    assert torch.equal(mxfp8_e4m3_fake_quant(exact), exact)
    bad = torch.randn(1, 64, generator=g)
    bad[0, 3] = float("inf")
    z = mxfp8_e4m3_fake_quant(bad)
    assert torch.isnan(z[0, :32]).all() and torch.isfinite(z[0, 32:]).all()
