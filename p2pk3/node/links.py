"""`PeerLink`: a lazily dialled, authenticated connection to whichever node serves a slot now.

Used for the ring successor and for the direct link to the entry (error reports skip the ring). Every
wait has a deadline: dialling retries with back-off until `dial_deadline_s`, a frame the peer does not
take within `send_timeout_s` drops the connection (a hung peer), and then `LinkDown` is raised. Frames
the peer sends back on the link (only errors, on the ring) go to `on_frame`, read by a task the link
keeps and cancels with the connection."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.connection import ConnectionClosed, TransportError, open_connection
from p2pk3.transport.messages import parse_error

log = logging.getLogger("p2pk3.node")

DIAL_ERRORS = (OSError, asyncio.TimeoutError, TransportError, ConnectionError, ProtocolError)


class LinkDown(ConnectionError):
    """The peer could not be reached (or did not take a frame) within the deadline."""


class PeerLink:
    def __init__(
        self,
        name: str,
        resolve: Callable[[], tuple[str, int]],
        secret: bytes,
        node_id: str,
        *,
        dial_deadline_s: float = 10.0,
        send_timeout_s: float = 10.0,
        connect_timeout_s: float = 2.0,
        on_frame: Callable[[Frame], None] | None = None,
    ):
        self.name = name
        self.resolve = resolve
        self.secret, self.node_id = secret, node_id
        self.dial_deadline_s, self.send_timeout_s = dial_deadline_s, send_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.on_frame = on_frame
        self._conn = None
        self._reader: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.frames_sent = 0

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    async def send(self, frame: Frame, *, as_received: bool = False, deadline_s: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.dial_deadline_s if deadline_s is None else deadline_s)
        async with self._lock:
            backoff = 0.05
            while True:
                conn = self._conn
                if conn is None or conn.closed:
                    try:
                        conn = await self._dial()
                    except DIAL_ERRORS as e:
                        if loop.time() >= deadline:
                            raise LinkDown(f"{self.name} unreachable: {e}") from None
                        log.debug("%s not reachable yet (%s); retrying", self.name, e)
                        await asyncio.sleep(min(backoff, max(0.0, deadline - loop.time())))
                        backoff = min(backoff * 2, 0.5)
                        continue
                try:
                    send = conn.forward(frame) if as_received else conn.send(frame)
                    await asyncio.wait_for(send, self.send_timeout_s)
                    self.frames_sent += 1
                    return
                except asyncio.TimeoutError:
                    self.reset(f"{self.name} took no frame for {self.send_timeout_s:.1f} s")
                    raise LinkDown(f"{self.name} is not taking frames (hung?)") from None
                except (ConnectionClosed, TransportError, OSError) as e:
                    log.warning("lost the connection to %s: %s", self.name, e)
                    self.reset(str(e))
                    if loop.time() >= deadline:
                        raise LinkDown(f"{self.name}: {e}") from None

    async def _dial(self):
        host, port = self.resolve()
        t = self.connect_timeout_s
        conn = await open_connection(host, port, self.secret, self.node_id, timeout=t, handshake_timeout=t)
        self._conn = conn
        self._reader = asyncio.create_task(self._read(conn), name=f"link-{self.name}")
        return conn

    async def _read(self, conn) -> None:
        try:
            async for f in conn:
                if self.on_frame is not None:
                    self.on_frame(f)
                elif f.kind == "error":
                    e = parse_error(f)
                    log.warning("%s reported: %s: %s", self.name, e.code, e.message)
        except (ProtocolError, TransportError, ConnectionError):
            pass

    def reset(self, reason: str = "route changed") -> None:
        """Drop the connection; the next send dials whoever serves the slot then."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close(reason, abort=True)
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None

    def close(self) -> None:
        self.reset("shutting down")
