"""Admission at the entry: requests beyond the session capacity wait in a bounded queue instead of being
refused (docs/architecture.md, "Admission").

A request is admitted at once while the entry holds fewer than `max_sessions` live sessions and nobody
waits before it; otherwise it waits in a FIFO queue of at most `max_queue` requests and is admitted, in
arrival order, as sessions finish. Only a request that finds the queue full is refused (`QueueFull`,
error code `busy`, with `retry_after`: the seconds the queue ahead of it takes to drain at the rate
sessions have been finishing). One that waited `timeout_s` without being admitted ends with
`QueueTimeout` (code `queue_timeout`, also with `retry_after`). A waiter whose task is cancelled (its
client disconnected, or sent `cancel`) leaves the queue at once.

Defaults: the queue holds QUEUE_FACTOR times the session capacity, and a request waits at most
DEFAULT_QUEUE_TIMEOUT_S: a full queue is QUEUE_FACTOR rounds of sessions, so that covers rounds of up to
DEFAULT_QUEUE_TIMEOUT_S / QUEUE_FACTOR seconds each (a K3 answer of a few thousand tokens at ~20 tok/s).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from .entry import Entry, Session
from .options import DEFAULT_QUEUE_TIMEOUT_S, QUEUE_FACTOR
_RATE_WINDOW = 64  # finishes the drain rate is measured over


class QueueFull(RuntimeError):
    """No room in the queue; `retry_after`: seconds after which a retry may find room."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class QueueTimeout(QueueFull):
    """The request waited its whole queue timeout without being admitted."""


def default_max_queue(max_sessions: int) -> int:
    return QUEUE_FACTOR * max_sessions


@dataclass
class _Waiter:
    submit: Callable[[], Session]
    fut: asyncio.Future
    t: float = field(default_factory=time.monotonic)


class Admission:
    """The entry's gate: `await admit(submit)` returns the Session that `submit()` made, once there is room."""

    def __init__(self, entry: Entry, *, max_queue: int | None = None, timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S):
        if max_queue is not None and max_queue < 0 or timeout_s <= 0:
            raise ValueError(f"max_queue ({max_queue}) must be >= 0 and timeout_s ({timeout_s}) > 0")
        self.entry = entry
        self.max_queue = default_max_queue(entry.max_sessions) if max_queue is None else max_queue
        self.timeout_s = timeout_s
        self.queue: collections.deque[_Waiter] = collections.deque()
        self.admitted = 0  # requests admitted (at once or after waiting)
        self.waited = 0  # of those, the ones that waited in the queue
        self.refused = 0  # found the queue full
        self.timed_out = 0
        self.left = 0  # left the queue before admission (client gone or cancelled)
        self.max_wait_s = 0.0  # the longest wait of an admitted request
        self._finishes: collections.deque[float] = collections.deque(maxlen=_RATE_WINDOW)
        self._pumping = False
        entry.on_finish = self._on_finish

    # ------------------------------------------------------------------ requests
    def has_room(self) -> bool:
        return len(self.entry.sessions) < self.entry.max_sessions

    async def admit(
        self, submit: Callable[[], Session], *, max_queue: int | None = None, timeout_s: float | None = None
    ) -> Session:
        """The session `submit()` makes, now or after waiting its turn. `max_queue` / `timeout_s` (a request's
        own, e.g. `p2pk3 serve --max-queue`) can only tighten the entry's. Raises QueueFull / QueueTimeout
        (and whatever `submit` raises: ValueError for a bad request)."""
        if not self.queue and self.has_room():
            self.admitted += 1
            return submit()
        bound = self.max_queue if max_queue is None else min(max_queue, self.max_queue)
        if len(self.queue) >= bound:
            self.refused += 1
            raise QueueFull(
                f"busy: {len(self.entry.sessions)} sessions in flight (max {self.entry.max_sessions}) and "
                f"{len(self.queue)} requests queued (max {bound}); retry after {self.retry_after()} s",
                self.retry_after(),
            )
        w = _Waiter(submit, asyncio.get_running_loop().create_future())
        self.queue.append(w)
        timeout = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        try:
            return await asyncio.wait_for(asyncio.shield(w.fut), timeout)
        except asyncio.TimeoutError:
            if w.fut.done() and not w.fut.cancelled():  # admitted just as the deadline passed
                return w.fut.result()
            self._drop(w)
            self.timed_out += 1
            raise QueueTimeout(
                f"waited {timeout:.0f} s in the entry's queue without a free session "
                f"({len(self.entry.sessions)} in flight, {len(self.queue)} queued); retry after "
                f"{self.retry_after()} s",
                self.retry_after(),
            ) from None
        except asyncio.CancelledError:
            if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                s = w.fut.result()  # admitted, but its client is gone: end the session it got
                self.entry.cancel(s.id, "client went away")
            else:
                self._drop(w)
                self.left += 1
            raise

    def _drop(self, w: _Waiter) -> None:
        try:
            self.queue.remove(w)
        except ValueError:
            pass
        if not w.fut.done():
            w.fut.cancel()

    # ------------------------------------------------------------------ sessions freeing
    def _on_finish(self, s: Session) -> None:
        self._finishes.append(time.monotonic())
        if self.queue and not self._pumping:
            self._pumping = True
            asyncio.get_running_loop().call_soon(self.pump)  # not inside the entry's result handling

    def pump(self) -> None:
        """Admit waiters, in order, while there is room. The entry schedules once after all of them, so
        their prompts can share prefill units (each submit alone would send a unit of its own)."""
        self._pumping = False
        if not self.queue or not self.has_room():
            return
        entry, was = self.entry, self.entry.paused
        entry.paused = was or "admitting queued requests"  # nothing is awaited until it is restored
        try:
            self._admit_waiters()
        finally:
            entry.paused = was
            entry.kick()

    def _admit_waiters(self) -> None:
        while self.queue and self.has_room():
            w = self.queue.popleft()
            if w.fut.done():  # cancelled meanwhile
                continue
            try:
                s = w.submit()
            except Exception as e:  # a bad request found only now: its waiter raises it
                w.fut.set_exception(e)
                continue
            wait = time.monotonic() - w.t
            self.admitted += 1
            self.waited += 1
            self.max_wait_s = max(self.max_wait_s, wait)
            w.fut.set_result(s)

    # ------------------------------------------------------------------ figures
    def drain_rate(self) -> float | None:
        """Sessions finished per second, over the last _RATE_WINDOW finishes (None: too few yet)."""
        f = self._finishes
        if len(f) < 2 or f[-1] <= f[0]:
            return None
        return (len(f) - 1) / (f[-1] - f[0])

    def retry_after(self) -> int:
        """Seconds until the queue as it is now has drained, at the measured rate (5 s before any measure)."""
        rate = self.drain_rate()
        if rate is None:
            return 5
        return max(1, min(3600, math.ceil((len(self.queue) + 1) / rate)))

    def stats(self) -> dict:
        """For the status, the dashboard and /metrics."""
        now = time.monotonic()
        rate = self.drain_rate()
        return {
            "queued": len(self.queue),
            "max_queue": self.max_queue,
            "timeout_s": self.timeout_s,
            "capacity": self.entry.max_sessions,
            "oldest_wait_s": round(now - self.queue[0].t, 3) if self.queue else 0.0,
            "max_wait_s": round(self.max_wait_s, 3),
            "admitted": self.admitted,
            "waited": self.waited,
            "refused": self.refused,
            "timed_out": self.timed_out,
            "left": self.left,
            "drain_per_s": round(rate, 3) if rate is not None else None,
        }
