"""Topology file: parsing, TOML writing, validation errors, splits, slot plans, memory estimates."""

from __future__ import annotations

import copy
import math
import tomllib
from pathlib import Path

import pytest
import tomli_w

from p2pk3.model.config import KIMI_K3, TINY_K3
from p2pk3.model.split import even_layer_ranges
from p2pk3.model.weights import embed_tensors, head_tensors, layer_tensors
from p2pk3.plan import balanced_split
from p2pk3.topology import (
    ClusterSpec,
    GiB,
    MemorySpec,
    ModelSpec,
    Slot,
    Topology,
    TopologyError,
    estimate_slot_bytes,
    even_split,
    format_ranges,
    parse_ranges,
    slot_plan,
    slot_tensors,
    weight_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
E = TINY_K3.num_experts  # 8


def base() -> dict:
    """local-4 as a dict: s0 [0,1], s1 [2,3], s2 [4,4] experts 0-3, s3 [4,5] experts 4-7."""
    return copy.deepcopy(tomllib.loads((ROOT / "topology" / "local-4.toml").read_text()))


def errors_of(d: dict, cfg=TINY_K3, **kw) -> str:
    with pytest.raises(TopologyError) as ei:
        Topology.from_dict(d).validate(cfg, **kw)
    return str(ei.value)


def test_ranges():
    assert parse_ranges("0-3,5, 7-8") == (0, 1, 2, 3, 5, 7, 8)
    assert format_ranges([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert parse_ranges([3, 1]) == (1, 3)
    for bad, msg in (("3-1", "reversed"), ("1,1", "listed twice"), ("a-b", "cannot parse"), ("1,,2", "empty item")):
        with pytest.raises(ValueError, match=msg):
            parse_ranges(bad)


def test_local_example_and_plans():
    t = Topology.load(ROOT / "topology" / "local-4.toml")
    assert t.validate(TINY_K3) == []
    assert [s.id for s in t.active] == ["s0", "s1", "s2", "s3"] and t.standby == []
    assert t.static_addresses()["s2"] == ("127.0.0.1", 47922)
    assert t.model_config() == TINY_K3
    p0, p1, p2, p3 = t.slot_plans(TINY_K3)
    assert p0.embed and not p0.head and [l.layer for l in p0.layers] == [0, 1] and p0.next_slot == "s1"
    assert p2.exits_mid_moe and not p2.enters_mid_moe
    l4 = p2.layers[0]
    assert l4.attn and not l4.finish and l4.experts == (0, 1, 2, 3) and l4.parts == ("attn", "mlp")
    assert p3.enters_mid_moe and p3.head and not p3.exits_mid_moe and p3.next_slot is None
    c4, l5 = p3.layers
    assert not c4.attn and c4.finish and c4.experts == (4, 5, 6, 7) and c4.parts == ("mlp",)
    assert l5.attn and l5.all_experts and l5.kind == "mla"
    # AttnRes bank rows (block size 2 in tiny-k3): ceil(l/2) before layer l; mid-layer-4 hop: ceil(5/2)
    assert [p.bank_rows_out(TINY_K3) for p in (p0, p1, p2)] == [1, 2, 3]
    assert p3.bank_rows_in(TINY_K3) == 3 and p0.bank_rows_in(TINY_K3) == 0
    D, W = TINY_K3.hidden_size, TINY_K3.expert_width
    assert p2.hop_bytes_per_token_out(TINY_K3) == (1 + 3) * D * 2 + W * 4  # fp32 partial latent
    # tensors: the attention half of layer 4 on s2 only; shared experts + up-proj where the layer finishes
    t2, t3 = slot_tensors(TINY_K3, p2), slot_tensors(TINY_K3, p3)
    assert "model.layers.4.self_attn.q_proj.weight" in t2 and "model.layers.4.self_attn.q_proj.weight" not in t3
    sh = "model.layers.4.block_sparse_moe.shared_experts.up_proj.weight"
    assert sh in t3 and sh not in t2
    assert "model.layers.4.block_sparse_moe.gate.weight" in t2 and "model.layers.4.block_sparse_moe.gate.weight" in t3
    assert "model.layers.4.block_sparse_moe.experts.3.w1.weight_packed" in t2
    assert "model.layers.4.block_sparse_moe.experts.3.w1.weight_packed" not in t3
    assert "model.embed_tokens.weight" in slot_tensors(TINY_K3, p0) and "lm_head.weight" in t3


def test_estimate_counts_embedding_head_and_caches():
    t = Topology.load(ROOT / "topology" / "local-4.toml")
    p0, p3 = t.slot_plan("s0", TINY_K3), t.slot_plan("s3", TINY_K3)

    def nb(d):
        return sum(math.prod(v.shape) * v.dtype.itemsize for v in d.values())

    w0 = nb(embed_tensors(TINY_K3)) + nb(layer_tensors(TINY_K3, 0)) + nb(layer_tensors(TINY_K3, 1))
    mem = MemorySpec(sessions=0, context=0, prefill_chunk=0, overhead_gb=0)
    assert estimate_slot_bytes(TINY_K3, p0, mem) == w0
    assert estimate_slot_bytes(TINY_K3, p0) > w0 + GiB  # default overhead and caches
    assert estimate_slot_bytes(TINY_K3, p3, mem) > nb(head_tensors(TINY_K3))
    spare = Slot("x", None, 1, standby=True)
    assert estimate_slot_bytes(TINY_K3, slot_plan(TINY_K3, [], spare)) == 0
    # the fast byte count equals the tensor inventory, on tiny and on a split K3 slot
    for p in t.slot_plans(TINY_K3):
        assert weight_bytes(TINY_K3, p) == nb(slot_tensors(TINY_K3, p))
    k = Topology.load(ROOT / "topology" / "k3-80x5090.toml")
    for sid in ("gpu00", "gpu01", "gpu77"):
        p = k.slot_plan(sid, KIMI_K3)
        assert weight_bytes(KIMI_K3, p) == nb(slot_tensors(KIMI_K3, p))


def test_dump_round_trip():
    t = Topology.load(ROOT / "topology" / "local-4.toml")
    text = t.dump(comment="hello\n\nworld ")
    assert text.startswith("# hello\n#\n# world\n\n[cluster]\n")
    assert Topology.loads(text).to_dict() == t.to_dict()
    k = Topology.load(ROOT / "topology" / "k3-80x5090.toml")
    assert Topology.loads(k.dump()).to_dict() == k.to_dict()
    # every field set, with values that need quoting and escapes
    full = Topology(
        ClusterSpec('lab "A"\\x', "keys/c.key", 47001, ["10.0.0.255", "127.255.255.255"]),
        ModelSpec(repo="moonshotai/Kimi-K3", revision="v1.0", preset="kimi-k3"),
        [
            Slot("gpu.0", (0, 1), 31.5, "10.0.0.5", 47920, {1: (0, 1, 2, 7)}),
            Slot("gpu_1", (1, 5), 24, None, None, {1: tuple(range(3, 7)) + (8,)}),
            Slot("spare-0", None, 0.25, "::1", 65535, standby=True),
        ],
        MemorySpec(sessions=2, context=100, prefill_chunk=0, overhead_gb=1.5),
    )
    text = full.dump()
    back = Topology.loads(text)
    assert (back.cluster, back.model, back.memory) == (full.cluster, full.model, full.memory)
    assert [vars(s) for s in back.slots] == [vars(s) for s in full.slots]
    assert tomllib.loads(text) == full.to_dict()


@pytest.mark.parametrize("n", range(1, TINY_K3.num_hidden_layers + 1))
def test_even_split_covers_every_layer_once(n):
    t = even_split(TINY_K3, n, preset="tiny-k3", gpu_memory_gb=4)
    t.validate(TINY_K3)
    covered = [l for s in t.active for l in s.layer_range]
    assert covered == list(range(TINY_K3.num_hidden_layers))
    sizes = [len(s.layer_range) for s in t.active]
    assert max(sizes) - min(sizes) <= 1
    # the same cut as the in-process pipeline (`score --stages n`)
    assert [s.layer_range for s in t.active] == even_layer_ranges(TINY_K3.num_hidden_layers, n)
    assert [s.port for s in t.active] == [47920 + i for i in range(n)]
    assert Topology.loads(t.dump()).to_dict() == t.to_dict()


def test_even_split_too_many_nodes_and_standby():
    with pytest.raises(TopologyError, match="7 nodes but only 6 layers: .*use `p2pk3 topology init --split experts`"):
        even_split(TINY_K3, 7)
    with pytest.raises(TopologyError, match="need at least one node"):
        even_split(TINY_K3, 0)
    assert [s.layer_range for s in even_split(KIMI_K3, 4).slots] == [
        range(0, 24),
        range(24, 47),
        range(47, 70),
        range(70, 93),
    ]
    t = even_split(TINY_K3, 3, n_standby=1, gpu_memory_gb=4)
    assert [s.id for s in t.standby] == ["s3"] and t.validate(TINY_K3) == []


@pytest.mark.parametrize("n", [1, 4, 8, 13, 20])
def test_balanced_split_tiny(n):
    t = balanced_split(TINY_K3, n, gpu_memory_gb=4)
    t.validate(TINY_K3)
    for l in range(TINY_K3.num_hidden_layers):
        owners = t.owners(l)
        if len(owners) > 1:
            got = sorted(e for s in owners for e in s.experts[l])
            assert got == list(range(E))


def test_k3_80x5090_example_validates():
    t = Topology.load(ROOT / "topology" / "k3-80x5090.toml")
    assert t.validate(KIMI_K3) == []
    assert len(t.active) == 78 and len(t.standby) == 2 and len(t.slots) == 80
    assert all(s.gpu_memory_gb <= 32 for s in t.slots)
    # a 32 GB card cannot hold two whole K3 layers, so layers are split by experts
    two = Slot("two", (1, 2), 31.5)
    assert estimate_slot_bytes(KIMI_K3, slot_plan(KIMI_K3, [two], two)) > 31.5 * GiB
    assert any(s.experts for s in t.active)
    plans = t.slot_plans(KIMI_K3)
    assert plans[0].embed and plans[-1].head
    # the bytes per token of the hops: at most 9 x 7168 x 2 (+ 3584 x 2 for a split layer)
    hop = [p.hop_bytes_per_token_out(KIMI_K3) for p in plans[:-1]]
    assert max(hop) <= 129_024 + 14_336 and all(h >= 14_336 for h in hop)
    assert any(
        p.exits_mid_moe and p.hop_bytes_per_token_out(KIMI_K3) == (1 + p.bank_rows_out(KIMI_K3)) * 14_336 + 14_336
        for p in plans
    )
    # the generator reproduces the checked-in file
    import importlib.util

    spec = importlib.util.spec_from_file_location("mk", ROOT / "tools" / "make_k3_topology.py")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    assert mk.build().to_dict() == t.to_dict()


# ------------------------------------------------------------------------------------- error cases
def test_error_gap():
    d = base()
    d["slots"][1]["layers"] = [2, 2]
    assert "layer 3 is not assigned to any slot" in errors_of(d)
    d["slots"][1]["layers"] = [2, 2]
    d["slots"][0]["layers"] = [0, 0]
    assert "layers 1, 3 are not assigned to any slot" in errors_of(d)


def test_error_overlap():
    d = base()
    d["slots"][0]["layers"] = [0, 3]
    assert "slots s0 [0, 3] and s1 [2, 3] overlap on layers 2-3" in errors_of(d)
    d = base()
    d["slots"][1]["layers"] = [1, 3]  # shares one (MoE) layer without listing experts
    assert "layer 1 is on slots s0 and s1: overlap (s0, s1 hold all its experts" in errors_of(d)
    d = base()
    d["slots"][0]["layers"] = [0, 0]
    d["slots"][1]["layers"] = [0, 3]
    msg = errors_of(d)
    assert "layer 0 is on slots s0 and s1: overlap (a dense layer cannot be split)" in msg


def test_error_layers_out_of_range_and_reversed():
    d = base()
    d["slots"][3]["layers"] = [4, 6]
    assert "slot s3: layers [4, 6] outside the model's layers 0..5" in errors_of(d)
    d = base()
    d["slots"][1]["layers"] = [3, 2]
    assert "slot s1: layers [3, 2] is reversed" in errors_of(d)


def test_error_experts_for_unknown_or_dense_layer():
    d = base()
    d["slots"][1]["experts"] = {"5": "0-7"}
    assert "slot s1 lists experts for layer 5, which is outside its layers [2, 3]" in errors_of(d)
    d = base()
    d["slots"][0]["experts"] = {"0": "0-7"}
    assert "slot s0 lists experts for layer 0, which is a dense layer (no routed experts)" in errors_of(d)
    d = base()
    d["slots"][2]["experts"] = {"4": "0-3,8-9"}
    assert "slot s2: experts 8-9 of layer 4 do not exist (the model has experts 0..7)" in errors_of(d)


def test_error_missing_experts():
    d = base()
    d["slots"][3]["experts"] = {"4": "4-6"}
    assert "expert 7 of layer 4 is on no slot (split over s2 and s3)" in errors_of(d)
    d = base()
    d["slots"][1]["experts"] = {"3": "0-3"}  # a subset on a layer that only s1 holds
    assert "experts 4-7 of layer 3 are on no slot" in errors_of(d)


def test_error_expert_on_two_slots():
    d = base()
    d["slots"][3]["experts"] = {"4": "3-7"}
    assert "expert 3 of layer 4 is on two slots: s2 and s3" in errors_of(d)


def test_error_split_over_non_consecutive_slots():
    d = base()
    # s1 holds layer 2 only; layer 3 is split over s0 and s2 (s1 in between)
    d["slots"][0].update(layers=[0, 3], experts={"3": "0-3"})
    d["slots"][1].update(layers=[2, 2])
    d["slots"][2].update(layers=[3, 4], experts={"3": "4-7", "4": "0-3"})
    msg = errors_of(d)
    assert "layer 3 is split over slots s0 and s2, which are not consecutive in the ring (s1 is between them)" in msg
    assert "slots s0 [0, 3] and s1 [2, 2] overlap on layer 2" in msg


def test_error_ring_order():
    d = base()
    d["slots"][0]["layers"], d["slots"][1]["layers"] = [2, 3], [0, 1]
    assert "slots must follow the layer order of the ring" in errors_of(d)


def test_error_duplicate_ids_and_addresses():
    d = base()
    d["slots"][1]["id"] = "s0"
    d["slots"][2]["port"] = 47923
    msg = errors_of(d)
    assert "duplicate slot id 's0' (2 slots)" in msg
    assert "slots s2 and s3 both use 127.0.0.1:47923" in msg


def test_error_memory():
    d = base()
    d["slots"][0]["gpu_memory_gb"] = 0.5
    msg = errors_of(d)
    assert (
        "slot s0 needs about 1.01 GiB (weights 0.00 GiB + caches 0.00 GiB + prefill workspace 0.01 GiB + CUDA "
        "reserve 1.00 GiB) but has gpu_memory_gb = 0.5: it would fit with a CUDA reserve of at most 0.49 GiB"
    ) in msg
    assert "fewer layers" not in msg  # the weights are not what does not fit
    # a custom estimate function
    msg = errors_of(base(), weight_bytes_fn=lambda s: 3 * GiB if s.id == "s1" else 0)
    assert "slot s1 needs about 3.00 GiB" in msg and "s0 needs" not in msg
    # K3 on 32 GB cards with whole layers
    t = even_split(KIMI_K3, 46, gpu_memory_gb=32)
    with pytest.raises(
        TopologyError,
        match=r"slot s1 needs about 3\d\.\d\d GiB .* but has gpu_memory_gb = 32: it would fit with .*fewer layers",
    ):
        t.validate(KIMI_K3)


def test_error_standby_and_structure():
    d = base()
    d["slots"].append({"id": "spare", "standby": True, "layers": [0, 1], "gpu_memory_gb": 2})
    assert "standby slot spare must not hold layers" in errors_of(d)
    d = base()
    d["slots"][1]["layer"] = [2, 3]
    with pytest.raises(TopologyError, match="unknown key 'layer' in slot s1 \\(did you mean 'layers'\\?\\)"):
        Topology.from_dict(d)
    d = base()
    d["slots"][2]["experts"] = {"4": "0-3x"}
    with pytest.raises(TopologyError, match="cannot parse '0-3x'"):
        Topology.from_dict(d)
    d = base()
    d["slots"][2]["layers"] = [4]
    with pytest.raises(TopologyError, match="layers must be \\[first, last\\]"):
        Topology.from_dict(d)
    with pytest.raises(TopologyError, match="missing \\[cluster\\] table"):
        Topology.from_dict({"slots": base()["slots"]})
    with pytest.raises(TopologyError, match="not valid TOML"):
        Topology.loads("[cluster\nname=1")
    d = base()
    for s in d["slots"]:
        s["standby"] = True
        s.pop("layers", None)
        s.pop("experts", None)
    assert "no active slots" in errors_of(d)


def test_all_errors_are_reported_together():
    d = base()
    d["slots"][1]["id"] = "s0"
    d["slots"][3]["experts"] = {"4": "3-7"}
    with pytest.raises(TopologyError) as ei:
        Topology.from_dict(d).validate(TINY_K3)
    assert len(ei.value.errors) == 2 and "2 problems" in str(ei.value)


def test_standby_warning_and_secret(tmp_path):
    d = base()
    d["slots"].append({"id": "tiny-spare", "standby": True, "gpu_memory_gb": 0.1})
    d["cluster"]["secret_file"] = "c.key"
    p = tmp_path / "t.toml"
    p.write_text(tomli_w.dumps(d))
    t = Topology.load(p)
    warns = t.validate(TINY_K3)
    assert warns and "standby slot tiny-spare (0.1 GiB) cannot take over any active slot" in warns[0]
    key = tmp_path / "c.key"
    with pytest.raises(
        TopologyError, match=f"secret file {key} does not exist \\(create one with `p2pk3 secret --out {key}`\\)"
    ):
        t.secret()
    key.write_text("short\n")
    with pytest.raises(TopologyError, match="at least 16 random bytes"):
        t.secret()
    key.write_text("ab" * 32 + "\n")
    assert t.secret() == b"ab" * 32
    t.cluster.secret_file = None
    with pytest.raises(TopologyError, match=f"no secret_file: .*`p2pk3 secret --out {tmp_path / 'cluster.key'}`"):
        t.secret()


def test_paths_resolve_against_the_topology_folder(tmp_path):
    t = Topology.load(ROOT / "topology" / "local-4.toml")
    assert t.resolve("m/config.json") == ROOT / "topology" / "m" / "config.json"
    assert t.resolve(tmp_path / "x") == tmp_path / "x"
    assert t.resolve("~/k") == Path.home() / "k"
    assert Topology.loads((ROOT / "topology" / "local-4.toml").read_text()).resolve("k") == Path("k")


def test_plans_follow_the_current_slot_list():
    """Slots added to (or removed from) `slots` after construction get the plan of where they are now."""
    whole = Topology.load(ROOT / "topology" / "local-4.toml")
    t = Topology.load(ROOT / "topology" / "local-4.toml")
    tail = t.slots[2:]
    del t.slots[2:]
    t.slots += [Slot(s.id, s.layers, s.gpu_memory_gb, s.host, s.port, dict(s.experts)) for s in tail]
    assert t.validate(TINY_K3) == []
    assert t.slot_plans(TINY_K3) == whole.slot_plans(TINY_K3)
    p2 = t.slot_plan("s2", TINY_K3)
    assert p2.index == 2 and p2.next_slot == "s3" and p2.exits_mid_moe and not p2.layers[0].finish
    # without s3, s2 alone holds layer 4: it is no longer split (and validation says what is missing)
    t.slots.pop()
    p2 = t.slot_plan("s2", TINY_K3)
    assert p2.next_slot is None and not p2.exits_mid_moe and p2.layers[0].finish and not p2.layers[0].all_experts
    assert "experts 4-7 of layer 4 are on no slot" in str(pytest.raises(TopologyError, t.validate, TINY_K3).value)
    # a standby slot turned active joins the ring
    t.slots.append(Slot("s3", (5, 5), 2))
    assert t.slot_plan("s3", TINY_K3).head and t.slot_plan("s2", TINY_K3).next_slot == "s3"


def test_slot_plan_needs_a_slot_of_the_ring():
    t = Topology.load(ROOT / "topology" / "local-4.toml")
    stranger = Slot("s9", (0, 1), 2)
    with pytest.raises(ValueError, match="slot s9 is not one of the active slots s0, s1, s2, s3; add it"):
        t.slot_plan(stranger, TINY_K3)
    alone = slot_plan(TINY_K3, [stranger], stranger)
    assert alone.embed and not alone.head and alone.index == 0 and [lp.layer for lp in alone.layers] == [0, 1]
    assert t.slot_plan(t.slot("s1"), TINY_K3) == t.slot_plan("s1", TINY_K3)


def test_error_slot_fields():
    d = base()
    del d["slots"][1]["layers"]
    assert "slot s1 has no layers (set layers = [first, last], or standby = true)" in errors_of(d)
    d = base()
    del d["slots"][1]["gpu_memory_gb"]
    assert "slot s1 has no gpu_memory_gb" in errors_of(d)
    t = Topology.load(ROOT / "topology" / "local-4.toml")
    t.slot("s2").experts[4] = ()
    with pytest.raises(TopologyError, match="slot s2: empty expert list for layer 4"):
        t.validate(TINY_K3)


def test_later_rules_wait_for_the_ones_they_need():
    # malformed slot layers: the ring rules (gaps, order) do not run on them
    d = base()
    d["slots"][1]["layers"] = [3, 2]
    with pytest.raises(TopologyError) as ei:
        Topology.from_dict(d).validate(TINY_K3)
    assert ei.value.errors == ["slot s1: layers [3, 2] is reversed"]
    # a layout error: no memory check (which sizes each slot's plan)
    d = base()
    d["slots"][0]["gpu_memory_gb"] = 0.5
    d["slots"][1]["id"] = "s0"
    with pytest.raises(TopologyError) as ei:
        Topology.from_dict(d).validate(TINY_K3)
    assert ei.value.errors == ["duplicate slot id 's0' (2 slots)"]
    # a non-blocking error (no gpu_memory_gb) does not hide the ring errors
    d = base()
    del d["slots"][0]["gpu_memory_gb"]
    d["slots"][1]["layers"] = [2, 2]
    with pytest.raises(TopologyError) as ei:
        Topology.from_dict(d).validate(TINY_K3)
    assert ei.value.errors == ["slot s0 has no gpu_memory_gb", "layer 3 is not assigned to any slot"]
