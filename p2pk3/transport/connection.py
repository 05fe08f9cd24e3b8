"""Authenticated frame connections over TCP (asyncio; works with the default loop and uvloop): the client
side (`open_connection`) and the connection both sides use. The listening side is p2pk3.transport.server,
the fault hooks for tests p2pk3.transport.faults.
(Over 500 lines as one module: the handshake, the zero-copy send path and the buffered receive protocol all
drive the same Connection state — write readiness, the decoder's limits, close reasons.)

Every connection starts with a mutual challenge-response on the cluster secret (docs/protocol.md, "Handshake"):

    client -> server   hello {node_id, version, nonce(32 B), role: "client"}
    server -> client   hello {node_id, version, nonce(32 B), role: "server"}
    client -> server   auth  {proof: HMAC-SHA256(secret, "client" | nonces | node ids | version)}
    server verifies    (wrong: error{code: auth_failed} + close, logged with the peer address)
    server -> client   auth  {proof: HMAC-SHA256(secret, "server" | ...)}
    client verifies    (wrong: close, logged)

Before authentication the receive limits are tiny (4 KiB headers, no payload) and only `hello`, `auth`
and `error` frames are accepted, so an unauthenticated peer can make us allocate nothing and learns
nothing but our node id and nonce. The data plane is not encrypted: run the ring on a trusted LAN or
inside a VPN (WireGuard).

Receiving uses an `asyncio.BufferedProtocol` around `decoder.FrameDecoder` (payload read straight into
one buffer per frame). Sending writes the prefix+header chunk and the caller's tensor buffers to the
socket with one `os.writev` while the transport has nothing buffered (no copy, no per-chunk work in
the transport); what the kernel does not take at once goes to the transport (`writelines`, zero copy
with uvloop and CPython >= 3.12; on CPython 3.11's selector loop, whose writelines joins them, we keep
`sendmsg`-ing them ourselves). `await send()` returns once every byte is in the kernel, so the caller
may reuse its tensor buffers afterwards; it creates no future unless it has to wait. `forward()` sends
a received frame on as it came in (no re-encoding), for stages passing frames along.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import os
import socket
import sys
import time
from typing import Any, Callable

from .codec import DEFAULT_MAX_PAYLOAD, MAX_HEADER_LEN, Frame, ProtocolError, encode
from .decoder import FrameDecoder
from .faults import PROCESS, Faults
from .messages import error_frame

log = logging.getLogger("p2pk3.transport")

PROTOCOL_VERSION = 1
NONCE_SIZE = 32
HANDSHAKE_MAX_HEADER = 4096
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
DEFAULT_CONNECT_TIMEOUT = 10.0
_AUTH_LABEL = b"p2k3-auth-v1"


class TransportError(Exception):
    """Base class of transport failures."""


class ConnectionClosed(TransportError, ConnectionError):
    """The connection is closed (by us, by the peer, or after an error); `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class AuthenticationError(ProtocolError):
    """The handshake failed: wrong cluster secret, wrong node, or incompatible protocol version."""


class HandshakeTimeout(TransportError, TimeoutError):
    pass


def _proof(
    secret: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes, client_id: str, server_id: str, version: int
) -> bytes:
    msg = bytearray(_AUTH_LABEL + b"\0" + role + b"\0" + client_nonce + server_nonce)
    for s in (client_id, server_id):
        b = s.encode()
        msg += len(b).to_bytes(2, "little") + b
    msg += version.to_bytes(2, "little")
    return hmac.new(secret, bytes(msg), hashlib.sha256).digest()


def check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not 0 < len(node_id) <= 128 or not node_id.isprintable():
        raise ValueError(f"node id must be 1..128 printable characters, got {node_id!r}")
    return node_id


def check_secret(secret: bytes | str) -> bytes:
    s = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not s:
        raise ValueError("the cluster secret is empty")
    return s


def tune_socket(sock: socket.socket | Any) -> None:
    """TCP_NODELAY, keepalive (dead peers noticed in ~20 s), larger buffers. Best effort."""
    opts = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1), (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), val))
    for level, opt, val in opts:
        try:
            sock.setsockopt(level, opt, val)
        except OSError:  # pragma: no cover - platform dependent
            pass


def _iov_max() -> int:
    try:
        return max(16, os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 1024


_IOV_MAX = _iov_max()
_writev = getattr(os, "writev", None)  # (POSIX)


def _skip(chunks: list[Any], n: int) -> list[Any]:
    """`chunks` without their first n bytes (views, no copies)."""
    if not n:
        return chunks
    out = []
    for c in chunks:
        k = len(c)
        if n >= k:
            n -= k
        elif n:
            out.append(memoryview(c)[n:])
            n = 0
        else:
            out.append(c)
    return out


class ConnectionProtocol(asyncio.BufferedProtocol):
    """The asyncio side of a `Connection`: socket events straight into it (reads into its decoder's buffer)."""

    def __init__(self, conn: "Connection"):
        self.conn = conn
        # the hot callbacks, bound straight to their targets (one Python call less per read)
        self.get_buffer = conn._decoder.get_buffer  # type: ignore[method-assign]
        self.buffer_updated = conn._received  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn._made(transport)

    def eof_received(self) -> bool:
        self.conn._eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn._lost(exc)

    def pause_writing(self) -> None:
        self.conn._pause_writing()

    def resume_writing(self) -> None:
        self.conn._resume_writing()


class Connection:
    """One authenticated, framed TCP connection. Create with `open_connection` or receive one from
    `p2pk3.transport.server.serve`.

    `await send(frame)`, `await recv() -> Frame` (single consumer), `close(reason)`, `async for frame in conn`.
    recv raises ProtocolError for a malformed frame (the connection is then closed, with the reason logged)
    and ConnectionClosed once the connection is closed and every frame received before is consumed."""

    def __init__(
        self,
        *,
        node_id: str,
        secret: bytes,
        role: str,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        faults: Faults | None = None,
        alloc: Callable[[int], Any] | None = None,
        checksum: bool = False,
        max_queued: int = 64,
        expect_peer: str | None = None,
    ):
        self.node_id = check_node_id(node_id)
        self._secret_b = check_secret(secret)
        self.role = role
        self.max_payload = max_payload
        self.faults = faults or Faults()
        self.checksum = checksum
        self.expect_peer = expect_peer
        self.peer_id: str | None = None
        self.peer_version: int | None = None
        self.peer_addr: tuple[str, int] | None = None
        self.authenticated = False
        self._decoder = FrameDecoder(max_header=HANDSHAKE_MAX_HEADER, max_payload=0, alloc=alloc)
        self._transport: asyncio.Transport | None = None
        self._queue: collections.deque[Frame] = collections.deque()
        self._max_queued = max_queued
        self._reading_paused = False
        self._waiter: asyncio.Future | None = None
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._send_busy = False  # a send() holds the connection (FIFO hand-over to _send_waiters)
        self._send_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._error: BaseException | None = None
        self._close_reason: str | None = None
        self._loop = asyncio.get_running_loop()
        self._closed = self._loop.create_future()
        self._ready = self._loop.create_future()
        self._raw_sock: socket.socket | None = None
        self._fd = -1  # the socket, for writing to it directly (see _write_now)
        self._writable_waiter: asyncio.Future | None = None
        self.frames_sent = self.frames_received = 0
        self.bytes_sent = 0
        self.created = time.time()

    # ------------------------------------------------------------------ public
    @property
    def closed(self) -> bool:
        return self._close_reason is not None

    @property
    def bytes_received(self) -> int:
        return self._decoder.bytes_received

    def describe(self) -> str:
        addr = f"{self.peer_addr[0]}:{self.peer_addr[1]}" if self.peer_addr else "?"
        return f"node {self.peer_id!r} at {addr}" if self.peer_id else addr

    async def send(self, frame: Frame) -> None:
        """Write one frame; returns when all of it is in the kernel's socket buffer (the caller may then
        reuse its tensor buffers). Concurrent sends are serialised in call order."""
        await self._send(frame, False)

    async def forward(self, frame: Frame) -> None:
        """Send a frame received on some connection on, as it came in: its header bytes as received and
        its payload buffer, without encoding it again (what a stage passing a frame along does). The
        header and buffers must not have been modified since it was received; a frame that was not
        received (no `wire`) is simply sent."""
        await self._send(frame, True)

    async def _send(self, frame: Frame, forward: bool) -> None:
        if not self.authenticated:
            raise TransportError("send() before the handshake completed")
        if self._send_busy or self._send_waiters:
            await self._send_turn()
        else:
            self._send_busy = True
        try:
            await self._send_frame(frame, forward=forward, count=True)
        finally:
            if self._send_waiters:
                self._send_release()
            else:
                self._send_busy = False

    async def _send_turn(self) -> None:
        """Wait until the sends queued before this one are done; on return this send holds the connection."""
        fut = self._loop.create_future()
        self._send_waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._send_release()  # the turn was handed to us as we were cancelled: pass it on
            else:
                try:
                    self._send_waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def _send_release(self) -> None:
        waiters = self._send_waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand over: _send_busy stays set for the next sender
                return
        self._send_busy = False

    async def recv(self) -> Frame:
        q = self._queue
        while not q:
            if self._error is not None:
                raise self._error
            if self._close_reason is not None:
                raise ConnectionClosed(self._close_reason)
            if self._waiter is not None:
                raise RuntimeError("recv() called concurrently on one connection")
            self._waiter = w = self._loop.create_future()
            try:
                await w
            finally:
                self._waiter = None
        f = q.popleft()
        if self._reading_paused and len(q) <= self._max_queued // 2 and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()
        return f

    def __aiter__(self) -> "Connection":
        return self

    async def __anext__(self) -> Frame:
        try:
            return await self.recv()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    def close(self, reason: str = "closed by this node", *, abort: bool = False) -> None:
        if self._close_reason is None:
            self._close_reason = reason
            log.debug("closing connection to %s: %s", self.describe(), reason)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.abort() if abort else self._transport.close()
        elif self._transport is None and not self._closed.done():
            self._closed.set_result(None)
        self._wake()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def on_closed(self, callback: Callable[[], Any]) -> None:
        """Call `callback()` once the connection is closed (soon, if it already is)."""
        self._closed.add_done_callback(lambda _f: callback())

    # ------------------------------------------------------------------ sending
    async def _send_frame(self, frame: Frame, *, forward: bool = False, count: bool) -> None:
        """The one send path, for handshake frames (count=False) and every frame after it: encode, hand
        the chunks to the kernel now, wait only if some of it did not fit. Fault injection (tests) acts on
        the encoded chunks inside this same path."""
        if self._error is not None:
            raise ConnectionClosed(f"connection failed: {self._error}")
        tr = self._transport
        if self._close_reason is not None or tr is None or tr.is_closing():
            raise ConnectionClosed(self._close_reason or "connection is closing")
        chunks = encode(frame, checksum=self.checksum, forward=forward)
        if count and (self.faults.active or PROCESS.active):
            chunks = await self._inject_faults(chunks)
            if chunks is None:  # dropped
                self.frames_sent += 1
                return
        total = sum(map(len, chunks))
        n = self._write_now(chunks)
        if n != total:
            await self._write_rest(chunks, n)
        if count:
            self.frames_sent += 1
        self.bytes_sent += total
        if count and self.faults.closes_at(self.frames_sent):
            self._fail_closed(self.faults.close_reason)

    async def _inject_faults(self, chunks: list[Any]) -> list[Any] | None:
        """Apply `self.faults` (p2pk3.transport.faults; the process-wide `PROCESS` when this connection has none
        on) to the encoded chunks of the next frame: None drops it."""
        f = self.faults if self.faults.active else PROCESS
        idx = self.frames_sent
        if f.closes_at(idx):
            self._fail_closed(f.close_reason)
            raise ConnectionClosed(self._close_reason)
        delay = f.delay()
        if delay is not None:
            await asyncio.sleep(delay)
            if self._close_reason is not None or self._transport.is_closing():
                raise ConnectionClosed(self._close_reason or "connection is closing")
        if f.drops(idx):
            return None
        return f.corrupt(idx, chunks)

    def _write_now(self, chunks: list[Any]) -> int:
        """Write as much of `chunks` as the kernel takes now, straight to the socket with one writev (no
        copy, none of the transport's per-chunk work) while the transport has nothing buffered; returns
        the number of bytes written (0 where this is not possible: the transport then gets them all)."""
        fd = self._fd
        if fd < 0 or len(chunks) > _IOV_MAX or self._transport.get_write_buffer_size():
            return 0
        try:
            return _writev(fd, chunks)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            self._fail_closed(f"send failed: {e}")
            raise ConnectionClosed(self._close_reason) from None

    async def _write_rest(self, chunks: list[Any], n: int) -> None:
        """Write what is left of `chunks` after the first `n` bytes, returning once the kernel has it all."""
        rest = _skip(chunks, n)
        if self._raw_sock is None:
            self._transport.writelines(rest)
            if self._write_paused or self._close_reason is not None:
                await self._drain()
            return
        # CPython < 3.12 selector transport: its writelines() joins (copies) the chunks and its buffer
        # copies again. Write them ourselves with sendmsg (zero copy) while the transport's own buffer
        # stays empty, waiting for writability on the socket when the kernel buffer is full.
        sock, loop = self._raw_sock, self._loop
        views = collections.deque(v for v in (memoryview(c).cast("B") for c in rest) if v.nbytes)
        while views:
            if self._close_reason is not None:
                raise ConnectionClosed(self._close_reason)
            fut = loop.create_future()
            self._writable_waiter = fut
            loop._add_writer(sock.fileno(), _set_done, fut)  # type: ignore[attr-defined]
            try:
                await fut
            finally:
                self._writable_waiter = None
                if sock.fileno() >= 0:
                    loop._remove_writer(sock.fileno())  # type: ignore[attr-defined]
            if self._close_reason is not None:
                raise ConnectionClosed(self._close_reason)
            batch = [views[i] for i in range(min(len(views), _IOV_MAX))]
            try:
                n = sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._fail_closed(f"send failed: {e}")
                raise ConnectionClosed(self._close_reason) from None
            while n:
                if n >= views[0].nbytes:
                    n -= views.popleft().nbytes
                else:
                    views[0] = views[0][n:]
                    n = 0

    async def _drain(self) -> None:
        if self._transport is None:
            return
        while self._write_paused and self._close_reason is None:
            fut = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            await fut
        if self._close_reason is not None and self._error is None and self._transport.get_write_buffer_size():
            raise ConnectionClosed(self._close_reason)

    def _pause_writing(self) -> None:
        self._write_paused = True

    def _resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()

    # ------------------------------------------------------------------ protocol callbacks
    def _made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if not self._ready.done():
            self._ready.set_result(None)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock)
            if _writev is not None:
                try:
                    self._fd = sock.fileno()
                except (AttributeError, OSError):  # pragma: no cover
                    self._fd = -1
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer_addr = (peer[0], peer[1])
        # high = low = 0: the protocol is paused whenever anything is buffered, so _drain() waits until
        # the transport has handed every byte (and thus every caller buffer) to the kernel.
        transport.set_write_buffer_limits(high=0, low=0)  # type: ignore[attr-defined]
        if sys.version_info < (3, 12) and type(transport).__name__ == "_SelectorSocketTransport":
            raw = getattr(transport, "_sock", None)
            if isinstance(raw, socket.socket) and hasattr(raw, "sendmsg"):
                self._raw_sock = raw

    def _received(self, nbytes: int) -> None:
        try:
            frames = self._decoder.buffer_updated(nbytes)
        except ProtocolError as e:
            for f in e.frames:
                self.frames_received += 1
                self._queue.append(f)
            self._protocol_error(e)
            return
        if frames:
            self.frames_received += len(frames)
            self._queue.extend(frames)
            if len(self._queue) >= self._max_queued and not self._reading_paused and self._transport is not None:
                self._reading_paused = True
                self._transport.pause_reading()
            w = self._waiter
            if w is not None and not w.done():
                w.set_result(None)

    def _protocol_error(self, e: ProtocolError) -> None:
        if self._error is None and self._close_reason is None:
            log.warning("closing connection to %s: protocol error: %s", self.describe(), e)
            self._error = e
            self._close_reason = f"protocol error: {e}"
        if self._transport is not None:
            self._transport.abort()
        self._wake()

    def _fail_closed(self, reason: str) -> None:
        if self._close_reason is None:
            self._close_reason = reason
            log.info("aborting connection to %s: %s", self.describe(), reason)
        if self._transport is not None:
            self._transport.abort()
        self._wake()

    def _eof(self) -> None:
        if self._close_reason is None:
            self._close_reason = f"closed by the peer ({self.describe()})"

    def _lost(self, exc: Exception | None) -> None:
        if self._close_reason is None:
            self._close_reason = f"connection lost: {exc}" if exc else f"closed by the peer ({self.describe()})"
        self._write_paused = False
        self._wake_drain()
        w = self._writable_waiter
        if w is not None:
            if self._raw_sock is not None and self._raw_sock.fileno() >= 0:
                asyncio.get_running_loop()._remove_writer(self._raw_sock.fileno())  # type: ignore[attr-defined]
            if not w.done():
                w.set_result(None)
        self._wake()
        if not self._closed.done():
            self._closed.set_result(None)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ------------------------------------------------------------------ handshake
    async def _recv_handshake(self, expect: str) -> Frame:
        f = await self.recv()
        if f.kind == "error":
            code, msg = f.header.get("code"), f.header.get("message")
            raise AuthenticationError(f"{self.describe()} refused the connection: {msg} [{code}]")
        if f.kind != expect:
            raise ProtocolError(f"unexpected frame kind {f.kind!r} during the handshake (expected {expect!r})")
        if f.buffers:
            raise ProtocolError("handshake frames carry no tensors")
        return f

    async def _handshake(self) -> None:
        await self._ready
        nonce = os.urandom(NONCE_SIZE)
        hello = Frame.make(
            "hello", node_id=self.node_id, version=PROTOCOL_VERSION, nonce=nonce, role=self.role, software="p2pk3"
        )
        await self._send_frame(hello, count=False)
        peer = await self._recv_handshake("hello")
        h = peer.header
        pid, pver, pnonce, prole = h.get("node_id"), h.get("version"), h.get("nonce"), h.get("role")
        if (
            not isinstance(pid, str)
            or not 0 < len(pid) <= 128
            or not isinstance(pnonce, bytes)
            or len(pnonce) != NONCE_SIZE
            or not isinstance(pver, int)
        ):
            raise ProtocolError("malformed hello frame")
        want_role = "server" if self.role == "client" else "client"
        if prole != want_role:
            raise ProtocolError(f"peer says it is a {prole!r}, expected a {want_role!r}")
        self.peer_id, self.peer_version = pid, pver
        if pver != PROTOCOL_VERSION:
            msg = f"protocol version mismatch: this node speaks {PROTOCOL_VERSION}, {self.describe()} speaks {pver}"
            await self._try_send(error_frame("version_mismatch", msg))
            raise AuthenticationError(msg)
        if self.expect_peer is not None and pid != self.expect_peer:
            raise AuthenticationError(f"expected node {self.expect_peer!r} at {self.describe()}, found node {pid!r}")
        cn, sn = (nonce, pnonce) if self.role == "client" else (pnonce, nonce)
        cid, sid = (self.node_id, pid) if self.role == "client" else (pid, self.node_id)
        mine = _proof(self._secret_b, self.role.encode(), cn, sn, cid, sid, PROTOCOL_VERSION)
        theirs = _proof(self._secret_b, want_role.encode(), cn, sn, cid, sid, PROTOCOL_VERSION)
        addr = f"{self.peer_addr[0]}:{self.peer_addr[1]}" if self.peer_addr else "?"
        if self.role == "client":
            await self._send_frame(Frame.make("auth", proof=mine), count=False)
            a = await self._recv_handshake("auth")
            if not hmac.compare_digest(_as_bytes(a.header.get("proof")), theirs):
                raise AuthenticationError(
                    f"authentication failed: server {addr} (node {pid!r}) could not prove "
                    f"the cluster secret (wrong cluster secret)"
                )
        else:
            a = await self._recv_handshake("auth")
            if not hmac.compare_digest(_as_bytes(a.header.get("proof")), theirs):
                await self._try_send(error_frame("auth_failed", "authentication failed: wrong cluster secret"))
                raise AuthenticationError(f"authentication failed: wrong cluster secret from {addr} (node {pid!r})")
            await self._send_frame(Frame.make("auth", proof=mine), count=False)
        self.authenticated = True
        self._decoder.max_header = MAX_HEADER_LEN
        self._decoder.max_payload = self.max_payload

    async def _try_send(self, frame: Frame) -> None:
        try:
            await asyncio.wait_for(self._send_frame(frame, count=False), 1.0)
        except Exception:
            pass


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _as_bytes(v: Any) -> bytes:
    return v if isinstance(v, bytes) else b""


async def run_handshake(conn: Connection, timeout: float) -> None:
    """Run `conn`'s handshake within `timeout` s; on failure the connection is closed (and the failure
    logged) and HandshakeTimeout, AuthenticationError, ProtocolError or ConnectionClosed is raised."""
    try:
        await asyncio.wait_for(conn._handshake(), timeout)
    except asyncio.TimeoutError:
        reason = f"handshake timeout after {timeout:g} s with {conn.describe()}"
        log.warning("%s", reason)
        conn.close(reason, abort=True)
        raise HandshakeTimeout(reason) from None
    except AuthenticationError as e:
        log.warning("%s", e)
        conn.close(str(e))
        await settle(conn)
        raise
    except ProtocolError as e:
        if e is not conn._error:  # errors from the decoder are logged where they happen
            log.warning("handshake with %s failed: %s", conn.describe(), e)
        conn.close(f"handshake failed: {e}", abort=True)
        raise
    except ConnectionClosed as e:
        log.info("handshake with %s failed: %s", conn.describe(), e.reason)
        raise


async def settle(conn: Connection, timeout: float = 1.0) -> None:
    """Wait up to `timeout` s for `conn` to finish closing, then abort its transport."""
    try:
        await asyncio.wait_for(conn.wait_closed(), timeout)
    except asyncio.TimeoutError:
        if conn._transport is not None:
            conn._transport.abort()


async def open_connection(
    host: str,
    port: int,
    secret: bytes | str,
    node_id: str,
    *,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    faults: Faults | None = None,
    alloc: Callable[[int], Any] | None = None,
    checksum: bool = False,
    expect_peer: str | None = None,
    local_addr: tuple[str, int] | None = None,
    max_queued: int = 64,
) -> Connection:
    """Connect, authenticate (mutually) and return the Connection. Raises OSError / asyncio.TimeoutError
    when the TCP connect fails, AuthenticationError when the handshake does, HandshakeTimeout."""
    loop = asyncio.get_running_loop()
    conn = Connection(
        node_id=node_id,
        secret=secret,
        role="client",
        max_payload=max_payload,
        faults=faults,
        alloc=alloc,
        checksum=checksum,
        expect_peer=expect_peer,
        max_queued=max_queued,
    )
    await asyncio.wait_for(
        loop.create_connection(lambda: ConnectionProtocol(conn), host, port, local_addr=local_addr), timeout
    )
    await run_handshake(conn, handshake_timeout)
    return conn


__all__ = [
    "PROTOCOL_VERSION",
    "TransportError",
    "ConnectionClosed",
    "AuthenticationError",
    "HandshakeTimeout",
    "ProtocolError",
    "Connection",
    "ConnectionProtocol",
    "open_connection",
    "run_handshake",
    "settle",
    "tune_socket",
    "check_secret",
    "check_node_id",
]
