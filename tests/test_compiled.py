"""The compiled decode step (p2pk3.model.compiled) gives eager's logits (<= 1e-5 relative) and the same greedy
tokens, builds one graph per bucket (no recompilation as the sequences grow), and falls back to eager,
saying why, when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from p2pk3.checkpoint.tiny import write_checkpoint
from p2pk3.engine.reference import Pipeline
from p2pk3.model import compiled
from p2pk3.model.cache import Span
from p2pk3.model.config import TINY_K3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    write_checkpoint(d, TINY_K3, seed=4)
    return d


def _greedy(pipe: Pipeline, batch: int, prompt: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [f"s{i}" for i in range(batch)]
    for s in ids:
        pipe.open(s)
    g = torch.Generator().manual_seed(1)
    tok = pipe.forward([Span(s, 0, prompt) for s in ids], torch.randint(0, 500, (batch * prompt,), generator=g)).argmax(
        -1
    )
    logits, toks = [], []
    for k in range(steps):
        lg = pipe.forward([Span(s, prompt + k, 1) for s in ids], tok)
        tok = lg.argmax(-1)
        logits.append(lg)
        toks.append(tok)
    for s in ids:
        pipe.close(s)
    return torch.stack(logits), torch.stack(toks)


def _check_exact(model, device: str, cuda_graphs: bool):
    eager = Pipeline.load(model, 2, device=device, compile=False, max_sessions=4, max_tokens=512)
    comp = Pipeline.load(model, 2, device=device, compile=False, max_sessions=4, max_tokens=512)
    for st in comp.stages:
        assert st.compile_decode(True, cuda_graphs=cuda_graphs)
    ref, ref_tok = _greedy(eager, 2, 6, 6)
    out, out_tok = _greedy(comp, 2, 6, 6)
    for st in comp.stages:
        assert st.decode_graph.failed is None, st.decode_graph.failed
        assert len(st.decode_graph.compile_s) == 1, "one graph for the bucket, not one per step"
    rel = float((out - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-5, f"compiled logits differ from eager by {rel:.3g} (relative)"
    assert torch.equal(out_tok, ref_tok)


@pytest.mark.slow
def test_compiled_decode_is_exact_on_cpu(model):
    _check_exact(model, "cpu", cuda_graphs=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU: CUDA graphs need a CUDA device")
def test_cuda_graph_decode_is_exact(model):
    _check_exact(model, "cuda", cuda_graphs=True)


@pytest.mark.slow
def test_compile_failure_falls_back_to_eager_and_says_why(model, monkeypatch, caplog):
    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("no C++ compiler for this host")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    ref, ref_tok = _greedy(Pipeline.load(model, 1, compile=False, max_sessions=2, max_tokens=256), 1, 4, 3)
    pipe = Pipeline.load(model, 1, compile=True, max_sessions=2, max_tokens=256)
    with caplog.at_level(logging.WARNING, logger="p2pk3.compile"):
        out, out_tok = _greedy(pipe, 1, 4, 3)
    assert "no C++ compiler for this host" in (pipe.stages[0].decode_graph.failed or "")
    assert "compiled decode off, running eager" in caplog.text
    assert torch.equal(out, ref) and torch.equal(out_tok, ref_tok)


def test_compile_default_by_device(monkeypatch):
    monkeypatch.delenv("P2PK3_COMPILE", raising=False)
    assert compiled.default_compile("cuda") and not compiled.default_compile("cpu")
    monkeypatch.setenv("P2PK3_COMPILE", "1")
    assert compiled.default_compile("cpu")
    monkeypatch.setenv("P2PK3_COMPILE", "0")
    assert not compiled.default_compile("cuda")


def test_dequantized_experts_give_the_same_logits(model):
    """LatentMoE.dequantize_experts (a CPU option): the same arithmetic on the same values as the packed path."""
    packed = Pipeline.load(model, 1, compile=False, dequant_experts=False, max_sessions=4, max_tokens=512)
    assert not any(getattr(m, "dequantized", False) for m in packed.stages[0].modules())
    ref, ref_tok = _greedy(packed, 3, 5, 4)
    pipe = Pipeline.load(model, 1, compile=False, dequant_experts=True, max_sessions=4, max_tokens=512)
    assert any(getattr(m, "dequantized", False) for m in pipe.stages[0].modules())
    out, out_tok = _greedy(pipe, 3, 5, 4)
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-6
    assert torch.equal(out_tok, ref_tok)


def test_experts_are_dequantized_by_default_only_on_the_torch_path_and_when_they_fit(model, monkeypatch):
    """default_dequant_experts: on a CPU with the torch kernels and room for the fp32 copy (8 bytes per packed
    byte within DEQUANT_RAM_SHARE of the available memory) yes; on CUDA, with forced Triton kernels, without
    the room, or when P2PK3_DEQUANT_EXPERTS says otherwise, no."""
    from p2pk3.checkpoint import stage as cs
    from p2pk3.model.kimi_k3 import LatentMoE
    from p2pk3_kernels import ops

    monkeypatch.delenv("P2PK3_DEQUANT_EXPERTS", raising=False)
    monkeypatch.delenv("P2PK3_KERNELS", raising=False)
    pipe = Pipeline.load(model, 1, compile=False, dequant_experts=False, max_sessions=2, max_tokens=64)
    moes = [m for m in pipe.stages[0].modules() if isinstance(m, LatentMoE)]
    packed = sum(b.numel() for m in moes for n, b in m.named_buffers() if n.endswith("_packed"))
    assert moes and packed > 0
    room = int(8 * packed / cs.DEQUANT_RAM_SHARE)  # exactly enough available memory
    monkeypatch.setattr(cs, "available_memory", lambda: room)
    assert cs.default_dequant_experts(moes, "cpu")
    assert not cs.default_dequant_experts(moes, "cuda")
    monkeypatch.setattr(cs, "available_memory", lambda: room - 8)
    assert not cs.default_dequant_experts(moes, "cpu")
    monkeypatch.setattr(cs, "available_memory", lambda: None)
    assert not cs.default_dequant_experts(moes, "cpu")
    monkeypatch.setattr(cs, "available_memory", lambda: room)
    ops.force("triton")
    try:
        assert not cs.default_dequant_experts(moes, "cpu")
    finally:
        ops.force(None)
    monkeypatch.setenv("P2PK3_DEQUANT_EXPERTS", "0")
    assert not cs.default_dequant_experts(moes, "cpu")
    monkeypatch.setenv("P2PK3_DEQUANT_EXPERTS", "1")
    assert cs.default_dequant_experts(moes, "cuda")
    monkeypatch.delenv("P2PK3_DEQUANT_EXPERTS")
    # and load_stage follows it: the default Pipeline on this host holds them dequantized
    default = Pipeline.load(model, 1, compile=False, max_sessions=2, max_tokens=64)
    assert all(m.dequantized for m in default.stages[0].modules() if isinstance(m, LatentMoE))
    monkeypatch.setenv("P2PK3_DEQUANT_EXPERTS", "0")
    off = Pipeline.load(model, 1, compile=False, max_sessions=2, max_tokens=64)
    assert not any(m.dequantized for m in off.stages[0].modules() if isinstance(m, LatentMoE))
