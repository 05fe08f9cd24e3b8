"""One prepared GPU run (an H200 lent for 15 minutes): a K3-shaped stage eager vs compiled + CUDA graphs, its
kernel launches, and the kernels against copy bandwidth. Writes `OUT/stage_gpu.json` and
`OUT/stage_gpu.md` (the section for docs/benchmarks.md).

    python tools/bench_stage_gpu.py --out $OUT                  # on the GPU machine (~5-8 minutes)
    PYTHONPATH=. python tools/bench_stage_gpu.py --tiny --out /tmp/x   # CPU smoke test of the script itself

The stage: K3's real widths, random weights (bf16, routed experts as random MXFP4 bytes, all 896 held),
two layers that cover every kind: layer 0 (KDA + dense MLP) and layer 3 (MLA + latent MoE), a middle stage
(it takes a hop and gives one). Sessions are prefilled to `--context` tokens, then decode steps are timed
at batch 1 and 8: eager, and compiled with CUDA graphs (p2pk3.model.compiled). The eager step is profiled
for its CUDA kernel launches; (eager - graphed) / launches is the measured host cost per launch, which
p2pk3/sim/overhead.py takes as an assumption until this has run. Kernels: a device copy (the bandwidth
reference), the routed experts at 16 experts (one token), a BF16 GEMV 12288 x 7168, KDA decode at 96
heads, MLA decode at 32 k context, each as GB/s of the bytes it must read and as a fraction of the copy.
Every section is guarded: a failure is recorded and the next section runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _this_trees_kernels() -> None:
    """Import `p2pk3_kernels` from this tree's kernels/ (an installed copy may be another checkout's)."""
    import tempfile

    shim = Path(tempfile.mkdtemp(prefix="p2pk3-kernels-"))
    (shim / "p2pk3_kernels").symlink_to(ROOT / "kernels", target_is_directory=True)
    sys.path.insert(0, str(shim))


_this_trees_kernels()

from p2pk3.model.cache import Span  # noqa: E402
from p2pk3.model.config import KIMI_K3, TINY_K3  # noqa: E402
from p2pk3.model.kimi_k3 import Hop, LatentMoE, checkpoint_to_module  # noqa: E402
from p2pk3.model.stage import K3Stage, StagePlan  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def random_stage(cfg, layers, device, dtype) -> K3Stage:
    """A stage of `layers` with random weights in place on `device` (no checkpoint, no host copy)."""
    plan = StagePlan(layers=layers)
    with torch.device("meta"):
        stage = K3Stage(cfg, plan)
    stage = stage.to_empty(device=device)
    keep32 = {checkpoint_to_module(n) for n, s in stage.expected_tensors().items() if s.dtype == torch.float32}
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            t = torch.empty(p.shape, device=device, dtype=torch.float32)
            if p.dim() == 1 or name.endswith("norm.weight"):
                t.fill_(1.0) if "A_log" not in name and "bias" not in name else t.normal_(0, 0.1, generator=g)
            else:
                t.normal_(0, 1 / math.sqrt(p.shape[-1]), generator=g)
            p.data = t if name in keep32 else t.to(dtype)
        for m in stage.modules():
            if isinstance(m, LatentMoE):
                m.init_maps()
                for w in ("w1", "w2", "w3"):
                    if cfg.quant is not None:
                        getattr(m, f"{w}_packed").random_(0, 256, generator=g)
                        getattr(m, f"{w}_scale").random_(118, 124, generator=g)
                    else:
                        setattr(m, f"{w}_weight", getattr(m, f"{w}_weight").normal_(0, 0.02, generator=g).to(dtype))
    stage.act_dtype = dtype
    return stage


def time_steps(fn, steps, dev) -> float:
    """Median seconds of `steps` calls of fn(k)."""
    ts = []
    for k in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        fn(k)
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def bench_stage(cfg, dev, dtype, context, batches, steps, compile_too: bool) -> dict:
    stage = random_stage(cfg, [0, 3], dev, dtype)
    out = {"layers": [0, 3], "context": context, "rows": []}
    for b in batches:
        cache = stage.new_cache(b, b * (context + 2 * steps + 64))
        ids = [f"s{i}" for i in range(b)]
        for s in ids:
            cache.open(s)
        D = cfg.hidden_size
        chunk = min(context, 2048)
        with torch.inference_mode():
            for p0 in range(0, context, chunk):  # prefill, one session at a time, in chunks
                for s in ids:
                    n = min(chunk, context - p0)
                    x = torch.randn(n, D, device=dev, dtype=dtype)
                    stage([Span(s, p0, n)], cache, hop=Hop(x, x.new_zeros(0, n, D)))
            x = torch.randn(b, D, device=dev, dtype=dtype)
            pos = [context]

            def step(_k, ids=ids, cache=cache, x=x, b=b, D=D, pos=pos):
                stage([Span(s, pos[0], 1) for s in ids], cache, hop=Hop(x, x.new_zeros(0, b, D)))
                pos[0] += 1

            stage.decode_graph = None
            step(0)
            eager = time_steps(step, steps, dev)
            row = {"batch": b, "eager_ms": eager * 1e3}
            try:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    step(0)
                    sync(dev)
                ev = prof.events()
                row["cuda_kernels"] = sum(1 for e in ev if e.device_type.name == "CUDA")
                row["aten_ops"] = sum(1 for e in ev if e.name.startswith("aten::"))
            except Exception as e:  # noqa: BLE001
                row["profile_error"] = repr(e)
            if compile_too:
                t0 = time.perf_counter()
                stage.compile_decode(True, cuda_graphs=dev.type == "cuda")
                step(0)
                sync(dev)
                row["compile_s"] = time.perf_counter() - t0
                row["compile_failed"] = stage.decode_graph.failed
                step(0)
                row["graphed_ms"] = time_steps(step, steps, dev) * 1e3
                if row.get("cuda_kernels"):
                    row["us_per_launch_saved"] = (row["eager_ms"] - row["graphed_ms"]) * 1e3 / row["cuda_kernels"]
                stage.decode_graph = None
        out["rows"].append(row)
        print("stage", row, flush=True)
    return out


def cuda_time(fn, reps=20) -> float:
    """Seconds per call, CUDA events (host clock on the CPU)."""
    fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


def bench_kernels(cfg, dev, dtype, tiny: bool) -> dict:
    from p2pk3_kernels import ops

    res = {}

    def rec(name, nbytes, fn):
        try:
            t = cuda_time(fn)
            res[name] = {"us": t * 1e6, "GB_per_s": nbytes / t / 1e9}
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": repr(e)[:300]}
        print("kernel", name, res[name], flush=True)

    n = (1 << 20) if tiny else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    bb = torch.empty_like(a)
    rec("copy", 2 * n, lambda: bb.copy_(a))
    E, W, I, k = cfg.num_experts, cfg.expert_width, cfg.moe_intermediate_size, min(16, cfg.num_experts)
    w1 = torch.randint(0, 256, (E, I, W // 2), dtype=torch.uint8, device=dev)
    s1 = torch.randint(118, 124, (E, I, W // 32), dtype=torch.uint8, device=dev)
    w2 = torch.randint(0, 256, (E, W, I // 2), dtype=torch.uint8, device=dev)
    s2 = torch.randint(118, 124, (E, W, I // 32), dtype=torch.uint8, device=dev)
    z = torch.randn(1, W, device=dev, dtype=dtype)
    ids = torch.randperm(E, device=dev)[:k].view(1, k)
    tw = torch.rand(1, k, device=dev)
    rec(
        f"mxfp4_moe_{k}_experts",
        k * (3 * I * W // 2 + 3 * I * W // 32),
        lambda: ops.mxfp4_moe(z, w1, s1, w1, s1, w2, s2, ids, tw, cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta),
    )
    M, K = (256, 128) if tiny else (12288, 7168)
    w = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    rec(f"gemv_bf16_{M}x{K}", M * K * 2, lambda: x @ w.T)
    H, Kd = cfg.kda_num_heads, cfg.kda_head_dim
    st = torch.zeros(8, H, Kd, Kd, device=dev)
    q = torch.randn(1, H, Kd, device=dev, dtype=dtype)
    rows = torch.zeros(1, dtype=torch.long, device=dev)
    Al, dtb = torch.zeros(H, device=dev), torch.zeros(H * Kd, device=dev)
    rec(
        f"kda_decode_{H}_heads",
        2 * H * Kd * Kd * 4,
        lambda: ops.kda_decode(q, q, q, q, q[..., 0], Al, dtb, st, rows, Kd**-0.5, cfg.kda_gate_lower_bound),
    )
    L = 4096 if tiny else 32768
    bs, Wc, R = 64, cfg.mla_cache_width, cfg.kv_lora_rank
    pool = torch.randn(L // bs + 1, bs, Wc, device=dev, dtype=dtype)
    bt = torch.arange(L // bs, device=dev, dtype=torch.int32).view(1, -1)
    lens = torch.tensor([L], device=dev, dtype=torch.int32)
    ql = torch.randn(1, cfg.num_attention_heads, R, device=dev, dtype=dtype)
    qp = torch.randn(1, cfg.num_attention_heads, Wc - R, device=dev, dtype=dtype)
    rec(
        f"mla_decode_{L // 1024}k",
        L * Wc * pool.element_size(),
        lambda: ops.mla_decode(ql, qp, pool, bt, lens, cfg.q_head_dim**-0.5),
    )
    cp = res.get("copy", {}).get("GB_per_s")
    for v in res.values():
        if cp and "GB_per_s" in v:
            v["of_copy"] = v["GB_per_s"] / cp
    return res


def markdown(r: dict) -> str:
    lines = [
        f"### K3-shaped stage on {r['device']} ({r['date']})",
        "",
        f"torch {r['torch']}, {r['dtype']}, layers 0 (KDA + dense) and 3 (MLA + MoE, 896 experts), "
        f"context {r.get('stage', {}).get('context')}",
        "",
        "| batch | eager ms/step | graphed ms/step | CUDA kernels per step | us per launch saved | compile s |",
        "|---|---|---|---|---|---|",
    ]
    for row in r.get("stage", {}).get("rows", []):
        lines.append(
            f"| {row['batch']} | {row.get('eager_ms', float('nan')):.3f} | {row.get('graphed_ms', float('nan')):.3f} "
            f"| {row.get('cuda_kernels', '-')} | {row.get('us_per_launch_saved', float('nan')):.2f} "
            f"| {row.get('compile_s', float('nan')):.1f} |"
        )
    lines += ["", "| kernel | us | GB/s | of copy |", "|---|---|---|---|"]
    for k, v in r.get("kernels", {}).items():
        if "us" in v:
            lines.append(f"| {k} | {v['us']:.1f} | {v['GB_per_s']:.0f} | {v.get('of_copy', float('nan')):.2f} |")
        else:
            lines.append(f"| {k} | failed: {v.get('error')} | | |")
    for k in ("stage_error", "kernels_error"):
        if k in r:
            lines.append(f"\n{k}: {r[k]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="TINY_K3 on this device (a smoke test of the script)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TINY_K3 if a.tiny else KIMI_K3
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    r = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": cfg.model_type,
    }

    def save():
        (out / "stage_gpu.json").write_text(json.dumps(r, indent=1))
        (out / "stage_gpu.md").write_text(markdown(r))

    try:
        r["kernels"] = bench_kernels(cfg, dev, dtype, a.tiny)
    except Exception:  # noqa: BLE001
        r["kernels_error"] = traceback.format_exc()[-2000:]
    save()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    try:
        r["stage"] = bench_stage(
            cfg,
            dev,
            dtype,
            min(a.context, 256) if a.tiny else a.context,
            [int(x) for x in a.batches.split(",")],
            a.steps,
            not a.no_compile,
        )
    except Exception:  # noqa: BLE001
        r["stage_error"] = traceback.format_exc()[-2000:]
    save()
    print(markdown(r))


if __name__ == "__main__":
    main()
