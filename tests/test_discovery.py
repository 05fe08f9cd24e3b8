"""LAN discovery on loopback: two daemons find each other; strangers' and forged beacons are ignored."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from p2pk3.node.claims import ClaimTable
from p2pk3.node.discovery import Discovery, beacon_key, decode_beacon, encode_beacon, BeaconError
from conftest import run as _run  # the one deadline-guarded runner

SECRET = b"cluster-secret-0123456789abcdef"
BCAST = "127.255.255.255"  # the loopback broadcast route: delivered to every socket bound to the port


def free_udp_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def mk(node: str, port: int, secret: bytes = SECRET, cluster: str = "test", **kw) -> Discovery:
    kw.setdefault("interval", 0.05)
    return Discovery(
        cluster,
        secret,
        node,
        port=kw.pop("tcp_port", 5000),
        beacon_port=port,
        beacon_addrs=[BCAST],
        bind="0.0.0.0",
        **kw,
    )


def run(coro):
    return _run(coro, 20.0)


def test_beacon_codec():
    k = beacon_key(SECRET)
    body = {
        "cluster": "c",
        "node": "n",
        "inst": "i",
        "seq": 1,
        "ts": time.time(),
        "host": "",
        "port": 1,
        "slot": "s0",
        "epoch": 2,
        "since": None,
    }
    data = encode_beacon(k, body)
    assert decode_beacon(k, data) == body
    with pytest.raises(BeaconError, match="signature") as ei:
        decode_beacon(beacon_key(b"other"), data)
    assert ei.value.kind == "bad_signature"
    bad = bytearray(data)
    bad[10] ^= 1
    with pytest.raises(BeaconError):
        decode_beacon(k, bytes(bad))
    with pytest.raises(BeaconError, match="malformed|bytes"):
        decode_beacon(k, b"P2KB")


def test_two_nodes_find_each_other_and_strangers_are_ignored(caplog):
    port = free_udp_port()

    async def main():
        events = []
        a = mk("node-a", port, tcp_port=7001, slot="s0", epoch=3, since=1000.0)
        b = mk("node-b", port, tcp_port=7002, on_event=lambda ev, p: events.append((ev, p.node_id)))
        evil = mk("evil", port, secret=b"not-the-secret-0123456789abcdef", tcp_port=6666, slot="s0", epoch=99)
        other = mk("other-cluster", port, cluster="someone-else", tcp_port=6667)
        for d in (a, b, evil, other):
            await d.start()
        try:
            await a.wait_for(lambda ps: "node-b" in ps, 5)
            ps = await b.wait_for(lambda ps: "node-a" in ps, 5)
            pa = ps["node-a"]
            assert (pa.host, pa.port, pa.slot, pa.epoch, pa.since) == ("127.0.0.1", 7001, "s0", 3, 1000.0)
            await asyncio.sleep(0.3)  # several beacon rounds of the strangers
            assert set(b.peers()) == {"node-a"} and set(a.peers()) == {"node-b"}
            assert b.stats["bad_signature"] >= 2 and b.stats["wrong_cluster"] >= 2 and b.stats["own"] >= 1
            assert b.resolve_slot("s0").node_id == "node-a"  # not the forged epoch-99 claim
            # an update is seen at once
            a.update(slot="s1", epoch=4)
            await b.wait_for(lambda ps: ps.get("node-a") and ps["node-a"].slot == "s1", 5)
            # bye: a leaves explicitly
            await a.stop()
            await b.wait_for(lambda ps: "node-a" not in ps, 5)
            assert ("join", "node-a") in events and ("update", "node-a") in events and ("leave", "node-a") in events
        finally:
            for d in (a, b, evil, other):
                await d.stop(bye=False)

    with caplog.at_level(logging.INFO, logger="p2pk3.discovery"):
        run(main())
    assert any("discovered node 'node-a'" in r.getMessage() for r in caplog.records)


def test_expiry_replay_skew_and_static_fallback():
    port = free_udp_port()

    async def main():
        b = mk("b", port, expiry=0.4, static={"s7": ("10.0.0.7", 4000)})
        await b.start()
        k = beacon_key(SECRET)
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)

        def send(**kw):
            body = {
                "cluster": "test",
                "node": "x",
                "inst": "i1",
                "seq": 1,
                "ts": time.time(),
                "host": "",
                "port": 9,
                "slot": "s7",
                "epoch": 1,
                "since": None,
            }
            body.update(kw)
            tx.sendto(encode_beacon(k, body), (BCAST, port))

        try:
            send(seq=5)
            await b.wait_for(lambda ps: "x" in ps, 5)
            assert b.resolve_slot("s7").port == 9
            send(seq=5, port=10)  # replayed sequence number: ignored
            send(seq=6, ts=time.time() - 3600, port=11)  # an hour old: ignored
            await asyncio.sleep(0.15)
            assert b.peers()["x"].port == 9
            assert b.stats["replayed"] == 1 and b.stats["stale"] == 1
            send(seq=1, inst="i2", port=12)  # a restarted process (new instance) starts again at seq 1
            await b.wait_for(lambda ps: ps["x"].port == 12, 5)
            await asyncio.sleep(0.7)  # silent: expires
            assert "x" not in b.peers()
            r = b.resolve_slot("s7")
            assert (r.host, r.port, r.source) == ("10.0.0.7", 4000, "static")
            assert b.resolve_slot("nope") is None
        finally:
            tx.close()
            await b.stop()

    run(main())


def test_duplicate_node_id_is_reported(caplog):
    port = free_udp_port()

    async def main():
        a1, a2 = mk("same", port), mk("same", port)
        await a1.start()
        await a2.start()
        try:
            for _ in range(100):
                if a1.stats["duplicate_id"]:
                    break
                await asyncio.sleep(0.05)
            assert a1.stats["duplicate_id"] >= 1 and a1.peers() == {}
        finally:
            await a1.stop()
            await a2.stop()

    with caplog.at_level(logging.WARNING, logger="p2pk3.discovery"):
        run(main())
    assert any("uses this node id 'same'" in r.getMessage() for r in caplog.records)


def test_beacons_feed_the_claim_table():
    port = free_udp_port()

    async def main():
        table = ClaimTable("b")
        a = mk("a", port, slot="s3", epoch=2, since=123.0)
        b = mk("b", port, claims=table)
        await a.start()
        await b.start()
        try:
            await b.wait_for(lambda ps: "a" in ps, 5)
            h = table.holder("s3")
            assert h is not None and (h.node, h.epoch, h.since) == ("a", 2, 123.0)
            await a.stop()  # bye: the slot is free again, its epoch remembered
            await b.wait_for(lambda ps: "a" not in ps, 5)
            assert table.holder("s3") is None and table.max_epoch("s3") == 2
        finally:
            await a.stop(bye=False)
            await b.stop()

    run(main())
