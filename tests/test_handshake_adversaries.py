"""Adversaries against the authenticated handshake (p2pk3/transport/connection.py) and LAN discovery
(p2pk3/node/discovery.py), on loopback only.

The attackers speak the wire format written out here from docs/protocol.md (frame prefix, msgpack header,
proof = HMAC-SHA256(secret, "p2k3-auth-v1" 0 role 0 client_nonce server_nonce len|client_id len|server_id
version)) and the beacon format from discovery.py's docstring - not through the code under test - so the
tests also pin the documented formats: a hand-written client that follows the document must be accepted.

Handshake: a fake server that reflects the client's proof, a replayed transcript of a real handshake, a
wrong role, a version mismatch, malformed hellos, a truncated proof and a wrong secret are each refused
with a clear error on the honest side, and the honest server keeps serving honest clients afterwards.
Discovery: forged, replayed and stale beacons are ignored; the highest-epoch claimant wins resolve_slot.
Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import struct
import time

import msgpack
import pytest

from p2pk3.transport import connection as C
from p2pk3.transport.connection import (
    AuthenticationError,
    ProtocolError,
    open_connection,
)
from p2pk3.transport.server import serve

from conftest import run as _run  # the one deadline-guarded runner

SECRET = b"s" * 32
OTHER = b"not-the-cluster-secret-012345678"
LOG = "p2pk3.transport"
WAIT = 5.0  # seconds for any single wait


def run(coro):
    return _run(coro, 30.0)


# ------------------------------------------------------------------ the documented wire format, by hand
PREFIX = struct.Struct("<4sBBIQ")  # magic, version, flags, header_len, payload_len (docs/protocol.md 1)


def frame(kind: str, **fields) -> bytes:
    hb = msgpack.packb({"kind": kind, **fields}, use_bin_type=True)
    return PREFIX.pack(b"P2K3", 1, 0, len(hb), 0) + hb


class Wire:
    """Raw frames over an asyncio stream pair (handshake frames only: no payload expected)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.r, self.w = reader, writer
        self.sent = bytearray()

    @classmethod
    async def connect(cls, port: int) -> Wire:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT)
        return cls(r, w)

    async def send_raw(self, data: bytes) -> None:
        self.sent += data
        try:
            self.w.write(data)
            await asyncio.wait_for(self.w.drain(), WAIT)
        except ConnectionError:  # the peer already closed: what it sent before is still read by recv()
            pass

    async def send(self, kind: str, **fields) -> None:
        await self.send_raw(frame(kind, **fields))

    async def recv(self, timeout: float = WAIT) -> dict | None:
        """The next frame's header, or None when the peer closed (or reset) the connection."""
        try:
            pre = await asyncio.wait_for(self.r.readexactly(PREFIX.size), timeout)
            magic, ver, flags, hl, pl = PREFIX.unpack(pre)
            assert magic == b"P2K3" and ver == 1, (magic, ver)
            body = await asyncio.wait_for(self.r.readexactly(hl + pl + (4 if flags & 1 else 0)), timeout)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None
        return msgpack.unpackb(body[:hl], raw=False)

    async def rest(self, timeout: float = WAIT) -> list[dict]:
        """Every frame until the peer closes."""
        out = []
        while True:
            f = await self.recv(timeout)
            if f is None:
                return out
            out.append(f)

    async def close(self) -> None:
        self.w.close()
        try:
            await asyncio.wait_for(self.w.wait_closed(), WAIT)
        except (TimeoutError, ConnectionError):
            pass


def proof(secret: bytes, role: str, cn: bytes, sn: bytes, cid: str, sid: str, version: int = 1) -> bytes:
    msg = b"p2k3-auth-v1" + b"\0" + role.encode() + b"\0" + cn + sn
    for s in (cid, sid):
        b = s.encode()
        msg += len(b).to_bytes(2, "little") + b
    msg += version.to_bytes(2, "little")
    return hmac.new(secret, msg, hashlib.sha256).digest()


def hello(node_id: str, role: str, nonce: bytes | None = None, version=1, **extra) -> dict:
    return dict(
        node_id=node_id,
        version=version,
        nonce=nonce if nonce is not None else os.urandom(32),
        role=role,
        software="adversary",
        **extra,
    )


async def echo(conn):
    async for f in conn:
        await conn.send(f)


class Honest:
    """An honest server (echo) that records which peers reached its handler."""

    def __init__(self):
        self.handled: list[str] = []

    async def handler(self, conn):
        self.handled.append(conn.peer_id)
        await echo(conn)


async def assert_serves(port: int, name: str = "honest") -> None:
    c = await asyncio.wait_for(open_connection("127.0.0.1", port, SECRET, name), WAIT)
    try:
        await asyncio.wait_for(c.send(C.Frame.make("ping", n=7)), WAIT)
        f = await asyncio.wait_for(c.recv(), WAIT)
        assert f.kind == "ping" and f.header["n"] == 7
    finally:
        c.close()


# ------------------------------------------------------------------------------ honest baseline
def test_hand_written_client_following_the_document_is_accepted():
    """Our own client, written from docs/protocol.md, completes the handshake; the server's proof is the
    documented one (role "server"); afterwards frames flow."""

    async def main():
        h = Honest()
        async with await serve("127.0.0.1", 0, SECRET, "srv", h.handler) as srv:
            w = await Wire.connect(srv.port)
            cn = os.urandom(32)
            await w.send("hello", **hello("hand", "client", cn))
            sh = await w.recv()
            assert sh["kind"] == "hello" and sh["role"] == "server" and sh["version"] == 1
            assert sh["node_id"] == "srv" and isinstance(sh["nonce"], bytes) and len(sh["nonce"]) == 32
            sn = sh["nonce"]
            await w.send("auth", proof=proof(SECRET, "client", cn, sn, "hand", "srv"))
            sa = await w.recv()
            assert sa is not None and sa["kind"] == "auth", sa
            assert sa["proof"] == proof(SECRET, "server", cn, sn, "hand", "srv")
            assert sa["proof"] != proof(SECRET, "client", cn, sn, "hand", "srv")
            await w.send("ping", n=1)
            back = await w.recv()
            assert back["kind"] == "ping" and back["n"] == 1
            await w.close()
            assert h.handled == ["hand"]

    run(main())


# ------------------------------------------------------------------------------- fake servers
async def fake_server(script):
    """Start a raw server running `script(wire)`; returns (server, port, results list)."""
    results: list = []

    async def on_conn(r, w):
        wire = Wire(r, w)
        try:
            results.append(await script(wire))
        except Exception as e:  # reported to the test through `results`
            results.append(e)
        finally:
            await wire.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], results


async def stop(srv) -> None:
    srv.close()
    await asyncio.wait_for(srv.wait_closed(), WAIT)


def test_fake_server_reflecting_the_clients_proof_is_refused(caplog):
    """An impostor without the secret sends the client's own proof back: the client must refuse (the
    role in the HMAC makes a client proof useless as a server proof) and send nothing more."""

    async def script(w: Wire):
        ch = await w.recv()
        await w.send("hello", **hello("impostor", "server"))
        ca = await w.recv()
        assert ch["kind"] == "hello" and ca["kind"] == "auth"
        await w.send("auth", proof=ca["proof"])  # reflect it
        return await w.rest()  # the client must close without sending anything else

    async def main():
        srv, port, results = await fake_server(script)
        try:
            with pytest.raises(AuthenticationError, match="could not prove the cluster secret"):
                await asyncio.wait_for(open_connection("127.0.0.1", port, SECRET, "victim"), WAIT)
            for _ in range(100):
                if results:
                    break
                await asyncio.sleep(0.02)
            assert results == [[]], results
        finally:
            await stop(srv)

    with caplog.at_level(logging.INFO, logger=LOG):
        run(main())
    assert any("could not prove" in r.getMessage() and "impostor" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", ["wrong_secret", "truncated", "empty", "not_bytes", "client_role"])
def test_fake_server_with_a_bad_server_proof_is_refused(bad):
    async def script(w: Wire):
        ch = await w.recv()
        sn = os.urandom(32)
        await w.send("hello", **hello("fake", "server", sn))
        ca = await w.recv()
        assert ca["kind"] == "auth"
        good = proof(SECRET, "server", ch["nonce"], sn, ch["node_id"], "fake")
        p = {
            "wrong_secret": proof(OTHER, "server", ch["nonce"], sn, ch["node_id"], "fake"),
            "truncated": good[:16],
            "empty": b"",
            "not_bytes": good.hex(),
            "client_role": proof(SECRET, "client", ch["nonce"], sn, ch["node_id"], "fake"),
        }[bad]
        await w.send("auth", proof=p)
        return await w.rest()

    async def main():
        srv, port, _ = await fake_server(script)
        try:
            with pytest.raises(AuthenticationError, match="could not prove the cluster secret"):
                await asyncio.wait_for(open_connection("127.0.0.1", port, SECRET, "victim"), WAIT)
        finally:
            await stop(srv)

    run(main())


def test_fake_server_with_a_good_proof_is_accepted():
    """Control for the tests above: the same fake server with the right proof is accepted."""

    async def script(w: Wire):
        ch = await w.recv()
        sn = os.urandom(32)
        await w.send("hello", **hello("fake", "server", sn))
        ca = await w.recv()
        assert ca["proof"] == proof(SECRET, "client", ch["nonce"], sn, ch["node_id"], "fake")
        await w.send("auth", proof=proof(SECRET, "server", ch["nonce"], sn, ch["node_id"], "fake"))
        f = await w.recv()
        return f["kind"]

    async def main():
        srv, port, results = await fake_server(script)
        try:
            c = await asyncio.wait_for(open_connection("127.0.0.1", port, SECRET, "victim"), WAIT)
            assert c.authenticated and c.peer_id == "fake"
            await asyncio.wait_for(c.send(C.Frame.make("hi")), WAIT)
            for _ in range(100):
                if results:
                    break
                await asyncio.sleep(0.02)
            assert results == ["hi"]
            c.close()
        finally:
            await stop(srv)

    run(main())


@pytest.mark.parametrize(
    "variant", ["role_client", "role_missing", "version_2", "short_nonce", "nonce_str", "node_id_int", "no_version"]
)
def test_fake_server_with_a_bad_hello_is_refused_before_the_client_proves(variant):
    """The client checks the server's hello before it sends its proof: a server that is not a server,
    speaks another version or sends a malformed hello learns no proof."""
    h = {
        "role_client": hello("fake", "client"),
        "role_missing": {k: v for k, v in hello("fake", "x").items() if k != "role"},
        "version_2": hello("fake", "server", version=2),
        "short_nonce": hello("fake", "server", os.urandom(31)),
        "nonce_str": hello("fake", "server", "n" * 32),
        "node_id_int": hello(7, "server"),
        "no_version": {k: v for k, v in hello("fake", "server").items() if k != "version"},
    }[variant]
    match = {
        "role_client": "expected a 'server'",
        "role_missing": "expected a 'server'",
        "version_2": "protocol version mismatch",
        "short_nonce": "malformed hello",
        "nonce_str": "malformed hello",
        "node_id_int": "malformed hello",
        "no_version": "malformed hello",
    }[variant]

    async def script(w: Wire):
        await w.recv()
        await w.send("hello", **h)
        return await w.rest()

    async def main():
        srv, port, results = await fake_server(script)
        try:
            with pytest.raises(ProtocolError, match=match) as ei:
                await asyncio.wait_for(open_connection("127.0.0.1", port, SECRET, "victim"), WAIT)
            if variant == "version_2":
                assert isinstance(ei.value, AuthenticationError)
            for _ in range(100):
                if results:
                    break
                await asyncio.sleep(0.02)
            sent = results[0]
            assert not isinstance(sent, Exception), sent
            assert "auth" not in [f["kind"] for f in sent], f"the client sent its proof to a bad server: {sent}"
            if variant == "version_2":
                assert [f.get("code") for f in sent if f["kind"] == "error"] == ["version_mismatch"]
        finally:
            await stop(srv)

    run(main())


# ---------------------------------------------------------------------- attacks on the honest server
def test_replayed_handshake_transcript_is_refused(caplog):
    """Record every byte an honest client sends through a proxy (hello, auth, a frame), replay them to the
    server on a new connection: the server's nonce differs, so the recorded proof fails, the server answers
    auth_failed and the replayed frame never reaches the handler."""

    async def main():
        h = Honest()
        async with await serve("127.0.0.1", 0, SECRET, "srv", h.handler) as srv:
            recorded = bytearray()

            async def pump(r, w, rec):
                try:
                    while True:
                        data = await r.read(65536)
                        if not data:
                            break
                        if rec is not None:
                            rec += data
                        w.write(data)
                        await w.drain()
                except ConnectionError:
                    pass
                finally:
                    w.close()

            async def on_conn(cr, cw):
                sr, sw = await asyncio.open_connection("127.0.0.1", srv.port)
                await asyncio.gather(pump(cr, sw, recorded), pump(sr, cw, None))

            proxy = await asyncio.start_server(on_conn, "127.0.0.1", 0)
            try:
                c = await asyncio.wait_for(
                    open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1], SECRET, "alice"), WAIT
                )
                await asyncio.wait_for(c.send(C.Frame.make("transfer", amount=100)), WAIT)
                assert (await asyncio.wait_for(c.recv(), WAIT)).header["amount"] == 100
                c.close()
                await asyncio.sleep(0.05)
            finally:
                await stop(proxy)
            assert h.handled == ["alice"]
            failures = srv.auth_failures
            # the replay: everything alice sent, byte for byte
            w = await Wire.connect(srv.port)
            await w.send_raw(bytes(recorded))
            got = await w.rest()
            await w.close()
            assert [f["kind"] for f in got] == ["hello", "error"], got
            assert got[1]["code"] == "auth_failed"
            assert h.handled == ["alice"], "the replayed session reached the handler"
            assert srv.auth_failures == failures + 1
            await assert_serves(srv.port)

    with caplog.at_level(logging.INFO, logger=LOG):
        run(main())
    assert any(
        "authentication failed: wrong cluster secret from 127.0.0.1:" in r.getMessage() and "'alice'" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(
    "bad", ["wrong_secret", "truncated", "empty", "not_bytes", "server_role", "old_nonce", "other_ids"]
)
def test_client_with_a_bad_proof_is_refused_and_the_server_keeps_serving(bad):
    async def main():
        h = Honest()
        async with await serve("127.0.0.1", 0, SECRET, "srv", h.handler) as srv:
            w = await Wire.connect(srv.port)
            cn = os.urandom(32)
            await w.send("hello", **hello("mallory", "client", cn))
            sn = (await w.recv())["nonce"]
            good = proof(SECRET, "client", cn, sn, "mallory", "srv")
            p = {
                "wrong_secret": proof(OTHER, "client", cn, sn, "mallory", "srv"),
                "truncated": good[:16],
                "empty": b"",
                "not_bytes": good.hex(),
                "server_role": proof(SECRET, "server", cn, sn, "mallory", "srv"),
                "old_nonce": proof(SECRET, "client", cn, os.urandom(32), "mallory", "srv"),
                "other_ids": proof(SECRET, "client", cn, sn, "alice", "srv"),
            }[bad]
            await w.send("auth", proof=p)
            await w.send("transfer", amount=1)  # must never be delivered
            got = await w.rest()
            await w.close()
            assert [f["kind"] for f in got] == ["error"], got
            assert got[0]["code"] == "auth_failed" and "authentication failed" in got[0]["message"]
            assert h.handled == []
            await assert_serves(srv.port)
            assert h.handled == ["honest"]

    run(main())


@pytest.mark.parametrize(
    "variant",
    [
        "role_server",
        "role_missing",
        "short_nonce",
        "long_nonce",
        "nonce_str",
        "node_id_int",
        "node_id_empty",
        "no_version",
        "version_str",
    ],
)
def test_client_with_a_bad_hello_is_dropped_and_the_server_keeps_serving(variant, caplog):
    """Even with a valid proof for its claims, a peer whose hello is wrong gets nothing but our hello."""
    cn = os.urandom(32)
    h = {
        "role_server": hello("m", "server", cn),
        "role_missing": {k: v for k, v in hello("m", "x", cn).items() if k != "role"},
        "short_nonce": hello("m", "client", cn[:31]),
        "long_nonce": hello("m", "client", cn + b"x"),
        "nonce_str": hello("m", "client", "n" * 32),
        "node_id_int": hello(5, "client", cn),
        "node_id_empty": hello("", "client", cn),
        "no_version": {k: v for k, v in hello("m", "client", cn).items() if k != "version"},
        "version_str": hello("m", "client", cn, version="1"),
    }[variant]
    log_match = "expected a 'client'" if variant.startswith("role") else "malformed hello"

    async def main():
        hs = Honest()
        async with await serve("127.0.0.1", 0, SECRET, "srv", hs.handler) as srv:
            w = await Wire.connect(srv.port)
            await w.send("hello", **h)
            first = await w.recv()
            assert first is not None and first["kind"] == "hello"
            await w.send("auth", proof=proof(SECRET, "client", cn, first["nonce"], "m", "srv"))
            got = await w.rest()
            await w.close()
            assert [f["kind"] for f in got if f["kind"] != "error"] == [], got  # no auth proof for this peer
            assert hs.handled == []
            await assert_serves(srv.port)

    with caplog.at_level(logging.INFO, logger=LOG):
        run(main())
    assert any(log_match in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_client_with_another_protocol_version_gets_a_clear_error():
    async def main():
        hs = Honest()
        async with await serve("127.0.0.1", 0, SECRET, "srv", hs.handler) as srv:
            w = await Wire.connect(srv.port)
            cn = os.urandom(32)
            await w.send("hello", **hello("future", "client", cn, version=2))
            first = await w.recv()
            assert first["kind"] == "hello"
            # even a proof for version 2 made with the right secret must not get it in
            await w.send("auth", proof=proof(SECRET, "client", cn, first["nonce"], "future", "srv", version=2))
            got = await w.rest()
            await w.close()
            assert [f["kind"] for f in got] == ["error"], got
            assert got[0]["code"] == "version_mismatch"
            assert "protocol version mismatch" in got[0]["message"] and "2" in got[0]["message"]
            assert hs.handled == []
            await assert_serves(srv.port)

    run(main())


def test_wrong_secret_client_is_refused_with_a_clear_error():
    async def main():
        hs = Honest()
        async with await serve("127.0.0.1", 0, SECRET, "srv", hs.handler) as srv:
            with pytest.raises(AuthenticationError, match="authentication failed"):
                await asyncio.wait_for(open_connection("127.0.0.1", srv.port, OTHER, "intruder"), WAIT)
            assert hs.handled == []
            await assert_serves(srv.port)

    run(main())


# ------------------------------------------------------------------------------------------ discovery
from p2pk3.node.discovery import Discovery  # noqa: E402  (the discovery half of this file)

CLUSTER = "adv"


def beacon_key(secret: bytes) -> bytes:  # documented: HMAC(cluster secret, "p2k3-beacon-v1")
    return hmac.new(secret, b"p2k3-beacon-v1", hashlib.sha256).digest()


def beacon(body: dict, secret: bytes = SECRET) -> bytes:
    """b"P2KB" | version u8 | body_len u16 LE | msgpack body | HMAC-SHA256(key, everything before)."""
    b = msgpack.packb(body, use_bin_type=True)
    msg = b"P2KB" + bytes([1]) + len(b).to_bytes(2, "little") + b
    return msg + hmac.new(beacon_key(secret), msg, hashlib.sha256).digest()


def body(node: str, seq: int, slot: str | None, epoch: int, ts: float | None = None, inst: str = "i0", **kw) -> dict:
    b = {
        "cluster": CLUSTER,
        "node": node,
        "inst": inst,
        "seq": seq,
        "ts": time.time() if ts is None else ts,
        "host": "127.0.0.1",
        "port": 7000 + seq,
        "slot": slot,
        "epoch": epoch,
        "since": None,
        "standby": False,
    }
    b.update(kw)
    return b


def free_udp_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Injector:
    def __init__(self, disc: Discovery, port: int):
        self.disc, self.port = disc, port
        self.tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    async def send(self, data: bytes) -> None:
        """Send one datagram and wait until the discovery has processed it."""
        n = self.disc.stats["received"]
        self.tx.sendto(data, ("127.0.0.1", self.port))
        for _ in range(250):
            if self.disc.stats["received"] > n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the beacon was not received within 2.5 s")


def test_discovery_ignores_forged_replayed_and_stale_beacons_and_highest_epoch_wins():
    port = free_udp_port()

    async def main():
        d = Discovery(
            CLUSTER,
            SECRET,
            "me",
            port=5000,
            beacon_port=port,
            beacon_addrs=[],
            bind="127.0.0.1",
            interval=10.0,
            expiry=60.0,
        )
        await d.start()
        inj = Injector(d, port)
        try:
            # three claimants of s1, the highest epoch neither first nor last
            await inj.send(beacon(body("n1", 1, "s1", 2)))
            await inj.send(beacon(body("n2", 1, "s1", 7)))
            await inj.send(beacon(body("n3", 1, "s1", 4)))
            assert set(d.peers()) == {"n1", "n2", "n3"}
            assert d.resolve_slot("s1").node_id == "n2"
            assert d.resolve_slot("s1").epoch == 7
            # forged: signed with another secret / tampered after signing / unsigned
            await inj.send(beacon(body("evil", 1, "s1", 99), secret=OTHER))
            good = bytearray(beacon(body("n1", 2, "s1", 2)))
            i = good.index(b"\xa5epoch") + 6  # msgpack "epoch" key, then the value byte
            good[i] = 99  # positive fixint 99
            await inj.send(bytes(good))
            await inj.send(beacon(body("evil2", 1, "s1", 98))[:-32] + bytes(32))
            assert d.stats["bad_signature"] == 3
            assert "evil" not in d.peers() and "evil2" not in d.peers()
            assert d.peers()["n1"].epoch == 2
            assert d.resolve_slot("s1").node_id == "n2"
            # n2 hands the slot back (seq 2): n3 (epoch 4) is now the highest claimant
            recorded = beacon(body("n2", 1, "s1", 7))  # what an eavesdropper recorded of n2 earlier
            await inj.send(beacon(body("n2", 2, None, 7)))
            assert d.resolve_slot("s1").node_id == "n3"
            # replays of n2's old claim (the same bytes, and an older seq) are ignored
            await inj.send(recorded)
            await inj.send(beacon(body("n2", 2, "s1", 7)))
            assert d.stats["replayed"] == 2
            assert d.peers()["n2"].slot is None and d.resolve_slot("s1").node_id == "n3"
            # stale (an hour old) and future-dated beacons are ignored
            await inj.send(beacon(body("n4", 1, "s1", 50, ts=time.time() - 3600)))
            await inj.send(beacon(body("n5", 1, "s1", 60, ts=time.time() + 3600)))
            assert d.stats["stale"] == 2
            assert "n4" not in d.peers() and "n5" not in d.peers()
            assert d.resolve_slot("s1").node_id == "n3"
            # a later, higher claim wins at once; a claim on another slot changes nothing here
            await inj.send(beacon(body("n1", 3, "s1", 9)))
            await inj.send(beacon(body("n6", 1, "s2", 100)))
            assert d.resolve_slot("s1").node_id == "n1" and d.resolve_slot("s1").epoch == 9
            assert d.resolve_slot("s2").node_id == "n6"
            # a restarted n2 (new instance) may start again at seq 1
            await inj.send(beacon(body("n2", 1, "s1", 10, inst="i1")))
            assert d.resolve_slot("s1").node_id == "n2"
        finally:
            inj.tx.close()
            await d.stop(bye=False)

    run(main())
