"""Per-stage costs: how long one stage pass takes for a batch, and how long a hop takes.

Analytic (a GPU profile): a pass over a batch of N tokens from U streams reads
  dense weights once                         sum_f dense_f / (BW * eff_f)
  routed experts touched                     sum_layers held * bytes_1 * (1 - (1 - k/E)^N) / (BW * eff_mxfp4)
  per stream KDA state (read + write) and the MLA cache up to its context   / (BW * eff_state)
and takes max(memory time, 2 * active params * N / tensor FLOP/s) + the fixed stage overhead. With t cards
in tensor parallel each card reads 1/t of it, and every layer adds `allreduces_per_layer` ring all-reduces of
N hidden vectors over TCP: 2(t-1) messages of (latency + software) + 2(t-1)/t of the bytes over the link.
Measured (a CPU host profile from tools/calibrate_host.py): the pass time is the sum of the measured
per-layer times at that batch size (interpolated) plus the measured fixed overhead."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from p2pk3.model.config import K3Config
from p2pk3.plan.memory import StageTraffic, expected_distinct, stage_traffic
from p2pk3.topology import Topology

from .hardware import ACT_BYTES, Profile, ProfileError
from .overhead import profile_overhead_s


@dataclass
class Unit:
    stream: int
    n_tokens: int
    context: int  # tokens of context this unit attends to (MLA cache read)
    prefill: bool


@dataclass
class StageModel:
    slot: str
    layers: list[int]
    embed: bool
    head: bool
    traffic: StageTraffic
    tp: int = 1
    n_layers: int = 0  # distinct layers (for all-reduces)
    hop_bytes: float = 0.0  # bytes per token sent to the next stage
    breakdown: dict = field(default_factory=dict)  # last pass: item -> seconds


def _merge(group: list[StageTraffic]) -> StageTraffic:
    dense: dict[str, int] = {}
    for g in group:
        for f, b in g.dense.items():
            dense[f] = dense.get(f, 0) + b
    return StageTraffic(
        dense,
        [e for g in group for e in g.experts],
        sum(g.kda_state for g in group),
        sum(g.mla_per_ctx_token for g in group),
        sum(g.params_active for g in group),
        group[-1].hop_bytes_per_token,
        group[-1].hop_partial_bytes_per_token,
    )


def build_stages(
    cfg: K3Config, topo: Topology, hw: Profile, formats: dict | None = None, tp: int = 1, act: str | None = None
) -> list[StageModel]:
    """One StageModel per ring stage; with tp > 1 each group of tp consecutive slots is one stage."""
    plans = topo.slot_plans(cfg)  # with tp not dividing the slots, the last stage has fewer cards
    act = act or hw.get("activations.dtype", "bf16")
    if act not in ACT_BYTES:
        raise ProfileError(f"activations.dtype {act!r}: expected one of {', '.join(ACT_BYTES)}")
    scale = ACT_BYTES[act] / 2.0
    out = []
    for i in range(0, len(plans), tp):
        grp = plans[i : i + tp]
        tr = _merge([stage_traffic(cfg, p, formats) for p in grp])
        layers = sorted({lp.layer for p in grp for lp in p.layers})
        hop = (tr.hop_bytes_per_token - tr.hop_partial_bytes_per_token) * scale + tr.hop_partial_bytes_per_token
        out.append(
            StageModel(
                "+".join(p.slot for p in grp), layers, grp[0].embed, grp[-1].head, tr, len(grp), len(layers), hop
            )
        )
    return out


def allreduce_s(hw: Profile, nbytes: float, t: int) -> float:
    """Ring all-reduce of nbytes among t cards over the profile's network."""
    if t <= 1:
        return 0.0
    lat = (hw.need("hop.latency_us") + hw.need("hop.software_us")) * 1e-6
    return 2 * (t - 1) * lat + 2 * (t - 1) / t * nbytes * 8 / (hw.need("hop.link_gbps") * 1e9)


def hop_s(hw: Profile, nbytes: float) -> float:
    return (hw.need("hop.latency_us") + hw.need("hop.software_us")) * 1e-6 + nbytes * 8 / (
        hw.need("hop.link_gbps") * 1e9
    )


class CostModel:
    """Pass and hop times of the stages of one ring on one profile."""

    def __init__(self, cfg: K3Config, stages: list[StageModel], hw: Profile):
        self.cfg, self.stages, self.hw = cfg, stages, hw
        self._memo: dict[tuple, tuple[float, dict]] = {}
        self.meas = hw.measured
        if self.meas:
            self.batches = np.array(self.meas["batches"], dtype=float)
            self.layer_ms = {int(k): np.array(v, dtype=float) for k, v in self.meas["layer_ms"].items()}
            missing = [l for s in stages for l in s.layers if l not in self.layer_ms]
            if missing:
                raise ProfileError(
                    f"{hw.path}: measured profile has no time for layers {sorted(set(missing))[:8]} "
                    f"(it was calibrated on another model)"
                )
            for s in stages:
                if s.tp > 1:
                    raise ProfileError("a measured CPU profile cannot price tensor parallelism; use a GPU profile")

    def _interp(self, arr: np.ndarray, n: float) -> float:
        b = self.batches
        if n <= b[-1]:
            return float(np.interp(n, b, arr))
        slope = (arr[-1] - arr[-2]) / (b[-1] - b[-2])  # linear beyond the largest measured batch
        return float(arr[-1] + slope * (n - b[-1]))

    def pass_s(self, k: int, units: list[Unit]) -> float:
        """Seconds of stage k's pass over `units` (remembered by width, streams and context: a ring with
        micro-batches prices millions of passes); `stages[k].breakdown` holds its items."""
        key = (k, sum(u.n_tokens for u in units), len(units), sum(u.context for u in units))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = (self._pass_s(k, units), dict(self.stages[k].breakdown))
        self.stages[k].breakdown = dict(hit[1])
        return hit[0]

    def _pass_s(self, k: int, units: list[Unit]) -> float:
        s = self.stages[k]
        n = sum(u.n_tokens for u in units)
        hw = self.hw
        if self.meas:
            t = sum(self._interp(self.layer_ms[l], n) for l in s.layers)
            if s.embed:
                t += self._interp(np.array(self.meas["embed_ms"]), n)
            if s.head:
                t += self._interp(np.array(self.meas["head_ms"]), len(units))
            t = t * 1e-3
            ov = float(self.meas.get("stage_overhead_ms", 0.0)) * 1e-3
            s.breakdown = {"compute": t, "overhead": ov}
            return t + ov
        tr, bw, tp = s.traffic, hw.bandwidth, s.tp
        dense = sum(b / (bw * hw.eff(f)) for f, b in tr.dense.items()) / tp
        exp = (
            sum(h * one * expected_distinct(E, kk, n) / E for h, one, E, kk in tr.experts) / (bw * hw.eff("mxfp4")) / tp
        )
        state = (
            (len(units) * tr.kda_state + tr.mla_per_ctx_token * sum(u.context for u in units))
            / (bw * hw.eff("state"))
            / tp
        )
        mem = dense + exp + state
        comp = 2 * tr.params_active * n / hw.tflops("bf16") / tp
        ar = (
            s.n_layers
            * float(hw.need("tensor_parallel.allreduces_per_layer"))
            * allreduce_s(hw, n * self.cfg.hidden_size * ACT_BYTES.get(hw.get("activations.dtype", "bf16"), 2), tp)
            if tp > 1
            else 0.0
        )
        ov = profile_overhead_s(hw, self.cfg, s)  # stage.overhead_us, or derived from launches (overhead.py)
        s.breakdown = {
            "dense weights": dense,
            "experts": exp,
            "kda/mla state": state,
            "compute (if bound)": max(0.0, comp - mem),
            "tp all-reduce": ar,
            "overhead": ov,
        }
        return max(mem, comp) + ar + ov

    def hop_out_s(self, k: int, units: list[Unit]) -> float:
        """The hop after stage k: to the next stage, or the result frame from the last stage to the entry."""
        s = self.stages[k]
        if s.head:
            return hop_s(self.hw, 16 * len(units))
        return hop_s(self.hw, s.hop_bytes * sum(u.n_tokens for u in units))
