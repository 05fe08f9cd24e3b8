"""Slot claims with epochs: who runs which ring slot, decided by every daemon on its own.

Model (docs/topology.md, "Slot claims"):

* A claim is (slot, node, epoch). Epochs of a slot only grow: the n-th hand-over of a slot gets an epoch
  above every epoch that slot had. Claims are totally ordered: A beats B when A.epoch > B.epoch, or the
  epochs are equal and A.node < B.node (string order). Every daemon applies the same order to the same
  information, so views converge without a central process.
* Each daemon keeps a ClaimTable fed by the beacons it sees (`observe`) and by direct claim messages.
  The best claim ever seen for a slot is its record; the record's holder is LIVE while its beacons keep
  arriving (within `lease_s`) and it has not released the slot. A node holds at most one slot:
  announcing another slot (or none) releases the previous one.
* A stale claim (one that the record beats: a returning node with an older epoch) is ignored. A node
  whose own claim is beaten learns it has lost the slot (`on_lost`).
* Taking a slot (`negotiate_claim`): refused at once if the local view has a live holder; otherwise the
  claimant picks epoch = highest known + 1 and sends a `claim` request to every reachable peer. A peer
  refuses when it sees a live holder, when the epoch is not above the slot's record, or when it knows a
  competing claim (its own pending one, or one it has granted in the last `promise_s`) that beats this
  one; otherwise it grants and remembers the grant. The claimant takes the slot only if no reachable
  peer refused and its own pending claim was not beaten meanwhile; then it announces the claim (commit
  message + beacons). Two racing claimants ask each other, so exactly one of them wins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Awaitable, Callable, Iterable, Mapping

from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.messages import (
    ClaimHolder,
    ClaimMessage,
    ClaimResult,
    claim_frame,
    claim_result_frame,
    parse_claim_result,
)

log = logging.getLogger("p2pk3.claims")


class ClaimRefused(Exception):
    """The slot cannot be taken; the message says who holds it."""

    def __init__(self, message: str, holder: "Claim | None" = None):
        super().__init__(message)
        self.holder = holder


def _beats(e1: int, n1: str, e2: int, n2: str) -> bool:
    return e1 > e2 or (e1 == e2 and n1 < n2)


def fmt_time(t: float | None) -> str:
    if t is None:
        return "an unknown time"
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass
class Claim:
    slot: str
    node: str
    epoch: int
    since: float | None = None  # unix time the holder took the slot
    last_seen: float = 0.0  # our clock (ClaimTable.clock) at the last observation
    released: bool = False

    def beats(self, other: "Claim") -> bool:
        return _beats(self.epoch, self.node, other.epoch, other.node)

    def describe(self) -> str:
        return f"node {self.node} (epoch {self.epoch}) since {fmt_time(self.since)}"


@dataclass
class Decision:
    granted: bool
    reason: str
    holder: Claim | None = None  # the deciding node's record of the slot (when it has one)
    epoch: int = 0  # the highest epoch the deciding node knows for the slot
    code: str = "granted"  # granted | held | stale | competing | forbidden
    live: bool = False  # whether `holder` is live in the deciding node's view


class ClaimTable:
    """The claim state machine one daemon runs. Pure (no I/O); `clock` is injectable for tests."""

    def __init__(
        self,
        node_id: str,
        *,
        lease_s: float = 10.0,
        promise_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        on_lost: Callable[[Claim, Claim], None] | None = None,
    ):
        self.node_id = node_id
        self.lease_s = lease_s
        self.promise_s = promise_s
        self.clock = clock
        self.on_lost = on_lost  # (our lost claim, the claim that beat it)
        self.records: dict[str, Claim] = {}  # slot -> best claim seen
        self.mine: Claim | None = None  # the slot we hold
        self._pending: dict[str, int] = {}  # slot -> epoch of our claim in progress
        self._pending_lost: dict[str, str] = {}  # slot -> why our pending claim lost
        self._promises: dict[str, tuple[int, str, float]] = {}  # slot -> (epoch, node, expires)

    # ---------------------------------------------------------------- queries
    def record(self, slot: str) -> Claim | None:
        r = self.records.get(slot)
        return replace(r) if r else None

    def max_epoch(self, slot: str) -> int:
        r = self.records.get(slot)
        return r.epoch if r else 0

    def is_live(self, c: Claim, now: float | None = None) -> bool:
        if c.released:
            return False
        if c.node == self.node_id:
            return self.mine is not None and self.mine.slot == c.slot and self.mine.epoch == c.epoch
        now = self.clock() if now is None else now
        return now - c.last_seen <= self.lease_s

    def holder(self, slot: str) -> Claim | None:
        """The live holder of `slot`, or None."""
        r = self.records.get(slot)
        return replace(r) if r is not None and self.is_live(r) else None

    # ---------------------------------------------------------------- observations
    def observe(self, node: str, slot: str | None, epoch: int, since: float | None = None) -> str:
        """A node announces that it holds `slot` at `epoch` (slot None: it holds nothing). Returns
        "new", "refresh", "stale" (ignored: the record beats it), "released", "superseded" (it beat
        our own claim: we lost the slot) or "self"."""
        now = self.clock()
        if node == self.node_id:
            return "self"
        # a node holds one slot: announcing another (or none) releases what it held
        for s, r in self.records.items():
            if r.node == node and s != slot and not r.released:
                r.released = True
                log.info("node %s released slot %s (epoch %d)", node, s, r.epoch)
        if slot is None:
            return "released"
        r = self.records.get(slot)
        if r is not None and r.node == node and r.epoch == epoch:
            r.last_seen = now
            r.released = False
            if since is not None:
                r.since = since
            return "refresh"
        if r is not None and not _beats(epoch, node, r.epoch, r.node):
            return "stale"
        new = Claim(slot, node, epoch, since, now)
        self.records[slot] = new
        p = self._promises.get(slot)
        if p is not None and not _beats(p[0], p[1], epoch, node):
            del self._promises[slot]
        if slot in self._pending and not _beats(self._pending[slot], self.node_id, epoch, node):
            self._pending_lost[slot] = f"slot {slot} was taken by {new.describe()}"
        if self.mine is not None and self.mine.slot == slot:
            lost = self.mine
            self.mine = None
            log.warning("lost slot %s (our epoch %d) to %s", slot, lost.epoch, new.describe())
            if self.on_lost is not None:
                self.on_lost(lost, replace(new))
            return "superseded"
        return "new"

    def mark_dead(self, slot: str, node: str, epoch: int) -> bool:
        """The failure detector declared `node`'s claim of `slot` at `epoch` dead (a takeover names it):
        the record stays (its epoch bounds the next claim) but no longer counts as a live holder. Our
        own live claim is never marked dead by others: a holder that is alive refuses the takeover."""
        r = self.records.get(slot)
        if r is None or r.node != node or r.epoch != epoch or node == self.node_id:
            return False
        r.released = True
        return True

    def forget(self, node: str) -> None:
        """The node left (bye beacon): its slot is free; the record keeps its epoch."""
        for r in self.records.values():
            if r.node == node:
                r.released = True

    # ---------------------------------------------------------------- deciding
    def decide(self, slot: str, node: str, epoch: int) -> Decision:
        """Our answer to `node` asking to take `slot` at `epoch` (a grant is remembered as a promise)."""
        now = self.clock()
        me = self.node_id
        r = self.records.get(slot)
        top = r.epoch if r else 0
        h = r if r is not None and self.is_live(r, now) else None
        if h is not None and h.node != node:
            return Decision(False, f"slot {slot} is held by {h.describe()}", replace(h), top, "held", True)
        if r is not None and not (h is not None and h.node == node and h.epoch == epoch) and epoch <= r.epoch:
            if r.node != node:
                why = (
                    f"slot {slot} was handed over to node {r.node} at epoch {r.epoch}; "
                    f"a claim at epoch {epoch} is stale"
                )
            else:
                why = f"claim epoch {epoch} for slot {slot} is stale (the slot is at epoch {r.epoch})"
            return Decision(False, why, replace(r), top, "stale", False)
        if slot in self._pending and node != me:
            pe = self._pending[slot]
            if _beats(pe, me, epoch, node):
                return Decision(
                    False,
                    f"node {me} is claiming slot {slot} at epoch {pe}, which wins over "
                    f"node {node}'s claim at epoch {epoch}",
                    None,
                    max(top, pe),
                    "competing",
                )
            self._pending_lost[slot] = f"node {node} claimed slot {slot} at epoch {epoch}, which wins over ours ({pe})"
        p = self._promises.get(slot)
        if p is not None and p[2] > now and p[1] != node and not _beats(epoch, node, p[0], p[1]):
            return Decision(
                False, f"slot {slot} is being claimed by node {p[1]} (epoch {p[0]})", None, max(top, p[0]), "competing"
            )
        if node != me:
            self._promises[slot] = (epoch, node, now + self.promise_s)
        return Decision(True, "granted", replace(h) if h else None, max(top, epoch), "granted", h is not None)

    # ---------------------------------------------------------------- our own claims
    def begin(self, slot: str, epoch: int | None = None) -> int:
        """Start claiming `slot`: refuse at once if our view says it is taken; returns the epoch to claim."""
        if self.mine is not None and self.mine.slot == slot:
            return self.mine.epoch
        h = self.holder(slot)
        if h is not None:
            raise ClaimRefused(f"slot {slot} is held by {h.describe()}", h)
        e = self.max_epoch(slot) + 1 if epoch is None else epoch
        d = self.decide(slot, self.node_id, e)
        if not d.granted:
            raise ClaimRefused(d.reason, d.holder)
        self._pending[slot] = e
        self._pending_lost.pop(slot, None)
        return e

    def learn(self, slot: str, holder: ClaimHolder | None) -> None:
        """Take in the slot record a refusing peer sent (a live holder counts as a fresh observation;
        a dead one only raises the epoch our next claim must exceed)."""
        if holder is None:
            return
        node, epoch, since = holder.node, holder.epoch, holder.since
        if holder.live:
            if node != self.node_id:
                self.observe(node, slot, epoch, since)
            return
        r = self.records.get(slot)
        if r is None or _beats(epoch, node, r.epoch, r.node):
            self.records[slot] = Claim(slot, node, epoch, since, 0.0, released=True)
            if self.mine is not None and self.mine.slot == slot and node != self.node_id:
                lost, self.mine = self.mine, None
                if self.on_lost is not None:
                    self.on_lost(lost, replace(self.records[slot]))

    def commit(self, slot: str, epoch: int) -> Claim:
        """Our claim was granted by every reachable peer: we hold the slot now."""
        if self._pending.get(slot) != epoch:
            raise ClaimRefused(f"no pending claim for slot {slot} at epoch {epoch}")
        lost = self._pending_lost.pop(slot, None)
        del self._pending[slot]
        if lost is not None:
            raise ClaimRefused(lost, self.holder(slot))
        r = self.records.get(slot)
        if r is not None and not _beats(epoch, self.node_id, r.epoch, r.node):
            raise ClaimRefused(f"slot {slot} was taken by {r.describe()} meanwhile", replace(r))
        now = self.clock()
        if self.mine is not None and self.mine.slot != slot:
            self.release()
        c = Claim(slot, self.node_id, epoch, now, now)
        self.records[slot] = c
        self.mine = c
        log.info("took slot %s at epoch %d", slot, epoch)
        return replace(c)

    def abort(self, slot: str) -> None:
        self._pending.pop(slot, None)
        self._pending_lost.pop(slot, None)

    def release(self) -> Claim | None:
        """Give up our slot (the record keeps the epoch, so the next holder goes above it)."""
        c = self.mine
        if c is None:
            return None
        self.mine = None
        r = self.records.get(c.slot)
        if r is not None and r.node == self.node_id:
            r.released = True
        log.info("released slot %s (epoch %d)", c.slot, c.epoch)
        return c

    def restore(self, slot: str, epoch: int, since: float | None = None) -> None:
        """A restarting node remembers the claim it had (persisted). It does NOT hold the slot again:
        it must negotiate; the remembered epoch only keeps its next claim above it."""
        r = self.records.get(slot)
        if r is None or _beats(epoch, self.node_id, r.epoch, r.node):
            self.records[slot] = Claim(slot, self.node_id, epoch, since, 0.0, released=True)


# ------------------------------------------------------------------------------------------- messages
def _reply(slot: str, d: Decision) -> Frame:
    h = d.holder
    holder = ClaimHolder(h.node, h.epoch, h.since, d.live) if h is not None else None
    return claim_result_frame(ClaimResult(slot, d.granted, d.code, d.reason, holder, d.epoch))


def handle_claim(table: ClaimTable, claim: ClaimMessage, *, peer_id: str | None = None) -> Frame | None:
    """Apply a received claim (`parse_claim` of a `claim` frame); returns the `claim_result` reply for
    requests (None otherwise). `peer_id`: the authenticated id of the sender; a claim on behalf of another
    node is refused."""
    c = claim
    if peer_id is not None and c.node != peer_id:
        return _reply(c.slot, Decision(False, f"node {peer_id} cannot claim for node {c.node}", code="forbidden"))
    if c.replaces is not None:
        table.mark_dead(c.slot, *c.replaces)
    if c.op == "commit":
        table.observe(c.node, c.slot, c.epoch, c.since)
        return None
    if c.op == "release":
        r = table.records.get(c.slot)
        if r is not None and r.node == c.node and r.epoch == c.epoch:
            r.released = True
        return None
    return _reply(c.slot, table.decide(c.slot, c.node, c.epoch))


Ask = Callable[[str, Frame], Awaitable[Frame | None]]
_REFUSAL_RANK = {"held": 0, "competing": 1, "forbidden": 2, "stale": 3}  # the most telling refusal is reported


async def negotiate_claim(
    table: ClaimTable,
    slot: str,
    peers: Iterable[str],
    ask: Ask,
    *,
    timeout: float = 2.0,
    retries: int = 1,
    notify: Callable[[str, Frame], Awaitable[None]] | None = None,
    replaces: tuple[str, int] | None = None,
) -> Claim:
    """Take `slot`: ask every peer (by id; `ask(peer, frame)` returns its claim_result frame, or None /
    raises when unreachable: an unreachable peer cannot object) and commit if nobody refused.
    Raises ClaimRefused with the reason (e.g. "slot s2 is held by node X (epoch 3) since ...")."""
    peers = [p for p in peers if p != table.node_id]
    if replaces is not None:
        table.mark_dead(slot, *replaces)
        # its epoch bounds ours even where no reachable peer knows it (the slot's epochs only grow)
        table.learn(slot, ClaimHolder(replaces[0], replaces[1], None, False))
    for attempt in range(retries + 1):
        epoch = table.begin(slot)
        if table.mine is not None and table.mine.slot == slot:
            return replace(table.mine)
        req = claim_frame(slot, table.node_id, epoch, replaces=replaces)

        async def one(p: str, req: Frame = req) -> Frame | None:
            try:
                return await asyncio.wait_for(ask(p, req), timeout)
            except (asyncio.TimeoutError, OSError, ConnectionError, ProtocolError) as e:
                log.info("claim of slot %s: peer %s unreachable (%s)", slot, p, e)
                return None

        replies = await asyncio.gather(*(one(p) for p in peers))
        refusal: str | None = None
        best = 99
        stale_only = True
        for p, r in zip(peers, replies):
            if r is None or r.kind != "claim_result":
                continue
            try:
                res = parse_claim_result(r)
            except ProtocolError as e:  # a reply we cannot read is no grant
                res = ClaimResult(slot, False, "bad_reply", f"malformed claim_result ({e})")
            if res.slot != slot or res.granted:
                continue
            table.learn(slot, res.holder)
            rank = _REFUSAL_RANK.get(res.code, 9)
            if refusal is None or rank < best:
                refusal, best = f"{res.reason} (refused by {p})", rank
            if res.code != "stale":
                stale_only = False
        if refusal is None:
            try:
                c = table.commit(slot, epoch)
            except ClaimRefused:
                table.abort(slot)
                raise
            if notify is not None:
                msg = claim_frame(slot, table.node_id, epoch, "commit", c.since)
                await asyncio.gather(*(notify(p, msg) for p in peers), return_exceptions=True)
            return c
        table.abort(slot)
        if not stale_only or attempt == retries:
            raise ClaimRefused(refusal, table.holder(slot))
        # refused only for a stale epoch: we learnt the current one; try again above it
    raise AssertionError("unreachable")  # pragma: no cover


def connection_asker(
    addresses: Mapping[str, tuple[str, int]], secret: bytes, node_id: str, *, connect_timeout: float = 2.0
) -> Ask:
    """An `ask` for negotiate_claim that opens an authenticated connection per request."""
    from p2pk3.transport.connection import open_connection

    async def ask(peer: str, frame: Frame) -> Frame | None:
        host, port = addresses[peer]
        conn = await open_connection(
            host, port, secret, node_id, timeout=connect_timeout, handshake_timeout=connect_timeout, expect_peer=peer
        )
        try:
            await conn.send(frame)
            if frame.header.get("op", "request") != "request":
                return None
            return await conn.recv()
        finally:
            conn.close("claim done")

    return ask


__all__ = [
    "Claim",
    "ClaimTable",
    "ClaimRefused",
    "Decision",
    "handle_claim",
    "negotiate_claim",
    "connection_asker",
    "fmt_time",
]
