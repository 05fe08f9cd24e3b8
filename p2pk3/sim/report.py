"""The simulator's figures as a table, JSON, or a PNG (matplotlib, needed only for --plot)."""

from __future__ import annotations

from p2pk3.quant.formats import parse_formats

from .events import SimResult
from .hardware import Profile


def table(results: list[SimResult], hw: Profile) -> str:
    m = results[0].meta
    lines = [
        f"profile: {hw.name}  ({hw.path})",
        f"stages {m['stages']} (tp {m['tp']}), activations {m['act']}, formats "
        f"{', '.join(f'{k}={v}' for k, v in sorted(m['formats'].items())) or 'as shipped'}, accept {m['accept']:g} "
        f"tokens/pass at width {m['width']}, prompt {m['prompt']}"
        + (f" ({m['cached_prefix']} of them cached)" if m.get("cached_prefix") else "")
        + f", new tokens {m['new_tokens']}, "
        f"context {m['context']}; schedule: {m['micro_batches']} decode micro-batches, "
        f"{m['prefill_depth']} chunks of a prompt in flight",
        f"one stream alone: {results[0].token_ms_1:.2f} ms per pass",
        f"{'streams':>8s} {'per-stream tok/s':>17s} {'aggregate tok/s':>16s} {'TTFT s':>9s}",
    ]
    for r in results:
        lines.append(f"{r.streams:8d} {r.per_stream_tps:17.2f} {r.aggregate_tps:16.1f} {r.ttft_s:9.3f}")
    r = results[-1]
    lines.append(f"per-stage breakdown at {r.streams} streams (mean per pass):")
    worst = sorted(r.stages, key=lambda s: -s["mean_pass_ms"])[:5]
    for s in worst:
        its = ", ".join(f"{k} {v:.3f}" for k, v in s["items_ms"].items() if v > 0)
        lines.append(
            f"  {s['stage']:14s} batch {s['mean_batch_tokens']:7.1f} tok  pass {s['mean_pass_ms']:8.3f} ms  "
            f"busy {100 * s['busy']:5.1f}%  ({its})"
        )
    if len(r.stages) > 5:
        lines.append(f"  ... {len(r.stages) - 5} more stages (--json lists all)")
    return "\n".join(lines)


def to_json(results: list[SimResult], hw: Profile) -> dict:
    return {
        "profile": hw.name,
        "profile_path": hw.path,
        "sources": hw.sources,
        "results": [
            {
                "streams": r.streams,
                "per_stream_tps": r.per_stream_tps,
                "aggregate_tps": r.aggregate_tps,
                "ttft_s": r.ttft_s,
                "one_stream_pass_ms": r.token_ms_1,
                "meta": r.meta,
                "stages": r.stages,
            }
            for r in results
        ],
    }


PLOT_NEEDS = "--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"


def require_matplotlib() -> None:
    """Raise RuntimeError naming the extra to install when matplotlib is missing (before any work)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError(PLOT_NEEDS)


def plot(results: list[SimResult], path: str, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(PLOT_NEEDS) from None
    xs = [r.streams for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [r.aggregate_tps for r in results], "o-", color="tab:blue", label="aggregate tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [r.per_stream_tps for r in results], "s--", color="tab:red", label="per-stream tokens/s")
    ax2.set_ylabel("per-stream tokens/s", color="tab:red")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FORMAT_ROWS = (
    ("BF16 as shipped", {}),
    ("MXFP8 non-experts", parse_formats("non-experts=mxfp8")),
    ("MXFP4 non-experts", parse_formats("non-experts=mxfp4")),
)


def capacity_sessions(
    cfg, cards, context: int, formats: dict, prefill_chunk: int = 2048, overhead_gb: float = 1.0, standby: int = 0
) -> int:
    """The most concurrent sessions at `context` tokens that a plan over `cards` can hold."""
    from p2pk3.plan.planner import PlanError, plan_ring
    from p2pk3.topology import MemorySpec

    def fits(n):
        try:
            plan_ring(
                cfg,
                cards,
                memory=MemorySpec(sessions=n, context=context, prefill_chunk=prefill_chunk, overhead_gb=overhead_gb),
                formats=formats,
                standby=standby,
                suggest=False,
            )
            return True
        except PlanError:
            return False

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def rack_figures(
    cfg, topo, hw, *, context: int = 32768, new_tokens: int = 48, accepts=(1.5, 2.0, 3.0), tps=(1, 2, 4)
) -> list[dict]:
    """Single-stream tokens/s of `topo` on `hw` for every weight format x speculation x placement."""
    from . import simulate_sweep

    rows = []
    for fname, fm in FORMAT_ROWS:
        for tp in tps:
            for acc in (None, *accepts):
                r = simulate_sweep(
                    cfg, topo, hw, [1], formats=fm, accept=acc, tp=tp, prompt=64, new_tokens=new_tokens, context=context
                )[0]
                rows.append(
                    {
                        "formats": fname,
                        "tp": tp,
                        "accept": acc or 1.0,
                        "width": r.meta["width"],
                        "per_stream_tps": r.per_stream_tps,
                        "pass_ms": r.token_ms_1,
                    }
                )
    return rows


def rack_markdown(rows: list[dict], ceiling: float = 12.9, claim: float = 20.0) -> str:
    accs = sorted({r["accept"] for r in rows})
    head = (
        "| weights | stages | "
        + " | ".join(
            "no speculation" if a == 1 else f"accept {a:g} (width {next(r['width'] for r in rows if r['accept'] == a)})"
            for a in accs
        )
        + " |"
    )
    lines = [head, "|" + "---|" * (2 + len(accs))]
    for f in dict.fromkeys(r["formats"] for r in rows):
        for tp in sorted({r["tp"] for r in rows}):
            cells = []
            for a in accs:
                r = next(x for x in rows if x["formats"] == f and x["tp"] == tp and x["accept"] == a)
                cells.append(f"{r['per_stream_tps']:.1f}")
            lines.append(f"| {f} | {'pipeline' if tp == 1 else f'{tp}-card TP'} | " + " | ".join(cells) + " |")
    lines.append(
        f"\n(per-stream tokens/s; bandwidth ceiling of the shipped checkpoint {ceiling} tok/s, the report's "
        f"claim {claim:g} tok/s)"
    )
    return "\n".join(lines)
