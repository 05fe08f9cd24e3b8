"""The stage worker: takes whatever is queued (up to a token budget), packs it into one batch, runs it
in a worker thread (the event loop keeps moving bytes and answering heartbeats), and hands the output
on: a hop to the successor, results to the entry. A failing batch is rerun unit by unit so that only
the offending sessions get an error; the worker survives anything a batch does.

`free` items travel the queue in order with the work, so a session is freed only after its last unit."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Awaitable, Callable

from p2pk3.model.cache import CacheFull, SessionError
from p2pk3.model.kimi_k3 import ExpertNotHeld
from p2pk3.transport.messages import ErrorCode, Result, Segment

from .stage_runner import HeadOut, HopOut, StageRunner, Work, merge

log = logging.getLogger("p2pk3.node")

RECOVERABLE = (CacheFull, SessionError, ExpertNotHeld)


@dataclass
class Free:
    sessions: list[tuple[str, int]]
    origin: str


@dataclass
class Retain:
    """Keep only these sessions (id -> epoch); free every other session and older epochs (after a repair)."""

    sessions: dict[str, int]


@dataclass
class WorkerStats:
    batches: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    errors: int = 0
    last_batch_ms: float = 0.0


def error_results(segments: list[Segment], e: Exception) -> list[Result]:
    code = ErrorCode.BUSY if isinstance(e, CacheFull) else ErrorCode.FAILED
    msg = str(e).strip("'\"") if isinstance(e, RECOVERABLE) else f"{type(e).__name__}: {e}"
    return [Result(s.session, s.epoch, s.start_pos, error=msg, code=code) for s in segments]


class StageWorker:
    def __init__(self, runner: StageRunner, executor: Executor, *, slot: str, max_batch_tokens: int,
                 emit: Callable[[list[Segment], HopOut | HeadOut], Awaitable[None]],
                 report: Callable[[list[Result]], Awaitable[None]],
                 pass_free: Callable[[Free], Awaitable[None]]):
        self.runner, self.executor, self.slot = runner, executor, slot
        self.max_batch_tokens = max_batch_tokens
        self.emit, self.report, self.pass_free = emit, report, pass_free
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stats = WorkerStats()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"stage-{self.slot}")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def put(self, item: Work | Free) -> None:
        self.queue.put_nowait(item)

    @property
    def depth(self) -> int:
        return self.queue.qsize()

    async def _loop(self) -> None:
        while True:
            item = await self.queue.get()
            if isinstance(item, Free):
                await self._free(item)
                continue
            if isinstance(item, Retain):
                self._retain(item)
                continue
            works, n, pending_free = [item], item.n_tokens, []
            while not self.queue.empty() and n < self.max_batch_tokens:  # continuous batching
                nxt = self.queue.get_nowait()
                if isinstance(nxt, (Free, Retain)):
                    pending_free.append(nxt)
                    break
                works.append(nxt)
                n += nxt.n_tokens
            try:
                await self._run(works)
                for fr in pending_free:
                    await self._free(fr) if isinstance(fr, Free) else self._retain(fr)
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

    def _retain(self, r: Retain) -> None:
        for sid, held in list(self.runner.epochs.items()):
            if r.sessions.get(sid, -1) != held:
                self.runner.free(sid)

    async def _free(self, fr: Free) -> None:
        for sid, epoch in fr.sessions:
            self.runner.free(str(sid), epoch)
        await self.pass_free(fr)

    async def _run(self, works: list[Work]) -> None:
        loop = asyncio.get_running_loop()
        groups = [works]
        if len(works) > 1 and (works[0].tokens is None) != (works[-1].tokens is None):
            groups = [[w] for w in works]
        for group in groups:
            t0 = time.perf_counter()
            try:
                outs = [(group, await loop.run_in_executor(self.executor, self.runner.run, merge(group)))]
            except Exception as e:  # CacheFull, SessionError, ExpertNotHeld, or a bad hop's shapes
                outs = []
                if len(group) == 1:
                    await self._failed(group[0], e)
                else:  # one bad unit must not fail the others: rerun them one by one
                    for w in group:
                        try:
                            outs.append(([w], await loop.run_in_executor(self.executor, self.runner.run, w)))
                        except Exception as e1:
                            await self._failed(w, e1)
            dt = time.perf_counter() - t0
            self.stats.busy_s += dt
            for g, out in outs:
                self.stats.batches += 1
                self.stats.tokens += sum(w.n_tokens for w in g)
                self.stats.last_batch_ms = 1000 * dt
                await self.emit([s for w in g for s in w.segments], out)

    async def _failed(self, work: Work, e: Exception) -> None:
        self.stats.errors += 1
        if isinstance(e, RECOVERABLE):
            log.warning("slot %s: %s", self.slot, e)
        else:
            log.error("slot %s: unexpected failure of a batch: %s: %s", self.slot, type(e).__name__, e, exc_info=e)
        await self.report(error_results(work.segments, e))
