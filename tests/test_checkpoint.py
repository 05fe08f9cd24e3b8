"""Checkpoint writer (p2pk3.checkpoint.tiny) and lazy loader (p2pk3.checkpoint.loader)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import p2pk3.checkpoint.loader as loader_mod  # noqa: E402
from p2pk3.checkpoint.loader import (  # noqa: E402
    CheckpointError,
    CheckpointReader,
    load_stage_weights,
    stage_tensor_specs,
)
from p2pk3.model.config import TINY_K3, TINY_KIMI_LINEAR, K3Config  # noqa: E402
from p2pk3.model.weights import all_tensors, embed_tensors, head_tensors, layer_tensors  # noqa: E402
from p2pk3.quant.mxfp4 import dequantize_mxfp4  # noqa: E402
from p2pk3.checkpoint.tiny import main as cli_main, random_state_dict, write_checkpoint  # noqa: E402

INDEX = "model.safetensors.index.json"
K3_L12 = TINY_K3.replace(num_hidden_layers=12, full_attn_layers=(3, 7, 10, 11))


def spec_bytes(specs) -> int:
    return sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in specs.values())


def all_names(cfg):
    return set(all_tensors(cfg))


def assert_same(got: dict, ref: dict):
    assert list(got) == list(ref) or set(got) == set(ref)
    for n, t in got.items():
        assert t.dtype == ref[n].dtype, n
        assert torch.equal(t, ref[n]), n


def shard_of(ckpt: Path, stored: str) -> Path:
    idx = ckpt / INDEX
    if not idx.exists():
        return ckpt / "model.safetensors"
    return ckpt / json.loads(idx.read_text())["weight_map"][stored]


def rewrite(ckpt: Path, stored: str, fn, *, drop_from_index: bool = False) -> Path:
    """Replace (fn returns a tensor) or delete (fn returns None) one stored tensor; returns its shard."""
    path = shard_of(ckpt, stored)
    sd = load_file(str(path))
    new = fn(sd[stored])
    if new is None:
        del sd[stored]
    else:
        sd[stored] = new
    save_file(sd, str(path), metadata={"format": "pt"})
    if drop_from_index:
        idx = json.loads((ckpt / INDEX).read_text())
        del idx["weight_map"][stored]
        (ckpt / INDEX).write_text(json.dumps(idx))
    return path


@pytest.fixture(scope="module")
def k3_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("k3"), TINY_K3, seed=0, shards=3)


# ------------------------------------------------------------------ writer
def test_writer_layout_k3(k3_ckpt):
    files = sorted(p.name for p in k3_ckpt.iterdir())
    assert files == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        INDEX,
    ]
    assert K3Config.from_pretrained(k3_ckpt) == TINY_K3
    idx = json.loads((k3_ckpt / INDEX).read_text())
    wm = idx["weight_map"]
    text = {n for n in wm if n.startswith("language_model.")}
    other = set(wm) - text
    assert {n[len("language_model.") :] for n in text} == all_names(TINY_K3)
    assert other and all(n.startswith(("vision_tower.", "mm_projector.")) for n in other)
    assert any(n.startswith("vision_tower.") for n in other) and any(n.startswith("mm_projector.") for n in other)
    assert "language_model.lm_head.weight" in wm and "language_model.model.embed_tokens.weight" in wm
    total = 0
    for fn in set(wm.values()):
        for n, t in load_file(str(k3_ckpt / fn)).items():
            assert wm[n] == fn
            total += t.numel() * t.element_size()
            if n.startswith("language_model."):
                assert t.dtype == all_tensors(TINY_K3)[n[len("language_model.") :]].dtype, n
    assert idx["metadata"]["total_size"] == total


def test_writer_random_init_is_sane():
    cfg = TINY_K3
    sd = random_state_dict(cfg, seed=3)
    assert_same(sd, random_state_dict(cfg, seed=3))  # deterministic
    assert not torch.equal(sd["model.embed_tokens.weight"], random_state_dict(cfg, seed=4)["model.embed_tokens.weight"])
    H = cfg.kda_num_heads
    a = sd["model.layers.0.self_attn.A_log"]
    assert a.dtype == torch.float32 and (a[H:] == 0).all()
    assert ((a[:H].exp() >= 1) & (a[:H].exp() <= 16)).all()
    assert (sd["model.layers.0.input_layernorm.weight"] == 1).all()
    assert (sd["model.layers.0.self_attn.o_norm.weight"] == 1).all()
    assert sd["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].abs().max() < 0.1
    assert sd["model.layers.0.self_attn.dt_bias"].abs().max() < 1.0
    q = sd["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() * math.sqrt(cfg.hidden_size) - 1) < 0.1
    e = dequantize_mxfp4(
        sd["model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"],
        sd["model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"],
    )
    assert abs(e.std().item() * math.sqrt(cfg.moe_intermediate_size) - 1) < 0.2
    for n, t in sd.items():
        assert torch.isfinite(t.float()).all(), n


def test_writer_is_fast(tmp_path):
    import time

    t0 = time.perf_counter()
    write_checkpoint(tmp_path, TINY_K3, shards=3)
    assert time.perf_counter() - t0 < 1.0


def test_cli(tmp_path):
    assert (
        cli_main(["--preset", "tiny-kimi-linear", "--out", str(tmp_path / "kl"), "--seed", "2", "--shards", "2"]) == 0
    )
    assert (tmp_path / "kl" / INDEX).exists()
    assert K3Config.from_pretrained(tmp_path / "kl") == TINY_KIMI_LINEAR
    w = load_stage_weights(tmp_path / "kl", TINY_KIMI_LINEAR, range(4), embed=True, head=True)
    assert_same(w, random_state_dict(TINY_KIMI_LINEAR, seed=2))


# ------------------------------------------------------------------ loader: layouts
@pytest.mark.parametrize(
    "cfg,prefix,shards",
    [
        (TINY_K3, None, 3),
        (TINY_K3, "", 2),
        (TINY_K3, None, 1),
        (TINY_KIMI_LINEAR, None, 3),
        (TINY_KIMI_LINEAR, "language_model.", 2),
        (TINY_KIMI_LINEAR, None, 1),
    ],
)
def test_full_round_trip(tmp_path, cfg, prefix, shards):
    ckpt = write_checkpoint(tmp_path, cfg, seed=1, shards=shards, prefix=prefix)
    assert (ckpt / INDEX).exists() == (shards > 1)
    assert (ckpt / "model.safetensors").exists() == (shards == 1)
    w = load_stage_weights(ckpt, cfg, range(cfg.num_hidden_layers), embed=True, head=True)
    assert list(w) == list(all_tensors(cfg))
    assert_same(w, random_state_dict(cfg, seed=1))
    assert not any("vision" in n or "projector" in n for n in w.stats.names_read)
    assert w.stats.bytes_read == spec_bytes(all_tensors(cfg))
    if cfg.model_type == "kimi_k3":
        assert len(CheckpointReader(ckpt).skipped) == 4


def test_shard_names_come_from_index(tmp_path):
    ckpt = write_checkpoint(tmp_path, TINY_K3, shards=3)
    idx = json.loads((ckpt / INDEX).read_text())
    ren = {f"model-0000{k}-of-00003.safetensors": f"model-{k:05d}-of-{96:06d}.safetensors" for k in (1, 2, 3)}
    for old, new in ren.items():
        (ckpt / old).rename(ckpt / new)
    idx["weight_map"] = {n: ren[f] for n, f in idx["weight_map"].items()}
    (ckpt / INDEX).write_text(json.dumps(idx))
    w = load_stage_weights(ckpt, TINY_K3, [0, 5], embed=True, head=True)
    assert w.stats.files_opened <= set(ren.values())


def test_multimodal_prefix_variants_are_skipped(tmp_path):
    sd = {"language_model." + n: t for n, t in random_state_dict(TINY_K3).items()}
    sd["multi_modal_projector.linear_1.weight"] = torch.zeros(2, 2)
    sd["language_model.vision_tower.x.weight"] = torch.zeros(2)
    sd["model.mm_projector.y"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    r = CheckpointReader(tmp_path)
    assert sorted(r.skipped) == sorted(
        ["multi_modal_projector.linear_1.weight", "language_model.vision_tower.x.weight", "model.mm_projector.y"]
    )
    assert r.check_inventory(all_tensors(TINY_K3)) == ([], [])
    w = load_stage_weights(tmp_path, TINY_K3, range(6), embed=True, head=True, reader=r)
    assert set(w) == all_names(TINY_K3)


# ------------------------------------------------------------------ loader: subsets and bytes read
def test_layer_expert_and_part_subsets(k3_ckpt):
    cfg = TINY_K3
    ref = random_state_dict(cfg, seed=0)
    w = load_stage_weights(
        k3_ckpt, cfg, [1, 3, 4], experts={1: [5, 0, 5], 4: [7], 0: [1]}, layer_parts={3: ("attn",), 4: ("mlp",)}
    )
    expect = {}
    expect.update(layer_tensors(cfg, 1, experts=[0, 5]))
    expect.update(layer_tensors(cfg, 3, parts=("attn",)))
    expect.update(layer_tensors(cfg, 4, experts=[7], parts=("mlp",)))
    assert list(w) == list(expect)
    assert_same(w, {n: ref[n] for n in expect})
    assert "model.layers.1.block_sparse_moe.experts.5.w2.weight_packed" in w
    assert not any(".experts.1." in n for n in w if n.startswith("model.layers.1."))
    assert "model.layers.3.post_attention_layernorm.weight" not in w
    assert "model.layers.4.input_layernorm.weight" not in w
    assert "model.embed_tokens.weight" not in w and "lm_head.weight" not in w
    e = load_stage_weights(k3_ckpt, cfg, [], embed=True)
    assert list(e) == list(embed_tensors(cfg))
    h = load_stage_weights(k3_ckpt, cfg, [], head=True)
    assert list(h) == list(head_tensors(cfg)) and "model.output_attn_res_proj.weight" in h


def test_subset_argument_errors(k3_ckpt):
    with pytest.raises(ValueError, match="layer 6 out of range"):
        load_stage_weights(k3_ckpt, TINY_K3, [6])
    with pytest.raises(ValueError, match=r"expert ids \[8\]"):
        load_stage_weights(k3_ckpt, TINY_K3, [1], experts={1: [8]})
    with pytest.raises(ValueError, match="layer_parts"):
        load_stage_weights(k3_ckpt, TINY_K3, [1], layer_parts={1: ("moe",)})


class RecordingOpen:
    """Wraps safetensors.safe_open and records every tensor whose data is read."""

    def __init__(self, real):
        self.real, self.reads, self.opens = real, [], []

    def __call__(self, path, framework):
        rec = self
        self.opens.append(Path(path).name)

        class H:
            def __init__(self):
                self.h = rec.real(path, framework=framework)

            def __enter__(self):
                self.f = self.h.__enter__()
                return self

            def __exit__(self, *a):
                return self.h.__exit__(*a)

            def keys(self):
                return self.f.keys()

            def get_slice(self, n):
                return self.f.get_slice(n)

            def get_tensor(self, n):
                rec.reads.append(n)
                return self.f.get_tensor(n)

        return H()


def test_one_layer_of_many_reads_only_that_layer(tmp_path, monkeypatch):
    cfg = K3_L12
    ckpt = write_checkpoint(tmp_path, cfg, shards=4)
    rec = RecordingOpen(loader_mod.safe_open)
    monkeypatch.setattr(loader_mod, "safe_open", rec)
    w = load_stage_weights(ckpt, cfg, [5])
    expect = layer_tensors(cfg, 5)
    # the data of exactly layer 5's tensors was read, nothing else (no other layer, no vision tower)
    assert sorted(rec.reads) == sorted("language_model." + n for n in expect)
    assert w.stats.bytes_read == spec_bytes(expect)
    assert w.stats.tensors_read == len(expect)
    on_disk = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert w.stats.bytes_read < on_disk / 10
    # fewer experts -> proportionally fewer bytes; the shards holding nothing of layer 5 are never opened
    rec.reads.clear()
    w2 = load_stage_weights(ckpt, cfg, [5], experts={5: [2]})
    assert w2.stats.bytes_read == spec_bytes(layer_tensors(cfg, 5, experts=[2])) < w.stats.bytes_read
    assert not any(".experts.3." in n for n in rec.reads)
    files = set(json.loads((ckpt / INDEX).read_text())["weight_map"][n] for n in rec.reads)
    assert w2.stats.files_opened == files


# ------------------------------------------------------------------ loader: dtypes, A_log layouts, export
def test_alternative_float_dtypes_are_accepted_and_cast(tmp_path):
    cfg = TINY_KIMI_LINEAR
    ckpt = write_checkpoint(tmp_path, cfg, shards=2)
    rewrite(ckpt, "model.layers.0.input_layernorm.weight", lambda t: t.float())
    rewrite(ckpt, "model.layers.0.self_attn.q_conv1d.weight", lambda t: t.to(torch.bfloat16))
    rewrite(ckpt, "model.layers.0.self_attn.A_log", lambda t: t[: cfg.kda_num_heads].clone().view(1, 1, -1, 1))
    w = load_stage_weights(ckpt, cfg, [0])
    assert w["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
    assert w["model.layers.0.self_attn.q_conv1d.weight"].dtype == torch.float32
    ref = random_state_dict(cfg)["model.layers.0.self_attn.A_log"]
    assert torch.equal(w["model.layers.0.self_attn.A_log"], ref)  # unpadded [1,1,H,1] -> padded spec shape
    raw = load_stage_weights(ckpt, cfg, [0], cast=False)
    assert raw["model.layers.0.input_layernorm.weight"].dtype == torch.float32


def test_export_state_dict_with_float_experts(tmp_path):
    cfg = TINY_K3
    g = torch.Generator().manual_seed(11)
    sd = {}
    floats = {}
    for n, spec in all_tensors(cfg).items():
        if n.endswith("weight_scale"):
            continue
        if n.endswith("weight_packed"):
            o, half = spec.shape
            fn = n[: -len("weight_packed")] + "weight"
            floats[fn] = sd[fn] = torch.randn(o, half * 2, generator=g) * 0.05
        elif n.endswith("A_log"):
            sd[n] = torch.log(torch.arange(1, cfg.kda_num_heads + 1, dtype=torch.float32))  # unpadded [H]
        else:
            sd[n] = torch.randn(spec.shape, generator=g).float()  # fp32 training weights: written as bf16
    ckpt = write_checkpoint(tmp_path, cfg, state_dict=sd, shards=2)
    w = load_stage_weights(ckpt, cfg, range(cfg.num_hidden_layers), embed=True, head=True)
    assert torch.equal(
        w["model.layers.2.self_attn.q_proj.weight"], sd["model.layers.2.self_attn.q_proj.weight"].bfloat16()
    )
    assert (
        w["model.layers.0.self_attn.A_log"][: cfg.kda_num_heads].tolist()
        == sd["model.layers.0.self_attn.A_log"].tolist()
    )
    base = "model.layers.3.block_sparse_moe.experts.6.w1."
    d = dequantize_mxfp4(w[base + "weight_packed"], w[base + "weight_scale"])
    ref = floats[base + "weight"]
    assert ((d - ref).norm() / ref.norm()).item() < 0.2
    # packed experts pass through bit-exactly
    w_packed = {n: t for n, t in w.items()}
    ckpt2 = write_checkpoint(tmp_path / "again", cfg, state_dict=w_packed, shards=1)
    assert_same(load_stage_weights(ckpt2, cfg, range(6), embed=True, head=True), w)
    with pytest.raises(ValueError, match="lacks"):
        write_checkpoint(tmp_path / "bad", cfg, state_dict={k: v for k, v in sd.items() if "lm_head" not in k})
    with pytest.raises(ValueError, match="does not list"):
        write_checkpoint(tmp_path / "bad2", cfg, state_dict={**sd, "model.layers.9.foo": torch.zeros(1)})


# ------------------------------------------------------------------ loader: errors name tensor and file
def _err(ckpt, cfg, **kw) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_stage_weights(ckpt, cfg, **kw)
    return str(ei.value)


def test_missing_tensor_in_index(tmp_path):
    ckpt = write_checkpoint(tmp_path, TINY_K3, shards=3)
    name = "model.layers.2.self_attn.q_proj.weight"
    rewrite(ckpt, "language_model." + name, lambda t: None, drop_from_index=True)
    msg = _err(ckpt, TINY_K3, layers=[2])
    assert name in msg and INDEX in msg and "missing" in msg
    load_stage_weights(ckpt, TINY_K3, [1, 3])  # other layers still load
    assert CheckpointReader(ckpt).check_inventory(all_tensors(TINY_K3))[0] == [name]


def test_tensor_in_index_but_not_in_shard(tmp_path):
    ckpt = write_checkpoint(tmp_path, TINY_KIMI_LINEAR, shards=2)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    shard = rewrite(ckpt, name, lambda t: None)
    msg = _err(ckpt, TINY_KIMI_LINEAR, layers=[1])
    assert name in msg and shard.name in msg


def test_missing_shard_file(tmp_path):
    ckpt = write_checkpoint(tmp_path, TINY_K3, shards=3)
    shard = shard_of(ckpt, "language_model.lm_head.weight")
    shard.unlink()
    msg = _err(ckpt, TINY_K3, layers=[], head=True)
    assert "lm_head.weight" in msg and shard.name in msg and "does not exist" in msg


def test_wrong_shape(tmp_path):
    ckpt = write_checkpoint(tmp_path, TINY_K3, shards=3)
    name = "model.layers.3.self_attn.kv_b_proj.weight"
    shard = rewrite(ckpt, "language_model." + name, lambda t: t.t().contiguous())
    msg = _err(ckpt, TINY_K3, layers=[3])
    assert name in msg and shard.name in msg and "shape" in msg


@pytest.mark.parametrize(
    "name,conv",
    [
        ("model.layers.1.block_sparse_moe.experts.0.w1.weight_packed", lambda t: t.to(torch.int8)),
        ("model.layers.1.block_sparse_moe.experts.0.w2.weight_scale", lambda t: t.to(torch.bfloat16)),
        ("model.layers.1.block_sparse_moe.gate.weight", lambda t: t.to(torch.int32)),
        ("model.layers.0.self_attn.A_log", lambda t: t.to(torch.float64)),
    ],
)
def test_wrong_dtype(tmp_path, name, conv):
    ckpt = write_checkpoint(tmp_path, TINY_K3, shards=2)
    shard = rewrite(ckpt, "language_model." + name, conv)
    msg = _err(ckpt, TINY_K3, layers=[0, 1])
    assert name in msg and shard.name in msg and "dtype" in msg


def test_truncated_shard(tmp_path):
    ckpt = write_checkpoint(tmp_path, TINY_K3, shards=3)
    name = "model.layers.4.self_attn.o_proj.weight"
    shard = shard_of(ckpt, "language_model." + name)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    msg = _err(ckpt, TINY_K3, layers=[4])
    assert shard.name in msg and "truncated" in msg
    assert "model.layers.4." in msg  # names the tensor it was loading
    # a garbage header is reported the same way
    shard.write_bytes(b"\xff" * 64)
    msg = _err(ckpt, TINY_K3, layers=[4])
    assert shard.name in msg and "model.layers.4." in msg


def test_truncated_single_file(tmp_path):
    ckpt = write_checkpoint(tmp_path, TINY_KIMI_LINEAR, shards=1)
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_stage_weights(ckpt, TINY_KIMI_LINEAR, [0])


def test_nan_scale(tmp_path):
    ckpt = write_checkpoint(tmp_path, TINY_K3, shards=3)
    name = "model.layers.2.block_sparse_moe.experts.4.w3.weight_scale"

    def poison(t):
        t = t.clone()
        t[1, 0] = 0xFF
        return t

    shard = rewrite(ckpt, "language_model." + name, poison)
    msg = _err(ckpt, TINY_K3, layers=[2])
    assert name in msg and shard.name in msg and "0xFF" in msg and "NaN" in msg
    # an expert subset that does not hold expert 4 loads fine
    load_stage_weights(ckpt, TINY_K3, [2], experts={2: [0, 1]})


def test_nonzero_a_log_padding(tmp_path):
    cfg = TINY_K3
    ckpt = write_checkpoint(tmp_path, cfg, shards=3)
    name = "model.layers.4.self_attn.A_log"

    def poison(t):
        t = t.clone()
        t[cfg.kda_num_heads + 1] = 0.5
        return t

    shard = rewrite(ckpt, "language_model." + name, poison)
    msg = _err(ckpt, cfg, layers=[4])
    assert name in msg and shard.name in msg and "padding" in msg and str(cfg.kda_num_heads + 1) in msg


def test_a_log_shorter_than_heads(tmp_path):
    cfg = TINY_K3
    ckpt = write_checkpoint(tmp_path, cfg, shards=2)
    name = "model.layers.0.self_attn.A_log"
    shard = rewrite(ckpt, "language_model." + name, lambda t: t[:1].clone())
    msg = _err(ckpt, cfg, layers=[0])
    assert name in msg and shard.name in msg


def test_nan_in_float_tensor(tmp_path):
    ckpt = write_checkpoint(tmp_path, TINY_KIMI_LINEAR, shards=2)
    name = "model.layers.0.mlp.down_proj.weight"
    shard = rewrite(ckpt, name, lambda t: torch.full_like(t, float("nan")))
    msg = _err(ckpt, TINY_KIMI_LINEAR, layers=[0])
    assert name in msg and shard.name in msg and "NaN" in msg
    load_stage_weights(ckpt, TINY_KIMI_LINEAR, [0], check_finite=False)


def test_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
    (tmp_path / INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match=INDEX):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"a": "../evil.safetensors"}}))
    with pytest.raises(CheckpointError, match="invalid shard file name"):
        CheckpointReader(tmp_path)


def test_duplicate_prefixed_and_plain_names(tmp_path):
    t = torch.ones(TINY_K3.hidden_size, dtype=torch.bfloat16)
    save_file(
        {"model.norm.weight": t, "language_model.model.norm.weight": t.clone()}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(CheckpointError, match="model.norm.weight.*stored twice"):
        CheckpointReader(tmp_path)


def test_stage_tensor_specs_matches_weights():
    specs = stage_tensor_specs(TINY_K3, range(6), embed=True, head=True)
    assert specs == all_tensors(TINY_K3)
