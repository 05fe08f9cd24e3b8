#!/usr/bin/env python3
"""Regenerate topology/k3-80x5090.toml with the planner (`p2pk3 plan`) and, with --figures, print the
rack tables of docs/rack.md (simulated with p2pk3/sim/profiles/rtx5090.toml).

    python tools/make_k3_topology.py [--out topology/k3-80x5090.toml] [--figures]

The same file comes from the command line:

    p2pk3 plan --model kimi-k3 --hosts hardware/k3-80x5090-nodes.toml --standby 2 --sessions 8 \\
        --context 32768 --name k3-80x5090 --out topology/k3-80x5090.toml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODES = ROOT / "hardware" / "k3-80x5090-nodes.toml"


def build():
    """The planned topology (what `p2pk3 plan` writes for hardware/k3-80x5090-nodes.toml, with the repo id)."""
    return build_plan().topology


def build_plan():
    sys.path.insert(0, str(ROOT))
    from p2pk3.model.config import KIMI_K3
    from p2pk3.plan import load_nodes, plan_ring
    from p2pk3.topology import MemorySpec

    mem = MemorySpec(sessions=8, context=32768, prefill_chunk=2048, overhead_gb=1.0)
    return plan_ring(
        KIMI_K3,
        load_nodes(NODES),
        memory=mem,
        standby=2,
        name="k3-80x5090",
        preset="kimi-k3",
        repo="moonshotai/Kimi-K3",
        secret_file="cluster.key",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "topology" / "k3-80x5090.toml"))
    ap.add_argument("--figures", action="store_true", help="also print the docs/rack.md tables")
    a = ap.parse_args()
    plan = build_plan()
    n_split = sum(1 for s in plan.topology.active if s.experts)
    plan.topology.dump(
        a.out,
        comment=(
            "Kimi K3 over 80 x RTX 5090 (hardware/k3-80x5090-nodes.toml): 78 active slots + 2 hot spares, planned by\n"
            "`p2pk3 plan` (tools/make_k3_topology.py; do not edit by hand) for 8 sessions x 32768 tokens, weights as\n"
            f"shipped. {n_split} slots hold part of a layer's experts (a layer on two consecutive slots is split by\n"
            "experts). Pace (slowest stage, 1,792 GB/s) "
            f"{plan.pace_ms:.3f} ms/token. Memory tables: `p2pk3 topology check` or docs/rack.md.\n"
            "host/port are absent: slots are found by LAN discovery. Secret: cluster.key next to this file."
        ),
    )
    print(plan.summary())
    print(f"wrote {a.out}")
    if a.figures:
        figures(Path(a.out))


def figures(path: Path) -> None:
    """The docs/rack.md tables: per-stream tokens/s by weights x speculation x placement, aggregate at the
    memory-capacity limit, and the recommended configuration (default and best-case profiles)."""
    sys.path.insert(0, str(ROOT))
    from p2pk3.model.config import KIMI_K3
    from p2pk3.plan import load_nodes
    from p2pk3.sim import load_profile, simulate_sweep
    from p2pk3.sim.hardware import PROFILES
    from p2pk3.sim.report import FORMAT_ROWS, capacity_sessions, rack_figures, rack_markdown
    from p2pk3.topology import Topology

    topo = Topology.load(path)
    memory_markdown(topo)
    dflt, best = load_profile(), load_profile(PROFILES / "rtx5090-best.toml")
    print(f"## per-stream tokens/s, one stream, 32k context ({dflt.name})\n")
    print(rack_markdown(rack_figures(KIMI_K3, topo, dflt)))
    cards = load_nodes(NODES)
    stages = len(topo.active)
    mb = stages + stages // 4  # 25 % more micro-batches than stages hide the hops (research 6.4)
    print(f"\n## aggregate at the memory-capacity limit ({mb} micro-batches)\n")
    print("| weights | context | sessions that fit | profile | per-stream tok/s | aggregate tok/s |")
    print("|---|---|---|---|---|---|")
    for fname, fm in FORMAT_ROWS:
        for ctx in (4096, 32768):
            n = capacity_sessions(KIMI_K3, cards, ctx, fm, standby=2)
            for hw in (dflt, best):
                r = simulate_sweep(
                    KIMI_K3, topo, hw, [n], formats=fm, prompt=4, new_tokens=24, context=ctx, micro_batches=mb
                )[0]
                print(
                    f"| {fname} | {ctx} | {n} | {'default' if hw is dflt else 'best-case'} | "
                    f"{r.per_stream_tps:.2f} | {r.aggregate_tps:.0f} |"
                )
    fm4 = dict(FORMAT_ROWS[2][1])
    print("\n## recommended: MXFP4 non-experts, best-case engineering, speculation accept 3.0 at k = 3 (width 4)\n")
    print("| streams | micro-batches | per-stream tok/s | aggregate tok/s |")
    print("|---|---|---|---|")
    for n, m in ((1, None), (78, mb), (156, mb), (312, mb), (589, mb)):
        r = simulate_sweep(
            KIMI_K3,
            topo,
            best,
            [n],
            formats=fm4,
            accept=3.0,
            spec_k=3,
            prompt=4,
            new_tokens=24,
            context=32768,
            micro_batches=m,
        )[0]
        print(f"| {n} | {m or 1} | {r.per_stream_tps:.1f} | {r.aggregate_tps:.0f} |")


def memory_markdown(topo) -> None:
    """One line per card of its itemised memory table (GiB), as `p2pk3 topology check` prints it in full."""
    from p2pk3.model.config import KIMI_K3
    from p2pk3.plan import memory_table
    from p2pk3.topology import GiB

    print(
        "| slot | layers | attention | shared+dense MLP | router+latent | routed experts (MXFP4) | embed/head | "
        "KDA state | MLA cache | workspace | logits | CUDA reserve | total | free |"
    )
    print("|" + "---|" * 14)
    for s in topo.active:
        t = memory_table(KIMI_K3, topo.slot_plan(s, KIMI_K3), topo.memory, s.gpu_memory_gb)
        w = {}
        for (c, _), b in t.weights.items():
            w[c] = w.get(c, 0) + b
        r = {item: b for item, _, b in t.runtime}

        def g(*ks, d=w):
            return f"{sum(d.get(k, 0) for k in ks) / GiB:.2f}"

        lay = f"{s.layers[0]}-{s.layers[1]}" + (" split" if s.experts else "")
        print(
            f"| {s.id} | {lay} | {g('attention', 'norms')} | {g('shared_experts', 'dense')} | "
            f"{g('router', 'latent')} | {g('routed_experts')} | {g('embedding', 'lm_head')} | "
            f"{g('KDA state', d=r)} | {g('MLA latent cache', d=r)} | {g('activations + workspace', d=r)} | "
            f"{g('logits + sampling', d=r)} | {g('CUDA context + allocator reserve', d=r)} | {t.total / GiB:.2f} | "
            f"{t.free / GiB:.2f} |"
        )


if __name__ == "__main__":
    main()
