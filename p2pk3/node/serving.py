"""Serving clients at the entry: `generate` requests stream `token` frames then `done` (or `error`);
`cancel` stops a running request; a client that goes away cancels its requests. Each request runs as
its own task, so the connection keeps being read while tokens stream (a `cancel` or a disconnect is
seen at once) and one connection may carry several requests. A request first passes admission
(admission.py): it may wait in the entry's queue, and leaves it when cancelled or its client goes away."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import torch

from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.connection import ConnectionClosed, TransportError
from p2pk3.transport.messages import ErrorCode, GenerateRequest, done_frame, error_frame, parse_cancel, token_frame

from .admission import Admission, QueueFull, QueueTimeout
from .entry import Busy, Entry
from .stage_runner import wire_tensor

log = logging.getLogger("p2pk3.node")

MAX_REQUESTS_PER_CONNECTION = 64


class ClientRequests:
    """The requests of one client connection."""

    def __init__(self, conn):
        self.conn = conn
        self.tasks: dict[int, asyncio.Task] = {}
        self.sessions: dict[int, str] = {}
        self.cancelled: set[int] = set()  # requests cancelled by a `cancel` frame while queued

    def close(self, entry: Entry | None) -> None:
        for rid, t in list(self.tasks.items()):
            t.cancel()
            if entry is not None and rid in self.sessions:
                entry.cancel(self.sessions[rid], "client went away")


class ClientService:
    def __init__(
        self,
        entry: Entry,
        vocab_size: int,
        *,
        health: Callable[[], tuple[str, str] | None],
        stage_stats: Callable[[], dict],
        admission: Admission | None = None,
    ):
        self.entry, self.vocab_size = entry, vocab_size
        self.admission = admission or Admission(entry)
        self.health = health  # () -> None when the ring can serve, else (ErrorCode, reason)
        self.stage_stats = stage_stats

    async def generate(self, conn, f: Frame, reqs: ClientRequests) -> None:
        try:
            req = GenerateRequest.parse(f, self.vocab_size)
        except ValueError as e:
            await conn.send(error_frame(ErrorCode.BAD_REQUEST, str(e), request_id=f.header.get("request_id")))
            return
        if req.request_id in reqs.tasks or len(reqs.tasks) >= MAX_REQUESTS_PER_CONNECTION:
            raise ProtocolError(f"request id {req.request_id} is in use or too many requests on one connection")
        bad = self.health()
        if bad is not None:
            await conn.send(error_frame(bad[0], bad[1], request_id=req.request_id))
            return
        reqs.tasks[req.request_id] = asyncio.create_task(self._serve(conn, req, reqs))

    async def _serve(self, conn, req: GenerateRequest, reqs: ClientRequests) -> None:
        """Admission (the request may wait in the queue), then the stream."""
        rid = req.request_id

        def submit():
            return self.entry.submit(
                req.prompt, req.params, want_logits=req.logits, incremental=req.incremental, generated=req.generated
            )

        try:
            s = await self.admission.admit(submit, max_queue=req.max_queue, timeout_s=req.queue_timeout)
        except QueueFull as e:
            code = ErrorCode.QUEUE_TIMEOUT if isinstance(e, QueueTimeout) else ErrorCode.BUSY
            await self._refuse(conn, rid, reqs, code, str(e), retry_after=e.retry_after)
            return
        except Busy as e:
            await self._refuse(conn, rid, reqs, ErrorCode.BUSY, str(e), retry_after=1)
            return
        except (ValueError, TypeError) as e:
            await self._refuse(conn, rid, reqs, ErrorCode.BAD_REQUEST, str(e))
            return
        except asyncio.CancelledError:
            if rid in reqs.cancelled:  # a `cancel` while queued: say so, as for a running request
                await self._refuse(conn, rid, reqs, ErrorCode.CANCELLED, "cancelled by the client while queued")
                return
            reqs.tasks.pop(rid, None)
            raise
        reqs.sessions[rid] = s.id
        await self._stream(conn, rid, s, reqs)

    async def _refuse(self, conn, rid: int, reqs: ClientRequests, code: str, message: str, **ctx) -> None:
        reqs.tasks.pop(rid, None)
        reqs.cancelled.discard(rid)
        try:
            await conn.send(error_frame(code, message, request_id=rid, **ctx))
        except (ConnectionClosed, TransportError, ConnectionError):
            pass

    def cancel(self, f: Frame, reqs: ClientRequests) -> None:
        rid = parse_cancel(f)
        sid = reqs.sessions.get(rid)
        if sid is not None:
            self.entry.cancel(sid, "cancelled by the client")
        elif rid in reqs.tasks:  # still queued: it leaves the queue
            reqs.cancelled.add(rid)
            reqs.tasks[rid].cancel()

    async def _stream(self, conn, rid: int, s, reqs: ClientRequests) -> None:
        try:
            n = 0
            while True:
                tok = await s.out.get()
                if tok is None:
                    break
                lp = s.logprobs[n] if n < len(s.logprobs) else None  # aligned with the generated tokens
                n += 1
                await conn.send(token_frame(rid, s.id, tok, lp))
            if s.error:
                await conn.send(error_frame(s.error_code or ErrorCode.FAILED, s.error, request_id=rid, session=s.id))
                return
            logits = wire_tensor(torch.cat(s.logits)) if s.want_logits and s.logits else None
            plp = s.prompt_lps if s.params.prompt_logprobs is not None else None
            if plp is not None and any(e is None for e in plp):
                await conn.send(
                    error_frame(ErrorCode.FAILED, "the ring did not score every prompt token", request_id=rid)
                )
                return
            await conn.send(done_frame(rid, s.id, s.generated, s.stats(), self.stage_stats(), logits, plp))
        except (ConnectionClosed, TransportError, ConnectionError):
            self.entry.cancel(s.id, "client went away")
        finally:
            reqs.tasks.pop(rid, None)
            reqs.sessions.pop(rid, None)
