"""Degraded stages (p2pk3/node/degraded.py): the detector on synthetic counters (a fake clock), the entry's
watch acting on it (a fake request), and the simulator's expectation. The live case — a process slowed to
a third of its speed by a SIGSTOP/SIGCONT duty cycle, replaced by the standby — is in tests/test_gray.py."""

from __future__ import annotations

import asyncio

import pytest

from p2pk3.node.degraded import DegradedDetector, DegradedWatch, sim_expectation
from p2pk3.node.monitor import PeerState
from p2pk3.transport.messages import error_frame, handover_frame, parse_handover


class Ring:
    """Cumulative counters of stages computing `ms` milliseconds per token, 20 tokens a second each."""

    def __init__(self, det: DegradedDetector, ms: dict[str, float]):
        self.det, self.ms = det, dict(ms)
        self.t = 0.0
        self.busy = {s: 0.0 for s in ms}
        self.tokens = {s: 0 for s in ms}
        self.node = {s: f"{s}@host" for s in ms}
        det.clock = lambda: self.t

    def run(self, seconds: float, step: float = 0.5) -> dict:
        out = {}
        for _ in range(int(seconds / step)):
            self.t += step
            for s, ms in self.ms.items():
                self.tokens[s] += 10
                self.busy[s] += 10 * ms / 1000
                self.det.observe(s, self.node[s], self.busy[s], self.tokens[s])
            out = self.det.evaluate()
        return out


def test_a_stage_slower_than_the_factor_for_the_time_is_degraded_and_only_then():
    ring = Ring(DegradedDetector(3.0, 10.0), {"s0": 2.0, "s1": 4.0, "s2": 4.0, "s3": 8.0})  # unequal shares
    figs = ring.run(30)
    assert not any(f.degraded for f in figs.values())
    assert figs["s1"].slowdown == pytest.approx(1.0, abs=0.05)
    ring.ms["s1"] = 4.0 * 3.5
    figs = ring.run(8)  # slow, but not for 10 s yet
    assert figs["s1"].slowdown > 3.0 and not figs["s1"].degraded
    figs = ring.run(8)
    assert figs["s1"].degraded and figs["s1"].slowdown == pytest.approx(3.5, rel=0.1)
    assert [s for s, f in figs.items() if f.degraded] == ["s1"]
    ring.ms["s1"] = 4.0  # back to its speed: the verdict ends
    figs = ring.run(6)
    assert not figs["s1"].degraded and figs["s1"].slow_since is None


def test_a_slow_stage_that_batches_more_is_judged_at_its_batch_widths():
    """Behind the others, a slow stage merges queued units into wider batches: per token it looks only
    2.6x slower, at the widths it runs 3.5x, and that is what counts."""
    det = DegradedDetector(3.0, 5.0)
    t, counts = 0.0, {s: [0.0, 0, {}] for s in ("s0", "s1", "s2")}
    table = {4: 4.0, 8: 6.0}  # every stage's pass ms by width when healthy

    def step(slow: bool):
        nonlocal t
        t += 0.5
        for s, c in counts.items():
            w = 8 if (slow and s == "s1") else 4
            ms = table[w] * (3.5 if (slow and s == "s1") else 1.0)
            passes = 4 // (w // 4)  # 16 tokens a step either way
            c[0] += passes * ms / 1000
            c[1] += 16
            c[2][w] = c[2].get(w, 0) + passes
            pms = dict(table) if not (slow and s == "s1") else {4: table[4], 8: ms}
            det.observe(s, f"{s}@h", c[0], c[1], dict(c[2]), pms, now=t)
        return det.evaluate(t)

    for _ in range(40):
        step(False)
    for _ in range(24):
        figs = step(True)
    per_token = figs["s1"].ms_per_token / figs["s0"].ms_per_token
    assert per_token == pytest.approx(2.625, rel=0.05)
    assert figs["s1"].slowdown == pytest.approx(3.5, rel=0.05) and figs["s1"].degraded


def test_a_workload_shift_on_every_stage_is_not_a_degraded_stage():
    ring = Ring(DegradedDetector(3.0, 5.0), {"s0": 1.0, "s1": 1.0, "s2": 1.0})
    ring.run(20)
    for s in ring.ms:  # decode after prefill: every stage's ms per token grows 10x at once
        ring.ms[s] *= 10
    figs = ring.run(30)
    assert not any(f.degraded for f in figs.values()), {s: f.slowdown for s, f in figs.items()}


def test_slower_than_the_factor_only_now_and_then_is_not_persistent():
    ring = Ring(DegradedDetector(3.0, 10.0), {"s0": 1.0, "s1": 1.0, "s2": 1.0})
    ring.run(20)
    for _ in range(4):  # 6 s slow, 6 s normal: never 10 s in a row
        ring.ms["s2"] = 5.0
        assert not ring.run(6)["s2"].degraded
        ring.ms["s2"] = 1.0
        ring.run(6)


def test_one_noisy_window_neither_starts_nor_ends_a_verdict():
    det = DegradedDetector(3.0, 8.0, window_s=1.0)  # a window of two samples: each step is a figure
    ring = Ring(det, {"s0": 1.0, "s1": 1.0, "s2": 1.0})
    ring.run(20)
    ring.ms["s1"] = 6.0
    ring.run(3)
    assert det.stages["s1"].figure.slow_since is not None
    for _ in range(3):  # slow, with a window at its usual speed every 3 s
        ring.ms["s1"] = 1.0
        ring.run(1)
        ring.ms["s1"] = 6.0
        figs = ring.run(2)
    assert figs["s1"].slow_since is not None
    figs = ring.run(2)
    assert figs["s1"].degraded and figs["s1"].persistent == pytest.approx(6.0, rel=0.1)
    ring.ms["s1"] = 1.0  # back to its speed: over once most windows are
    figs = ring.run(8)
    assert not figs["s1"].degraded and figs["s1"].slow_since is None


def test_a_noisy_window_right_after_the_first_slow_one_does_not_restart_the_count():
    det = DegradedDetector(3.0, 8.0, window_s=1.0)
    ring = Ring(det, {"s0": 1.0, "s1": 1.0, "s2": 1.0})
    ring.run(20)
    ring.ms["s1"] = 6.0
    ring.run(0.5)
    start = det.stages["s1"].figure.slow_since
    assert start is not None
    ring.ms["s1"] = 1.0  # one window wholly at its usual speed, the third evaluation of the verdict
    ring.run(1.0)
    ring.ms["s1"] = 6.0
    figs = ring.run(8)
    assert figs["s1"].slow_since == start and figs["s1"].degraded


def test_a_stage_a_third_of_whose_windows_dip_below_the_threshold_is_still_degraded_in_time():
    """A slow stage whose windows dip to or below the threshold (2.5 at factor 3) one time in three: the
    median of the recent evaluations stays above, so the verdict comes after `after_s`, not never (a rule
    of "3/4 of the windows above" restarted the count every few windows)."""
    det = DegradedDetector(3.0, 8.0, window_s=0.5)  # each 0.5 s step is one evaluation
    ring = Ring(det, {"s0": 1.0, "s1": 1.0, "s2": 1.0})
    ring.run(20)
    start, figs = ring.t, {}
    for k in range(30):
        ring.ms["s1"] = (3.6, 3.6, 2.3)[k % 3]
        figs = ring.run(0.5)
        if figs["s1"].degraded:
            break
    assert figs["s1"].degraded, figs["s1"]
    assert ring.t - start <= 8.5 and figs["s1"].persistent == pytest.approx(3.6, rel=0.05)


def test_a_new_holder_starts_afresh():
    ring = Ring(DegradedDetector(3.0, 4.0), {"s0": 1.0, "s1": 1.0, "s2": 1.0})
    ring.run(20)
    ring.ms["s1"] = 5.0
    assert ring.run(12)["s1"].degraded
    ring.node["s1"], ring.ms["s1"] = "spare@host", 1.0  # a takeover: another node, counters from 0
    ring.busy["s1"], ring.tokens["s1"] = 0.0, 0
    figs = ring.run(1)
    assert not figs["s1"].degraded and figs["s1"].node == "spare@host"


def test_the_simulators_expectation_catches_a_stage_slow_from_the_start():
    """Without history a stage slow from its first token looks normal to itself; the simulator's figure
    for its slot says what it should take."""
    det = DegradedDetector(3.0, 5.0, expected={"s0": 1.0, "s1": 2.0, "s2": 2.0})
    ring = Ring(det, {"s0": 1.0, "s1": 2.0 * 4, "s2": 2.0})
    figs = ring.run(15)
    assert figs["s1"].degraded and figs["s1"].slowdown == pytest.approx(4.0, rel=0.1)
    assert figs["s1"].expected_ratio == pytest.approx(4 / 3, rel=0.01)  # 2 over the median of 1 and 2
    assert not figs["s0"].degraded and not figs["s2"].degraded


def test_a_stage_alone_is_compared_with_its_own_history():
    ring = Ring(DegradedDetector(3.0, 5.0), {"s0": 2.0})
    assert not ring.run(20)["s0"].degraded
    ring.ms["s0"] = 8.0
    assert ring.run(12)["s0"].degraded


def test_idle_windows_say_nothing():
    ring = Ring(DegradedDetector(3.0, 5.0), {"s0": 1.0, "s1": 1.0})
    ring.run(20)
    assert ring.det.evaluate(ring.t + 30)["s0"].slowdown is None  # no fresh counters: no figure
    ring.ms["s0"] = 10.0
    for _ in range(20):  # idle: the same counters every heartbeat
        ring.t += 0.5
        for s in ring.ms:
            ring.det.observe(s, ring.node[s], ring.busy[s], ring.tokens[s])
    figs = ring.det.evaluate()
    assert figs["s0"].slowdown is None and not figs["s0"].degraded


def test_a_stage_exactly_at_the_factor_is_caught_and_one_at_twice_is_not():
    """The factor names the slowdown to catch: windows of a stage exactly 3x slower read about 3, half of
    them below, and it must still be found; a stage 2x slower stays below the threshold (2.5 at factor 3)."""
    for slow, want in ((3.0, True), (2.0, False)):
        det = DegradedDetector(3.0, 8.0, window_s=0.5)
        ring = Ring(det, {"s0": 1.0, "s1": 1.0, "s2": 1.0})
        ring.run(20)
        for k in range(40):
            ring.ms["s1"] = slow * (1.15, 0.85)[k % 2]  # +-15 %: half of the windows below the factor
            figs = ring.run(0.5)
        assert figs["s1"].degraded is want, (slow, figs["s1"])
    assert DegradedDetector(1.2).threshold > 1.0


def test_the_factor_must_be_above_one():
    with pytest.raises(ValueError, match="must be above 1"):
        DegradedDetector(1.0)


class Entry:
    """What the watch reads and does, faked: three stages' pongs and the requests it sends."""

    def __init__(self, refuse: bool = False):
        self.states = {s: PeerState(s, state="up") for s in ("s1", "s2")}
        self.sent: list = []
        self.refuse = refuse
        self.own = {"node": "s0@h", "busy_s": 0.0, "tokens": 0}

    def tick(self, det, ms: dict[str, float]) -> None:
        det.clock = lambda: self.t
        for s, m in ms.items():
            info = self.own if s == "s0" else self.states[s].info
            info.setdefault("node", f"{s}@h")
            info["tokens"] = info.get("tokens", 0) + 10
            info["busy_s"] = info.get("busy_s", 0.0) + 10 * m / 1000

    async def request(self, addr, frame, timeout):
        self.sent.append((addr, frame))
        if self.refuse:
            return error_frame("failed", "handover refused: not the holder")
        return handover_frame(*parse_handover(frame))


def _watch(e: Entry, det: DegradedDetector, cooldown_s: float = 60.0) -> DegradedWatch:
    return DegradedWatch(
        det,
        own_slot="s0",
        own_stats=lambda: e.own,
        active=lambda: ["s0", "s1", "s2"],
        state=e.states.get,
        holder_of=lambda slot, ps: (f"{slot}@h", 4),
        address=lambda slot: ("10.0.0.1", 7000 + int(slot[1:])),
        request=e.request,
        cooldown_s=cooldown_s,
    )


def _drive(e: Entry, w: DegradedWatch, ms: dict[str, float], seconds: float, standbys: list[str]):
    handed = []

    async def go():
        for _ in range(int(seconds / 0.5)):
            e.t += 0.5
            e.tick(w.detector, ms)
            slot = await w.check(standbys)
            if slot:
                handed.append((e.t, slot))

    asyncio.run(go())
    return handed


def test_the_watch_hands_a_degraded_stage_over_once_and_keeps_it_for_the_cooldown():
    e, det = Entry(), DegradedDetector(3.0, 5.0)
    e.t = 0.0
    w = _watch(e, det)
    assert _drive(e, w, {"s0": 1.0, "s1": 1.0, "s2": 1.0}, 20, ["s3"]) == []
    handed = _drive(e, w, {"s0": 1.0, "s1": 1.0, "s2": 4.0}, 40, ["s3"])
    assert [s for _, s in handed] == ["s2"], handed  # once: then the cooldown holds it
    ((addr, frame),) = e.sent
    assert addr == ("10.0.0.1", 7002)
    slot, epoch, reason = parse_handover(frame)
    assert (slot, epoch) == ("s2", 4) and "x its expected time per token" in reason
    assert w.events[-1]["event"] == "degraded" and w.events[-1]["slot"] == "s2"
    assert "cooldown" in w.report()["s2"]["action"]


def test_without_a_standby_the_degraded_stage_stays_and_says_so(caplog):
    e, det = Entry(), DegradedDetector(3.0, 5.0)
    e.t = 0.0
    w = _watch(e, det)
    _drive(e, w, {"s0": 1.0, "s1": 1.0, "s2": 1.0}, 20, [])
    with caplog.at_level("WARNING", logger="p2pk3.node"):
        assert _drive(e, w, {"s0": 1.0, "s1": 5.0, "s2": 1.0}, 20, []) == []
    assert e.sent == []
    rep = w.report()["s1"]
    assert rep["degraded"] and "no standby" in rep["action"] and rep["slowdown"] > 3
    lines = [r.getMessage() for r in caplog.records if "degraded" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("slot s1 is degraded: 5.0x"), lines  # said once, with the figure


def test_a_holder_that_refuses_keeps_its_slot_and_the_entry_slot_is_never_handed_over():
    e, det = Entry(refuse=True), DegradedDetector(3.0, 5.0)
    e.t = 0.0
    w = _watch(e, det)
    _drive(e, w, {"s0": 1.0, "s1": 1.0, "s2": 1.0}, 20, ["s3"])
    assert _drive(e, w, {"s0": 6.0, "s1": 1.0, "s2": 1.0}, 20, ["s3"]) == []
    assert e.sent == []
    rep = w.report()
    assert rep["s0"]["degraded"] and "entry slot is not handed over" in rep["s0"]["action"]
    assert _drive(e, w, {"s0": 1.0, "s1": 1.0, "s2": 6.0}, 20, ["s3"]) == []
    rep = w.report()
    assert not rep["s0"]["degraded"]
    assert rep["s2"]["degraded"] and "did not step down" in rep["s2"]["action"]
    assert 1 <= len(e.sent) <= 2  # asked again only every RETRY_S (10 s), not every heartbeat


def test_sim_expectation_prices_every_active_slot(ckpt):
    from p2pk3.model.config import K3Config

    from ring_helpers import loopback_topology

    topo = loopback_topology(ckpt, 3)
    e = sim_expectation(K3Config.from_pretrained(ckpt), topo, "rtx5090")
    assert set(e) == {"s0", "s1", "s2"} and all(v > 0 for v in e.values())


def test_the_dashboard_and_metrics_show_a_degraded_stage():
    import threading
    import types

    from rich.console import Console

    from p2pk3.cli.dashboard import render
    from p2pk3.frontends.cluster_view import mark_degraded
    from p2pk3.node.metrics import DaemonCollector

    verdicts = {
        "s1": {"slowdown": 3.6, "persistent_slowdown": 3.4, "degraded": True, "action": "no standby is available"},
        "s2": {"slowdown": 1.0, "persistent_slowdown": None, "degraded": False, "action": ""},
    }
    rows = [
        {
            "slot": s,
            "state": "up",
            "reason": "answering",
            "slowdown": None,
            "standby_slot": False,
            "node": s,
            "layers": None,
            "sessions": 0,
            "queue": 0,
            "batches_per_s": None,
            "tokens_per_s": None,
            "compute_ms": None,
            "busy": None,
            "hop_ms": None,
            "memory": None,
        }
        for s in ("s0", "s1", "s2")
    ]
    mark_degraded(rows, verdicts)
    assert [r["state"] for r in rows] == ["up", "degraded", "up"] and rows[2]["slowdown"] == 1.0
    assert rows[1]["reason"] == "degraded: 3.4x its expected time per token; no standby is available"
    totals = {"standby": 0, "serving": 3, "active": 3, "tokens_per_s": None, "live_sessions": 0}
    console = Console(width=160, record=True)
    console.print(render({"cluster": "c", "entry": None, "slots": rows, "totals": totals}))
    text = console.export_text()
    assert "degraded" in text and "s1: degraded: 3.4x" in text

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        d = types.SimpleNamespace(
            worker=None,
            monitor=None,
            entry=None,
            stats={"errors": 0},
            public_stats=lambda: {"slot": "s0", "role": "entry", "degraded": verdicts},
        )
        fams = {f.name: f for f in DaemonCollector(d, loop, None).collect()}
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
    slow = {s.labels["peer"]: s.value for s in fams["p2pk3_stage_slowdown"].samples}
    deg = {s.labels["peer"]: s.value for s in fams["p2pk3_stage_degraded"].samples}
    assert slow == {"s1": 3.6, "s2": 1.0} and deg == {"s1": 1, "s2": 0}
