"""What a dead slot means, decided where the failure detector runs (docs/architecture.md, "Failure
handling").

On the ENTRY (it watches every other active slot and every standby): a slot that was up and stops
answering — or one never seen up `startup_grace_s` after start — is DOWN. The entry pauses scheduling,
asks the first live standby to take the slot over (`takeover` frame: the standby loads exactly that
slot's weights and claims it at a new epoch, naming the dead holder so the claim protocol does not wait
for its lease), announces the new route to every node (the predecessor re-dials), then replays every
live session (entry.replay_all) and tells each stage which sessions are still alive (`retain`), so
every stage agrees. With no live standby, the sessions in flight end with an `unavailable` error naming
the slot and new requests are refused with that reason, until the slot answers again (restarted) or a
standby appears; then service resumes by itself.

On a STANDBY (it watches the entry slot and the other standbys): when the entry slot dies, the first
live standby in topology order takes the entry slot and its role; clients resume on it (node/client.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Awaitable, Callable

from p2pk3.topology import Topology
from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.connection import open_connection
from p2pk3.transport.messages import ErrorCode, parse_error, parse_route, retain_frame, route_frame, takeover_frame

from .entry import Entry
from .links import DIAL_ERRORS
from .monitor import DEAD, DOWN, UP, Monitor, PeerState
from .options import NodeOptions
from .routes import RouteTable
from .spares import SparePool

log = logging.getLogger("p2pk3.node")

TAKEOVER_TIMEOUT_S = 300.0  # loading a K3 slot from local NVMe takes tens of seconds

HolderOf = Callable[[str, "PeerState | None"], "tuple[str, int] | None"]
Request = Callable[[tuple[str, int], Frame, float], Awaitable[Frame]]


async def request(addr: tuple[str, int], secret: bytes, node_id: str, frame: Frame, timeout: float) -> Frame:
    """One request/response on a fresh connection, with a deadline."""
    conn = await open_connection(*addr, secret, node_id, timeout=min(timeout, 5.0), handshake_timeout=min(timeout, 5.0))
    try:
        await asyncio.wait_for(conn.send(frame), timeout)
        return await asyncio.wait_for(conn.recv(), timeout)
    finally:
        conn.close("request done")


class Coordinator:
    """The entry's repair loop. It is given what it reads and does, not the daemon: `entry` (its sessions),
    `slot_id` (the entry's own slot), `topo` (which slots are active / standby), `opts` (the timings),
    `routes` (where slots are served; it announces the new route), `holder_of(slot, state)` (the claim a
    takeover replaces), `mark_dead(slot, node, epoch)` (void that claim), `broadcast(frame, stages_only=)`
    (to every other node), `retain(sessions)` (apply a `retain` on this node too) and `request(addr, frame,
    timeout)` (one request / reply with a standby); `spares` (node/spares.py: the pool spares beyond the
    topology's standby slots, watched under their keys). The failure detector comes with `start(monitor)`."""

    def __init__(
        self,
        entry: Entry,
        *,
        slot_id: str,
        topo: Topology,
        opts: NodeOptions,
        routes: RouteTable,
        holder_of: HolderOf,
        mark_dead: Callable[[str, str, int], object],
        broadcast: Callable[..., Awaitable[None]],
        retain: Callable[[dict[str, int]], None],
        request: Request,
        spares: SparePool | None = None,
        degraded=None,
    ):
        self.entry, self.slot_id, self.topo, self.opts, self.routes = entry, slot_id, topo, opts, routes
        self.spares = spares
        self.holder_of, self.mark_dead, self.broadcast, self.retain, self.request = (
            holder_of,
            mark_dead,
            broadcast,
            retain,
            request,
        )
        self.monitor: Monitor | None = None
        self.degraded = degraded  # node/degraded.py DegradedWatch: a slow stage is repaired like a dead one
        self.down: dict[str, PeerState] = {}  # active slots that are down, by slot id
        self.unavailable: str | None = None  # why requests are refused (no standby for a down slot)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.started = time.monotonic()
        self.events: list[dict] = []  # detection / recovery log (status, tests, docs)
        self._last_retain = time.monotonic()

    def start(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self._task = asyncio.create_task(self._run(), name="failover")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ detector events
    def on_change(self, slot: str, ps: PeerState) -> None:
        self._wake.set()

    def health(self) -> tuple[str, str] | None:
        """None when a request can be served now, else (ErrorCode, reason). A slot that has never answered
        (its node not started, a wrong address) refuses requests at once rather than letting them wait."""
        if self.unavailable:
            return ErrorCode.UNAVAILABLE, self.unavailable
        m, o = self.monitor, self.opts
        if m is not None and not self.entry.paused:
            now = time.monotonic()
            for s in self.topo.active:
                ps = m.state(s.id)
                # a slot still starting gets a detector period's grace (its link re-dials meanwhile)
                if (
                    s.id != self.slot_id
                    and ps is not None
                    and ps.state == DOWN
                    and now - ps.since > o.heartbeat_s + o.dead_after_s
                ):
                    return ErrorCode.UNAVAILABLE, (
                        f"slot {s.id} is not reachable ({ps.reason}); start its node "
                        f"(`p2pk3 node --topology ... --slot {s.id}`)"
                    )
        return None

    def _live_standbys(self) -> list[str]:
        """The standby slots, then the pool spares, that answer heartbeats as standbys now."""
        m = self.monitor
        out = []
        for key in [s.id for s in self.topo.standby] + (self.spares.keys() if self.spares else []):
            ps = m.state(key) if m else None
            if ps is not None and ps.state == UP and ps.info.get("role") == "standby":
                out.append(key)
        return out

    def _standby_address(self, key: str) -> tuple[str, int]:
        a = self.spares.address(key) if self.spares is not None else None
        return a if a is not None else self.routes.address(key)

    def _scan(self) -> None:
        """Recompute which active slots are down from the detector's states."""
        m = self.monitor
        grace = time.monotonic() - self.started > self.opts.startup_grace_s
        for s in self.topo.active:
            if s.id == self.slot_id:
                continue
            ps = m.state(s.id)
            if ps is None:
                continue
            if ps.state == DEAD or (ps.state == DOWN and grace):
                if s.id not in self.down:
                    self.down[s.id] = ps
                    holder = self.holder_of(s.id, ps)
                    if holder is not None:  # never seen up (DOWN after the grace): void its claim too
                        self.mark_dead(s.id, *holder)
                    self.events.append({"event": "down", "slot": s.id, "t": time.time(), "reason": ps.reason})
            elif ps.state == UP and s.id in self.down:
                del self.down[s.id]
                self.events.append({"event": "up", "slot": s.id, "t": time.time(), "node": ps.info.get("node")})

    # ------------------------------------------------------------------ the repair loop
    async def _run(self) -> None:
        entry = self.entry
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.opts.heartbeat_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            entry.expire(self.opts.unit_timeout_s)
            await self._retain_now_and_then(entry)
            self._scan()
            if not self.down and self.degraded is not None and not entry.paused:
                slot = await self.degraded.check(self._live_standbys())
                if slot is not None:  # its holder stepped down: a standby takes it over, sessions replay
                    ev = self.degraded.events[-1]
                    self.down[slot] = replace(self.monitor.state(slot), reason=f"degraded, {ev['slowdown']}x slower")
                    self.events.append(ev)
            if not self.down:
                if self.unavailable or entry.paused:
                    await self._recovered("the ring is whole again")
                continue
            try:
                await self._repair()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("repair failed; retrying")

    async def _retain_now_and_then(self, entry) -> None:
        """Every `retain_every_s` the stages learn which sessions are alive (`retain`): state that a lost
        `free` (a link that broke), a failed request or a hostile peer left behind is freed, so a stage's
        rows never fill up with sessions nobody will finish."""
        now = time.monotonic()
        if now - self._last_retain < self.opts.retain_every_s or entry.paused or self.down:
            return
        self._last_retain = now
        live = [(s.id, s.epoch) for s in entry.live()]
        await self.broadcast(retain_frame(live), stages_only=True)
        self.retain(dict(live))

    async def _repair(self) -> None:
        entry = self.entry
        slot = next(s.id for s in self.topo.active if s.id in self.down)
        ps = self.down[slot]
        standbys = self._live_standbys()
        if not standbys:
            why = (
                f"slot {slot} is down ({ps.reason}) and no standby is available to take it over; "
                f"start a spare on any host (`p2pk3 node --topology ... --standby`: it joins at once) "
                f"or restart the slot's node"
            )
            if self.unavailable != why:
                log.error("%s", why)
                self.unavailable = why
                self.events.append({"event": "unavailable", "slot": slot, "t": time.time()})
            entry.fail_all(why, code=ErrorCode.UNAVAILABLE)
            return
        if not entry.paused:
            entry.pause(f"repairing slot {slot}")
            entry.replay_all()
        replaces = self.holder_of(slot, ps)
        sb = standbys[0]
        log.warning("slot %s is down (%s): asking standby %s to take it over", slot, ps.reason, sb)
        t0 = time.time()
        try:
            reply = await self.request(self._standby_address(sb), takeover_frame(slot, replaces), TAKEOVER_TIMEOUT_S)
            if reply.kind == "error":
                e = parse_error(reply)
                raise ConnectionError(f"{e.code}: {e.message}")
            route = parse_route(reply)
        except (*DIAL_ERRORS, ProtocolError) as e:
            log.error("standby %s could not take over slot %s: %s", sb, slot, e)
            self.events.append(
                {"event": "takeover_failed", "slot": slot, "standby": sb, "t": time.time(), "error": str(e)}
            )
            await asyncio.sleep(self.opts.heartbeat_s)
            return
        self.routes.announce(route)
        if self.spares is not None:
            self.spares.taken(sb)  # a pool spare serves the slot now
        self.monitor.moved(slot)
        await self.broadcast(route_frame(route))
        self.events.append(
            {
                "event": "takeover",
                "slot": slot,
                "standby": sb,
                "node": route.node,
                "epoch": route.epoch,
                "t": time.time(),
                "takeover_s": time.time() - t0,
            }
        )
        del self.down[slot]
        log.warning("slot %s now served by %s (epoch %d)", slot, route.node, route.epoch)

    async def _recovered(self, why: str) -> None:
        entry = self.entry
        self.unavailable = None
        if not entry.paused:
            entry.replay_all()
        live = [(s.id, s.epoch) for s in entry.live()]
        await self.broadcast(retain_frame(live), stages_only=True)
        self.retain(dict(live))
        entry.resume()
        log.warning(
            "%s: %d session%s continue%s", why, len(live), "" if len(live) == 1 else "s", "s" if len(live) == 1 else ""
        )
        self.events.append({"event": "recovered", "t": time.time()})


# ---------------------------------------------------------------------- standby side
def entry_lost(monitor: Monitor, topo: Topology, slot_id: str, grace_left_s: float) -> bool | float:
    """On a standby (`slot_id`): is the entry slot lost and am I the standby that must take it? Lost: DEAD
    (answered, then stopped), or DOWN without ever answering once the start-up grace (`grace_left_s`: what
    is left of it, counted from this daemon's start) is over. Returns the seconds left of that grace when
    the entry has never answered yet, so that the caller looks again then."""
    ps = monitor.state(topo.active[0].id)
    if ps is None or ps.state not in (DEAD, DOWN):
        return False
    if ps.state == DOWN and grace_left_s > 0:
        return max(grace_left_s, 0.05)
    live = [
        s.id
        for s in topo.standby
        if s.id == slot_id
        or ((p := monitor.state(s.id)) is not None and p.state == UP and p.info.get("role") == "standby")
    ]
    return bool(live) and live[0] == slot_id
