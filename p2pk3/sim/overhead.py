"""The fixed cost of one stage pass, derived from the engine: the kernel launches of the stage's layers (as
measured) times a cost per launch (with its source), eager or captured in CUDA graphs.

Launches per layer part: the non-view, non-allocation leaf aten ops of one decode pass on the Triton path
(what a GPU runs; a Triton launch counts one, the interpreter's own copies inside it none), counted with torch's profiler by `python tools/count_ops.py --kernels triton`
(TRITON_INTERPRET=1 on a CPU: the same ops, the kernels interpreted; docs/benchmarks.md, "issue 22"). The
counts do not depend on the model's widths on the decode path, so the tiny K3's counts are K3's.

Cost per launch:
  eager    the host time per launch of the eager decode step, measured on this repo's CPU host (ms per
           step / launches per step of the tiny K3 on the torch path): on a GPU at batch 1 eager PyTorch is
           bound by the host issuing small kernels, not by the kernels;
  graphed  research 6.3 (shared/research/performance.md): ~80 us for ~25 small kernels under CUDA graphs,
           3.2 us per kernel of launch gaps and tails.
Both are to be replaced by the H200's figures (tools/bench_stage_gpu.py) once it has run.

A profile selects it with `[stage] overhead_from = "eager"` or `"graphed"` (p2pk3/sim/profiles/
rtx5090-engine-*.toml); without it `stage.overhead_us` is taken as written.
"""

from __future__ import annotations

from p2pk3.model.config import K3Config

# launches per layer part, Triton path, one decode pass (tools/count_ops.py, 2026-12-01, after issue 22)
LAUNCHES = {"kda": 24, "mla": 30, "moe": 58, "dense": 18, "embed_head": 9}
LAUNCHES_SOURCE = "tools/count_ops.py --kernels triton, tiny K3, batch 1 (2026-12-01, docs/benchmarks.md issue 22)"

US_PER_LAUNCH = {"eager": 8.3, "graphed": 3.2}
US_PER_LAUNCH_SOURCE = {
    "eager": "measured here: eager torch-path decode step of the tiny K3 on the 2-core CPU host, 5.41 ms per step "
    "/ 655 launches per step = 8.3 us (docs/benchmarks.md, issue 22); a GPU adds cudaLaunchKernel",
    "graphed": "research 6.3: ~80 us per ~25 small kernels with CUDA graphs (3.2 us per kernel)",
}


def stage_launches(cfg: K3Config, layers: list[int], embed: bool, head: bool) -> int:
    """Kernel launches of one decode pass of a stage holding `layers` (a split layer counts whole)."""
    n = sum(LAUNCHES[cfg.layer_types[i]] + LAUNCHES["moe" if cfg.is_moe_layer(i) else "dense"] for i in layers)
    return n + (LAUNCHES["embed_head"] if embed or head else 0)


def stage_overhead_us(cfg: K3Config, layers: list[int], embed: bool, head: bool, mode: str) -> float:
    """Fixed cost of one pass, us: launches x the cost per launch of `mode` ("eager" or "graphed")."""
    if mode not in US_PER_LAUNCH:
        raise ValueError(f"stage overhead mode {mode!r}: expected one of {sorted(US_PER_LAUNCH)}")
    return stage_launches(cfg, layers, embed, head) * US_PER_LAUNCH[mode]


def profile_overhead_s(hw, cfg: K3Config, stage) -> float:
    """The profile's per-pass overhead for this stage (a `p2pk3.sim.model.StageModel`), seconds."""
    mode = hw.get("stage.overhead_from")
    if mode is None:
        return float(hw.need("stage.overhead_us")) * 1e-6
    return stage_overhead_us(cfg, stage.layers, stage.embed, stage.head, mode) * 1e-6
