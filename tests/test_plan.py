"""`p2pk3 plan` and `p2pk3 topology check`: NODES.toml, the itemised memory table, time-balanced splits of
mixed cards, refusals, and a planned topology that the daemons run with the single-process outputs."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import numpy as np
import pytest

from p2pk3.engine.reference import Pipeline
from p2pk3.engine.sampling import SamplingParams
from p2pk3.model.config import KIMI_K3, TINY_K3
from p2pk3.model.weights import all_tensors
from p2pk3.node.local import free_ports
from p2pk3.plan import Card, NodesError, PlanError, memory_table, parse_nodes, plan_ring
from p2pk3.quant.formats import parse_formats
from p2pk3.plan.memory import stage_traffic
from p2pk3.topology import GiB, MemorySpec, Topology, estimate_slot_bytes
from ring_helpers import InProcessRing

# ring order as listed: the fast cards at both ends hold the indivisible heavy pieces (dense layer 0 + embedding,
# lm_head); the slow ones in the middle must get less to read
MIXED = {
    "nodes": [
        {"name": "rtx5090", "count": 20, "gpu_memory_gb": 31.5, "memory_bandwidth_gbs": 1792},
        {"name": "rtx3090", "count": 30, "gpu_memory_gb": 23.5, "gpu": "rtx3090", "link_gbps": 10},
        {"name": "rtx4090", "count": 30, "gpu_memory_gb": 23.5, "gpu": "rtx4090"},
        {"name": "rtx5090b", "count": 20, "gpu_memory_gb": 31.5, "gpu": "rtx5090"},
    ]
}


def dense_read(cfg, topo, sid):
    tr = stage_traffic(cfg, topo.slot_plan(sid, cfg))
    return sum(tr.dense.values())


def test_nodes_toml_mixed_cards_with_datasheet_defaults_and_errors():
    cards = parse_nodes(MIXED)
    assert len(cards) == 100 and cards[0].id == "rtx5090-00" and cards[-1].id == "rtx5090b19"
    assert cards[50].bandwidth_gbs == 1008 and cards[20].bandwidth_gbs == 936 and cards[20].link_gbps == 10
    assert cards[99].bandwidth_gbs == 1792 and "datasheet" in cards[99].bandwidth_source
    with pytest.raises(NodesError) as e:
        parse_nodes(
            {
                "nodes": [
                    {"name": "a", "gpu_memory_gb": -1},
                    {"name": "b", "gpu_memory_gb": 8, "cnt": 2},
                    {"name": "c", "gpu_memory_gb": 8, "gpu": "rtx9999"},
                ]
            }
        )
    msg = str(e.value)
    assert "node 'a': gpu_memory_gb must be a positive" in msg and "unknown key(s) cnt" in msg and "rtx9999" in msg


def test_mixed_cards_are_balanced_by_time_not_bytes():
    cards = parse_nodes(MIXED)
    p = plan_ring(KIMI_K3, cards, memory=MemorySpec(8, 32768, 2048, 1.0), standby=2, preset="kimi-k3")
    topo = p.topology
    topo.validate(KIMI_K3)  # the repo's own checker agrees
    assert len(topo.standby) == 2 and all(s.id.startswith("rtx5090b") for s in topo.standby)  # the largest, last
    act = topo.active
    assert [s.id for s in act] == [c.id for c in cards if c.id not in {s.id for s in topo.standby}]  # ring order kept
    for s in act:
        t = p.tables[s.id]
        assert t.total <= s.gpu_memory_gb * GiB
        assert t.total == estimate_slot_bytes(KIMI_K3, topo.slot_plan(s, KIMI_K3), topo.memory)
    # a 3090 reads fewer bytes per token than a 5090 (it is 1.9x slower), so the pace is shared evenly in time
    d5 = np.mean([dense_read(KIMI_K3, topo, s.id) for s in act if s.id.startswith("rtx5090")])
    d3 = np.mean([dense_read(KIMI_K3, topo, s.id) for s in act if s.id.startswith("rtx3090")])
    assert d5 > 1.3 * d3
    # and the pace beats a plan that ignores bandwidth (every card the same speed: a bytes balance)
    blind = plan_ring(
        KIMI_K3,
        [Card(c.id, c.kind, c.gpu_memory_gb, None, standby=c.standby) for c in cards],
        memory=MemorySpec(8, 32768, 2048, 1.0),
        standby=2,
    )
    bw = {c.id: c.bandwidth_gbs * 1e9 for c in cards}
    real_pace_of_blind = max(
        (dense_read(KIMI_K3, blind.topology, s.id) + _rest(KIMI_K3, blind.topology, s.id)) / bw[s.id] * 1e3 + 0.08
        for s in blind.topology.active
    )
    assert p.pace_ms < 0.95 * real_pace_of_blind


def _rest(cfg, topo, sid):
    tr = stage_traffic(cfg, topo.slot_plan(sid, cfg))
    return sum(h * one * k / e for h, one, e, k in tr.experts) + tr.kda_state + tr.mla_per_ctx_token * 32768


@pytest.mark.slow
def test_a_model_that_does_not_fit_is_refused_with_the_shortfall_and_what_would_fit():
    cards = [Card(f"g{i}", "rtx5090", 31.5, 1792) for i in range(40)]
    with pytest.raises(PlanError) as e:
        plan_ring(KIMI_K3, cards, memory=MemorySpec(8, 32768, 2048, 1.0))
    msg = str(e.value)
    weights = sum(math.prod(s.shape) * s.dtype.itemsize for s in all_tensors(KIMI_K3).values())
    short = float(msg.split("short by ")[1].split(" GiB")[0])
    assert short > (weights - 40 * 31.5 * GiB) / GiB  # at least the weights' deficit, plus caches and reserves
    n_more = int(msg.split("It would fit with any one of: ")[1].split(" more card")[0].split("; ")[-1])
    assert "more cards of kind 'rtx5090'" in msg
    plan_ring(
        KIMI_K3,
        cards + [Card(f"x{i}", "rtx5090", 31.5, 1792) for i in range(n_more)],
        memory=MemorySpec(8, 32768, 2048, 1.0),
        suggest=False,
    )
    with pytest.raises(PlanError):
        plan_ring(
            KIMI_K3,
            cards + [Card(f"x{i}", "rtx5090", 31.5, 1792) for i in range(n_more - 1)],
            memory=MemorySpec(8, 32768, 2048, 1.0),
            suggest=False,
        )
    # a cache target too large for 80 cards: fewer sessions or a shorter context would fit, and each does
    big = [Card(f"g{i}", "rtx5090", 31.5, 1792) for i in range(80)]
    with pytest.raises(PlanError) as e:
        plan_ring(KIMI_K3, big, memory=MemorySpec(600, 32768, 2048, 1.0))
    msg = str(e.value)
    s_ok = int(msg.split("--sessions ")[1].split(";")[0])
    c_ok = int(msg.split("--context ")[1].split(";")[0])
    assert 1 <= s_ok < 600 and 1024 <= c_ok < 32768
    plan_ring(KIMI_K3, big, memory=MemorySpec(s_ok, 32768, 2048, 1.0), suggest=False)
    plan_ring(KIMI_K3, big, memory=MemorySpec(600, c_ok, 2048, 1.0), suggest=False)
    with pytest.raises(PlanError):
        plan_ring(KIMI_K3, big, memory=MemorySpec(s_ok + 1, 32768, 2048, 1.0), suggest=False)


def test_context_times_sessions_target_changes_the_split_and_the_table():
    cards = [Card(f"g{i:02d}", "rtx5090", 31.5, 1792) for i in range(80)]
    small = plan_ring(KIMI_K3, cards, memory=MemorySpec(8, 4096, 2048, 1.0), standby=2)
    large = plan_ring(KIMI_K3, cards, memory=MemorySpec(64, 32768, 2048, 1.0), standby=2)
    a = [(s.layers, s.experts) for s in small.topology.active]
    b = [(s.layers, s.experts) for s in large.topology.active]
    assert a != b
    for p, (n, ctx) in ((small, (8, 4096)), (large, (64, 32768))):
        for s in p.topology.active:
            sp = p.topology.slot_plan(s, KIMI_K3)
            n_mla = sum(1 for lp in sp.layers if lp.attn and lp.kind == "mla")
            rows = {r[0]: r[2] for r in p.tables[s.id].runtime}
            assert rows.get("MLA latent cache", 0) == n_mla * (n * ctx + n * 64) * 576 * 2  # + a partial block each
            assert p.tables[s.id].total <= 31.5 * GiB
    # a denser format shrinks the weight rows by the format's bytes per parameter
    sp = small.topology.slot_plan(small.topology.active[5], KIMI_K3)
    bf = memory_table(KIMI_K3, sp, small.topology.memory, 31.5)
    f8 = memory_table(KIMI_K3, sp, small.topology.memory, 31.5, parse_formats("attention=mxfp8"))
    assert f8.weights[("attention", "mxfp8")] == pytest.approx(
        bf.weights[("attention", "bf16")] / 2 * 1.03125, rel=1e-6
    )


def test_planned_topology_for_unequal_cards_runs_on_daemons_with_reference_outputs(ckpt):
    mem = MemorySpec(4, 256, 64, 0.0)
    total = plan_ring(TINY_K3, [Card("big", "x", 1.0, 100.0)], memory=mem).tables["big"].total
    cards = [
        Card("a", "fast", total * 0.55 / GiB, 200.0),
        Card("b", "slow", total * 0.35 / GiB, 50.0),
        Card("c", "mid", total * 0.6 / GiB, 100.0),
    ]
    p = plan_ring(TINY_K3, cards, memory=mem, model_path=str(ckpt), secret_file=None)
    topo = p.topology
    assert len(topo.active) == 3 and any(s.experts for s in topo.active)  # a layer split by experts
    sizes = [p.tables[s.id].total for s in topo.active]
    assert len(set(sizes)) == 3  # unequal pieces
    ports = free_ports(3)
    for s, port in zip(topo.active, ports):
        s.host, s.port = "127.0.0.1", port
    topo = Topology.loads(topo.dump())  # through the file format
    topo.validate(TINY_K3)
    ref = Pipeline.load(ckpt, 1, max_sessions=4, max_tokens=512, block_size=8)
    toks = [5, 17, 300, 42, 42, 7, 99, 123, 511, 0, 1, 2]
    want = ref.score(toks).numpy()
    want_gen = ref.generate([toks[:5]], SamplingParams(max_tokens=6))[0]

    async def go():
        async with InProcessRing(topo, ckpt, prefill_chunk=8) as ring:
            await ring.wait_healthy(30)  # the entry's failure detector has seen the later slots come up
            c = await ring.client()
            a = await c.generate(toks, SamplingParams(max_tokens=0), logits=True)
            g = await c.generate(toks[:5], SamplingParams(max_tokens=6))
            c.close()
            return a.logits, g.tokens

    logits, gen = asyncio.run(asyncio.wait_for(go(), 240))
    assert np.abs(logits - want).max() <= 1e-4
    assert gen == want_gen


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "p2pk3.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_cli_plan_refusal_is_one_line_and_topology_check_names_every_problem(tmp_path):
    nodes = tmp_path / "NODES.toml"
    nodes.write_text('[[nodes]]\nname = "rtx5090"\ncount = 20\ngpu = "rtx5090"\n')
    r = _cli("plan", "--model", "kimi-k3", "--hosts", str(nodes))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    err = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(err) == 1 and "short by" in err[0] and "more cards of kind 'rtx5090'" in err[0]
    nodes.write_text('[[nodes]]\nname = "g"\ncount = 3\ngpu_memory_gb = 1.0\nmemory_bandwidth_gbs = 100\n')
    out = tmp_path / "t.toml"
    r = _cli(
        "plan",
        "--model",
        "tiny-k3",
        "--hosts",
        str(nodes),
        "--out",
        str(out),
        "--sessions",
        "2",
        "--context",
        "256",
        "--prefill-chunk",
        "64",
        "--overhead-gb",
        "0",
        "--formats",
        "non-experts=mxfp8",
    )
    assert r.returncode == 0, r.stderr
    planned = Topology.load(out)
    assert planned.model.formats == parse_formats("non-experts=mxfp8")  # the plan writes its formats
    r = _cli("topology", "check", str(out))  # and the check sizes the file's own formats
    assert r.returncode == 0 and "KDA state" in r.stdout and "CUDA context" in r.stdout and ": ok" in r.stdout
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith("weights: attention")]
    assert rows and all(row[2] == "mxfp8" for row in rows), r.stdout
    bad = out.read_text().replace("layers = [\n    0,", "layers = [\n    1,", 1).replace('id = "g01"', 'id = "g00"')
    out.write_text(bad)
    r = _cli("topology", "check", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "2 problems" in err[0]
    assert "layer 0 is not assigned to any slot" in err[0] and "duplicate slot id 'g00'" in err[0]
