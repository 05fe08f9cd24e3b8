"""The entry role: owns sessions (token history, sampling parameters), schedules them into the ring with
continuous batching, and streams tokens out.

Each round takes every session that has nothing in flight: running decodes contribute one token each,
new prompts contribute a prefill chunk (at most `prefill_chunk` tokens per session, `max_batch_tokens`
per batch), so a long prompt never stalls the decodes of the others. A session has at most one unit in
flight; many sessions keep the pipeline of stages full. The whole token history stays here, so a session
can be replayed into a restarted stage (future work: hot spares).
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import torch

from p2pk3.engine.sampling import SamplingParams, fresh_seed
from p2pk3.transport.frames import Segment

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
    sent: int = 0
    inflight: bool = False
    done: bool = False
    error: str | None = None
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
                "decode_tokens_per_s": (n - 1) / decode if decode else None}


class Entry:
    def __init__(self, submit_work, free_sessions, *, prefill_chunk: int = 256, max_batch_tokens: int = 2048,
                 max_sessions: int = 64):
        self._submit_work = submit_work  # callable(Work) -> None (first stage queue)
        self._free_sessions = free_sessions  # callable(list[(session, epoch)]) -> None (free along the ring)
        self.prefill_chunk, self.max_batch_tokens, self.max_sessions = prefill_chunk, max_batch_tokens, max_sessions
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self.node_tag = f"{time.time_ns() % 10**9:x}"

    # ------------------------------------------------------------------ public
    def submit(self, prompt: list[int], params: SamplingParams, *, want_logits: bool = False,
               incremental: bool = False) -> Session:
        live = sum(1 for s in self.sessions.values() if not s.done)
        if live >= self.max_sessions:
            raise Busy(f"busy: {live} sessions in flight (max {self.max_sessions}); retry later")
        if not prompt:
            raise ValueError("empty prompt")
        if params.temperature > 0 and params.seed is None:
            params = SamplingParams(**{**params.__dict__, "seed": fresh_seed()})
        sid = f"s{self.node_tag}-{next(self._ids)}"
        s = Session(sid, 0, list(prompt), len(prompt), params, want_logits, incremental)
        self.sessions[sid] = s
        self.kick()
        return s

    def cancel(self, sid: str, reason: str = "cancelled") -> None:
        s = self.sessions.get(sid)
        if s and not s.done:
            self._finish(s, error=reason)

    # ------------------------------------------------------------------ scheduling
    def kick(self) -> None:
        segs, ids, budget = [], [], self.max_batch_tokens
        # decodes first (1 token each), then prefill chunks
        ready = [s for s in self.sessions.values() if not s.done and not s.inflight and s.sent < len(s.tokens)]
        ready.sort(key=lambda s: (s.sent < s.prompt_len, s.t_submit))
        for s in ready:
            n = min(len(s.tokens) - s.sent, self.prefill_chunk, budget)
            if s.incremental:
                n = 1
            if n <= 0:
                break
            last = s.sent + n == len(s.tokens)
            if s.want_logits:
                sample = {"want": "logits"}
            elif last:
                p = s.params
                sample = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "seed": p.seed or 0}
            else:
                sample = None
            segs.append(Segment(s.id, s.epoch, s.sent, n, sample))
            ids.extend(s.tokens[s.sent:s.sent + n])
            s.sent += n
            s.inflight = True
            budget -= n
        if segs:
            self._submit_work(Work(segs, tokens=torch.tensor(ids, dtype=torch.long)))

    def on_results(self, results: list[dict], logits: torch.Tensor | None) -> None:
        row = 0
        for r in results:
            s = self.sessions.get(str(r["session"]))
            n = int(r.get("rows", 0))
            if s is None or s.done:
                row += n
                continue
            s.inflight = False
            if r.get("error"):
                self._finish(s, error=str(r["error"]))
                continue
            if s.want_logits:
                s.logits.append(logits[row:row + n].clone())
                row += n
                if s.sent >= len(s.tokens):
                    self._finish(s)
                continue
            if r.get("skip"):
                continue
            tok = int(r["token"])
            if s.t_first is None:
                s.t_first = time.perf_counter()
            s.tokens.append(tok)
            s.out.put_nowait(tok)
            if tok in s.params.stop_ids or len(s.generated) >= s.params.max_tokens:
                self._finish(s)
        self.kick()

    def fail_all(self, reason: str) -> None:
        for s in list(self.sessions.values()):
            if not s.done:
                self._finish(s, error=reason)

    def _finish(self, s: Session, error: str | None = None) -> None:
        s.done, s.error, s.inflight = True, error, False
        s.t_done = time.perf_counter()
        s.out.put_nowait(None)
        self._free_sessions([(s.id, s.epoch)])
        self.sessions.pop(s.id, None)
