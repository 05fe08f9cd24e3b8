"""Serving clients at the entry: `generate` requests stream `token` frames then `done` (or `error`);
`cancel` stops a running request; a client that goes away cancels its requests. Each request runs as
its own task, so the connection keeps being read while tokens stream (a `cancel` or a disconnect is
seen at once) and one connection may carry several requests."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import torch

from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.connection import ConnectionClosed, TransportError
from p2pk3.transport.messages import ErrorCode, GenerateRequest, done_frame, error_frame, parse_cancel, token_frame

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
    ):
        self.entry, self.vocab_size = entry, vocab_size
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
        try:
            s = self.entry.submit(
                req.prompt, req.params, want_logits=req.logits, incremental=req.incremental, generated=req.generated
            )
        except Busy as e:
            await conn.send(error_frame(ErrorCode.BUSY, str(e), request_id=req.request_id))
            return
        except (ValueError, TypeError) as e:
            await conn.send(error_frame(ErrorCode.BAD_REQUEST, str(e), request_id=req.request_id))
            return
        reqs.sessions[req.request_id] = s.id
        reqs.tasks[req.request_id] = asyncio.create_task(self._stream(conn, req.request_id, s, reqs))

    def cancel(self, f: Frame, reqs: ClientRequests) -> None:
        rid = parse_cancel(f)
        sid = reqs.sessions.get(rid)
        if sid is not None:
            self.entry.cancel(sid, "cancelled by the client")

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
