"""The entry role: owns sessions (token history, sampling parameters), schedules them into the ring with
continuous batching, and streams tokens out.

Each round takes every session that has nothing in flight: running decodes contribute one token each,
new prompts contribute a prefill chunk (at most `prefill_chunk` tokens per session, `max_batch_tokens`
per batch), so a long prompt never stalls the decodes of the others. A session has at most one unit in
flight; many sessions keep the pipeline of stages full.

The whole token history stays here, which is what makes failures survivable: `replay_all()` gives every
live session a new epoch and restarts it from position 0, so its history (prompt + tokens generated so
far) is prefilled again through the repaired ring like any prompt (every stage drops the old epoch's
state when the new epoch arrives at position 0), and generation continues where it was: greedy and
seeded output are the same as without the failure (sampling is a function of seed and position).
While the ring is being repaired the entry is `paused`: nothing is scheduled, results of the old epoch
are ignored, and new requests wait in the session table.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import torch

from p2pk3.engine.sampling import SamplingParams, fresh_seed
from p2pk3.transport.messages import ErrorCode, Result, Segment

from .stage_runner import Work


class Busy(RuntimeError):
    pass


@dataclass
class Session:
    id: str
    epoch: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    want_logits: bool = False
    incremental: bool = False
    sent: int = 0  # tokens of `tokens` sent into the ring in this epoch
    inflight: bool = False
    t_sent: float = 0.0  # when the unit in flight was sent
    done: bool = False
    error: str | None = None
    error_code: str | None = None
    replays: int = 0
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    logits: list[torch.Tensor] = field(default_factory=list)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_done: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def stats(self) -> dict:
        n = len(self.generated)
        ttft = (self.t_first - self.t_submit) if self.t_first else None
        total = (self.t_done or time.perf_counter()) - self.t_submit
        decode = (self.t_done - self.t_first) if (self.t_done and self.t_first and n > 1) else None
        return {"prompt_tokens": self.prompt_len, "generated_tokens": n, "ttft_s": ttft, "total_s": total,
                "decode_tokens_per_s": (n - 1) / decode if decode else None, "replays": self.replays}


class Entry:
    def __init__(self, submit_work, free_sessions, *, prefill_chunk: int = 256, max_batch_tokens: int = 2048,
                 max_sessions: int = 64):
        self._submit_work = submit_work  # callable(Work) -> None (first stage queue)
        self._free_sessions = free_sessions  # callable(list[(session, epoch)]) -> None (free along the ring)
        self.prefill_chunk, self.max_batch_tokens, self.max_sessions = prefill_chunk, max_batch_tokens, max_sessions
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self.node_tag = f"{time.time_ns() % 10**9:x}"
        self.paused: str | None = None  # why scheduling is paused (a ring repair), or None
        self.finished = 0
        self.failed = 0

    # ------------------------------------------------------------------ public
    def submit(self, prompt: list[int], params: SamplingParams, *, want_logits: bool = False,
               incremental: bool = False) -> Session:
        live = sum(1 for s in self.sessions.values() if not s.done)
        if live >= self.max_sessions:
            raise Busy(f"busy: {live} sessions in flight (max {self.max_sessions}); retry later")
        if not prompt:
            raise ValueError("empty prompt")
        if params.temperature > 0 and params.seed is None:
            params = params.with_seed(fresh_seed())
        sid = f"s{self.node_tag}-{next(self._ids)}"
        s = Session(sid, 0, list(prompt), len(prompt), params, want_logits, incremental)
        self.sessions[sid] = s
        if params.max_tokens == 0 and not want_logits:
            self._finish(s)  # nothing to generate
            return s
        self.kick()
        return s

    def cancel(self, sid: str, reason: str = "cancelled", code: str = "cancelled") -> None:
        s = self.sessions.get(sid)
        if s and not s.done:
            self._finish(s, error=reason, code=code)

    def live(self) -> list[Session]:
        return [s for s in self.sessions.values() if not s.done]

    # ------------------------------------------------------------------ failures
    def pause(self, reason: str) -> None:
        """Stop scheduling (a slot is down; a repair is under way). Units in flight are abandoned."""
        self.paused = reason

    def replay_all(self) -> int:
        """Restart every live session at a new epoch from position 0 (its whole history). Returns how many."""
        n = 0
        for s in self.live():
            s.epoch += 1
            s.sent, s.inflight = 0, False
            s.logits.clear()
            s.replays += 1
            n += 1
        return n

    def resume(self) -> None:
        self.paused = None
        self.kick()

    def fail_all(self, reason: str, code: str = "failed") -> None:
        for s in self.live():
            self._finish(s, error=reason, code=code)

    def expire(self, timeout_s: float) -> list[Session]:
        """Fail the sessions whose unit in flight has had no answer for `timeout_s` (nothing waits forever)."""
        now = time.perf_counter()
        late = [s for s in self.live() if s.inflight and now - s.t_sent > timeout_s]
        for s in late:
            self._finish(s, error=f"no answer from the ring for {timeout_s:.0f} s (a stage lost the request)",
                         code="failed")
        return late

    # ------------------------------------------------------------------ scheduling
    def kick(self) -> None:
        if self.paused:
            return
        segs, ids, budget = [], [], self.max_batch_tokens
        # decodes first (1 token each), then prefill chunks
        ready = [s for s in self.sessions.values() if not s.done and not s.inflight and s.sent < len(s.tokens)]
        ready.sort(key=lambda s: (s.sent < s.prompt_len, s.t_submit))
        now = time.perf_counter()
        for s in ready:
            n = min(len(s.tokens) - s.sent, self.prefill_chunk, budget)
            if s.incremental:
                n = 1
            if n <= 0:
                break
            last = s.sent + n == len(s.tokens)
            sample = s.params if last and not s.want_logits else None
            segs.append(Segment(s.id, s.epoch, s.sent, n, sample, s.want_logits))
            ids.extend(s.tokens[s.sent:s.sent + n])
            s.sent += n
            s.inflight, s.t_sent = True, now
            budget -= n
        if segs:
            self._submit_work(Work(segs, tokens=torch.tensor(ids, dtype=torch.long)))

    def on_results(self, results: list[Result], logits: torch.Tensor | None) -> None:
        row = 0
        for r in results:
            s = self.sessions.get(str(r.session))
            if s is None or s.done or r.epoch != s.epoch:  # finished, or a unit of an epoch before a replay
                row += r.rows
                continue
            s.inflight = False
            if r.error is not None:
                self._finish(s, error=r.error, code=r.code or ErrorCode.FAILED)
                continue
            if s.want_logits:
                s.logits.append(logits[row:row + r.rows].clone())
                row += r.rows
                if s.sent >= len(s.tokens):
                    self._finish(s)
                continue
            if r.skip:
                continue
            if s.t_first is None:
                s.t_first = time.perf_counter()
            s.tokens.append(r.token)
            s.out.put_nowait(r.token)
            if r.token in s.params.stop_ids or len(s.generated) >= s.params.max_tokens:
                self._finish(s)
        self.kick()

    def _finish(self, s: Session, error: str | None = None, code: str | None = None) -> None:
        s.done, s.error, s.error_code, s.inflight = True, error, code, False
        s.t_done = time.perf_counter()
        s.out.put_nowait(None)
        if error:
            self.failed += 1
        else:
            self.finished += 1
        self._free_sessions([(s.id, s.epoch)])
        self.sessions.pop(s.id, None)
