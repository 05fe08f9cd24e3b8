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
from typing import TYPE_CHECKING

from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.connection import open_connection
from p2pk3.transport.messages import ErrorCode

from .links import DIAL_ERRORS
from .monitor import DEAD, DOWN, UP, PeerState
from .routes import parse_route, route_frame

if TYPE_CHECKING:
    from .daemon import NodeDaemon

log = logging.getLogger("p2pk3.node")

TAKEOVER_TIMEOUT_S = 300.0  # loading a K3 slot from local NVMe takes tens of seconds


def takeover_frame(slot: str, replaces: tuple[str, int] | None) -> Frame:
    extra = {"replaces": {"node": replaces[0], "epoch": replaces[1]}} if replaces else {}
    return Frame.make("takeover", slot=slot, **extra)


def parse_takeover(f: Frame) -> tuple[str, tuple[str, int] | None]:
    h = f.header
    rep = h.get("replaces")
    if not isinstance(h.get("slot"), str):
        raise ProtocolError("takeover frame needs a string 'slot'")
    if rep is not None:
        if not (isinstance(rep, dict) and isinstance(rep.get("node"), str) and isinstance(rep.get("epoch"), int)):
            raise ProtocolError("takeover frame: 'replaces' must be {node: str, epoch: int}")
        return h["slot"], (rep["node"], rep["epoch"])
    return h["slot"], None


def retain_frame(sessions: list[tuple[str, int]]) -> Frame:
    return Frame.make("retain", sessions=[[s, e] for s, e in sessions])


def parse_retain(f: Frame) -> dict[str, int]:
    ss = f.header.get("sessions")
    if not isinstance(ss, list) or not all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
                                           and isinstance(x[1], int) for x in ss):
        raise ProtocolError("retain frame: 'sessions' must be a list of [session, epoch]")
    return {s: e for s, e in ss}


async def request(addr: tuple[str, int], secret: bytes, node_id: str, frame: Frame, timeout: float) -> Frame:
    """One request/response on a fresh connection, with a deadline."""
    conn = await open_connection(*addr, secret, node_id, timeout=min(timeout, 5.0), handshake_timeout=min(timeout, 5.0))
    try:
        await asyncio.wait_for(conn.send(frame), timeout)
        return await asyncio.wait_for(conn.recv(), timeout)
    finally:
        conn.close("request done")


class Coordinator:
    def __init__(self, daemon: "NodeDaemon"):
        self.d = daemon
        self.down: dict[str, PeerState] = {}  # active slots that are down, by slot id
        self.unavailable: str | None = None  # why requests are refused (no standby for a down slot)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.started = time.monotonic()
        self.events: list[dict] = []  # detection / recovery log (status, tests, docs)
        self._last_retain = time.monotonic()

    def start(self) -> None:
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
        m = self.d.monitor
        o = self.d.opts
        if m is not None and (self.d.entry is None or not self.d.entry.paused):
            now = time.monotonic()
            for s in self.d.topo.active:
                ps = m.state(s.id)
                # a slot still starting gets a detector period's grace (its link re-dials meanwhile)
                if (s.id != self.d.slot_id and ps is not None and ps.state == DOWN
                        and now - ps.since > o.heartbeat_s + o.dead_after_s):
                    return ErrorCode.UNAVAILABLE, (f"slot {s.id} is not reachable ({ps.reason}); start its node "
                                                   f"(`p2pk3 node --topology ... --slot {s.id}`)")
        return None

    def _live_standbys(self) -> list[str]:
        m = self.d.monitor
        out = []
        for s in self.d.topo.standby:
            ps = m.state(s.id) if m else None
            if ps is not None and ps.state == UP and ps.info.get("role") == "standby":
                out.append(s.id)
        return out

    def _scan(self) -> None:
        """Recompute which active slots are down from the detector's states."""
        m = self.d.monitor
        grace = time.monotonic() - self.started > self.d.opts.startup_grace_s
        for s in self.d.topo.active:
            if s.id == self.d.slot_id:
                continue
            ps = m.state(s.id)
            if ps is None:
                continue
            if ps.state == DEAD or (ps.state == DOWN and grace):
                if s.id not in self.down:
                    self.down[s.id] = ps
                    holder = self.d.holder_of(s.id, ps)
                    if holder is not None:  # never seen up (DOWN after the grace): void its claim too
                        self.d.claims.mark_dead(s.id, *holder)
                    self.events.append({"event": "down", "slot": s.id, "t": time.time(), "reason": ps.reason})
            elif ps.state == UP and s.id in self.down:
                del self.down[s.id]
                self.events.append({"event": "up", "slot": s.id, "t": time.time(), "node": ps.info.get("node")})

    # ------------------------------------------------------------------ the repair loop
    async def _run(self) -> None:
        entry = self.d.entry
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.d.opts.heartbeat_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if entry is None:
                entry = self.d.entry
            if entry is not None:
                entry.expire(self.d.opts.unit_timeout_s)
                await self._retain_now_and_then(entry)
            self._scan()
            if not self.down:
                if self.unavailable or (entry is not None and entry.paused):
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
        if now - self._last_retain < self.d.opts.retain_every_s or entry.paused or self.down:
            return
        self._last_retain = now
        live = [(s.id, s.epoch) for s in entry.live()]
        await self.d.broadcast(retain_frame(live), stages_only=True)
        self.d.retain(dict(live))

    async def _repair(self) -> None:
        entry = self.d.entry
        slot = next(s.id for s in self.d.topo.active if s.id in self.down)
        ps = self.down[slot]
        standbys = self._live_standbys()
        if not standbys:
            why = (f"slot {slot} is down ({ps.reason}) and no standby is available to take it over; "
                   f"start a spare (`p2pk3 node --standby`) or restart the slot's node")
            if self.unavailable != why:
                log.error("%s", why)
                self.unavailable = why
                self.events.append({"event": "unavailable", "slot": slot, "t": time.time()})
            if entry is not None:
                entry.fail_all(why, code=ErrorCode.UNAVAILABLE)
            return
        if entry is not None and not entry.paused:
            entry.pause(f"repairing slot {slot}")
            entry.replay_all()
        replaces = self.d.holder_of(slot, ps)
        sb = standbys[0]
        log.warning("slot %s is down (%s): asking standby %s to take it over", slot, ps.reason, sb)
        t0 = time.time()
        try:
            addr = self.d.routes.address(sb)
            reply = await request(addr, self.d.secret, self.d.node_id, takeover_frame(slot, replaces),
                                  TAKEOVER_TIMEOUT_S)
            if reply.kind != "route":
                raise ConnectionError(f"{reply.header.get('code')}: {reply.header.get('message')}")
            route = parse_route(reply)
        except (*DIAL_ERRORS, ProtocolError) as e:
            log.error("standby %s could not take over slot %s: %s", sb, slot, e)
            self.events.append({"event": "takeover_failed", "slot": slot, "standby": sb, "t": time.time(),
                                "error": str(e)})
            await asyncio.sleep(self.d.opts.heartbeat_s)
            return
        self.d.routes.announce(route)
        self.d.monitor.moved(slot)
        await self.d.broadcast(route_frame(route))
        self.events.append({"event": "takeover", "slot": slot, "standby": sb, "node": route.node,
                            "epoch": route.epoch, "t": time.time(), "takeover_s": time.time() - t0})
        del self.down[slot]
        log.warning("slot %s now served by %s (epoch %d)", slot, route.node, route.epoch)

    async def _recovered(self, why: str) -> None:
        entry = self.d.entry
        self.unavailable = None
        if entry is not None:
            if not entry.paused:
                entry.replay_all()
            live = [(s.id, s.epoch) for s in entry.live()]
            await self.d.broadcast(retain_frame(live), stages_only=True)
            self.d.retain(dict(live))
            entry.resume()
            log.warning("%s: %d session%s continue%s", why, len(live), "" if len(live) == 1 else "s",
                        "s" if len(live) == 1 else "")
        self.events.append({"event": "recovered", "t": time.time()})

    # ------------------------------------------------------------------ standby side
    def entry_lost(self) -> bool | float:
        """On a standby: is the entry slot lost and am I the standby that must take it? Lost: DEAD (answered,
        then stopped), or DOWN without ever answering once the start-up grace (counted from this daemon's
        start) is over. Returns the seconds left of that grace when the entry has never answered yet, so
        that the caller looks again then."""
        m = self.d.monitor
        entry_slot = self.d.topo.active[0].id
        ps = m.state(entry_slot)
        if ps is None or ps.state not in (DEAD, DOWN):
            return False
        if ps.state == DOWN:
            left = self.d.opts.startup_grace_s - (time.monotonic() - self.d.started_mono)
            if left > 0:
                return max(left, 0.05)
        live = [s.id for s in self.d.topo.standby
                if s.id == self.d.slot_id or ((p := m.state(s.id)) is not None and p.state == UP
                                              and p.info.get("role") == "standby")]
        return bool(live) and live[0] == self.d.slot_id
