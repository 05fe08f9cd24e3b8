"""The stage worker: picks what to run next from what is queued, runs it in a worker thread (the event
loop keeps receiving frames and answering heartbeats meanwhile), and hands the output to an ordered
sender, so the next batch starts while the previous result is still being sent. A failing batch is rerun
unit by unit so that only the offending sessions get an error; the worker survives anything a batch does.

What runs next (docs/architecture.md, "The scheduler"):
* decode units before prefill units, with at most one prefill unit between two decode batches (a
  prompt's chunks never wait forever, a decode never waits behind more than one chunk);
* on every stage but the first, the queued units of that kind are batched together (up to the token
  budget) when the stage is behind; the first stage runs the entry's units as the entry formed them,
  so its micro-batches stay apart instead of merging back into one lockstep batch;
* never two units of one session in one batch, and never a unit of a session before an earlier one of
  that session (a stage runs one session's chunks in position order);
* `free` / `retain` items are barriers: nothing moves past them, so a session is freed only after its
  last unit, and they are passed on behind the outputs of the work before them.

Busy fraction (compute time / wall time) over the last seconds is `busy_fraction()`, in the status."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from p2pk3.model.cache import CacheFull, SessionError, UnknownSession
from p2pk3.model.kimi_k3 import ExpertNotHeld
from p2pk3.model.prefix_cache import PrefixMiss
from p2pk3.spec.draft_len import PassCost
from p2pk3.transport.messages import ErrorCode, Result, Segment

from .stage_runner import HeadOut, HopOut, StageRunner, Work, merge

log = logging.getLogger("p2pk3.node")

RECOVERABLE = (CacheFull, SessionError, ExpertNotHeld)
BUSY_WINDOW_S = 5.0
OUTBOX = 4  # outputs waiting to be sent before the worker waits for the sender (backpressure)
RETAIN_GRACE_S = 5.0  # a `retain` frees no session opened this recently (it may have overtaken the retain:
# the broadcast that carries it takes up to 2 s to connect and 2 s to send)


@dataclass
class Free:
    sessions: list[tuple[str, int]]
    origin: str
    keep: dict = field(default_factory=dict)  # session -> Keep: registered in the prefix cache first


@dataclass
class Retain:
    """Keep only these sessions (id -> epoch); free every other session and older epochs (after a repair)."""

    sessions: dict[str, int]


@dataclass
class WorkerStats:
    batches: int = 0
    tokens: int = 0
    busy_s: float = 0.0  # computing
    held_s: float = 0.0  # holding work: from a unit's arrival at an idle worker until it is idle again
    errors: int = 0
    last_batch_ms: float = 0.0


def error_results(segments: list[Segment], e: Exception) -> list[Result]:
    code = (
        ErrorCode.BUSY
        if isinstance(e, CacheFull)
        else ErrorCode.PREFIX_MISS
        if isinstance(e, PrefixMiss)
        else ErrorCode.LOST_STATE
        if isinstance(e, UnknownSession)
        else ErrorCode.FAILED
    )
    msg = str(e).strip("'\"") if isinstance(e, RECOVERABLE) else f"{type(e).__name__}: {e}"
    return [Result(s.session, s.epoch, s.start_pos, error=msg, code=code) for s in segments]


def is_decode(work: Work) -> bool:
    """A unit of decode steps: every segment samples after its one token (and its drafts)."""
    return all(s.sample is not None and s.n_tokens == 1 + len(s.draft) for s in work.segments)


def cost_width(n: int) -> int:
    """Batch widths as the stage's cost table keeps them: exact up to 16, then in steps of 16."""
    return n if n <= 16 else 16 * round(n / 16)


class BusyMeter:
    """Compute intervals of the last `window_s` seconds -> the fraction of wall time spent computing."""

    def __init__(self, window_s: float = BUSY_WINDOW_S):
        self.window_s = window_s
        self.spans: collections.deque[tuple[float, float]] = collections.deque()
        self.running_since: float | None = None

    def start(self) -> None:
        self.running_since = time.perf_counter()

    def stop(self) -> None:
        if self.running_since is not None:
            self.spans.append((self.running_since, time.perf_counter()))
            self.running_since = None

    def fraction(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        t0 = now - self.window_s
        while self.spans and self.spans[0][1] < t0:
            self.spans.popleft()
        busy = sum(min(b, now) - max(a, t0) for a, b in self.spans if b > t0)
        if self.running_since is not None:
            busy += now - max(self.running_since, t0)
        return max(0.0, min(1.0, busy / self.window_s))


class StageWorker:
    def __init__(
        self,
        runner: StageRunner,
        executor: Executor,
        *,
        slot: str,
        max_batch_tokens: int,
        emit: Callable[[list[Segment], HopOut | HeadOut], Awaitable[None]],
        report: Callable[[list[Result]], Awaitable[None]],
        pass_free: Callable[[Free], Awaitable[None]],
        first: bool = False,
        report_prefix: Callable[[list, list], Awaitable[None]] | None = None,
    ):
        self.runner, self.executor, self.slot = runner, executor, slot
        self.max_batch_tokens = max_batch_tokens
        self.emit, self.report, self.pass_free = emit, report, pass_free
        self.report_prefix = report_prefix  # (added, evicted) of the stage's prefix cache -> the entry
        self.first = first  # the entry's stage: runs the entry's units as they are (no merging)
        self.items: collections.deque = collections.deque()
        self._wake = asyncio.Event()
        self._outbox: asyncio.Queue = asyncio.Queue(OUTBOX)
        self.stats = WorkerStats()
        self.busy = BusyMeter()
        self.cost = PassCost()  # compute ms by batch width (cost_width): the entry cuts prefill units by it
        self._prefill_owed = False
        self._held_since: float | None = None  # when the worker last went from idle to holding a unit
        self.opened: dict[str, float] = {}  # session -> when its position 0 was queued here (the retain's grace)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._loop(), name=f"stage-{self.slot}"),
            asyncio.create_task(self._send_loop(), name=f"stage-{self.slot}-send"),
        ]

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()

    def put(self, item: Work | Free | Retain) -> None:
        if isinstance(item, Work):
            now = time.monotonic()
            for s in item.segments:
                if s.start_pos == 0:
                    self.opened[str(s.session)] = now
            if self._held_since is None:
                self._held_since = time.perf_counter()
        self.items.append(item)
        self._wake.set()

    @property
    def depth(self) -> int:
        return len(self.items)

    def held_s(self) -> float:
        """Wall seconds this worker has held work (queued or computing, the gaps between batches included):
        what a stage's slowness costs the ring, wherever in the stage it lands (node/degraded.py)."""
        now = time.perf_counter()
        return self.stats.held_s + (now - self._held_since if self._held_since is not None else 0.0)

    def busy_fraction(self) -> float:
        return self.busy.fraction()

    async def _loop(self) -> None:
        while True:
            while not self.items:
                if self._held_since is not None:  # idle: the held time ends here
                    self.stats.held_s += time.perf_counter() - self._held_since
                    self._held_since = None
                self._wake.clear()
                await self._wake.wait()
            head = self.items[0]
            if isinstance(head, (Free, Retain)):
                self.items.popleft()
                if isinstance(head, Free):
                    for sid, epoch in head.sessions:
                        if str(sid) in head.keep and self.runner.epochs.get(str(sid)) == epoch:
                            try:
                                self.runner.keep(str(sid), head.keep[str(sid)])
                            except Exception:  # noqa: BLE001 - a reply not kept costs hits, never the worker
                                log.exception("slot %s: keeping session %s in the prefix cache failed", self.slot, sid)
                        self.runner.free(str(sid), epoch)
                    await self._report_prefix()
                    await self._outbox.put(("free", head))
                else:
                    self._retain(head)
                continue
            works = self._take()
            try:
                await self._run(works)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the worker must survive anything one batch does
                self.stats.errors += 1
                log.exception("slot %s: batch failed", self.slot)
                for w in works:
                    try:
                        await self.report(error_results(w.segments, RuntimeError(f"slot {self.slot} failed: {e}")))
                    except Exception:
                        log.warning("slot %s: could not report the failure to the entry", self.slot)

    def _take(self) -> list[Work]:
        """The units of the next batch, removed from the queue (see the module docstring)."""
        head = next((i for i, it in enumerate(self.items) if isinstance(it, (Free, Retain))), len(self.items))
        queued = [self.items[i] for i in range(head)]
        decode = [is_decode(w) for w in queued]
        has_prefill = not all(decode)
        want = any(decode) and not (self._prefill_owed and has_prefill)
        self._prefill_owed = want and has_prefill  # a prefill unit waits behind this decode batch: it goes next
        taken, seen, blocked, n = [], set(), set(), 0
        for i, w in enumerate(queued):
            sids = {str(s.session) for s in w.segments}
            if (
                decode[i] != want
                or sids & (seen | blocked)
                or (taken and n + w.n_tokens > self.max_batch_tokens)
                or (taken and (w.tokens is None) != (queued[taken[0]].tokens is None))
            ):
                blocked |= sids  # its later units must not overtake it
                continue
            taken.append(i)
            seen |= sids
            n += w.n_tokens
            if self.first:
                break
        keep = set(taken)
        rest = [w for i, w in enumerate(queued) if i not in keep]
        for _ in range(head):
            self.items.popleft()
        self.items.extendleft(reversed(rest))
        return [queued[i] for i in taken]

    def _retain(self, r: Retain) -> None:
        """Free every session `r` does not list, except those opened in the last RETAIN_GRACE_S: the entry
        listed its sessions before it sent the retain (another connection than the ring's), so a session
        begun meanwhile can reach this stage first; a young leftover goes at the next retain."""
        now = time.monotonic()
        self.opened = {sid: t for sid, t in self.opened.items() if now - t < RETAIN_GRACE_S}
        for sid, held in list(self.runner.epochs.items()):
            listed = r.sessions.get(sid)
            # a newer epoch than the list's was opened after it (a replay): kept, as a young session is
            if (listed is None or held < listed) and sid not in self.opened:
                self.runner.free(sid)

    async def _send_loop(self) -> None:
        """Sends outputs and passes frees on, in the order the worker produced them."""
        while True:
            kind, a, *b = await self._outbox.get()
            try:
                if kind == "free":
                    await self.pass_free(a)
                elif kind == "prefix":
                    await self.report_prefix(a, b[0])
                else:
                    await self.emit(a, b[0])
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed send must not stop the sender
                log.exception("slot %s: sending an output failed", self.slot)

    def _compute(self, group: list[Work]):
        return self.runner.run(merge(group))

    async def _run(self, works: list[Work]) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        self.busy.start()
        try:
            try:
                outs = [(works, await loop.run_in_executor(self.executor, self._compute, works))]
                self.cost.observe(cost_width(sum(w.n_tokens for w in works)), 1000 * (time.perf_counter() - t0))
            except Exception as e:  # CacheFull, SessionError, ExpertNotHeld, or a bad hop's shapes
                outs = []
                if len(works) == 1:
                    await self._failed(works[0], e)
                else:  # one bad unit must not fail the others: rerun them one by one
                    for w in works:
                        try:
                            outs.append(([w], await loop.run_in_executor(self.executor, self.runner.run, w)))
                        except Exception as e1:
                            await self._failed(w, e1)
        finally:
            self.busy.stop()
        dt = time.perf_counter() - t0
        self.stats.busy_s += dt
        await self._report_prefix()  # before the outputs: the entry knows what is held when they arrive
        for g, out in outs:
            self.stats.batches += 1
            self.stats.tokens += sum(w.n_tokens for w in g)
            self.stats.last_batch_ms = 1000 * dt
            await self._outbox.put(("out", [s for w in g for s in w.segments], out))

    async def _report_prefix(self) -> None:
        """What the prefix cache added and evicted since the last report, to the ordered sender."""
        if self.runner.prefix is not None and self.report_prefix is not None:
            added, evicted = self.runner.prefix.take_report()
            if added or evicted:
                await self._outbox.put(("prefix", added, evicted))

    async def _failed(self, work: Work, e: Exception) -> None:
        self.stats.errors += 1
        if isinstance(e, RECOVERABLE):
            log.warning("slot %s: %s", self.slot, e)
        else:
            log.error("slot %s: unexpected failure of a batch: %s: %s", self.slot, type(e).__name__, e, exc_info=e)
        await self.report(error_results(work.segments, e))
