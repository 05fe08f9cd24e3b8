"""Weight formats of the non-expert matrices (p2pk3.quant.formats, kernels/mx_linear*.py).

* The MXFP8 quantizer against an independent oracle (numpy + ml_dtypes' float8_e4m3fn / float8_e8m0fnu), the
  MXFP4 path against ml_dtypes' float4_e2m1fn decoding; both dequantizers exact.
* The torch reference `mx_linear_ref.mx_linear` against a float64 matmul of the ml_dtypes-decoded weight.
* The Triton kernel (TRITON_INTERPRET=1 without a GPU) against the reference: odd M / N / K (K not a multiple
  of 32, with garbage -- including E4M3 NaN bytes -- in the padded columns), strided activations, split-K,
  fp32 / bf16 / fp16 activations, outputs pre-filled with NaN. Bounds: fp32 / fp16 1e-5 (exact products, fp32
  sums), bf16 1.5e-2 (one bf16 rounding of the output; the interpreter truncates).
* The formats map (CLI string, topology table) and its errors; the loader hook (bit-identical when off, every
  chosen class converted, the converted stage equal to a dequantized-weights oracle, the cache file).
* Held-out perplexity of the embedded model with the formats on (docs/quality.md).
Fresh random inputs per run; the seed is in every message and `P2PK3_TEST_SEED=<n>` replays it.
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
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from p2pk3.quant import convert
from p2pk3.quant import formats as fmts
from p2pk3.quant.convert import (
    MXLinear,
    apply_formats,
    dequantize_mxfp8,
    dequantize_weight,
    quantize_mxfp8,
    quantize_weight,
)
from p2pk3.quant.formats import BYTES_PER_PARAM, FormatError, class_of, parse_formats
from p2pk3.quant.mxfp4 import mxfp8_e4m3_fake_quant, quantize_mxfp4
from p2pk3_kernels import mx_linear_ref, ops

from conftest import rel

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
MODEL = Path(__file__).resolve().parents[1] / "p2pk3" / "assets" / "tiny-k3-pydoc"


def spread_weights(out_f: int, in_f: int) -> torch.Tensor:
    """Blocks of very different magnitudes (1e-30 .. 1e4), some all-zero blocks, exact ties."""
    w = torch.randn(out_f, in_f) * torch.exp2(torch.randint(-100, 14, (out_f, 1)).float())
    w[0, : min(32, in_f)] = 0.0
    if out_f > 1:
        w[1, :] = torch.tensor([1.0, 1.0625, 1.1875, 448.0, 460.0, 2.0**-9 * 3] * in_f)[:in_f]  # ties, saturation
    return w


# ------------------------------------------------------------------------------------------ oracles
def oracle_mxfp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Independent OCP MX v1.0 MXFP8 quantizer: numpy frexp for the shared exponent, ml_dtypes for E4M3 RNE."""
    out_f, k = w.shape
    kp = -(-k // 32) * 32
    wp = np.zeros((out_f, kp), np.float64)
    wp[:, :k] = w
    blocks = wp.reshape(out_f, kp // 32, 32)
    amax = np.abs(blocks).max(-1)
    _, e = np.frexp(np.where(amax > 0, amax, 1.0))
    shared = np.where(amax > 0, (e - 1) - 8, -127).clip(-127, None)
    scaled = np.clip(blocks / np.exp2(shared)[..., None], -448, 448)
    q = scaled.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(out_f, kp)
    return q, (shared + 127).astype(np.uint8)


def decode_oracle(data: np.ndarray, scale: np.ndarray, fmt: str) -> np.ndarray:
    """ml_dtypes decoding of MXFP8 bytes / MXFP4 nibbles times the E8M0 scales -> float64 [out, Kp]."""
    if fmt == "mxfp8":
        vals = data.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    else:
        codes = np.stack([data & 0xF, data >> 4], -1).reshape(data.shape[0], -1)
        vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return (vals.reshape(*scale.shape, 32) * s[..., None]).reshape(vals.shape)


@pytest.mark.parametrize("k", [32, 96, 70, 5])
def test_mxfp8_quantizer_matches_independent_oracle(seed, k):
    w = spread_weights(9, k)
    data, scale = quantize_mxfp8(w)
    q, s = oracle_mxfp8(w.double().numpy())
    assert data.dtype == torch.uint8 and tuple(data.shape) == q.shape, seed
    assert np.array_equal(scale.numpy(), s), f"seed {seed}: E8M0 scales differ"
    assert np.array_equal(data.numpy(), q), f"seed {seed}: E4M3 bytes differ at {np.argwhere(data.numpy() != q)[:4]}"
    # exact dequant, equal to the ml_dtypes decoding and (K % 32 == 0) to the existing MXFP8 fake quant
    deq = dequantize_mxfp8(data, scale)
    assert np.array_equal(deq.double().numpy(), decode_oracle(data.numpy(), scale.numpy(), "mxfp8")), seed
    assert torch.equal(deq[:, k:], torch.zeros_like(deq[:, k:])), "padding must quantize to zero"
    if k % 32 == 0:
        assert torch.equal(deq, mxfp8_e4m3_fake_quant(w.float())), seed


@pytest.mark.parametrize("k", [64, 40])
def test_mxfp4_weights_match_the_expert_quantizer_and_ml_dtypes(seed, k):
    w = spread_weights(7, k)
    data, scale = quantize_weight(w, "mxfp4")
    wp = F.pad(w.float(), (0, (-k) % 32))
    d2, s2 = quantize_mxfp4(wp)
    assert torch.equal(data, d2) and torch.equal(scale, s2), seed
    deq = dequantize_weight(data, scale, "mxfp4", k)
    assert np.array_equal(deq.double().numpy(), decode_oracle(data.numpy(), scale.numpy(), "mxfp4")[:, :k]), seed


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp8(torch.tensor([[1.0, float("inf")] + [0.0] * 30]))
    with pytest.raises(FormatError, match="bf16"):
        quantize_weight(torch.ones(2, 32), "bf16")
    with pytest.raises(ValueError, match="shape mismatch"):
        dequantize_mxfp8(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------ reference
def random_mx(n: int, k: int, fmt: str, garbage_pad: bool = True):
    """Random packed weights: any E4M3 byte but the NaNs (or any nibble), scales 2^-8..2^3, and (K % 32) random
    bytes -- E4M3 NaNs included -- in the padded columns, which every implementation must ignore."""
    kp = -(-k // 32) * 32
    if fmt == "mxfp8":
        data = torch.randint(0, 256, (n, kp), dtype=torch.uint8)
        data[(data & 0x7F) == 0x7F] = 0x3C
        if garbage_pad and kp > k:
            data[:, k:] = torch.randint(0, 256, (n, kp - k), dtype=torch.uint8)
            data[:, -1] = 0x7F  # NaN
    else:
        data = torch.randint(0, 256, (n, kp // 2), dtype=torch.uint8)
    scale = torch.randint(119, 131, (n, kp // 32), dtype=torch.uint8)
    return data, scale


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_reference_matches_float64_oracle(seed, fmt):
    for m, n, k in [(5, 19, 64), (3, 8, 45)]:
        data, scale = random_mx(n, k, fmt)
        x = torch.randn(m, k)
        w = decode_oracle(data.numpy(), scale.numpy(), fmt)[:, :k]
        want = x.double().numpy() @ w.T
        got = mx_linear_ref.mx_linear(x, data, scale, fmt)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert rel(got, torch.from_numpy(want)) < 1e-6, f"seed {seed} {fmt} {(m, n, k)}"
        gb = mx_linear_ref.mx_linear(x.bfloat16(), data, scale, fmt)
        assert gb.dtype == torch.bfloat16 and rel(gb, torch.from_numpy(x.bfloat16().double().numpy() @ w.T)) < 8e-3
    # a NaN (0xFF) scale poisons the outputs it touches, as the OCP spec says
    data, scale = random_mx(4, 32, fmt)
    scale[2, 0] = 255
    y = mx_linear_ref.mx_linear(torch.randn(3, 32), data, scale, fmt)
    assert torch.isnan(y[:, 2]).all() and not torch.isnan(y[:, [0, 1, 3]]).any()


def test_reference_checks_shapes():
    data, scale = random_mx(4, 64, "mxfp8")
    with pytest.raises(ValueError, match="needs scale"):
        mx_linear_ref.mx_linear(torch.randn(2, 100), data, scale, "mxfp8")
    with pytest.raises(ValueError, match="format"):
        mx_linear_ref.mx_linear(torch.randn(2, 64), data, scale, "fp8")


# ------------------------------------------------------------------------------------------ Triton kernel
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERP, reason="no CUDA device and TRITON_INTERPRET was not set before triton was imported"
)


@needs_triton
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_triton_kernel_matches_reference(seed, fmt, dtype, monkeypatch):
    pytest.importorskip("triton")
    from p2pk3_kernels import mx_linear as mxk

    monkeypatch.setattr(mxk, "_POISON", True)
    # fp32: summation order only; fp16 output: an element may round to the neighbouring fp16 value when the
    # split-K partial sums add in another order (~5e-4 relative on that element, ~1e-5 over the matrix)
    bound = {torch.bfloat16: 1.5e-2, torch.float16: 1e-4}.get(dtype, 1e-5)
    cases = [(1, 33, 40, None), (7, 50, 96, None), (20, 64, 130, 3), (17, 9, 256, 2), (3, 16, 1, None)]
    for m, n, k, split in cases:
        data, scale = random_mx(n, k, fmt)
        data, scale = data.to(DEVICE), scale.to(DEVICE)
        x = torch.randn(m, 2 * k, device=DEVICE).to(dtype)[:, ::2]  # strided activations (stride 2 along K)
        ref = mx_linear_ref.mx_linear(x, data, scale, fmt)
        got = mxk.mx_linear(x, data, scale, fmt, split_k=split)
        assert got.dtype == dtype and got.shape == (m, n)
        assert not torch.isnan(got).any(), f"seed {seed} {fmt} {(m, n, k)}: unwritten outputs"
        e = rel(got, ref)
        assert e <= bound, f"seed {seed} {fmt} {dtype} {(m, n, k, split)}: rel err {e:.3g} > {bound}"
    empty = mxk.mx_linear(torch.randn(0, 64, device=DEVICE), *[t.to(DEVICE) for t in random_mx(5, 64, fmt)], fmt)
    assert empty.shape == (0, 5)


@needs_triton
def test_ops_dispatch_reaches_both_paths(monkeypatch):
    pytest.importorskip("triton")
    from p2pk3_kernels import mx_linear as mxk

    calls = []
    monkeypatch.setattr(mxk, "mx_linear", lambda *a, **k: calls.append("triton") or mx_linear_ref.mx_linear(*a))
    monkeypatch.setattr(ops, "mx_linear", ops._pick("mx_linear", "mx_linear", mx_linear_ref.mx_linear))
    data, scale = random_mx(4, 32, "mxfp8")
    x = torch.randn(2, 32, device=DEVICE)
    try:
        ops.force("triton")
        ops.mx_linear(x, data.to(DEVICE), scale.to(DEVICE), "mxfp8")
        assert calls == ["triton"]
        ops.force("torch")
        ops.mx_linear(x, data.to(DEVICE), scale.to(DEVICE), "mxfp8")
        assert calls == ["triton"]
    finally:
        ops.force(None)


# ------------------------------------------------------------------------------------------ formats map
def test_parse_formats_and_errors():
    assert parse_formats("attention=mxfp8, shared_experts=mxfp4") == {"attention": "mxfp8", "shared_experts": "mxfp4"}
    assert parse_formats({"dense": "bf16", "lm_head": "mxfp8"}) == {"dense": "bf16", "lm_head": "mxfp8"}
    assert parse_formats(None) == {} and parse_formats("") == {}
    with pytest.raises(FormatError, match="unknown tensor class 'attn'"):
        parse_formats({"attn": "mxfp8"})
    with pytest.raises(FormatError, match="lm_head: unknown format 'fp8'"):
        parse_formats("lm_head=fp8")
    with pytest.raises(FormatError, match="not CLASS=FORMAT"):
        parse_formats("attention")
    assert (
        fmts.format_spec({"shared_experts": "mxfp4", "attention": "mxfp8", "dense": "bf16"})
        == "attention=mxfp8,shared_experts=mxfp4"
    )
    assert BYTES_PER_PARAM == {"bf16": 2.0, "mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32}


def test_one_vocabulary_for_the_cli_the_topology_and_the_planner():
    every = dict.fromkeys(fmts.TENSOR_CLASSES, "mxfp8")
    # what the planner's parser took ...
    assert parse_formats("non-experts=mxfp8") == parse_formats("mxfp8") == parse_formats("all=mxfp8") == every
    assert parse_formats({"non-experts": "mxfp8"}) == every  # also in a topology's [model] formats table
    assert parse_formats("dense_mlp=mxfp4,latent_proj=shipped") == {"dense": "mxfp4", "latent": "bf16"}
    assert parse_formats("router=shipped,routed_experts=mxfp4,embedding=shipped") == {}
    # ... and what the loader's took, one result for both
    assert parse_formats("dense=mxfp8") == {"dense": "mxfp8"}
    assert parse_formats("lm_head=bf16,non-experts=mxfp4") == {
        **dict.fromkeys(fmts.TENSOR_CLASSES, "mxfp4"),
        "lm_head": "bf16",
    }  # a named class wins
    assert parse_formats("expert_inputs=mxfp8") == {"expert_inputs": "mxfp8"}  # not part of non-experts
    assert "expert_inputs" not in parse_formats("non-experts=mxfp8")
    for bad, want in (
        ("atention=mxfp8", "did you mean 'attention'?"),
        ("dense=mxpf8", "did you mean 'mxfp8'?"),
        ("non-expert=mxfp8", "did you mean 'non-experts'?"),
        ("router=mxfp8", "router cannot be stored as mxfp8"),
        ("routed_experts=mxfp8", "ship in MXFP4"),
        ("expert_inputs=mxfp4", "bf16 or mxfp8"),
        ("dense=mxfp8,dense_mlp=mxfp4", "'dense' given twice"),
    ):
        with pytest.raises(FormatError, match=want):
            parse_formats(bad)


def test_expert_inputs_entry_quantizes_the_expert_input_of_the_loaded_stage(ckpt):
    from p2pk3.model.kimi_k3 import LatentMoE

    st = _stage(ckpt, {"expert_inputs": "mxfp8"})
    moes = [m for m in st.modules() if isinstance(m, LatentMoE)]
    assert moes and all(m.mxfp8_activations for m in moes) and LatentMoE.mxfp8_activations is False
    a, b = _logits(st, TOKS), _logits(_stage(ckpt), TOKS)
    assert not torch.equal(a, b)
    assert rel(a, b) < 0.2


TOPO = """
[cluster]
name = "t"
[model]
preset = "tiny-k3"
{formats}
[[slots]]
id = "a"
layers = [0, 5]
"""


def test_topology_formats_round_trip_and_errors():
    from p2pk3.topology import Topology
    from p2pk3.topology.specs import TopologyError

    t = Topology.loads(TOPO.format(formats='formats = { attention = "mxfp8", shared_experts = "mxfp4" }'))
    assert t.model.formats == {"attention": "mxfp8", "shared_experts": "mxfp4"}
    assert Topology.loads(t.dump()).model.formats == t.model.formats
    assert Topology.loads(TOPO.format(formats="")).model.formats == {}
    assert "formats" not in Topology.loads(TOPO.format(formats="")).dump()
    with pytest.raises(TopologyError, match="unknown tensor class 'embeddings'"):
        Topology.loads(TOPO.format(formats='formats = { embeddings = "mxfp8" }'))
    with pytest.raises(TopologyError, match="unknown format 'int4'"):
        Topology.loads(TOPO.format(formats='formats = { dense = "int4" }'))
    with pytest.raises(TopologyError, match="formats must be a table"):
        Topology.loads(TOPO.format(formats='formats = "attention=mxfp8"'))


def test_class_of_covers_every_checkpoint_matrix():
    from p2pk3.model.config import KIMI_K3, TINY_K3
    from p2pk3.model.weights import all_tensors

    never = ("embed_tokens", "block_sparse_moe.gate.weight", "_res_proj.weight", ".experts.")
    for cfg in (TINY_K3, KIMI_K3.replace(num_experts=2, num_experts_per_token=1)):
        for name, sp in all_tensors(cfg).items():
            if len(sp.shape) != 2 or sp.dtype != torch.bfloat16:
                assert class_of(name) is None, name
                continue
            if any(s in name for s in never):
                assert class_of(name) is None, name
            else:
                assert class_of(name) is not None, f"{name} has no tensor class"
    assert class_of("model.layers.3.self_attn.kv_a_proj_with_mqa.weight") == "attention"
    assert class_of("model.layers.0.mlp.down_proj") == "dense"
    assert class_of("model.layers.2.block_sparse_moe.shared_experts.up_proj") == "shared_experts"
    assert class_of("model.layers.2.block_sparse_moe.routed_expert_up_proj.weight") == "latent"
    assert class_of("lm_head") == "lm_head" and class_of("model.layers.1.mlp_res.proj") is None


# ------------------------------------------------------------------------------------------ loader hook
def _stage(ckpt, formats=None, cache=None):
    from p2pk3.checkpoint.stage import load_stage
    from p2pk3.model.config import K3Config
    from p2pk3.model.stage import StagePlan

    cfg = K3Config.from_pretrained(ckpt)
    return load_stage(ckpt, StagePlan.whole(cfg), "float32", "cpu", cfg, formats, cache)


def _logits(stage, toks, incremental=False):
    from p2pk3.engine.reference import Pipeline

    return Pipeline([stage], max_sessions=1, max_tokens=64, block_size=8).score(toks, incremental=incremental)


TOKS = [5, 17, 300, 42, 42, 7, 99, 123, 4, 8, 9, 10, 511]


def test_formats_off_is_bit_identical(ckpt):
    base = _logits(_stage(ckpt), TOKS)
    for off in (None, {}, {"attention": "bf16", "lm_head": "bf16"}):
        st = _stage(ckpt, off)
        assert not any(isinstance(m, MXLinear) for m in st.modules())
        assert torch.equal(_logits(st, TOKS), base)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_converted_stage_equals_dequantized_oracle(ckpt, fmt):
    """Every chosen class is converted; the logits equal a stage whose nn.Linear weights were replaced by the
    dequantized MX values (an oracle built without MXLinear or the mx_linear op)."""
    fm = {"attention": fmt, "shared_experts": fmt, "dense": fmt, "lm_head": fmt, "latent": fmt}
    st = _stage(ckpt, fm)
    oracle = _stage(ckpt)
    n_conv = 0
    for name, mod in oracle.named_modules():
        if isinstance(mod, nn.Linear) and class_of(name):
            conv = st.get_submodule(name)
            assert isinstance(conv, MXLinear) and conv.fmt == fmt, name
            d, s = quantize_weight(mod.weight.detach(), fmt)
            mod.weight.data = dequantize_weight(d, s, fmt, mod.in_features)
            n_conv += 1
        elif isinstance(mod, nn.Linear):
            assert isinstance(st.get_submodule(name), nn.Linear), name
    assert n_conv >= 30
    for inc in (False, True):
        got, want = _logits(st, TOKS, inc), _logits(oracle, TOKS, inc)
        assert rel(got, want) < 1e-5, (fmt, inc, rel(got, want))
    assert rel(_logits(st, TOKS), _logits(_stage(ckpt), TOKS)) > 1e-4, "the formats changed nothing"


def test_cache_file_is_written_then_reused(ckpt, tmp_path):
    fm = {"attention": "mxfp8", "shared_experts": "mxfp4"}
    cache = tmp_path / "converted.safetensors"
    a = _stage(ckpt, fm, cache)
    assert cache.exists()
    calls = []
    orig = convert.quantize_weight
    convert.quantize_weight = lambda *a_, **k: calls.append(1) or orig(*a_, **k)
    try:
        b = _stage(ckpt, fm, cache)
        assert not calls, "the cache was not used"
        c = _stage(ckpt, {"attention": "mxfp4"}, cache)  # other formats: recomputed and rewritten
        assert calls
    finally:
        convert.quantize_weight = orig
    for (n, m), (_, m2) in zip(a.named_modules(), b.named_modules()):
        if isinstance(m, MXLinear):
            assert torch.equal(m.data, m2.data) and torch.equal(m.scale, m2.scale), n
    assert torch.equal(_logits(a, TOKS), _logits(b, TOKS))
    assert (
        isinstance(c.model.layers["1"].self_attn.q_proj, MXLinear)
        and c.model.layers["1"].self_attn.q_proj.fmt == "mxfp4"
    )


def test_tied_lm_head_is_refused():
    from p2pk3.model.config import TINY_K3
    from p2pk3.model.stage import K3Stage, StagePlan

    cfg = TINY_K3.replace(tie_word_embeddings=True, num_hidden_layers=1, full_attn_layers=(0,))
    st = K3Stage(cfg, StagePlan.whole(cfg))
    with pytest.raises(FormatError, match="tied"):
        apply_formats(st, {"lm_head": "mxfp8"})


def test_mxlinear_weight_and_leading_dims(seed):
    lin = nn.Linear(40, 24, bias=False)
    m = MXLinear.from_linear(lin, "mxfp8")
    x = torch.randn(2, 3, 40)
    w = m.weight
    assert w.shape == (24, 40) and rel(w, lin.weight.detach()) < 0.05, seed
    assert torch.allclose(m(x), x @ w.T, rtol=1e-5, atol=1e-6), seed
    assert m.nbytes() == 24 * 64 + 24 * 2


# ------------------------------------------------------------------------------------------ quality
@pytest.mark.slow
@pytest.mark.skipif(not (MODEL / "heldout_eval.json").exists(), reason="shipped model not present")
def test_shipped_model_perplexity_with_formats():
    """The held-out slice shipped with the model (tests/test_shipped_model.py), scored as shipped and with
    every class in MXFP8 / MXFP4 (docs/quality.md has the full held-out numbers)."""
    from p2pk3.checkpoint.stage import load_stage
    from p2pk3.model.cache import Span
    from p2pk3.model.config import K3Config
    from p2pk3.model.stage import StagePlan
    from p2pk3.tokenizer import load_tokenizer

    cfg = K3Config.from_pretrained(MODEL)
    tok = load_tokenizer(MODEL)
    rec = json.loads((MODEL / "heldout_eval.json").read_text())
    ids = (([tok.bos_id] if rec["prepend_bos"] else []) + tok.encode(rec["text"]))[: rec["num_tokens"]]
    T, W = rec["window"], rec["windows"]
    x = torch.tensor([ids[w * T : w * T + T + 1] for w in range(W)])

    def ppl(formats):
        st = load_stage(MODEL, StagePlan.whole(cfg), "float32", "cpu", cfg, formats)
        cache = st.new_cache(max_sessions=W, max_tokens=W * T, block_size=T)
        for w in range(W):
            cache.open(f"w{w}")
        with torch.inference_mode():
            lg = st([Span(f"w{w}", 0, T) for w in range(W)], cache, tokens=x[:, :-1].reshape(-1), logits="all")
        return math.exp(float(F.cross_entropy(lg.float(), x[:, 1:].reshape(-1))))

    base = ppl(None)
    all8 = ppl({c: "mxfp8" for c in fmts.TENSOR_CLASSES})
    all4 = ppl({c: "mxfp4" for c in fmts.TENSOR_CLASSES})
    assert abs(all8 / base - 1) < 0.02, (base, all8)
    assert all4 != base and all4 / base - 1 < 0.06, (base, all4)


# ------------------------------------------------------------------------------------------ offline compile
COMPILE_SCRIPT = r"""
import json, re, sys, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from p2pk3_kernels import mx_linear
cap = int(sys.argv[1])
fn = mx_linear._mx_linear_kernel
for act in ("bf16", "fp32"):
    for fp4 in (False, True):
        types = {"x_ptr": "*" + act, "w_ptr": "*u8", "s_ptr": "*u8", "y_ptr": "*" + act}
        consts = dict(FP4=fp4, F32=act == "fp32", DOT_F32=False, BM=16, BN=64, BK=128)
        sig = {a: ("constexpr" if a in consts else types.get(a, "i32")) for a in fn.arg_names}
        try:
            k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", cap, 32),
                               options=dict(num_warps=4, num_stages=3))
            ptx = k.asm["ptx"]
            res = dict(ok=bool(k.asm.get("cubin")), mma=sorted(set(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", ptx))))
        except Exception as e:  # noqa: BLE001
            res = dict(ok=False, err=f"{type(e).__name__}: {e}"[:2000])
        res.update(act=act, fp4=fp4)
        print("RESULT " + json.dumps(res), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("cap", [90, 120])
def test_offline_compile_mx_linear(cap):
    """The compiled (non-interpreter) kernel builds for sm_90 (H200) and sm_120 (RTX 5090); with bf16
    activations its dots run on tensor cores (wgmma / mma.sync with bf16 operands)."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception as e:  # pragma: no cover
        pytest.skip(f"triton offline compile API unavailable: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, str(cap)], env=env, capture_output=True, text=True, timeout=900
    )
    res = [json.loads(x[7:]) for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if not res and "ptxas" in r.stderr.lower() and "not found" in r.stderr.lower():
        pytest.skip(f"no ptxas bundled with this triton: {r.stderr[-500:]}")
    assert len(res) == 4, r.stderr[-3000:]
    for x in res:
        assert x["ok"], x
        if x["act"] == "bf16":
            assert any("bf16" in m for m in x["mma"]), x
