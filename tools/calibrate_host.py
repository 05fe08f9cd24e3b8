#!/usr/bin/env python3
"""Measure this machine into a "this host" hardware profile for `p2pk3 simulate`, and (with --compare)
check the simulator against loopback rings measured in the same run.

Measured: the per-hop software cost (tools/bench_ring.py's echo of a forward frame, one way = half the
round trip), loopback bandwidth (a raw socket copy), per-layer stage compute of the embedded model at each
batch size (one stage per layer in one process, decode steps timed stage by stage), the same for a random
tiny K3, and the fixed per-pass overhead of a daemon: a 1-node loopback ring of the random tiny K3 (NOT the
embedded model) with one stream, minus its measured compute. The load average of the host is recorded.

With --compare the rings run the daemons' default schedule (one decode micro-batch and one prompt chunk per
stage in flight) and the simulator models the same; besides decode at each stream count it times the first
token of one --long-prompt (1,536 tokens by default: pipelined prefill).

    python tools/calibrate_host.py [--out hardware/this-host.toml] [--compare [--json OUT] [--markdown OUT]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

BATCHES = [1, 2, 4, 8, 16, 32]


P_REF = [float("inf")]  # the fastest probe sample seen in this run: the speed of a free core


def probe(samples: int = 15) -> float:
    """Median seconds of a fixed 1-thread torch job now; `share(t)` turns it into the share of a core this
    process gets (against the fastest sample of the whole run, the speed of a free core)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    ts = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(20):
            a = torch.tanh(a @ a * 1e-2)
        ts.append(time.perf_counter() - t)
        time.sleep(0.002)
    P_REF[0] = min(P_REF[0], min(ts))
    return statistics.median(ts)


def share(probe_median: float) -> float:
    return min(1.0, P_REF[0] / probe_median)


def background_from_share(share: float) -> float:
    """Runnable processes of others implied by the share one thread gets on this host's cores (fair sharing:
    share = cores / (1 + background) when the host is oversubscribed)."""
    cores = os.cpu_count() or 1
    return max(0.0, cores / max(share, 1e-3) - 1) if share < 0.97 else 0.0


def layer_times(model_dir: str, reps: int = 10) -> dict:
    """ms per decode pass of each layer (layer 0 includes the embedding, the last the head) by batch size."""
    import torch

    from p2pk3.engine.reference import Pipeline
    from p2pk3.model.cache import Span
    from p2pk3.model.config import K3Config

    torch.set_num_threads(1)
    cfg = K3Config.from_pretrained(model_dir)
    L = cfg.num_hidden_layers
    pipe = Pipeline.load(model_dir, L, max_sessions=max(BATCHES), max_tokens=max(BATCHES) * 256, block_size=16)
    g = torch.Generator().manual_seed(0)
    med = {l: [] for l in range(L)}
    probes = []
    with torch.inference_mode():
        for b in BATCHES:
            ids = [f"c{b}-{i}" for i in range(b)]
            for s in ids:
                pipe.open(s)
            toks = torch.randint(3, cfg.vocab_size, (b * 8,), generator=g)
            pipe.forward([Span(s, 0, 8) for s in ids], toks)
            samples = {l: [] for l in range(L)}
            for r in range(reps + 1):
                spans = [Span(s, 8 + r, 1) for s in ids]
                tok = torch.randint(3, cfg.vocab_size, (b,), generator=g)
                hop = None
                for l, (st, cache) in enumerate(zip(pipe.stages, pipe.caches)):
                    t = time.perf_counter()
                    hop = st(spans, cache, tokens=tok if st.plan.embed else None, hop=hop, logits="last")
                    if r:
                        samples[l].append(time.perf_counter() - t)
            probes.append(probe(7))
            for l in range(L):
                med[l].append(1e3 * statistics.median(samples[l]))
            for s in ids:
                pipe.close(s)
    return {"median_ms": med, "probes": probes, "layers": L}


def free_core_table(raw: dict) -> dict:
    """Per-layer ms as on a free core: the medians measured under load times the share of a core the probe
    got at that moment; a larger batch never takes less time (noise of a shared host smoothed out)."""
    import numpy as np

    out = {}
    for l, v in raw["median_ms"].items():
        scaled = [x * share(p) for x, p in zip(v, raw["probes"])]
        out[str(l)] = [float(x) for x in np.maximum.accumulate(np.array(scaled))]
    return {"layer_ms": out, "layers": raw["layers"]}


async def _ring_run(ring, prompts, new_tokens: int) -> dict:
    from p2pk3.params import SamplingParams

    cs = [await ring.client() for _ in prompts]
    try:
        await cs[0].generate(prompts[0], SamplingParams(max_tokens=3))  # warm-up
        stamps = [[] for _ in prompts]
        t0 = time.perf_counter()

        async def one(i):
            def on(tok):
                stamps[i].append(time.perf_counter())

            await cs[i].generate(prompts[i], SamplingParams(max_tokens=new_tokens), on_token=on)

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        for c in cs:
            c.close()
    per = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps if len(s) > 1]
    end = max(s[-1] for s in stamps)
    # aggregate as the simulator reports it: the sum of the streams' decode speeds (first token to last)
    return {
        "per_stream_tps": statistics.mean(per),
        "aggregate_tps": sum(per),
        "wall_tps": sum(len(s) for s in stamps) / (end - t0),
        "ttft_s": statistics.mean(s[0] - t0 for s in stamps),
        "tokens": [len(s) for s in stamps],
    }


async def _ttft(ring, prompt) -> float:
    from p2pk3.params import SamplingParams

    c = await ring.client()
    try:
        t0 = time.perf_counter()
        r = await c.generate(prompt, SamplingParams(max_tokens=1))
        return r.stats.get("ttft_s") or time.perf_counter() - t0
    finally:
        c.close()


def measure_ring(
    model_dir: str, nodes: int, streams: list[int], new_tokens: int, prompt_len: int, long_prompt: int = 0
) -> dict:
    """Decode of each stream count; with long_prompt, also the TTFT of one prompt that long (key "long")."""
    import numpy as np

    from p2pk3.node.local import LocalRing

    rng = np.random.default_rng(0)
    out = {}
    with LocalRing(model_dir, nodes) as ring:
        for n in streams:
            prompts = [[int(t) for t in rng.integers(3, 200, prompt_len)] for _ in range(n)]
            before = probe()
            r = asyncio.run(_ring_run(ring, prompts, new_tokens))
            out[n] = {**r, "load": os.getloadavg()[0], "probe": (before + probe()) / 2}
        if long_prompt:
            before = probe()
            t = asyncio.run(_ttft(ring, [int(x) for x in rng.integers(3, 200, long_prompt)]))
            out["long"] = {"ttft_s": t, "load": os.getloadavg()[0], "probe": (before + probe()) / 2}
    return out


def hop_cost(rounds: int) -> dict:
    from bench_ring import _latency, _raw_copy, _uvloop_run

    ours, bare = _uvloop_run(_latency(768, rounds))
    big, _ = _uvloop_run(_latency(129024, rounds))
    bw = _raw_copy(8 << 20, 5)
    return {"rtt_tiny_us": ours * 1e6, "rtt_bare_us": bare * 1e6, "rtt_129k_us": big * 1e6, "loopback_GBps": bw / 1e9}


def build_profile(emb: dict, hop: dict, overhead_ms: float, load: float, model: str, out: str) -> str:
    import tomli_w

    L = emb["layers"]
    doc = {
        "name": f"this host: {os.cpu_count()} CPU cores, loopback (measured {time.strftime('%Y-%m-%d %H:%M')})",
        "inherit": os.path.relpath(ROOT / "p2pk3" / "sim" / "profiles" / "rtx5090.toml", Path(out).resolve().parent),
        "card": {"gpu": "this-host-cpu"},
        "gpus": {
            "this-host-cpu": {
                "memory_bandwidth_gbs": 10.0,
                "memory_gb": 8,
                "usable_memory_gib": 8.0,
                "tflops": {"bf16": 0.05},
                "source": "placeholder: the measured table below is used",
            }
        },
        "stage": {"overhead_us": overhead_ms * 1e3},
        "hop": {"link_gbps": hop["loopback_GBps"] * 8, "latency_us": 0.0, "software_us": hop["rtt_tiny_us"] / 2},
        "cpu": {"cores": os.cpu_count() or 1, "background": 0.0},
        "workload": {"prompt": 16, "new_tokens": 24, "context": 0},
        "batching": {"max_batch_tokens": 2048, "prefill_chunk": 256},
        "measured": {
            "model": model,
            "batches": BATCHES,
            "layer_ms": emb["layer_ms"],
            "embed_ms": [0.0] * len(BATCHES),
            "head_ms": [0.0] * len(BATCHES),
            "stage_overhead_ms": overhead_ms,
            "layers": L,
        },
        "sources": {
            "hop.software_us": f"measured: p2pk3 forward-frame echo round trip {hop['rtt_tiny_us']:.1f} us / 2 "
            f"(bare uvloop {hop['rtt_bare_us']:.1f} us; 129 KB hop {hop['rtt_129k_us']:.1f} us)",
            "hop.link_gbps": f"measured: loopback raw socket copy {hop['loopback_GBps']:.2f} GB/s",
            "hop.latency_us": "loopback: no wire",
            "measured.layer_ms": "measured: decode pass of each layer of the embedded model per batch size, one "
            "process, 1 thread, median of 10 repetitions times the probe's share of a core "
            "(= a free core), non-decreasing in batch (layer 0 includes the embedding, the "
            "last layer the head)",
            "stage.overhead_us": "measured: 1-node loopback ring of a RANDOM tiny K3, 1 stream: ms per token minus "
            "its measured compute (per pass: framing, thread hand-off, scheduling, client)",
            "cpu.cores": "os.cpu_count()",
            "cpu.background": "set per measurement: others' runnable processes implied by a 1-thread probe (tools/calibrate_host.py probe)",
            "workload": "as tools/bench_ring.py: 16-token prompts, 24 new tokens",
        },
    }
    return tomli_w.dumps(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "hardware" / "this-host.toml"))
    ap.add_argument("--model", default=None, help="model to calibrate and compare on (default: the embedded one)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument(
        "--compare", action="store_true", help="also measure 1/2/4-node rings and print prediction vs measurement"
    )
    ap.add_argument("--nodes", default="1,2,4")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument(
        "--long-prompt", type=int, default=1536, help="with --compare: TTFT of one prompt this long (0: skip)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()

    from p2pk3.checkpoint.tiny import write_checkpoint
    from p2pk3.engine.reference import default_model_dir
    from p2pk3.model.config import TINY_K3

    model = a.model or str(default_model_dir())
    load0 = os.getloadavg()[0]
    print(f"load average before: {load0:.2f} on {os.cpu_count()} cores")
    probe(60)  # look for the speed of a free core
    hop = hop_cost(a.rounds)
    print(
        f"hop: p2pk3 echo RTT {hop['rtt_tiny_us']:.1f} us (bare {hop['rtt_bare_us']:.1f}), loopback {hop['loopback_GBps']:.2f} GB/s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, TINY_K3, seed=0)
        rnd_raw = layer_times(tmp)
        one = measure_ring(tmp, 1, [1], a.new_tokens, 16)[1]
        rnd = free_core_table(rnd_raw)
        comp = sum(v[0] for v in rnd["layer_ms"].values())
        # the ring's ms per token as on a free core (one process running back to back: it got `share` of a core)
        overhead = max(0.0, 1e3 / one["per_stream_tps"] * share(one["probe"]) - comp)
        print(
            f"random tiny K3: compute {comp:.2f} ms/token in one process, 1-node ring {1e3 / one['per_stream_tps']:.2f} "
            f"ms/token -> overhead {overhead:.2f} ms per pass"
        )
    emb = free_core_table(layer_times(model))
    print(
        "embedded model, ms per decode pass by batch "
        + str(BATCHES)
        + ": total "
        + ", ".join(f"{sum(v[i] for v in emb['layer_ms'].values()):.1f}" for i in range(len(BATCHES)))
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(build_profile(emb, hop, overhead, load0, model, a.out))
    print(f"wrote {a.out}")
    if not a.compare:
        return
    from p2pk3.model.config import K3Config
    from p2pk3.sim import load_profile, simulate_sweep
    from p2pk3.topology import even_split

    cfg = K3Config.from_pretrained(model)
    hw = load_profile(a.out)
    streams = [int(x) for x in a.streams.split(",")]
    rows = []
    for n in [int(x) for x in a.nodes.split(",")]:
        meas = measure_ring(model, n, streams, a.new_tokens, 16, a.long_prompt)
        topo = even_split(cfg, n)
        mb = max(1, min(n, os.cpu_count() or 1))  # as LocalRing schedules its daemons (they share this host)
        if a.long_prompt:  # one long prompt: pipelined prefill (the daemons' default depth, one per stage)
            m = meas["long"]
            bg = background_from_share(share(m["probe"]))
            p = simulate_sweep(
                cfg,
                topo,
                hw.with_overrides(**{"cpu.background": bg}),
                [1],
                prompt=a.long_prompt,
                new_tokens=2,
                context=0,
                micro_batches=mb,
            )[0]
            rows.append(
                {
                    "nodes": n,
                    "streams": f"TTFT {a.long_prompt}",
                    "measured_ttft_s": m["ttft_s"],
                    "predicted_ttft_s": p.ttft_s,
                    "load": m["load"],
                    "background": bg,
                }
            )
            print(
                f"{n} node(s) TTFT of a {a.long_prompt}-token prompt: {m['ttft_s']:.2f} s measured vs "
                f"{p.ttft_s:.2f} s predicted ({p.ttft_s / m['ttft_s'] - 1:+.0%}); load {m['load']:.2f}"
            )
        for s in streams:
            m = meas[s]
            m["background"] = background_from_share(share(m["probe"]))
            hw_now = hw.with_overrides(**{"cpu.background": m["background"]})
            p = simulate_sweep(cfg, topo, hw_now, [s], prompt=16, new_tokens=a.new_tokens, context=0, micro_batches=mb)[
                0
            ]
            rows.append(
                {
                    "nodes": n,
                    "streams": s,
                    "measured_per_stream": m["per_stream_tps"],
                    "predicted_per_stream": p.per_stream_tps,
                    "measured_aggregate": m["aggregate_tps"],
                    "predicted_aggregate": p.aggregate_tps,
                    "load": m["load"],
                    "background": m["background"],
                }
            )
            r = rows[-1]
            print(
                f"{n} node(s) {s:2d} streams: per-stream {r['measured_per_stream']:7.1f} measured vs "
                f"{r['predicted_per_stream']:7.1f} predicted ({r['predicted_per_stream'] / r['measured_per_stream'] - 1:+.0%}); "
                f"aggregate {r['measured_aggregate']:7.1f} vs {r['predicted_aggregate']:7.1f} "
                f"({r['predicted_aggregate'] / r['measured_aggregate'] - 1:+.0%}); load {m['load']:.2f}, others ~{m['background']:.1f} runnable"
            )
    if a.json:
        Path(a.json).write_text(
            json.dumps({"load_before": load0, "hop": hop, "overhead_ms": overhead, "rows": rows}, indent=2)
        )
    if a.markdown:
        lines = [
            "| nodes | streams | per-stream measured | predicted | error | aggregate measured | predicted | error | load avg | others runnable (probe) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if "measured_ttft_s" in r:
                e = r["predicted_ttft_s"] / r["measured_ttft_s"] - 1
                lines.append(
                    f"| {r['nodes']} | {r['streams']} (s) | {r['measured_ttft_s']:.2f} | {r['predicted_ttft_s']:.2f} | "
                    f"{e:+.0%} | | | | {r['load']:.2f} | {r['background']:.1f} |"
                )
                continue
            e1 = r["predicted_per_stream"] / r["measured_per_stream"] - 1
            e2 = r["predicted_aggregate"] / r["measured_aggregate"] - 1
            lines.append(
                f"| {r['nodes']} | {r['streams']} | {r['measured_per_stream']:.1f} | {r['predicted_per_stream']:.1f} | "
                f"{e1:+.0%} | {r['measured_aggregate']:.1f} | {r['predicted_aggregate']:.1f} | {e2:+.0%} | {r['load']:.2f} | {r['background']:.1f} |"
            )
        Path(a.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
