"""The listening side of authenticated connections: `serve` binds a socket and returns the started `Server`;
each accepted connection runs the handshake (p2pk3.transport.connection), then the caller's handler, and
is closed when the handler returns. Bad peers are logged, counted (`auth_failures`) and dropped; the server
keeps serving."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Awaitable, Callable

from .codec import DEFAULT_MAX_PAYLOAD, ProtocolError
from .connection import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    AuthenticationError,
    Connection,
    ConnectionClosed,
    ConnectionProtocol,
    TransportError,
    check_node_id,
    check_secret,
    run_handshake,
    settle,
)
from .faults import Faults

log = logging.getLogger("p2pk3.transport")


Handler = Callable[[Connection], Awaitable[None]]


class Server:
    """A listening socket; each accepted connection is authenticated, then passed to `handler(conn)`
    (closed when the handler returns). Bad peers are logged and dropped; the server keeps serving."""

    def __init__(self, secret: bytes, node_id: str, handler: Handler, **conn_kw: Any):
        self._secret = check_secret(secret)
        self.node_id = check_node_id(node_id)
        self.handler = handler
        self.conn_kw = conn_kw
        self.handshake_timeout = conn_kw.pop("handshake_timeout", DEFAULT_HANDSHAKE_TIMEOUT)
        self.connections: set[Connection] = set()  # authenticated, in their handler
        self._all: set[Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None
        self.auth_failures = 0

    def _factory(self) -> ConnectionProtocol:
        conn = Connection(node_id=self.node_id, secret=self._secret, role="server", **self.conn_kw)
        self._all.add(conn)
        conn.on_closed(lambda: self._all.discard(conn))
        proto = ConnectionProtocol(conn)
        t = asyncio.get_running_loop().create_task(self._serve_one(conn))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return proto

    async def _serve_one(self, conn: Connection) -> None:
        try:
            await run_handshake(conn, self.handshake_timeout)
        except (ProtocolError, TransportError) as e:
            if isinstance(e, AuthenticationError):
                self.auth_failures += 1
            return
        except Exception:  # pragma: no cover
            log.exception("handshake with %s crashed", conn.describe())
            conn.close("internal error", abort=True)
            return
        self.connections.add(conn)
        try:
            await self.handler(conn)
        except ConnectionClosed as e:
            log.info("connection to %s closed: %s", conn.describe(), e.reason)
        except ProtocolError as e:
            log.info("dropped %s: %s", conn.describe(), e)
        except asyncio.CancelledError:
            conn.close("server shutting down")
            raise
        except Exception:
            log.exception("handler failed on the connection to %s", conn.describe())
        finally:
            self.connections.discard(conn)
            conn.close("handler finished")

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._server.sockets) if self._server else []

    @property
    def port(self) -> int:
        return self.sockets[0].getsockname()[1]

    @property
    def host(self) -> str:
        return self.sockets[0].getsockname()[0]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.close("server shutting down")
        for t in list(self._tasks):
            t.cancel()

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in list(self._all):
            c.close("server shutting down")
            await settle(c)

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def __aenter__(self) -> "Server":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
        await self.wait_closed()


async def serve(
    host: str,
    port: int,
    secret: bytes | str,
    node_id: str,
    handler: Handler,
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    faults: Faults | None = None,
    alloc: Callable[[int], Any] | None = None,
    checksum: bool = False,
    reuse_port: bool | None = None,
    backlog: int = 128,
    max_queued: int = 64,
) -> Server:
    """Listen on host:port (port 0: any free port, see `server.port`) and return the started Server."""
    srv = Server(
        check_secret(secret),
        node_id,
        handler,
        max_payload=max_payload,
        handshake_timeout=handshake_timeout,
        faults=faults,
        alloc=alloc,
        checksum=checksum,
        max_queued=max_queued,
    )
    loop = asyncio.get_running_loop()
    srv._server = await loop.create_server(srv._factory, host, port, reuse_port=reuse_port, backlog=backlog)
    return srv


__all__ = ["Handler", "Server", "serve"]
