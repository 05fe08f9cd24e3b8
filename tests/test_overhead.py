"""The simulator's per-stage overhead is the engine's: p2pk3/sim/overhead.py's launch counts are what
tools/count_ops.py measures on the Triton path now, and a profile with `overhead_from` prices a stage by them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from p2pk3.model.config import KIMI_K3
from p2pk3.sim import overhead
from p2pk3.sim.hardware import PROFILES, load_profile
from p2pk3.sim.model import CostModel, StageModel, Unit

ROOT = Path(__file__).resolve().parent.parent


def test_launch_counts_are_the_measured_ones(tmp_path):
    out = tmp_path / "c.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "count_ops.py"), "--kernels", "triton", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(out.read_text())
    per = {k.lower(): round(v["compute"]) for k, v in m["per_kind"].items()}
    layers = sum(m["layers"].values()) // 2
    parts = sum(
        per[k] * m["layers"][kk] for k, kk in (("kda", "KDA"), ("mla", "MLA"), ("moe", "MoE"), ("dense", "dense"))
    )
    per["embed_head"] = m["stage"]["compute"] - parts
    assert layers == 6
    assert per == overhead.LAUNCHES, "the engine's launch count changed: update LAUNCHES (and docs/rack.md)"


def test_profile_overhead_from_launches():
    base = load_profile(PROFILES / "rtx5090.toml")
    cfg = KIMI_K3
    s = StageModel("s", [3, 4], False, False, traffic=None)
    for mode in ("eager", "graphed"):
        hw = base.with_overrides(**{"stage.overhead_from": mode})
        want = (
            (overhead.LAUNCHES["mla"] + overhead.LAUNCHES["kda"] + 2 * overhead.LAUNCHES["moe"])
            * overhead.US_PER_LAUNCH[mode]
            * 1e-6
        )
        assert abs(overhead.profile_overhead_s(hw, cfg, s) - want) < 1e-12
    assert overhead.profile_overhead_s(base, cfg, s) == base.need("stage.overhead_us") * 1e-6
    for name in ("rtx5090-engine-eager", "rtx5090-engine-graphed", "rtx5090-best-engine-graphed"):
        assert load_profile(PROFILES / f"{name}.toml").get("stage.overhead_from") in overhead.US_PER_LAUNCH


def test_cost_model_uses_the_derived_overhead():
    from p2pk3.plan.memory import StageTraffic

    hw = load_profile(PROFILES / "rtx5090-engine-graphed.toml")
    tr = StageTraffic({}, [], 0, 0, 0, 0, 0)
    s = StageModel("s", [1], False, False, tr)
    t = CostModel(KIMI_K3, [s], hw).pass_s(0, [Unit(0, 1, 0, False)])
    assert abs(t - overhead.stage_overhead_us(KIMI_K3, [1], False, False, "graphed") * 1e-6) < 1e-12
    assert s.breakdown["overhead"] == t
