"""The ring on paper: hardware profiles (hardware.py, profiles/*.toml), per-stage costs (model.py), the
discrete-event ring (events.py) and its report (report.py). docs/rack.md."""

from __future__ import annotations

import math

from .events import SimResult, Workload, run
from .hardware import Profile, ProfileError, datasheet, load_profile
from .model import CostModel, StageModel, allreduce_s, build_stages, hop_s

__all__ = [
    "SimResult",
    "Workload",
    "run",
    "Profile",
    "ProfileError",
    "datasheet",
    "load_profile",
    "CostModel",
    "StageModel",
    "allreduce_s",
    "build_stages",
    "hop_s",
    "simulate_sweep",
    "spec_width",
]


def spec_width(accept: float | None, k: int | None) -> tuple[float, int]:
    """(tokens accepted per pass, pass width k + 1). No speculation: (1, 1)."""
    if accept is None or accept <= 1.0:
        return 1.0, 1 if not k else k + 1
    k = k or max(1, math.ceil(2 * (accept - 1) - 1e-9))
    if accept > k + 1:
        raise ProfileError(
            f"acceptance {accept} tokens per pass needs at least {math.ceil(accept - 1)} draft tokens "
            f"(got --spec-k {k})"
        )
    return accept, k + 1


def simulate_sweep(
    cfg,
    topo,
    hw: Profile,
    streams: list[int],
    *,
    formats=None,
    accept=None,
    spec_k=None,
    tp=1,
    act=None,
    prompt=None,
    new_tokens=None,
    context=None,
    micro_batches=None,
    prefill_depth=None,
    cached_prefix: int = 0,
    snapshot_span: int = 256,
) -> list[SimResult]:
    """The ring's figures at each stream count, scheduled as the daemon schedules it: micro_batches and
    prefill_depth None (auto) are one per stage, the daemon's default; 1 and 1 is the schedule before
    micro-batches. `cached_prefix`: prompt tokens the stages' prefix caches hold (a hit); the rest is then cut
    at the snapshot points, every `snapshot_span` tokens (the daemon's --snapshot-every x --prefix-block)."""
    stages = build_stages(cfg, topo, hw, formats, tp, act)
    cost = CostModel(cfg, stages, hw)
    a, width = spec_width(accept, spec_k)
    out = []
    for n in streams:
        w = Workload(
            n,
            prompt or int(hw.get("workload.prompt", 1024)),
            new_tokens or int(hw.get("workload.new_tokens", 256)),
            int(hw.get("workload.context", 32768)) if context is None else context,
            a,
            width,
            int(hw.get("batching.prefill_chunk", 2048)),
            int(hw.get("batching.max_batch_tokens", 2048)),
            micro_batches or 0,
            prefill_depth or 0,
            cached_prefix,
            snapshot_span if cached_prefix else 0,
        )
        r = run(
            cost,
            w,
            int(hw.get("cpu.cores", 0)),
            float(hw.get("cpu.background", 0.0)),
            float(hw.get("cpu.sleeper_gap_s", math.inf)),
        )
        r.meta = {
            "accept": a,
            "width": width,
            "tp": tp,
            "act": act or hw.get("activations.dtype", "bf16"),
            "formats": dict(formats or {}),
            "stages": len(stages),
            "prompt": w.prompt,
            "cached_prefix": w.cached,
            "new_tokens": w.new_tokens,
            "context": w.context,
            "micro_batches": w.micro_batches or len(stages),
            "prefill_depth": w.prefill_depth or len(stages),
        }
        out.append(r)
    return out
