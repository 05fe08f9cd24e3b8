"""The spare pool: standbys beyond the topology's standby slots, so that a ring gets back to full
redundancy after a takeover (docs/architecture.md, "Back to full redundancy").

A topology names a few standby slots, each with one address; once its spare has taken a slot over, that
address serves the slot, and a second spare has nowhere to go. A *pool spare* is a standby that no
topology slot names: `p2pk3 node --standby` without `--slot` (or a former holder whose slot was taken,
with `--rejoin-as-standby`) listens on any free port, claims nothing, and tells the entry it is there
with a `join` frame every JOIN_EVERY_S (so a new entry, after an entry takeover, learns it too). With
discovery on, the entry also hears its beacons (standby, no slot). The entry watches every pool spare
with its failure detector, like a standby slot, and the next failure takes the first that answers as a
standby (the `takeover` frame); a spare that stops joining for FORGET_AFTER_S is forgotten.

Entry side: `SparePool` (`join`, `heard`, `keys`, `address`, `taken`, `rows`) and `handle_join`. Spare
side: `with_pool_slot` (the topology as the spare sees it: one more standby slot, POOL_SLOT, without an
address) and `join_pool`. Like claiming.py, the two handlers take the daemon and use only its routes,
secret, ids, role, pool and coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from p2pk3.topology import Slot, Topology
from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.connection import AuthenticationError
from p2pk3.transport.messages import (
    ErrorCode,
    error_frame,
    join_frame,
    joined_frame,
    parse_error,
    parse_join,
    parse_joined,
)

log = logging.getLogger("p2pk3.node")

POOL_SLOT = "pool"  # the slot id a pool spare gives itself (no topology names it)
KEY_PREFIX = "spare:"  # the entry watches a pool spare under "spare:<node id>"
JOIN_EVERY_S = 2.0
FORGET_AFTER_S = 30.0


def spare_key(node_id: str) -> str:
    return KEY_PREFIX + node_id


@dataclass
class Spare:
    node: str
    address: tuple[str, int]
    joined: float = field(default_factory=time.monotonic)  # first heard
    last: float = field(default_factory=time.monotonic)  # last join (or beacon)
    via: str = "join"  # "join" | "discovery"


class SparePool:
    """The entry's pool spares, by watch key. `clock` is injectable for tests."""

    def __init__(self, *, forget_after_s: float = FORGET_AFTER_S, clock: Callable[[], float] = time.monotonic):
        self.forget_after_s, self.clock = forget_after_s, clock
        self.spares: dict[str, Spare] = {}

    def join(self, node: str, address: tuple[str, int], via: str = "join") -> bool:
        """A spare said it is there (again). True when it is new to the pool (or moved)."""
        key, now = spare_key(node), self.clock()
        old = self.spares.get(key)
        if old is not None and old.address == address:
            old.last = now
            return False
        self.spares[key] = Spare(node, address, now, now, via)
        log.warning("spare %s joined the pool at %s:%d (%s)", node, *address, via)
        return True

    def heard(self, peers) -> None:
        """Discovery's live peers (node id -> PeerInfo): a standby beacon without a slot is a pool spare."""
        for nid, p in peers.items():
            if p.standby and p.slot is None:
                self.join(nid, p.address, via="discovery")

    def keys(self) -> list[str]:
        """The spares to watch, oldest first (those not heard for forget_after_s are dropped)."""
        now = self.clock()
        for k in [k for k, s in self.spares.items() if now - s.last > self.forget_after_s]:
            log.info("spare %s left the pool (not heard for %.0f s)", self.spares[k].node, self.forget_after_s)
            del self.spares[k]
        return sorted(self.spares, key=lambda k: self.spares[k].joined)

    def address(self, key: str) -> tuple[str, int] | None:
        s = self.spares.get(key)
        return s.address if s is not None else None

    def taken(self, key: str) -> None:
        """The spare took a slot over: it is no spare any more."""
        self.spares.pop(key, None)

    def rows(self, state_of: Callable[[str], object]) -> list[dict]:
        """For the status and the dashboard: each spare with its detector state (`state_of(key)`: a
        monitor.PeerState or None); `ready`: it answers heartbeats as a standby."""
        out = []
        for k in self.keys():
            s, ps = self.spares[k], state_of(k)
            state = ps.state if ps is not None else "unknown"
            ready = state == "up" and ps.info.get("role") == "standby"
            out.append({"node": s.node, "address": list(s.address), "state": state, "ready": ready, "via": s.via})
        return out


# ---------------------------------------------------------------------- spare side
def with_pool_slot(topo: Topology) -> Topology:
    """The topology as a pool spare sees it: the same slots plus a standby slot POOL_SLOT (no address)."""
    if any(s.id == POOL_SLOT for s in topo.slots):
        raise ValueError(f"the topology has a slot named {POOL_SLOT!r}, the id pool spares use; rename that slot")
    return replace(topo, slots=[*topo.slots, Slot(POOL_SLOT, standby=True)])


async def join_pool(d) -> None:
    """On a pool spare (the daemon `d`): tell the entry that this spare listens at its advertised address,
    every JOIN_EVERY_S while it is a standby. Says once when it joined, and why a join fails."""
    said_joined, last_error = None, None
    while d.role == "standby":
        try:
            entry_node, n = await _join_once(d)
            if said_joined != entry_node:
                log.warning("joined the spare pool of entry %s (%d spare%s ready or joining)", entry_node, n,
                            "" if n == 1 else "s")
                said_joined = entry_node
            last_error = None
        except asyncio.CancelledError:
            raise
        except AuthenticationError as e:
            msg = f"the entry refused this spare's handshake ({e}): is the topology's secret_file the ring's?"
            if msg != last_error:
                log.error("%s", msg)
                last_error = msg
        except Exception as e:  # noqa: BLE001 - the entry is down or moving: try again
            msg = f"could not join the spare pool at the entry ({type(e).__name__}: {e}); retrying"
            if msg != last_error:
                log.warning("%s", msg)
                last_error = msg
            said_joined = None
        await asyncio.sleep(JOIN_EVERY_S)


async def _join_once(d) -> tuple[str, int]:
    """One `join`: at the entry's address as the route table knows it, else at every slot's address of the
    topology (a pool spare gets no `route` frames: after an entry takeover the old address is dead), and
    where a node without the entry role says the entry is now (its `not_entry` answer's `entry`)."""
    from .failover import request  # (failover.py imports this module for SparePool)

    def addr(slot):
        try:
            return d.routes.address(slot)
        except ConnectionError:
            return None

    todo = [a for a in [addr(d.topo.active[0].id), *(addr(s.id) for s in d.topo.slots)] if a is not None]
    tried, last = set(), "no address known for the entry"
    frame = join_frame(d.node_id, d.advertised_host, d.port)
    while todo:
        a = todo.pop(0)
        if a in tried or a == (d.advertised_host, d.port):
            continue
        tried.add(a)
        try:
            reply = await request(a, d.secret, d.node_id, frame, 5.0)
        except AuthenticationError:
            raise
        except Exception as e:  # noqa: BLE001 - that one is down: the next
            last = f"{a[0]}:{a[1]}: {type(e).__name__}: {e}"
            continue
        if reply.kind == "joined":
            return parse_joined(reply)
        err = parse_error(reply)
        last = f"{a[0]}:{a[1]}: {err.code}: {err.message}"
        hint = reply.header.get("entry")
        if isinstance(hint, list) and len(hint) == 2 and isinstance(hint[0], str) and isinstance(hint[1], int):
            todo.insert(0, (hint[0], hint[1]))
    raise ConnectionError(last)


async def handle_join(d, conn, f: Frame) -> None:
    """On the entry (the daemon `d`): a `join` from a pool spare; answered with `joined` (or `not_entry`)."""
    node, host, port = parse_join(f)
    if node != conn.peer_id:
        raise ProtocolError(f"join frame for node {node[:64]!r} from node {conn.peer_id!r}")
    if d.coordinator is None:
        try:
            where = {"entry": list(d.routes.address(d.topo.active[0].id))}  # where this node thinks it is
        except ConnectionError:
            where = {}
        await conn.send(error_frame(ErrorCode.NOT_ENTRY, f"slot {d.slot_id} has no entry role ({d.role})", **where))
        return
    seen = conn.peer_addr[0] if conn.peer_addr else None
    if host in ("127.0.0.1", "localhost") and seen and not seen.startswith("127."):
        host = seen  # a spare on another host that advertises loopback (listening on 0.0.0.0, no --advertise-host)
    if d.spares.join(node, (host, port)):
        d.coordinator.events.append({"event": "spare_joined", "node": node, "t": time.time()})
        d.coordinator.on_change(spare_key(node), None)  # a repair waiting for a standby looks again
    await conn.send(joined_frame(d.node_id, len(d.spares.keys())))
