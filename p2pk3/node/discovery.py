"""LAN discovery: signed UDP beacons, with the topology's static addresses as the fallback.

Every daemon broadcasts a beacon every `interval` seconds to each address in `beacon_addrs`
(default 255.255.255.255; per-interface broadcast addresses such as 192.168.1.255 are more reliable on
hosts with several NICs) and to `unicast` hosts (peers on other subnets, where broadcast does not reach),
on UDP port `beacon_port`. A beacon is

    b"P2KB" | version u8 | body_len u16 (LE) | body (msgpack map) | HMAC-SHA256 tag (32 B)

with tag = HMAC(key, everything before it), key = HMAC(cluster secret, "p2k3-beacon-v1"). The body:
cluster (name), node (id), inst (random per process: tells a restart from a duplicated node id), seq,
ts (sender's unix time), host/port (TCP endpoint; an empty host means "the address the beacon came
from"), slot / epoch / since (the node's slot claim, see claims.py), standby, bye (leaving now).

Receivers drop beacons that are malformed, unsigned or signed with another secret, from another
cluster, older than `max_skew` seconds (or from the future), replayed (seq not increasing for an
instance), or their own. A peer silent for `expiry` seconds is removed. Counters in `stats`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import random
import socket
import struct
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

import msgpack

log = logging.getLogger("p2pk3.discovery")

BEACON_MAGIC = b"P2KB"
BEACON_VERSION = 1
_HEAD = struct.Struct("<4sBH")
TAG_SIZE = 32
MAX_BEACON = 1400
DEFAULT_BEACON_PORT = 47900


def beacon_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"p2k3-beacon-v1", hashlib.sha256).digest()


def encode_beacon(key: bytes, body: Mapping[str, Any]) -> bytes:
    b = msgpack.packb(dict(body), use_bin_type=True)
    msg = _HEAD.pack(BEACON_MAGIC, BEACON_VERSION, len(b)) + b
    if len(msg) + TAG_SIZE > MAX_BEACON:
        raise ValueError(f"beacon of {len(msg) + TAG_SIZE} bytes exceeds {MAX_BEACON}")
    return msg + hmac.new(key, msg, hashlib.sha256).digest()


class BeaconError(ValueError):
    def __init__(self, kind: str, msg: str):
        super().__init__(msg)
        self.kind = kind


def decode_beacon(key: bytes, data: bytes) -> dict[str, Any]:
    """The verified body of a beacon; BeaconError(kind) otherwise (kind: malformed / bad_signature)."""
    if len(data) < _HEAD.size + TAG_SIZE or len(data) > MAX_BEACON:
        raise BeaconError("malformed", f"beacon of {len(data)} bytes")
    magic, ver, n = _HEAD.unpack_from(data)
    if magic != BEACON_MAGIC:
        raise BeaconError("malformed", "bad beacon magic")
    if ver != BEACON_VERSION:
        raise BeaconError("malformed", f"beacon version {ver} (this node speaks {BEACON_VERSION})")
    if _HEAD.size + n + TAG_SIZE != len(data):
        raise BeaconError("malformed", "beacon length mismatch")
    msg, tag = data[:-TAG_SIZE], data[-TAG_SIZE:]
    if not hmac.compare_digest(hmac.new(key, msg, hashlib.sha256).digest(), tag):
        raise BeaconError("bad_signature", "beacon signature does not verify (another cluster's secret?)")
    try:
        body = msgpack.unpackb(msg[_HEAD.size :], raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception as e:
        raise BeaconError("malformed", f"beacon body: {e}") from None
    if not isinstance(body, dict):
        raise BeaconError("malformed", "beacon body is not a map")
    for k, t in (
        ("cluster", str),
        ("node", str),
        ("inst", str),
        ("seq", int),
        ("ts", (int, float)),
        ("port", int),
        ("epoch", int),
    ):
        if not isinstance(body.get(k), t) or isinstance(body.get(k), bool):
            raise BeaconError("malformed", f"beacon field {k!r} missing or of the wrong type")
    for k, t in (("host", str), ("slot", str), ("since", (int, float))):
        if body.get(k) is not None and not isinstance(body[k], t):
            raise BeaconError("malformed", f"beacon field {k!r} has the wrong type")
    return body


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("extension types are not allowed")


@dataclass
class PeerInfo:
    node_id: str
    host: str  # TCP host to dial
    port: int  # TCP port
    slot: str | None = None  # claimed slot (None: no claim)
    epoch: int = 0
    since: float | None = None  # unix time the claim was taken
    last_seen: float = 0.0  # local monotonic time of the last beacon
    instance: str = ""
    standby: bool = False
    source: str = "beacon"  # "beacon" | "static"
    beacon_addr: tuple[str, int] | None = None

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


class _UDP(asyncio.DatagramProtocol):
    def __init__(self, disc: "Discovery"):
        self.disc = disc

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.disc._on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:  # e.g. ICMP unreachable for a unicast target
        log.debug("beacon socket error: %s", exc)


class Discovery:
    """Broadcasts this node's beacon and tracks the peers whose beacons verify.

    on_event(event, peer): "join", "update" (claim/address changed), "leave" (bye or expiry).
    claims: optional claims.ClaimTable; every verified beacon is fed to `claims.observe(...)`.
    static: slot id -> (host, port) from the topology, returned by `resolve_slot` when no live peer
    claims the slot."""

    def __init__(
        self,
        cluster: str,
        secret: bytes | str,
        node_id: str,
        *,
        port: int,
        host: str | None = None,
        slot: str | None = None,
        epoch: int = 0,
        since: float | None = None,
        standby: bool = False,
        beacon_port: int = DEFAULT_BEACON_PORT,
        beacon_addrs: Iterable[str] = ("255.255.255.255",),
        unicast: Iterable[str] = (),
        bind: str = "0.0.0.0",
        interval: float = 1.0,
        expiry: float | None = None,
        max_skew: float = 30.0,
        static: Mapping[str, tuple[str, int]] | None = None,
        on_event: Callable[[str, PeerInfo], None] | None = None,
        claims: Any = None,
        drop_received: bool = False,
    ):
        self.cluster = cluster
        sec = secret.encode() if isinstance(secret, str) else bytes(secret)
        if not sec:
            raise ValueError("empty cluster secret")
        self._key = beacon_key(sec)
        self.node_id = node_id
        self.instance = os.urandom(8).hex()
        self.host, self.port = host, port
        self.slot, self.epoch, self.since, self.standby = slot, epoch, since, standby
        self.beacon_port = beacon_port
        self.beacon_addrs = list(beacon_addrs)
        self.unicast = list(unicast)
        self.bind = bind
        self.interval = interval
        self.expiry = expiry if expiry is not None else max(3.0, 5 * interval)
        self.max_skew = max_skew
        self.static = dict(static or {})
        self.on_event = on_event
        self.claims = claims
        self.drop_received = drop_received  # fault injection: every received beacon is lost (counted)
        self.stats = {
            k: 0
            for k in (
                "sent",
                "received",
                "accepted",
                "malformed",
                "bad_signature",
                "wrong_cluster",
                "stale",
                "replayed",
                "own",
                "duplicate_id",
                "send_errors",
                "dropped",
            )
        }
        self._peers: dict[str, PeerInfo] = {}
        self._seqs: dict[tuple[str, str], int] = {}
        self._seq = 0
        self._transport: asyncio.DatagramTransport | None = None
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._dup_warned: set[str] = set()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            except OSError:  # pragma: no cover
                pass
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.bind((self.bind, self.beacon_port))
        sock.setblocking(False)
        self._transport, _ = await loop.create_datagram_endpoint(lambda: _UDP(self), sock=sock)
        self._task = loop.create_task(self._run())

    async def stop(self, *, bye: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._transport is not None:
            if bye:
                self._send(bye=True)
            self._transport.close()
            self._transport = None

    async def __aenter__(self) -> "Discovery":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # ---------------------------------------------------------------- what we advertise
    def update(self, **kw: Any) -> None:
        """Change what the beacon advertises (slot, epoch, since, standby, host, port) and send it now."""
        for k, v in kw.items():
            if k not in ("slot", "epoch", "since", "standby", "host", "port"):
                raise TypeError(f"unknown beacon field {k!r}")
            setattr(self, k, v)
        if self._transport is not None:
            self._send()

    def body(self, *, bye: bool = False) -> dict[str, Any]:
        self._seq += 1
        b: dict[str, Any] = {
            "cluster": self.cluster,
            "node": self.node_id,
            "inst": self.instance,
            "seq": self._seq,
            "ts": time.time(),
            "host": self.host or "",
            "port": self.port,
            "slot": self.slot,
            "epoch": self.epoch,
            "since": self.since,
            "standby": self.standby,
        }
        if bye:
            b["bye"] = True
        return b

    def _send(self, *, bye: bool = False) -> None:
        data = encode_beacon(self._key, self.body(bye=bye))
        for addr in self.beacon_addrs + self.unicast:
            try:
                self._transport.sendto(data, (addr, self.beacon_port))
                self.stats["sent"] += 1
            except OSError as e:
                self.stats["send_errors"] += 1
                log.debug("beacon to %s:%d failed: %s", addr, self.beacon_port, e)

    async def _run(self) -> None:
        while True:
            self._send()
            self._expire()
            await asyncio.sleep(self.interval * random.uniform(0.8, 1.2))

    # ---------------------------------------------------------------- receiving
    def _on_datagram(self, data: bytes, addr: tuple[str, int]) -> None:
        self.stats["received"] += 1
        if self.drop_received:
            self.stats["dropped"] += 1
            return
        try:
            b = decode_beacon(self._key, data)
        except BeaconError as e:
            self.stats[e.kind] += 1
            log.debug("ignored beacon from %s: %s", addr[0], e)
            return
        if b["cluster"] != self.cluster:
            self.stats["wrong_cluster"] += 1
            return
        if abs(time.time() - b["ts"]) > self.max_skew:
            self.stats["stale"] += 1
            log.debug(
                "ignored beacon from %s: timestamp %.1f s off (clocks out of sync?)", addr[0], time.time() - b["ts"]
            )
            return
        node, inst = b["node"], b["inst"]
        if node == self.node_id:
            if inst == self.instance:
                self.stats["own"] += 1
            else:
                self.stats["duplicate_id"] += 1
                if inst not in self._dup_warned:
                    self._dup_warned.add(inst)
                    log.warning(
                        "another process at %s uses this node id %r: node ids must be unique "
                        "(copied config or state directory?)",
                        addr[0],
                        node,
                    )
            return
        last = self._seqs.get((node, inst))
        if last is not None and b["seq"] <= last:
            self.stats["replayed"] += 1
            return
        self._seqs[(node, inst)] = b["seq"]
        self.stats["accepted"] += 1
        now = time.monotonic()
        old = self._peers.get(node)
        if b.get("bye"):
            if old is not None and old.instance == inst:
                del self._peers[node]
                self._event("leave", old)
            if self.claims is not None:
                self.claims.forget(node)
            return
        if old is not None and old.instance != inst and old.last_seen > now - self.expiry:
            # two live instances with one id (or a restart): the newest beacon wins; warn once
            if inst not in self._dup_warned and old.host != (b["host"] or addr[0]):
                self._dup_warned.add(inst)
                log.warning(
                    "node id %r is announced from %s and from %s: duplicate node ids?",
                    node,
                    old.host,
                    b["host"] or addr[0],
                )
        peer = PeerInfo(
            node,
            b["host"] or addr[0],
            b["port"],
            b.get("slot"),
            b["epoch"],
            b.get("since"),
            now,
            inst,
            bool(b.get("standby", False)),
            "beacon",
            addr,
        )
        self._peers[node] = peer
        if old is None:
            log.info(
                "discovered node %r at %s:%d (slot %s, epoch %d)", node, peer.host, peer.port, peer.slot, peer.epoch
            )
            self._event("join", peer)
        elif (old.host, old.port, old.slot, old.epoch, old.instance) != (
            peer.host,
            peer.port,
            peer.slot,
            peer.epoch,
            inst,
        ):
            self._event("update", peer)
        if self.claims is not None:
            self.claims.observe(node, peer.slot, peer.epoch, since=peer.since)

    def _event(self, ev: str, peer: PeerInfo) -> None:
        self._changed.set()
        if self.on_event is not None:
            try:
                self.on_event(ev, peer)
            except Exception:
                log.exception("discovery on_event callback failed")

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.expiry
        for node, p in list(self._peers.items()):
            if p.last_seen < cutoff:
                del self._peers[node]
                log.info("node %r at %s:%d went silent (no beacon for %.0f s)", node, p.host, p.port, self.expiry)
                self._event("leave", p)

    # ---------------------------------------------------------------- queries
    def peers(self) -> dict[str, PeerInfo]:
        """Live peers (node id -> PeerInfo), beacons only."""
        self._expire()
        return {k: replace(v) for k, v in self._peers.items()}

    def resolve_slot(self, slot: str) -> PeerInfo | None:
        """The live peer claiming `slot` (highest epoch), else the topology's static address, else None."""
        live = [p for p in self.peers().values() if p.slot == slot]
        if live:
            return max(live, key=lambda p: (p.epoch, [-ord(c) for c in p.node_id]))
        if slot in self.static:
            h, p = self.static[slot]
            return PeerInfo("", h, p, slot, source="static")
        return None

    async def wait_for(self, predicate: Callable[[dict[str, PeerInfo]], bool], timeout: float) -> dict[str, PeerInfo]:
        """Wait until predicate(peers()) holds; asyncio.TimeoutError after `timeout` seconds."""

        async def loop() -> dict[str, PeerInfo]:
            while True:
                ps = self.peers()
                if predicate(ps):
                    return ps
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), self.interval)
                except asyncio.TimeoutError:
                    pass

        return await asyncio.wait_for(loop(), timeout)


def broadcast_addresses() -> list[str]:
    """IPv4 broadcast addresses of the up interfaces (Linux, via `ip -j addr`); [] if unavailable."""
    import json
    import shutil
    import subprocess

    if not shutil.which("ip"):
        return []
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show", "up"], capture_output=True, text=True, timeout=5).stdout
        data = json.loads(out or "[]")
    except (OSError, ValueError, subprocess.SubprocessError):
        return []
    addrs = []
    for itf in data:
        if "LOOPBACK" in itf.get("flags", []):
            continue
        for a in itf.get("addr_info", []):
            if a.get("broadcast"):
                addrs.append(a["broadcast"])
    return addrs


__all__ = [
    "Discovery",
    "PeerInfo",
    "encode_beacon",
    "decode_beacon",
    "beacon_key",
    "BeaconError",
    "broadcast_addresses",
    "DEFAULT_BEACON_PORT",
]
