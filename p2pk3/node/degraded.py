"""Degraded stages: a stage that is alive but slow (a throttling card, a noisy host, a link renegotiated
down) answers its heartbeats, so the failure detector never calls it dead; this module notices it.

The entry samples every active stage's statistics every heartbeat (what each pong carries, and its own
worker's): the cumulative time it held work and its tokens (`held_s`, `tokens`: held = from a unit's
arrival at an idle worker until it is idle again, so a stall lands in it wherever in the stage it hits,
in the compute or in the frame handling around it; a stopped-two-thirds stage measured only 2.3-2.7x by
its compute time) and the passes and recent pass times by batch width (`spec`, stage_runner.py). A
stage's time moves with the workload (a prefill token costs a fraction of a decode token), but the same
units pass every stage, so the detector compares a stage with the others over the same window rather
than with a fixed number:

    ratio     = X's held time in the last `window_s` over what the others take for the same work:
                the batches X ran, by width, priced at the fastest other stage's recent pass times at
                those widths (a stage that falls behind merges queued units into wider batches, which
                its time per token alone would flatter); without widths, X's ms per token over the
                others' median
    expected  = the simulator's predicted ratio for X's slot (`expected`: ms per token by slot, from
                `sim_expectation`), else X's own usual ratio (the median of its healthy windows)
    slowdown  = ratio / expected

With one stage alone (no others have a figure) the slowdown is its ms per token over its own usual one.
`factor` names the slowdown to catch: a stage `factor` times slower than expected must be found, and
the 5-second windows of a stage slowed to exactly a third of its speed read about 3x, as many below as
above (medians over a verdict 3.14x and 4.42x; in a third run no verdict in 90 s at a threshold of 3),
so a window counts as slow above the detector's `threshold` = 1 + NOISE x (factor - 1): 2.5 at the
default 3, always above 1 (a healthy stage reads about 1). A stage whose slowdown stays above the
threshold for `after_s` seconds is degraded: from its first window above, the median of its last
RECENT (8) evaluations must stay above too, else the count starts again; a single window at or below
never ends it (one noisy window neither starts a verdict nor ends one). A median, not a share of
windows above: with a third of the windows below, a rule of "3/4 of the windows above" kept restarting
the count (detected after 44.5 and 56.7 s in two of three runs). `DegradedWatch` acts on the verdict at the entry: a
degraded stage is handed over to a live standby through the failover's takeover and replay paths (the
holder is asked to step down with a `handover` frame first, node/daemon.py), at most once per slot per
`cooldown_s`
(hysteresis: a slot does not ping-pong), and without a standby it keeps serving and says so. The entry's
own slot is marked but never handed over by itself (it holds the sessions; a standby takes it over only
when it dies). docs/architecture.md, "Failure handling"."""

from __future__ import annotations

import collections
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from p2pk3.spec.draft_len import PassCost
from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.messages import handover_frame, parse_error

from .links import DIAL_ERRORS

log = logging.getLogger("p2pk3.node")

MIN_TOKENS = 8  # a window with fewer tokens through a stage says nothing about its speed
HEALTHY = 1.5  # windows below this slowdown teach a stage's usual ratio
RECENT = 8  # a verdict stands while the median of its last RECENT evaluations is above the threshold
NOISE = 0.75  # threshold = 1 + NOISE x (factor - 1): the allowance for a window's noise (module doc)
USUAL_WINDOWS = 3  # usual ratio known after this many healthy windows (judging starts then)
RETRY_S = 10.0  # a holder that did not step down is asked again after this long


@dataclass
class StageFigure:
    """What the detector says about one stage (the status' `degraded` table, /metrics, the dashboard)."""

    slot: str
    node: str | None
    ms_per_token: float | None = None  # this window's compute ms per token
    expected_ratio: float | None = None  # its expected time over the others' (simulator or its usual share)
    slowdown: float | None = None
    slow_since: float | None = None  # monotonic time the slowdown went above the threshold
    persistent: float | None = None  # the median of its last RECENT slowdowns (the figure a verdict names)
    degraded: bool = False
    action: str = ""  # what was done about it ("handed over to s4", "no standby: keeps serving", ...)

    def public(self, now: float) -> dict:
        r = lambda x: None if x is None else round(x, 3)  # noqa: E731
        return {
            "node": self.node,
            "ms_per_token": r(self.ms_per_token),
            "expected_ratio": r(self.expected_ratio),
            "slowdown": r(self.slowdown),
            "persistent_slowdown": r(self.persistent),
            "slow_for_s": r(now - self.slow_since) if self.slow_since is not None else None,
            "degraded": self.degraded,
            "action": self.action,
        }


@dataclass
class _Sample:
    t: float
    busy_s: float
    tokens: int
    passes: dict[int, int]  # passes run by batch width (cumulative; empty where the stage does not say)
    pass_ms: dict[int, float]  # recent compute ms of a pass by batch width


class _Stage:
    def __init__(self, slot: str, node: str | None):
        self.figure = StageFigure(slot, node)
        self.samples: collections.deque[_Sample] = collections.deque()
        self.ratios: collections.deque[float] = collections.deque(maxlen=120)  # healthy windows' ratios
        self.alone: collections.deque[float] = collections.deque(maxlen=120)  # healthy ms/token (no others)
        self.since: collections.deque[float] = collections.deque(maxlen=RECENT)  # the last slowdowns since slow_since

    def fresh(self, now: float, window_s: float) -> bool:
        """Whether its last window says anything: fresh counters, long enough, enough tokens through it."""
        s = self.samples
        return (
            len(s) >= 2
            and s[-1].t >= now - window_s
            and s[-1].t - s[0].t >= 0.5 * window_s
            and s[-1].tokens - s[0].tokens >= MIN_TOKENS
        )

    def ms_per_token(self) -> float:
        a, b = self.samples[0], self.samples[-1]
        return 1000.0 * max(0.0, b.busy_s - a.busy_s) / (b.tokens - a.tokens)

    def ran(self) -> dict[int, int]:
        """Passes by width in the window."""
        a, b = self.samples[0], self.samples[-1]
        return {w: n - a.passes.get(w, 0) for w, n in b.passes.items() if n > a.passes.get(w, 0) and w in b.pass_ms}

    def cost(self) -> PassCost | None:
        """Its recent pass times by width (interpolated between the widths it ran)."""
        if not self.samples or not self.samples[-1].pass_ms:
            return None
        pc = PassCost()
        pc.ms = dict(self.samples[-1].pass_ms)
        return pc


def widths_of(stats: dict) -> tuple[dict[int, int], dict[int, float]]:
    """(passes by width, ms by width) from a stage's public statistics (`spec`: stage_runner.spec_stats)."""
    sp = stats.get("spec") if isinstance(stats.get("spec"), dict) else {}
    out = []
    for key, typ in (("passes_by_width", int), ("pass_ms_by_width", float)):
        d = sp.get(key) if isinstance(sp.get(key), dict) else {}
        out.append({int(w): typ(v) for w, v in d.items() if str(w).isdigit() and isinstance(v, (int, float))})
    return out[0], out[1]


class DegradedDetector:
    """Pure (no I/O): `observe` counters, `evaluate` verdicts. `clock` is injectable for tests."""

    def __init__(
        self,
        factor: float = 3.0,
        after_s: float = 10.0,
        *,
        window_s: float = 5.0,
        expected: dict[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if factor <= 1.0:
            raise ValueError(f"the degraded factor must be above 1 (a stage at its expected speed is 1), got {factor}")
        self.factor, self.after_s, self.window_s = factor, after_s, window_s
        self.threshold = 1 + NOISE * (factor - 1)  # what a window must read to count as slow (module doc)
        self.expected = dict(expected or {})
        self.clock = clock
        self.stages: dict[str, _Stage] = {}

    def observe(
        self,
        slot: str,
        node: str | None,
        busy_s: float,
        tokens: int,
        passes: dict[int, int] | None = None,
        pass_ms: dict[int, float] | None = None,
        now: float | None = None,
    ) -> None:
        """A stage's cumulative counters (and, where it says them, its passes and pass times by batch
        width). Another node on the slot (a takeover) or counters that went back (a restart) start its
        samples and its verdict afresh; its usual ratio (the slot's share of the ring's time) stays."""
        now = self.clock() if now is None else now
        st = self.stages.get(slot)
        if st is None:
            st = self.stages[slot] = _Stage(slot, node)
        elif st.figure.node != node or (st.samples and tokens < st.samples[-1].tokens):
            self.restart(slot)
            st.figure.node = node
        st.samples.append(_Sample(now, float(busy_s), int(tokens), dict(passes or {}), dict(pass_ms or {})))
        while len(st.samples) > 2 and st.samples[1].t <= now - self.window_s:
            st.samples.popleft()

    def restart(self, slot: str) -> None:
        """Start the slot's samples and verdict afresh (it was handed over); its usual ratio stays."""
        st = self.stages.get(slot)
        if st is not None:
            st.samples.clear()
            st.alone.clear()
            st.since.clear()
            st.figure = StageFigure(slot, st.figure.node)

    def _ratio(self, slot: str, others: list[str]) -> float | None:
        """The stage's compute time in this window over what the others take for the same batches: the
        batch widths it ran, priced at the fastest other stage's recent pass times at those widths (a
        stage that falls behind merges queued units into wider batches, which its time per token alone
        would flatter). Without widths: its ms per token over the others' median."""
        st = self.stages[slot]
        costs = [c for c in (self.stages[o].cost() for o in others) if c is not None]
        ran = st.ran()
        if ran and costs:
            theirs = sum(n * min(c.estimate(w) for c in costs) for w, n in ran.items())
            if theirs > 0:
                return 1000.0 * (st.samples[-1].busy_s - st.samples[0].busy_s) / theirs
        ms = [self.stages[o].ms_per_token() for o in others]
        med = statistics.median(ms)
        return st.ms_per_token() / med if med > 0 else None

    def evaluate(self, now: float | None = None) -> dict[str, StageFigure]:
        now = self.clock() if now is None else now
        fresh = [s for s, st in self.stages.items() if st.fresh(now, self.window_s)]
        for slot, st in self.stages.items():
            f = st.figure
            f.ms_per_token = st.ms_per_token() if slot in fresh else None
            others = [s for s in fresh if s != slot]
            slowdown = None
            if slot in fresh and others:
                ratio = self._ratio(slot, others)
                exp = self._expected_ratio(slot, others)
                if exp is None and len(st.ratios) >= USUAL_WINDOWS:
                    exp = statistics.median(st.ratios)
                f.expected_ratio = exp
                if exp and ratio is not None:
                    slowdown = ratio / exp
                if ratio is not None and (slowdown is None or slowdown < HEALTHY) and not f.degraded:
                    st.ratios.append(ratio)
            elif slot in fresh:  # alone: against its own usual figure
                m = f.ms_per_token
                if len(st.alone) >= USUAL_WINDOWS:
                    slowdown = m / statistics.median(st.alone)
                if (slowdown is None or slowdown < HEALTHY) and not f.degraded:
                    st.alone.append(m)
            f.slowdown = slowdown
            if slowdown is None:
                continue  # no evidence this window (idle, or still learning): the verdict stands
            if f.slow_since is None and slowdown > self.threshold:
                f.slow_since = now
                st.since.clear()
            if f.slow_since is not None:
                st.since.append(slowdown)
                # a median of the recent evaluations at or below the threshold ends it; one noisy window never does
                med = statistics.median(st.since)
                if med <= self.threshold and sum(x <= self.threshold for x in st.since) >= 2:
                    f.slow_since, f.degraded, f.action, f.persistent = None, False, "", None
                else:
                    f.persistent = med
                    f.degraded = now - f.slow_since >= self.after_s
        return {s: st.figure for s, st in self.stages.items()}

    def _expected_ratio(self, slot: str, others: list[str]) -> float | None:
        """The simulator's ratio for `slot` against the median of `others` (None where it has no figure)."""
        e = self.expected
        if slot not in e or not others or any(s not in e for s in others):
            return None
        return e[slot] / statistics.median(e[s] for s in others)


def sim_expectation(cfg, topo, profile: str) -> dict[str, float]:
    """The simulator's predicted compute ms per token of a decode pass (8 streams, 512 tokens of context)
    for every active slot of `topo` on hardware `profile` (a name or path, p2pk3/sim/profiles). Raises
    p2pk3.sim.ProfileError for an unknown profile."""
    from pathlib import Path

    from p2pk3.sim import CostModel, build_stages, load_profile
    from p2pk3.sim.hardware import DEFAULT
    from p2pk3.sim.model import Unit

    named = DEFAULT.parent / f"{profile}.toml"
    hw = load_profile(named if not Path(profile).is_file() and named.is_file() else profile)
    stages = build_stages(cfg, topo, hw, topo.model.formats)
    cm = CostModel(cfg, stages, hw)
    units = [Unit(i, 1, 512, False) for i in range(8)]
    return {st.slot: 1000.0 * cm.pass_s(k, units) / len(units) for k, st in enumerate(stages)}


Request = Callable[[tuple[str, int], Frame, float], Awaitable[Frame]]


def entry_watch(d, slot_id: str) -> "DegradedWatch":
    """The watch of the entry daemon `d` (node/daemon.py) on `slot_id`, as its options say: factor, time,
    cooldown, and the simulator's expectation where `sim_profile` names the hardware."""
    o = d.opts
    expected = sim_expectation(d.cfg, d.topo, o.sim_profile) if o.sim_profile else None
    return DegradedWatch(
        DegradedDetector(o.degraded_factor, o.degraded_after_s, expected=expected),
        own_slot=slot_id,
        own_stats=d.public_stats,
        active=lambda: [s.id for s in d.topo.active],
        state=lambda slot: d.monitor.state(slot) if d.monitor is not None else None,
        holder_of=d.holder_of,
        address=d.routes.address,
        request=d._request,
        cooldown_s=o.handover_cooldown_s,
    )


class DegradedWatch:
    """The entry's use of the detector: feed it from the heartbeats, and hand a degraded stage over.

    Given what it reads and does (the failover Coordinator's way): `own_slot` / `own_stats()` (the
    entry's stage), `active()` (the active slot ids), `state(slot)` (the failure detector's PeerState: its
    last pong's statistics), `holder_of(slot, state)` ((node, epoch) or None), `address(slot)` and
    `request(addr, frame, timeout)`. The Coordinator calls `check(standbys)` while the ring is whole."""

    def __init__(
        self,
        detector: DegradedDetector,
        *,
        own_slot: str,
        own_stats: Callable[[], dict],
        active: Callable[[], list[str]],
        state: Callable[[str], object],
        holder_of: Callable[[str, object], tuple[str, int] | None],
        address: Callable[[str], tuple[str, int]],
        request: Request,
        cooldown_s: float = 120.0,
    ):
        self.detector, self.own_slot, self.own_stats = detector, own_slot, own_stats
        self.active, self.state, self.holder_of = active, state, holder_of
        self.address, self.request = address, request
        self.cooldown_s = cooldown_s
        self.handed_over: dict[str, float] = {}  # slot -> monotonic time of its last degraded handover
        self.refused: dict[str, float] = {}  # slot -> when its holder last failed to step down (asked again later)
        self.events: list[dict] = []

    def sample(self) -> dict[str, StageFigure]:
        d = self.detector
        for slot in self.active():
            if slot == self.own_slot:
                info = self.own_stats()
            else:
                ps = self.state(slot)
                info = ps.info if ps is not None and ps.state == "up" else None
            if info and isinstance(info.get("tokens"), int) and isinstance(info.get("busy_s"), (int, float)):
                held = info.get("held_s")  # the time it held work; older nodes say only their compute time
                held = held if isinstance(held, (int, float)) else info["busy_s"]
                d.observe(slot, info.get("node"), held, info["tokens"], *widths_of(info))
        return d.evaluate()

    async def check(self, standbys: list[str]) -> str | None:
        """Sample, and for a degraded stage that may be handed over now (`standbys`: the live ones): ask
        its holder to step down. Returns the slot handed over (the caller repairs it like a dead one)."""
        now = self.detector.clock()
        for slot, f in self.sample().items():
            if not f.degraded:
                continue
            figure = f"{f.persistent:.1f}x its expected time per token ({_now(f)})"
            if slot == self.own_slot:
                self._say(f, "the entry slot is not handed over while it serves (a standby takes it when it dies)")
                continue
            last = self.handed_over.get(slot)
            if last is not None and now - last < self.cooldown_s:
                self._say(f, f"handed over {now - last:.0f} s ago: kept for the cooldown ({self.cooldown_s:.0f} s)")
                continue
            if not standbys:
                self._say(f, "no standby is available: it keeps serving (start a spare: `p2pk3 node --standby`)")
                continue
            tried = self.refused.get(slot)
            if tried is not None and now - tried < RETRY_S:
                continue
            holder = self.holder_of(slot, self.state(slot))
            if holder is None:
                self._say(f, "its holder is not known yet")
                continue
            log.warning(
                "slot %s is degraded: %s for %.0f s; handing it over to a standby", slot, figure, now - f.slow_since
            )
            try:
                reply = await self.request(self.address(slot), handover_frame(slot, holder[1], figure), 10.0)
                if reply.kind == "error":
                    e = parse_error(reply)
                    raise ConnectionError(f"{e.code}: {e.message}")
                if reply.kind != "handover":
                    raise ProtocolError(f"answered a handover with {reply.kind!r}")
            except (*DIAL_ERRORS, ProtocolError) as e:
                self._say(f, f"its holder did not step down: {e}")
                self.refused[slot] = now
                continue
            self.handed_over[slot] = now
            f.action = "handed over"
            self.events.append(
                {
                    "event": "degraded",
                    "slot": slot,
                    "node": holder[0],
                    "t": time.time(),
                    "slowdown": round(f.persistent, 2),
                    "ms_per_token": f.ms_per_token,
                }
            )
            self.detector.restart(slot)
            return slot
        return None

    def _say(self, f: StageFigure, action: str) -> None:
        if f.action != action:
            f.action = action
            log.warning(
                "slot %s is degraded: %.1fx its expected time per token for %.0f s (%s); %s",
                f.slot,
                f.persistent,
                self.detector.clock() - f.slow_since,
                _now(f),
                action,
            )

    def report(self) -> dict[str, dict]:
        now = self.detector.clock()
        return {s: st.figure.public(now) for s, st in sorted(self.detector.stages.items())}


def _now(f: StageFigure) -> str:
    return f"{f.ms_per_token:.2f} ms per token now" if f.ms_per_token is not None else "idle now"
