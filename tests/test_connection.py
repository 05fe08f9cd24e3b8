"""Authenticated connections: handshake, wrong secrets, malformed frames, limits, fault hooks."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from p2pk3.transport import codec as F
from p2pk3.transport.connection import (
    AuthenticationError,
    ConnectionClosed,
    HandshakeTimeout,
    ProtocolError,
    open_connection,
)
from p2pk3.transport.faults import Faults
from p2pk3.transport.server import serve
from p2pk3.transport.codec import Frame
from p2pk3.transport.decoder import FrameDecoder
from conftest import run as _run  # the one deadline-guarded runner

SECRET = b"k" * 32
LOG = "p2pk3.transport"

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

LOOPS = ["asyncio"] + (["uvloop"] if uvloop is not None else [])


def run(coro, loop: str = "asyncio"):
    return _run(coro, 20.0, loop)


async def echo(conn):
    async for f in conn:
        await conn.send(f)


@pytest.mark.parametrize("loop", LOOPS)
def test_handshake_and_round_trip(loop):
    async def main():
        seen = {}

        async def handler(conn):
            seen["peer"], seen["ver"] = conn.peer_id, conn.peer_version
            await echo(conn)

        async with await serve("127.0.0.1", 0, SECRET, "server-a", handler) as srv:
            c = await open_connection("127.0.0.1", srv.port, SECRET, "client-b")
            assert c.authenticated and c.peer_id == "server-a" and c.peer_version == 1
            a = np.arange(12, dtype=np.float32).reshape(3, 4)
            ids = np.arange(5, dtype=np.int64)
            raw = bytearray(range(16))
            await c.send(Frame.make("t", {"a": a, "ids": ids, "h": ("bfloat16", (2, 4), raw)}, n=1))
            g = await c.recv()
            assert seen == {"peer": "client-b", "ver": 1}
            assert g.header["n"] == 1
            np.testing.assert_array_equal(g.array("a"), a)
            np.testing.assert_array_equal(g.array("ids"), ids)
            assert bytes(g.buffer("h")) == bytes(raw)
            # a frame larger than the socket buffers (partial writes); the buffer is reusable after send()
            big = np.arange(6 << 20, dtype=np.int32)
            want = big.copy()
            send = asyncio.ensure_future(c.send(Frame.make("big", {"x": big})))
            got = await c.recv()
            await send
            big[:] = 0
            np.testing.assert_array_equal(got.array("x"), want)
            c.close("done")
            await c.wait_closed()
            with pytest.raises(ConnectionClosed):
                await c.recv()

    run(main(), loop)


def test_wrong_secret_is_refused_and_server_keeps_serving(caplog):
    async def main():
        handled = []

        async def handler(conn):
            handled.append(conn.peer_id)
            await echo(conn)

        async with await serve("127.0.0.1", 0, SECRET, "srv", handler) as srv:
            with pytest.raises(AuthenticationError, match="refused the connection: authentication failed"):
                await open_connection("127.0.0.1", srv.port, b"wrong" * 8, "intruder")
            assert srv.auth_failures == 1 and handled == []
            good = await open_connection("127.0.0.1", srv.port, SECRET, "good")
            await good.send(Frame.make("ping", id=1))
            assert (await good.recv()).header["id"] == 1
            assert handled == ["good"]
            good.close()

    with caplog.at_level(logging.INFO, logger=LOG):
        run(main())
    msgs = [r.getMessage() for r in caplog.records]
    assert any(
        "authentication failed: wrong cluster secret from 127.0.0.1:" in m and "'intruder'" in m for m in msgs
    ), msgs


def test_client_rejects_server_that_cannot_prove_the_secret(caplog):
    """A fake server that accepts anything: the client must notice it does not know the secret."""

    async def main():
        async def fake(reader, writer):
            dec = FrameDecoder(max_payload=0)
            writer.write(
                F.encode_bytes(Frame.make("hello", node_id="impostor", version=1, nonce=b"n" * 32, role="server"))
            )
            got = []
            while len(got) < 2:
                data = await reader.read(4096)
                if not data:
                    return
                got += dec.feed(data)
            assert [g.kind for g in got] == ["hello", "auth"]
            writer.write(F.encode_bytes(Frame.make("auth", proof=b"\0" * 32)))
            await writer.drain()
            rest = await reader.read(4096)  # the client must close without sending anything else
            assert rest == b""
            writer.close()

        srv = await asyncio.start_server(fake, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        with pytest.raises(AuthenticationError, match="could not prove the cluster secret"):
            await open_connection("127.0.0.1", port, SECRET, "victim")
        srv.close()
        await srv.wait_closed()

    with caplog.at_level(logging.INFO, logger=LOG):
        run(main())
    assert any("server 127.0.0.1:" in r.getMessage() and "could not prove" in r.getMessage() for r in caplog.records)


async def _raw_exchange(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    got = b""
    try:
        while True:
            chunk = await asyncio.wait_for(r.read(65536), timeout)
            if not chunk:
                break
            got += chunk
    except (ConnectionResetError, asyncio.TimeoutError):
        pass
    w.close()
    try:
        await w.wait_closed()
    except ConnectionError:
        pass
    return got


def test_unauthenticated_garbage_and_oversized_hello(caplog):
    async def main():
        async with await serve("127.0.0.1", 0, SECRET, "srv", echo) as srv:
            # an HTTP client: bad magic, dropped; it receives only our hello
            got = await _raw_exchange(srv.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            kinds = [f.kind for f in FrameDecoder().feed(got)]
            assert kinds == ["hello"]
            # before authentication, no payload at all is accepted (no allocation for strangers)
            hb = F.pack_header({"kind": "hello"})
            got = await _raw_exchange(srv.port, F.PREFIX.pack(F.MAGIC, F.VERSION, 0, len(hb), 1 << 30) + hb)
            assert [f.kind for f in FrameDecoder().feed(got)] == ["hello"]
            # a non-handshake frame before auth
            got = await _raw_exchange(srv.port, F.encode_bytes(Frame.make("forward", x=1)))
            assert [f.kind for f in FrameDecoder().feed(got)] == ["hello"]
            c = await open_connection("127.0.0.1", srv.port, SECRET, "good")
            await c.send(Frame.make("ping"))
            assert (await c.recv()).kind == "ping"
            c.close()

    with caplog.at_level(logging.INFO, logger=LOG):
        run(main())
    msgs = "\n".join(r.getMessage() for r in caplog.records)
    assert "protocol error: bad magic b'GET '" in msgs
    assert "frame payload of 1073741824 bytes exceeds the limit of 0 bytes" in msgs
    assert "unexpected frame kind 'forward' during the handshake" in msgs


def test_handshake_timeout(caplog):
    async def main():
        async with await serve("127.0.0.1", 0, SECRET, "srv", echo, handshake_timeout=0.3) as srv:
            t = time.monotonic()
            got = await _raw_exchange(srv.port, b"", timeout=5)  # connect and say nothing
            assert 0.25 < time.monotonic() - t < 4
            assert [f.kind for f in FrameDecoder().feed(got)] == ["hello"]

        # client side: a server that never answers
        async def mute(reader, writer):
            await reader.read()  # never answers; returns when the client gives up
            writer.close()

        s = await asyncio.start_server(mute, "127.0.0.1", 0)
        with pytest.raises(HandshakeTimeout, match="handshake timeout"):
            await open_connection("127.0.0.1", s.sockets[0].getsockname()[1], SECRET, "c", handshake_timeout=0.3)
        s.close()
        await s.wait_closed()

    with caplog.at_level(logging.INFO, logger=LOG):
        run(main())
    assert any("handshake timeout after 0.3 s" in r.getMessage() for r in caplog.records)


def test_malformed_frame_after_auth_closes_only_that_connection(caplog):
    async def main():
        errors = []

        async def handler(conn):
            try:
                async for f in conn:
                    await conn.send(f)
            except ProtocolError as e:
                errors.append(str(e))
                raise

        async with await serve("127.0.0.1", 0, SECRET, "srv", handler, max_payload=1 << 20) as srv:
            other = await open_connection("127.0.0.1", srv.port, SECRET, "other")
            bad = await open_connection("127.0.0.1", srv.port, SECRET, "bad")
            await bad.send(Frame.make("ok"))
            assert (await bad.recv()).kind == "ok"
            bad._transport.write(b"XXXX" + bytes(30))  # bad magic
            with pytest.raises(ConnectionClosed):
                await bad.recv()
            bad2 = await open_connection("127.0.0.1", srv.port, SECRET, "bad2")
            hb = F.pack_header({"kind": "x"})
            bad2._transport.write(F.PREFIX.pack(F.MAGIC, F.VERSION, 0, len(hb), 2 << 20) + hb)  # > max_payload
            with pytest.raises(ConnectionClosed):
                await bad2.recv()
            await other.send(Frame.make("still", {"x": np.ones(3, np.float64)}))
            assert (await other.recv()).kind == "still"
            c = await open_connection("127.0.0.1", srv.port, SECRET, "new")
            await c.send(Frame.make("hi"))
            assert (await c.recv()).kind == "hi"
            for x in (other, c):
                x.close()
            await asyncio.sleep(0.05)
            return errors

    with caplog.at_level(logging.INFO, logger=LOG):
        errors = run(main())
    assert any("bad magic" in e for e in errors)
    assert any("exceeds the limit of 1048576 bytes" in e for e in errors)
    msgs = "\n".join(r.getMessage() for r in caplog.records)
    assert "closing connection to node 'bad' at 127.0.0.1:" in msgs and "protocol error: bad magic" in msgs


def test_client_side_receives_protocol_error():
    async def main():
        async def handler(conn):
            await conn.recv()
            conn._transport.write(b"\x00" * 40)  # the server turns bad
            await asyncio.sleep(1)

        async with await serve("127.0.0.1", 0, SECRET, "srv", handler) as srv:
            c = await open_connection("127.0.0.1", srv.port, SECRET, "c")
            await c.send(Frame.make("go"))
            with pytest.raises(ProtocolError, match="bad magic"):
                await c.recv()
            with pytest.raises(ProtocolError):
                await c.recv()
            with pytest.raises(ConnectionClosed):
                await c.send(Frame.make("more"))

    run(main())


def test_expect_peer():
    async def main():
        async with await serve("127.0.0.1", 0, SECRET, "real", echo) as srv:
            with pytest.raises(AuthenticationError, match="expected node 'other'"):
                await open_connection("127.0.0.1", srv.port, SECRET, "c", expect_peer="other")
            c = await open_connection("127.0.0.1", srv.port, SECRET, "c", expect_peer="real")
            c.close()

    run(main())


def test_fault_delay_close_drop():
    async def main():
        inbox: asyncio.Queue = asyncio.Queue()

        async def sink(conn):
            try:
                async for f in conn:
                    await inbox.put(f.header.get("i"))
            except ConnectionClosed:
                pass
            await inbox.put("closed")

        async with await serve("127.0.0.1", 0, SECRET, "srv", sink) as srv:
            # delay
            c = await open_connection("127.0.0.1", srv.port, SECRET, "c", faults=Faults(delay_s=0.05))
            t = time.monotonic()
            for i in range(4):
                await c.send(Frame.make("x", i=i))
            assert time.monotonic() - t >= 0.19
            assert [await inbox.get() for _ in range(4)] == [0, 1, 2, 3]
            c.close()
            assert await inbox.get() == "closed"
            # close after 3 frames: the peer sees 3 frames, then the connection ends
            c = await open_connection("127.0.0.1", srv.port, SECRET, "c", faults=Faults(close_after=3))
            for i in range(3):
                await c.send(Frame.make("x", i=i))
            with pytest.raises(ConnectionClosed, match="fault injection: closed after 3 frames"):
                await c.send(Frame.make("x", i=3))
            assert [await inbox.get() for _ in range(4)] == [0, 1, 2, "closed"]
            # drop after 2: a black hole, the connection stays up
            c = await open_connection("127.0.0.1", srv.port, SECRET, "c", faults=Faults(drop_after=2))
            for i in range(5):
                await c.send(Frame.make("x", i=i))
            assert [await inbox.get() for _ in range(2)] == [0, 1]
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(inbox.get(), 0.3)
            assert not c.closed
            c.faults = Faults()  # switch the fault off at run time
            await c.send(Frame.make("x", i=99))
            assert await inbox.get() == 99
            c.close()
            assert await inbox.get() == "closed"

    run(main())


def test_fault_corrupt(caplog):
    async def main():
        results: asyncio.Queue = asyncio.Queue()

        async def sink(conn):
            try:
                async for f in conn:
                    await results.put(f.header.get("i"))
            except ProtocolError as e:
                await results.put(str(e))

        async with await serve("127.0.0.1", 0, SECRET, "srv", sink, checksum=True) as srv:
            # a corrupted prefix byte
            c = await open_connection(
                "127.0.0.1", srv.port, SECRET, "c", faults=Faults(corrupt_frame=1, corrupt_offset=0)
            )
            await c.send(Frame.make("x", i=0))
            await c.send(Frame.make("x", i=1))
            assert await results.get() == 0
            assert "bad magic" in await results.get()
            # a corrupted payload byte, caught by the optional CRC-32
            c = await open_connection(
                "127.0.0.1", srv.port, SECRET, "c", checksum=True, faults=Faults(corrupt_frame=0, corrupt_offset=200)
            )
            await c.send(Frame.make("x", {"a": np.zeros(100, np.float32)}, i=0))
            assert "checksum mismatch" in await results.get()

    with caplog.at_level(logging.INFO, logger=LOG):
        run(main())


def test_backpressure_pauses_reading():
    async def main():
        async def burst(conn):
            for i in range(40):
                await conn.send(Frame.make("x", {"a": np.full(25000, i, np.int32)}, i=i))
            await asyncio.sleep(2)

        async with await serve("127.0.0.1", 0, SECRET, "srv", burst) as srv:
            c = await open_connection("127.0.0.1", srv.port, SECRET, "c", max_queued=4)
            deadline = asyncio.get_running_loop().time() + 5
            while len(c._queue) < 4:  # frames arrive until reading pauses
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # and then no more come: this wait is the point of the test
            assert 4 <= len(c._queue) <= 6  # reading paused; the rest waits in the kernel / the sender
            got = []
            for _ in range(40):
                f = await c.recv()
                assert f.array("a")[0] == f.header["i"]
                got.append(f.header["i"])
            assert got == list(range(40))
            c.close()

    run(main())


@pytest.mark.parametrize("loop", LOOPS)
def test_forward_and_concurrent_sends_keep_order(loop):
    async def main():
        async def relay(conn):  # a stage passing frames on unchanged
            async for f in conn:
                await conn.forward(f)

        async with await serve("127.0.0.1", 0, SECRET, "srv", relay, checksum=True) as srv:
            c = await open_connection("127.0.0.1", srv.port, SECRET, "c")
            big = np.arange(3 << 20, dtype=np.int32)  # larger than the socket buffers: partial writes
            sends = []
            for i in range(12):
                t = {"a": big} if i % 3 == 0 else {"a": np.full(10, i, np.int16)}
                sends.append(asyncio.ensure_future(c.send(Frame.make("x", t, i=i))))
            sends[7].cancel()  # still waiting for its turn: never sent, the others go on
            await asyncio.sleep(0)
            sends[8].cancel()
            got = []
            for _ in range(10):
                f = await asyncio.wait_for(c.recv(), 10)
                got.append(f.header["i"])
                if f.header["i"] % 3 == 0:
                    np.testing.assert_array_equal(f.array("a"), big)
                else:
                    assert f.array("a").tolist() == [f.header["i"]] * 10
            assert got == [0, 1, 2, 3, 4, 5, 6, 9, 10, 11]
            results = await asyncio.gather(*sends, return_exceptions=True)
            assert [type(r).__name__ for r in results].count("CancelledError") == 2
            assert c.frames_sent == 10
            c.close()

    run(main(), loop)
