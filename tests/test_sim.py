"""The simulator against hand-computed cases: one stream through a 2-stage ring (bytes / bandwidth +
overhead + hops), the speculation width cost (distinct experts of (k+1) tokens), the tensor-parallel
all-reduce price, processor sharing on a shared CPU, the profile file, and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from p2pk3.model.config import KIMI_K3, TINY_K3
from p2pk3.model.weights import all_tensors
from p2pk3.plan import Card, plan_ring
from p2pk3.plan.memory import expected_distinct
from p2pk3.topology.sizing import kda_state_bytes
from p2pk3.sim import CostModel, Workload, allreduce_s, build_stages, load_profile, run, simulate_sweep, spec_width
from p2pk3.sim.model import Unit
from p2pk3.topology import MemorySpec, even_split

BW, EFF, OV, LAT, SW, LINK = 1000.0, 0.5, 100.0, 20.0, 30.0, 10.0


def flat_profile(tmp_path, **extra):
    """Round numbers: 1000 GB/s at efficiency 0.5 for everything, 100 us per stage, 20 + 30 us per hop, 10 Gb/s."""
    p = tmp_path / "hw.toml"
    p.write_text(f"""name = "flat"
[card]
gpu = "x"
[gpus.x]
memory_bandwidth_gbs = {BW}
tflops = {{ bf16 = 1e9 }}
[efficiency]
bf16 = {EFF}
mxfp8 = {EFF}
mxfp4 = {EFF}
state = {EFF}
[stage]
overhead_us = {OV}
[hop]
link_gbps = {LINK}
latency_us = {LAT}
software_us = {SW}
[tensor_parallel]
allreduces_per_layer = 3
{extra.get("more", "")}
""")
    return load_profile(p)


def hand_bytes(cfg, layers, head, context):
    """Bytes one stream reads per token on a stage holding whole `layers` (hand computed from weights.py)."""
    n = 0
    for name, s in all_tensors(cfg).items():
        if name == "model.embed_tokens.weight":
            continue
        if name.startswith("model.layers."):
            l = int(name.split(".")[2])
            if l not in layers:
                continue
            if ".experts." in name:
                n += math.prod(s.shape) * s.dtype.itemsize * cfg.num_experts_per_token / cfg.num_experts
                continue
        elif not head:
            continue
        n += math.prod(s.shape) * s.dtype.itemsize
    for l in layers:
        n += (
            2 * kda_state_bytes(cfg)
            if cfg.layer_types[l] == "kda"
            else context * 576 * 2 * 0 + context * cfg.mla_cache_width * 2
        )
    return n


def test_one_stream_time_per_token_is_bytes_over_bandwidth_plus_overhead_plus_hops(tmp_path):
    hw = flat_profile(tmp_path)
    topo = even_split(TINY_K3, 2)
    ctx = 1000
    r = simulate_sweep(TINY_K3, topo, hw, [1], prompt=8, new_tokens=40, context=ctx)[0]
    b0 = hand_bytes(TINY_K3, range(0, 3), False, ctx)
    b1 = hand_bytes(TINY_K3, range(3, 6), True, ctx)
    hop01 = (LAT + SW) * 1e-6 + (1 + TINY_K3.bank_rows_before(3)) * TINY_K3.hidden_size * 2 * 8 / (LINK * 1e9)
    hop10 = (LAT + SW) * 1e-6 + 16 * 8 / (LINK * 1e9)
    t = (b0 + b1) / (BW * 1e9 * EFF) + 2 * OV * 1e-6 + hop01 + hop10
    assert r.per_stream_tps == pytest.approx(1 / t, rel=1e-6)
    assert r.token_ms_1 == pytest.approx(t * 1e3, rel=1e-6)


def test_speculation_width_cost_counts_distinct_experts(tmp_path):
    assert expected_distinct(896, 16, 1) == pytest.approx(16)
    assert expected_distinct(896, 16, 5) == pytest.approx(896 * (1 - (1 - 16 / 896) ** 5))
    assert expected_distinct(896, 16, 10**6) == pytest.approx(896)
    assert spec_width(2.0, None) == (2.0, 3) and spec_width(3.0, None) == (3.0, 5) and spec_width(1.5, None) == (1.5, 2)
    with pytest.raises(ValueError):
        spec_width(3.0, 1)
    hw = flat_profile(tmp_path)
    p = plan_ring(KIMI_K3, [Card(f"g{i}", "g", 31.5, 1792) for i in range(78)], memory=MemorySpec(8, 4096, 2048, 1))
    stages = build_stages(KIMI_K3, p.topology, hw)
    cost = CostModel(KIMI_K3, stages, hw)
    k = 10
    one = cost.pass_s(k, [Unit(0, 1, 4096, False)])
    wide = cost.pass_s(k, [Unit(0, 5, 4096, False)])
    held = sum(h * b / E for h, b, E, _ in stages[k].traffic.experts)
    want = held * (expected_distinct(896, 16, 5) - 16) / (BW * 1e9 * EFF)
    assert wide - one == pytest.approx(want, rel=1e-9)  # dense weights and state are read once per pass
    # the simulated stream makes `accept` tokens per pass of that width
    base = simulate_sweep(KIMI_K3, p.topology, hw, [1], prompt=8, new_tokens=61, context=4096)[0]
    spec = simulate_sweep(KIMI_K3, p.topology, hw, [1], prompt=8, new_tokens=61, context=4096, accept=3.0, spec_k=4)[0]
    assert spec.per_stream_tps == pytest.approx(3.0 * 1e3 / spec.token_ms_1, rel=0.05)
    assert base.per_stream_tps == pytest.approx(1e3 / base.token_ms_1, rel=1e-6)


def test_tensor_parallel_stage_reads_a_t_th_and_pays_all_reduces(tmp_path):
    hw = flat_profile(tmp_path)
    D = KIMI_K3.hidden_size
    for t in (2, 4):
        want = 2 * (t - 1) * (LAT + SW) * 1e-6 + 2 * (t - 1) / t * D * 2 * 8 / (LINK * 1e9)
        assert allreduce_s(hw, D * 2, t) == pytest.approx(want)
    assert allreduce_s(hw, D * 2, 1) == 0
    p = plan_ring(KIMI_K3, [Card(f"g{i}", "g", 31.5, 1792) for i in range(78)], memory=MemorySpec(8, 4096, 2048, 1))
    pipe = CostModel(KIMI_K3, build_stages(KIMI_K3, p.topology, hw), hw)
    tp2 = CostModel(KIMI_K3, build_stages(KIMI_K3, p.topology, hw, tp=2), hw)
    assert len(tp2.stages) == 39
    u = [Unit(0, 1, 4096, False)]
    mem = pipe.pass_s(4, u) + pipe.pass_s(5, u) - 2 * OV * 1e-6
    layers = len(set(pipe.stages[4].layers) | set(pipe.stages[5].layers))
    want = mem / 2 + layers * 3 * allreduce_s(hw, D * 2, 2) + OV * 1e-6
    assert tp2.pass_s(2, u) == pytest.approx(want, rel=1e-9)
    # fp8 activations: the hop carries about half the bytes
    bf = build_stages(KIMI_K3, p.topology, hw)[3].hop_bytes
    f8 = build_stages(KIMI_K3, p.topology, hw, act="fp8")[3].hop_bytes
    partial = KIMI_K3.expert_width * 4 if pipe.stages[3].traffic.hop_partial_bytes_per_token else 0
    assert f8 == pytest.approx((bf - partial) * (1 + 1 / 32) / 2 + partial) and f8 < bf


def test_continuous_batching_and_processor_sharing(tmp_path):
    hw = flat_profile(tmp_path)
    topo = even_split(TINY_K3, 2)
    cost = CostModel(TINY_K3, build_stages(TINY_K3, topo, hw), hw)
    w = Workload(16, prompt=4, new_tokens=20, context=100, prefill_chunk=64, micro_batches=1, prefill_depth=1)
    r = run(cost, w)
    assert r.stages[0]["mean_batch_tokens"] > 8  # the 16 streams ride together
    one_stream = simulate_sweep(TINY_K3, topo, hw, [1], prompt=4, new_tokens=20, context=100, micro_batches=1)[0]
    assert r.aggregate_tps > 8 * one_stream.aggregate_tps
    # one micro-batch visits one stage at a time: two stages on one core lose nothing ...
    assert run(cost, w, cores=1).aggregate_tps == pytest.approx(r.aggregate_tps)
    # ... two micro-batches (the default on two stages) keep both stages busy, and on one core each runs at
    # half speed
    w2 = Workload(16, prompt=4, new_tokens=20, context=100, prefill_chunk=64)
    free, shared = run(cost, w2), run(cost, w2, cores=1)
    assert shared.aggregate_tps < 0.8 * free.aggregate_tps
    assert min(s["busy"] for s in free.stages) > 1.5 * min(s["busy"] for s in r.stages)
    # on one stage running back to back, others' load slows a stream by cores / (1 + background) ...
    one = CostModel(TINY_K3, build_stages(TINY_K3, even_split(TINY_K3, 1), hw), hw)
    a = run(one, Workload(1, 4, 20, 100), cores=2)
    b = run(one, Workload(1, 4, 20, 100), cores=2, background=3.0)
    assert b.per_stream_tps == pytest.approx(a.per_stream_tps * 2 / 4, rel=1e-6)
    # ... while stages that wait for their input (a woken sleeper) are not slowed by it
    c = run(cost, Workload(1, 4, 20, 100), cores=2, sleep_gap_s=1e-6)
    d = run(cost, Workload(1, 4, 20, 100), cores=2, background=3.0, sleep_gap_s=1e-6)
    e = run(cost, Workload(1, 4, 20, 100), cores=2, background=3.0)  # default: everyone shares
    assert d.per_stream_tps == pytest.approx(c.per_stream_tps, rel=1e-6) and e.per_stream_tps < 0.6 * c.per_stream_tps


def test_default_profile_has_a_source_for_every_assumption():
    hw = load_profile()
    for key in (
        "efficiency.bf16",
        "efficiency.mxfp8",
        "efficiency.mxfp4",
        "efficiency.state",
        "stage.overhead_us",
        "hop.link_gbps",
        "hop.latency_us",
        "hop.software_us",
        "speculation.k_rule",
        "tensor_parallel.allreduces_per_layer",
    ):
        assert hw.get(key) is not None and hw.source(key), key
    for g in ("rtx5090", "rtx4090", "rtx3090"):
        assert hw.get(f"gpus.{g}.source")
    assert hw.get("gpus.rtx5090.memory_bandwidth_gbs") == 1792 and hw.get("gpus.rtx4090.memory_bandwidth_gbs") == 1008
    assert hw.get("gpus.rtx3090.memory_bandwidth_gbs") == 936


@pytest.mark.slow
def test_cli_simulate_json_and_errors(tmp_path):
    topo = tmp_path / "t.toml"
    even_split(TINY_K3, 2, preset="tiny-k3").dump(topo)
    hw = flat_profile(tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2pk3.cli",
            "simulate",
            "--topology",
            str(topo),
            "--hardware",
            hw.path,
            "--streams",
            "1,4",
            "--json",
            "--prompt",
            "8",
            "--new-tokens",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [x["streams"] for x in d["results"]] == [1, 4] and d["results"][1]["aggregate_tps"] > d["results"][0][
        "aggregate_tps"
    ]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2pk3.cli",
            "simulate",
            "--topology",
            str(topo),
            "--hardware",
            str(tmp_path / "none.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "no such hardware profile" in r.stderr and "Traceback" not in r.stderr


def test_measured_host_profile_prices_a_stage_by_its_measured_layers(tmp_path):
    """The "this host" profile of tools/calibrate_host.py: a pass is the sum of the measured per-layer times at
    that batch size (interpolated, linear beyond the largest batch) plus the measured overhead."""
    p = tmp_path / "host.toml"
    base = load_profile().path
    layer_ms = {str(l): [1.0 + l, 2.0 + l, 4.0 + 2 * l] for l in range(6)}
    lm = ", ".join(f'"{k}" = {v}' for k, v in layer_ms.items())
    p.write_text(f"""inherit = "{base}"
name = "host"
[cpu]
cores = 2
[hop]
latency_us = 0.0
software_us = 50.0
link_gbps = 8.0
[measured]
batches = [1, 2, 4]
embed_ms = [0.0, 0.0, 0.0]
head_ms = [0.0, 0.0, 0.0]
stage_overhead_ms = 3.0
layer_ms = {{ {lm} }}
""")
    hw = load_profile(p)
    cost = CostModel(TINY_K3, build_stages(TINY_K3, even_split(TINY_K3, 2), hw), hw)
    u = [Unit(i, 1, 10, False) for i in range(3)]  # 3 tokens: halfway between batch 2 and 4
    want = sum((2.0 + l + 4.0 + 2 * l) / 2 for l in range(3)) + 3.0
    assert cost.pass_s(0, u) * 1e3 == pytest.approx(want)
    u8 = [Unit(i, 1, 10, False) for i in range(8)]  # beyond the table: the last slope continues
    want8 = sum(4.0 + 2 * l + (4.0 + 2 * l - 2.0 - l) / 2 * 4 for l in range(3, 6)) + 3.0
    assert cost.pass_s(1, u8) * 1e3 == pytest.approx(want8)
    r = simulate_sweep(TINY_K3, even_split(TINY_K3, 2), hw, [1], prompt=4, new_tokens=10, context=0)[0]
    one = sum(1.0 + l for l in range(6)) + 2 * 3.0 + 2 * (50e-3 + 0)  # ms: layers + 2 overheads + 2 hops
    assert 1e3 / r.per_stream_tps == pytest.approx(one, rel=1e-3)


def test_default_schedule_is_the_daemons_micro_batches_and_pipelined_prefill(tmp_path):
    """M = D = one per stage: decode groups leave on their own and a prompt's chunks enter back to back, so
    4 stages give ~4 micro-batches' throughput and the TTFT of a long prompt is ~(chunks + stages) stage
    passes, not chunks x stages; M = D = 1 is the lockstep schedule before."""
    # compute-bound cards: a pass costs in proportion to its tokens, so batching is not free and only
    # micro-batches keep the four stages busy
    hw = flat_profile(tmp_path).with_overrides(**{"gpus.x.tflops.bf16": 1e-3})
    topo = even_split(TINY_K3, 4)
    cost = CostModel(TINY_K3, build_stages(TINY_K3, topo, hw), hw)
    dec = dict(prompt=4, new_tokens=30, context=100, prefill_chunk=64)
    new = run(cost, Workload(16, **dec))
    old = run(cost, Workload(16, **dec, micro_batches=1, prefill_depth=1))
    assert new.aggregate_tps > 2.5 * old.aggregate_tps
    assert all(s["busy"] > 2 * o["busy"] for s, o in zip(new.stages, old.stages))
    longp = dict(prompt=16 * 64, new_tokens=2, context=0, prefill_chunk=64)
    t_new = run(cost, Workload(1, **longp)).ttft_s
    t_old = run(cost, Workload(1, **longp, micro_batches=1, prefill_depth=1)).ttft_s
    assert t_new < 0.5 * t_old
    # what the CLI prints says which schedule it modelled
    r = simulate_sweep(TINY_K3, topo, hw, [2])[0]
    assert r.meta["micro_batches"] == 4 and r.meta["prefill_depth"] == 4
    from p2pk3.node.entry import PREFILL_SHARE
    from p2pk3.sim.events import PREFILL_SHARE as SIM_SHARE

    assert SIM_SHARE == PREFILL_SHARE  # the simulator cuts prefill units as the entry does
