"""Triton kernels vs their torch references (kernels/<op>.py vs kernels/<op>_ref.py).

Without a GPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set here and in conftest.py before
triton is imported); on a CUDA host they run compiled on CUDA tensors. Inputs are fresh random numbers on every run:
the seed is printed in every assertion message and `P2PK3_TEST_SEED=<n>` replays it.

Errors are relative Frobenius norms ||out - ref|| / ||ref||. Bounds per input dtype (interpreter numbers in
brackets were typical when written):
  * MXFP4 MoE (dot_scaled / dequant): activations are rounded to bf16 before the matmuls (the interpreter rounds
    by truncation, GPUs to nearest) and h is stored bf16: fp32 z <= 3e-2 [~8e-3], bf16 z <= 3e-2 [~8e-3].
  * MXFP4 MoE W4A8 (sm_120 option): vs an MXFP8 emulation <= 2e-2; vs the exact reference <= 0.2 [~7e-2].
  * KDA decode / prefill: fp32 math from the same inputs: 1e-4 for fp32 and bf16 inputs [~2e-7].
  * MLA decode: fp32 cache 1e-5 (interpreter, exact fp32) / 5e-3 (GPU, tf32); bf16 cache 1e-2 [~1e-3].
  * AttnRes: fp32 1e-5; bf16 output 1e-2 [~3e-3, one bf16 rounding].
Outputs (and the MoE / MLA intermediates) are pre-filled with NaN to prove that every element is written.
The offline-compile tests build every kernel for sm_90 and sm_120 in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import os

if not os.environ.get("P2PK3_TEST_CUDA_KERNELS"):
    try:
        import torch as _t

        if not _t.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    except Exception:  # pragma: no cover
        os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import random
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

from p2pk3_kernels import attnres, attnres_ref, kda, kda_ref, mla_decode, mla_decode_ref, mxfp4_moe, mxfp4_moe_ref  # noqa: E402
from p2pk3_kernels import ops  # noqa: E402

from conftest import rel  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERP, reason="no CUDA device and TRITON_INTERPRET was not set before triton was imported"
)


def nan_like(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


# ----------------------------------------------------------------------------------------------------------------
# MXFP4 MoE
# ----------------------------------------------------------------------------------------------------------------
def rand_mx(E, out_f, in_f):
    packed = torch.randint(0, 256, (E, out_f, in_f // 2), dtype=torch.uint8, device=DEVICE)
    scale = torch.randint(119, 125, (E, out_f, in_f // 32), dtype=torch.uint8, device=DEVICE)
    return packed, scale


def moe_case(N, W, I, E, k, zdtype, p_skip=0.2):
    z = torch.randn(N, W, device=DEVICE).to(zdtype)
    w1, s1 = rand_mx(E, I, W)
    w3, s3 = rand_mx(E, I, W)
    w2, s2 = rand_mx(E, W, I)
    ids = (
        torch.stack([torch.randperm(E, device=DEVICE)[:k] for _ in range(N)])
        if N
        else torch.zeros(0, k, dtype=torch.long, device=DEVICE)
    )
    ids = torch.where(torch.rand(ids.shape, device=DEVICE) < p_skip, torch.full_like(ids, -1), ids)
    tw = torch.rand(N, k, device=DEVICE)
    return z, w1, s1, w3, s3, w2, s2, ids, tw


def run_moe(args, activation, mode):
    z = args[0]
    out = nan_like((z.shape[0], z.shape[1]), torch.float32)
    mxfp4_moe._POISON = True
    try:
        res = mxfp4_moe._launch(*args, activation, 4.0, 25.0, mode=mxfp4_moe.MODES[mode], out=out)
    finally:
        mxfp4_moe._POISON = False
    assert res is out
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,activation,zdtype",
    [
        ("dot_scaled", "situ", torch.float32),
        ("dot_scaled", "silu", torch.bfloat16),
        ("dequant", "situ", torch.bfloat16),
        ("dequant", "silu", torch.float32),
        ("dequant_f16", "situ", torch.float32),
        ("dequant_f32", "situ", torch.float32),
    ],
)
def test_mxfp4_moe(mode, activation, zdtype, seed):
    N = random.choice([1, 3, 7])
    args = moe_case(N, 96, 64, 6, 3, zdtype)  # W = 96: not a power of two (masked K / N tails)
    out = run_moe(args, activation, mode)
    ref = mxfp4_moe_ref.mxfp4_moe(*args, activation=activation)
    assert not out.isnan().any(), f"unwritten output elements (seed={seed})"
    bound = 1e-5 if mode == "dequant_f32" else 3e-2  # fp32 end to end vs bf16-rounded activations
    assert rel(out, ref) <= bound, f"rel err {rel(out, ref):.3g} (seed={seed}, N={N})"


@pytest.mark.slow
def test_mxfp4_moe_prefill_blocks(seed):
    """Many rows per expert: BLOCK_M = 64 path, experts split over several M-blocks, odd token count."""
    args = moe_case(67, 64, 32, 3, 3, torch.bfloat16, p_skip=0.1)
    out = run_moe(args, "situ", "dot_scaled")
    ref = mxfp4_moe_ref.mxfp4_moe(*args)
    assert not out.isnan().any(), f"seed={seed}"
    assert rel(out, ref) <= 3e-2, f"rel err {rel(out, ref):.3g} (seed={seed})"


def test_mxfp4_moe_all_skipped(seed):
    args = list(moe_case(3, 64, 32, 4, 2, torch.bfloat16))
    args[7] = torch.full_like(args[7], -1)
    out = run_moe(tuple(args), "situ", "dot_scaled")
    assert torch.equal(out, torch.zeros_like(out)), f"seed={seed}"


def fake_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """OCP MXFP8 (E4M3) quantize-dequantize along the last dim: shared exp floor(log2 amax) - 8, RNE, saturate."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    ebits = (amax.view(torch.int32) >> 23) & 0xFF
    sbyte = (ebits - 8).clamp(0, 253)
    scale = torch.exp2(sbyte.float() - 127.0)
    q = (xb / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape)


def bf16_like_kernel(h: torch.Tensor) -> torch.Tensor:
    """h rounded to bf16 as the kernel stores it: the Triton interpreter truncates fp32 -> bf16, GPUs round to
    nearest even. (MXFP8 rounding amplifies a one-ulp bf16 difference into a different e4m3 code, so the
    emulation must round h the same way to be compared tightly.)"""
    if INTERP:
        return (h.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)
    return h.to(torch.bfloat16).float()


def moe_w4a8_emulated(z, w1, s1, w3, s3, w2, s2, ids, tw, activation):
    deq = mxfp4_moe_ref.dequant_mxfp4
    out = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        rows, cols = (ids == e).nonzero(as_tuple=True)
        x = fake_mxfp8(z[rows].to(torch.bfloat16))
        h = mxfp4_moe_ref.glu_act(x @ deq(w1[e], s1[e]).T, x @ deq(w3[e], s3[e]).T, activation, 4.0, 25.0)
        y = fake_mxfp8(bf16_like_kernel(h)) @ deq(w2[e], s2[e]).T
        out.index_add_(0, rows, y * tw[rows, cols].float().unsqueeze(-1))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["situ"])
def test_mxfp4_moe_w4a8(activation, seed):
    args = moe_case(5, 96, 64, 6, 3, torch.bfloat16)
    out = run_moe(args, activation, "w4a8")
    emu = moe_w4a8_emulated(*args, activation)
    ref = mxfp4_moe_ref.mxfp4_moe(*args, activation=activation)
    assert not out.isnan().any(), f"seed={seed}"
    assert rel(out, emu) <= 2e-2, f"vs MXFP8 emulation {rel(out, emu):.3g} (seed={seed})"
    assert rel(out, ref) <= 0.2, f"vs exact reference {rel(out, ref):.3g} (seed={seed})"


def test_mxfp8_quant_helper_exact(seed):
    """The in-kernel MXFP8 quantizer (W4A8 path) against the torch emulation, element for element."""
    tl = triton.language

    @triton.jit
    def k(x_ptr, q_ptr, s_ptr, BM: tl.constexpr, BK: tl.constexpr):
        om = tl.arange(0, BM)
        ok = tl.arange(0, BK)
        x = tl.load(x_ptr + om[:, None] * BK + ok[None, :])
        q, s = mxfp4_moe._quant_mxfp8(x, BM, BK)
        tl.store(q_ptr + om[:, None] * BK + ok[None, :], q.to(tl.float32))
        os_ = tl.arange(0, BK // 32)
        tl.store(s_ptr + om[:, None] * (BK // 32) + os_[None, :], s)

    x = torch.randn(16, 128, device=DEVICE) * torch.exp2(
        torch.randint(-20, 20, (16, 4, 1), device=DEVICE).float()
    ).repeat_interleave(32, 1).reshape(16, 128)
    x[0, :32] = 0.0  # an all-zero block
    q = torch.empty(16, 128, device=DEVICE)
    s = torch.empty(16, 4, dtype=torch.uint8, device=DEVICE)
    k[(1,)](x, q, s, BM=16, BK=128)
    deq = (q.view(16, 4, 32) * torch.exp2(s.float() - 127).unsqueeze(-1)).reshape(16, 128)
    assert torch.equal(deq, fake_mxfp8(x)), f"seed={seed}"


def test_route_blocks(seed):
    E, BM = 5, 4
    ids = torch.randint(-1, E, (9, 3), device=DEVICE)
    pairs, be, bs, br = mxfp4_moe.route_blocks(ids, E, BM)
    flat = ids.reshape(-1)
    seen = []
    for b in range(be.numel()):
        e = int(be[b])
        if e < 0:
            assert int(br[b]) == 0
            continue
        rows = pairs[int(bs[b]) : int(bs[b]) + int(br[b])].long()
        assert 1 <= rows.numel() <= BM and bool((flat[rows] == e).all()), f"seed={seed}"
        seen += rows.tolist()
    assert sorted(seen) == sorted((flat >= 0).nonzero().flatten().tolist()), f"seed={seed}"


# ----------------------------------------------------------------------------------------------------------------
# KDA
# ----------------------------------------------------------------------------------------------------------------
def kda_inputs(T, H, K, V, dtype):
    q, k, a = (torch.randn(T, H, K, device=DEVICE).to(dtype) for _ in range(3))
    v = torch.randn(T, H, V, device=DEVICE).to(dtype)
    b = torch.randn(T, H, device=DEVICE).to(dtype)
    A_log = torch.randn(H, device=DEVICE) * 0.5
    dt_bias = torch.randn(H * K, device=DEVICE)
    return q, k, v, a, b, A_log, dt_bias


@pytest.mark.slow
@pytest.mark.parametrize(
    "lower_bound,dtype,K,V",
    [
        (-5.0, torch.float32, 24, 80),
        (None, torch.bfloat16, 24, 80),
        (-5.0, torch.bfloat16, 128, 128),
        (None, torch.float32, 128, 128),
    ],
)
def test_kda_decode(lower_bound, dtype, K, V, seed):
    B, H, S = 3, 2, 6
    q, k, v, a, b, A_log, dt_bias = kda_inputs(B, H, K, V, dtype)
    state = torch.randn(S, H, K, V, device=DEVICE)
    rows = torch.randperm(S, device=DEVICE)[:B].int()
    st_t, st_r = state.clone(), state.clone()
    out = nan_like((B, H, V), torch.float32)
    kda._kda_decode(q, k, v, a, b, A_log, dt_bias, st_t, rows, K**-0.5, lower_bound, out=out)
    ref = kda_ref.kda_decode(q, k, v, a, b, A_log, dt_bias, st_r, rows, K**-0.5, lower_bound)
    assert not out.isnan().any(), f"seed={seed}"
    assert rel(out, ref) <= 1e-4, f"o rel err {rel(out, ref):.3g} (seed={seed})"
    assert rel(st_t, st_r) <= 1e-4, f"state rel err {rel(st_t, st_r):.3g} (seed={seed})"
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[rows.long().cpu()] = False
    assert torch.equal(st_t[untouched.to(DEVICE)], state[untouched.to(DEVICE)]), f"seed={seed}"


@pytest.mark.slow
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_prefill(lower_bound, dtype, seed):
    H, K, V, S = 2, 24, 80, 5
    lens = [random.choice([1, 5, 9, 13]), 0, random.choice([2, 7, 11])]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEVICE, dtype=torch.int32)
    N = int(cu[-1])
    q, k, v, a, b, A_log, dt_bias = kda_inputs(N, H, K, V, dtype)
    state = torch.randn(S, H, K, V, device=DEVICE)
    rows = torch.randperm(S, device=DEVICE)[:3].int()
    st_t, st_r = state.clone(), state.clone()
    out = nan_like((N, H, V), torch.float32)
    kda._kda_prefill(q, k, v, a, b, A_log, dt_bias, st_t, cu, rows, K**-0.5, lower_bound, out=out)
    ref = kda_ref.kda_prefill(q, k, v, a, b, A_log, dt_bias, st_r, cu, rows, K**-0.5, lower_bound, chunk_size=4)
    assert not out.isnan().any(), f"seed={seed}"
    assert rel(out, ref) <= 1e-4, f"o rel err {rel(out, ref):.3g} (seed={seed}, lens={lens})"
    assert rel(st_t, st_r) <= 1e-4, f"state rel err {rel(st_t, st_r):.3g} (seed={seed}, lens={lens})"


@pytest.mark.slow
def test_kda_decode_matches_fla(seed):
    """Cross-check against fla's fused_recurrent_kda (pool + row indices, gate / sigmoid / l2norm in kernel)."""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # pragma: no cover
        pytest.skip(f"fla not importable: {e}")
    B, H, K, V, S = 3, 2, 32, 64, 5
    q, k, v, a, b, A_log, dt_bias = kda_inputs(B, H, K, V, torch.float32)
    state = torch.randn(S, H, K, V, device=DEVICE)
    rows = torch.randperm(S, device=DEVICE)[:B]
    for lb in (-5.0, None):
        s1, s2 = state.clone(), state.clone()
        o1 = kda.kda_decode(q, k, v, a, b, A_log, dt_bias, s1, rows.int(), K**-0.5, lb)
        o2, _ = fused_recurrent_kda_fwd(
            *(x[:, None].contiguous() for x in (q, k, v, a, b)),
            A_log=A_log,
            dt_bias=dt_bias,
            initial_state=s2,
            scale=K**-0.5,
            inplace_final_state=True,
            ssm_state_indices=rows.long(),
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=lb,
        )
        assert rel(o1, o2[:, 0]) <= 1e-4 and rel(s1, s2) <= 1e-4, f"lb={lb} seed={seed}"


# ----------------------------------------------------------------------------------------------------------------
# MLA decode
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,num_splits", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 3), (torch.bfloat16, 1)]
)
def test_mla_decode(dtype, num_splits, seed):
    B, H, R, P, bs, NB = 3, 20, 48, 8, 16, 24  # H = 20: a full and a partial head group; R, P not powers of 2
    q_lat = torch.randn(B, H, R, device=DEVICE).to(dtype)
    q_pe = torch.randn(B, H, P, device=DEVICE).to(dtype)
    kv = torch.randn(NB, bs, R + P, device=DEVICE).to(dtype)
    bt = torch.stack([torch.randperm(NB, device=DEVICE)[:6] for _ in range(B)]).int()
    seq_lens = torch.tensor([random.randint(17, 96), 1, random.randint(2, 40)], device=DEVICE, dtype=torch.int32)
    out = nan_like((B, H, R), torch.float32)
    mla_decode._POISON = True
    try:
        mla_decode._mla_decode(q_lat, q_pe, kv, bt, seq_lens, R**-0.5, out=out, num_splits=num_splits)
    finally:
        mla_decode._POISON = False
    ref = mla_decode_ref.mla_decode(q_lat, q_pe, kv, bt, seq_lens, R**-0.5)
    tol = 1e-2 if dtype == torch.bfloat16 else (1e-5 if INTERP else 5e-3)
    assert not out.isnan().any(), f"seed={seed}"
    assert rel(out, ref) <= tol, f"rel err {rel(out, ref):.3g} (seed={seed}, seq_lens={seq_lens.tolist()})"


@pytest.mark.slow
def test_mla_decode_k3_width_and_empty(seed):
    """K3's 512 + 64 row width; a zero-length sequence gives z = 0."""
    B, H, R, P, bs, NB = 2, 16, 512, 64, 32, 4
    q_lat = torch.randn(B, H, R, device=DEVICE, dtype=torch.bfloat16)
    q_pe = torch.randn(B, H, P, device=DEVICE, dtype=torch.bfloat16)
    kv = torch.randn(NB, bs, R + P, device=DEVICE, dtype=torch.bfloat16)
    bt = torch.tensor([[2, 0], [1, 3]], device=DEVICE, dtype=torch.int32)
    seq_lens = torch.tensor([random.randint(33, 64), 0], device=DEVICE, dtype=torch.int32)
    out = nan_like((B, H, R), torch.float32)
    mla_decode._mla_decode(q_lat, q_pe, kv, bt, seq_lens, (R + P) ** -0.5, out=out)
    ref = mla_decode_ref.mla_decode(q_lat, q_pe, kv, bt, seq_lens, (R + P) ** -0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1])), f"seed={seed}"
    assert rel(out, ref) <= 1e-2, f"rel err {rel(out, ref):.3g} (seed={seed})"


# ----------------------------------------------------------------------------------------------------------------
# AttnRes
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("R", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attnres_mix(R, dtype, seed):
    N, D = random.choice([1, 5, 7]), 200
    buf = torch.randn(8, N, D, device=DEVICE).to(dtype) * 2  # bank = first R rows of a preallocated buffer
    bank = buf[:R]
    prefix = torch.randn(N, D, device=DEVICE).to(dtype)
    w = torch.randn(D, device=DEVICE)
    out = nan_like((N, D), dtype)
    attnres._attnres_mix(bank, prefix, w, 1e-5, out=out)
    ref = attnres_ref.attnres_mix(bank, prefix, w, 1e-5)
    assert out.dtype == ref.dtype and not out.isnan().any(), f"seed={seed}"
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(out, ref) <= tol, f"rel err {rel(out, ref):.3g} (seed={seed}, N={N})"


# ----------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------
def test_ops_dispatch_to_triton(monkeypatch, seed):
    calls = []
    real = attnres.attnres_mix
    monkeypatch.setattr(attnres, "attnres_mix", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("P2PK3_KERNELS", "triton")
    ops.force(None)
    bank = torch.randn(2, 3, 64, device=DEVICE)
    prefix = torch.randn(3, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    out = ops.attnres_mix(bank, prefix, w, 1e-5)
    assert calls == [1], "ops.attnres_mix did not reach kernels/attnres.py"
    assert rel(out, attnres_ref.attnres_mix(bank, prefix, w, 1e-5)) <= 1e-5
    for mod, name in [(kda, "kda_decode"), (kda, "kda_prefill"), (mla_decode, "mla_decode"), (mxfp4_moe, "mxfp4_moe")]:
        hit = []
        monkeypatch.setattr(mod, name, lambda *a, _h=hit, **k: _h.append(1))
        getattr(ops, name)(torch.zeros(1, device=DEVICE), *([None] * 10))
        assert hit == [1], f"ops.{name} did not dispatch to kernels/{mod.__name__.split('.')[-1]}.py"


# ----------------------------------------------------------------------------------------------------------------
# offline compile for sm_90 (H200) and sm_120 (RTX 5090), no GPU needed: run without TRITON_INTERPRET
# ----------------------------------------------------------------------------------------------------------------
COMPILE_SCRIPT = textwrap.dedent(r"""
    import json, re, sys, time, warnings
    warnings.filterwarnings("ignore")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from p2pk3_kernels import attnres, kda, mla_decode, mxfp4_moe
    cap = int(sys.argv[1])
    MOE = {"z_ptr": "*bf16", "w1_ptr": "*u8", "s1_ptr": "*u8", "w3_ptr": "*u8", "s3_ptr": "*u8", "h_ptr": "*bf16",
           "w2_ptr": "*u8", "s2_ptr": "*u8", "y_ptr": "*fp32", "tw_ptr": "*fp32", "pairs_ptr": "*i32",
           "blk_expert_ptr": "*i32", "blk_start_ptr": "*i32", "blk_rows_ptr": "*i32", "ids_ptr": "*i32",
           "out_ptr": "*fp32", "beta1": "fp32", "beta2": "fp32"}
    KDA = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr")}
    KDA.update({"alog_ptr": "*fp32", "dtb_ptr": "*fp32", "st_ptr": "*fp32", "row_ptr": "*i32", "cu_ptr": "*i32",
                "o_ptr": "*fp32", "scale": "fp32", "lower_bound": "fp32"})
    MLA = {"ql_ptr": "*bf16", "qp_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "sl_ptr": "*i32",
           "po_ptr": "*fp32", "pl_ptr": "*fp32", "out_ptr": "*fp32", "sm_scale_log2": "fp32"}
    AR = {"bank_ptr": "*bf16", "pre_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16", "eps": "fp32"}
    moe_c = lambda mode, **kw: dict(MODE=mode, BM=16, BN=64, BK=128, DOT_F32=False, **kw)
    SPECS = {
        90: [("moe_gate_up_dequant", mxfp4_moe._moe_gate_up_kernel, MOE, moe_c(1, ACT=0), 4, 3),
             ("moe_gate_up_dot_scaled", mxfp4_moe._moe_gate_up_kernel, MOE, moe_c(0, ACT=0), 4, 3),
             ("moe_down_dequant", mxfp4_moe._moe_down_kernel, MOE, moe_c(1), 4, 3),
             ("moe_down_dequant_f16", mxfp4_moe._moe_down_kernel, MOE, dict(MODE=3, BM=16, BN=128, BK=32,
                                                                            DOT_F32=False), 4, 4),
             ("moe_gate_up_dequant_f32", mxfp4_moe._moe_gate_up_kernel, {**MOE, "z_ptr": "*fp32", "h_ptr": "*fp32"},
              moe_c(4, ACT=0), 4, 3)],
        120: [("moe_gate_up_dot_scaled", mxfp4_moe._moe_gate_up_kernel, MOE, moe_c(0, ACT=0), 4, 3),
              ("moe_gate_up_w4a8", mxfp4_moe._moe_gate_up_kernel, MOE, moe_c(2, ACT=0), 4, 3),
              ("moe_down_w4a8", mxfp4_moe._moe_down_kernel, MOE, moe_c(2), 4, 3)],
    }[cap] + [
        ("moe_combine", mxfp4_moe._moe_combine_kernel, MOE, dict(BLOCK=1024), 4, 1),
        ("kda_decode", kda._kda_decode_kernel, KDA, dict(HAS_LB=True, BK=128, BV=32), 4, 1),
        ("kda_prefill", kda._kda_prefill_kernel, KDA, dict(HAS_LB=True, BK=128, BV=32), 4, 1),
        ("mla_split", mla_decode._mla_split_kernel, MLA, dict(BLOCK_H=16, BLOCK_T=32, BR=512, BP=64, DOT_F32=False), 4, 2),
        ("mla_reduce", mla_decode._mla_reduce_kernel, MLA, dict(BR=512), 4, 1),
        ("attnres", attnres._attnres_kernel, AR, dict(BLOCK_D=8192), 8, 1),
    ]
    for name, fn, types, consts, nw, ns in SPECS:
        sig = {a: ("constexpr" if a in consts else types.get(a, "i32")) for a in fn.arg_names}
        t = time.time()
        try:
            k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", cap, 32),
                               options=dict(num_warps=nw, num_stages=ns))
            ptx = k.asm["ptx"]
            mma = sorted(set(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", ptx)))
            res = dict(ok=bool(k.asm.get("cubin")), mma=mma, shared=k.metadata.shared,
                       mxf8f6f4="mxf8f6f4" in ptx)
        except Exception as e:  # noqa: BLE001
            res = dict(ok=False, err=f"{type(e).__name__}: {e}"[:2000])
        res.update(name=name, cap=cap, seconds=round(time.time() - t, 2))
        print("RESULT " + json.dumps(res), flush=True)
""")


_COMPILE_PROCS: dict = {}


def _compile_api_error():
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401

        return None
    except Exception as e:  # pragma: no cover
        return e


def _start_compiles():
    if _COMPILE_PROCS or _compile_api_error() is not None:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for cap in (90, 120):
        _COMPILE_PROCS[cap] = subprocess.Popen(
            [sys.executable, "-c", COMPILE_SCRIPT, str(cap)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


@pytest.fixture(scope="module", autouse=True)
def _background_compiles(request):
    """Start the offline compiles when the module starts (they run beside the interpreter tests) if any compile
    test was selected; stop them if nobody waited for them."""
    if any("offline_compile" in item.name for item in request.session.items):
        _start_compiles()
    yield
    for p in _COMPILE_PROCS.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.fixture(scope="module")
def compiled():
    err = _compile_api_error()
    if err is not None:
        pytest.skip(f"triton offline compile API unavailable: {err}")
    _start_compiles()
    results = {}
    for cap, p in _COMPILE_PROCS.items():
        out, err = p.communicate(timeout=900)
        lines = [json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT ")]
        if not lines:
            if "ptxas" in err.lower() and "not found" in err.lower():
                pytest.skip(f"no ptxas bundled with this triton: {err[-500:]}")
            raise AssertionError(f"compile subprocess for sm_{cap} failed:\n{err[-4000:]}")
        for r in lines:
            results[(r["name"], cap)] = r
    return results


@pytest.mark.slow
@pytest.mark.parametrize("cap", [90, 120])
@pytest.mark.parametrize(
    "name", ["moe_gate_up_dot_scaled", "moe_combine", "kda_decode", "kda_prefill", "mla_split", "mla_reduce", "attnres"]
)
def test_offline_compile(compiled, name, cap):
    r = compiled[(name, cap)]
    assert r["ok"], f"{name} failed to compile for sm_{cap}: {r.get('err')}"


@pytest.mark.slow
def test_offline_compile_sm90_dequant(compiled):
    for name in ("moe_gate_up_dequant", "moe_down_dequant", "moe_down_dequant_f16"):
        r = compiled[(name, 90)]
        assert r["ok"], f"{name}: {r.get('err')}"
        assert r["mma"], f"{name}: no tensor-core MMA in the sm_90 PTX"


@pytest.mark.slow
def test_offline_compile_sm120_w4a8_native_mx(compiled):
    for name in ("moe_gate_up_w4a8", "moe_down_w4a8"):
        r = compiled[(name, 120)]
        assert r["ok"], f"{name}: {r.get('err')}"
        assert r["mxf8f6f4"], f"{name}: no native block-scaled MMA (kind::mxf8f6f4) in the sm_120 PTX: {r['mma']}"
