"""The failure detector: heartbeats to a set of slots over their own authenticated connections.

Each watched slot gets a task that dials it (wherever the route table says it is served), sends a
`ping` every `heartbeat_s` and waits for the `pong` at most `dead_after_s`. A slot that answered once
and then stops answering (killed, hung, cut off) turns DEAD; one never reached is DOWN; the first pong
makes it UP; a slot not probed yet (or just moved to another node: `moved`) is UNKNOWN. Changes go to `on_change(slot, PeerState)`. Detection time is at most
heartbeat_s + dead_after_s after the last answer. The pong carries the peer's public statistics
(node id, slot, epoch, role, sessions, ...), kept in `PeerState.info` for the entry and the dashboard."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from p2pk3.transport.connection import ConnectionClosed, open_connection
from p2pk3.transport.codec import ProtocolError
from p2pk3.transport.messages import parse_pong, ping_frame

from .links import DIAL_ERRORS

log = logging.getLogger("p2pk3.node")

UNKNOWN, UP, DOWN, DEAD = "unknown", "up", "down", "dead"


@dataclass
class PeerState:
    slot: str
    state: str = UNKNOWN
    since: float = field(default_factory=time.monotonic)
    ever_up: bool = False
    address: tuple[str, int] | None = None
    rtt_ms: float | None = None
    reason: str = "not probed yet"
    info: dict[str, Any] = field(default_factory=dict)


class Monitor:
    def __init__(
        self,
        secret: bytes,
        node_id: str,
        targets: Callable[[], list[str]],
        resolve: Callable[[str], tuple[str, int]],
        *,
        heartbeat_s: float = 0.5,
        dead_after_s: float = 2.5,
        on_change: Callable[[str, PeerState], None] | None = None,
    ):
        self.secret, self.node_id = secret, node_id
        self.targets, self.resolve = targets, resolve
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.on_change = on_change
        self.peers: dict[str, PeerState] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._main: asyncio.Task | None = None
        self._ping_id = 0

    def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name="monitor")

    def stop(self) -> None:
        for t in [self._main, *self._tasks.values()]:
            if t is not None:
                t.cancel()
        self._tasks.clear()

    def moved(self, slot: str) -> None:
        """The slot is served elsewhere now (a takeover): forget its state and probe the new holder at once."""
        t = self._tasks.pop(slot, None)
        if t is not None:
            t.cancel()
        self.peers[slot] = PeerState(slot, reason="moved; probing the new holder")
        if self._main is not None and not self._main.done():
            self._tasks[slot] = asyncio.create_task(self._watch(slot), name=f"watch-{slot}")

    def state(self, slot: str) -> PeerState | None:
        return self.peers.get(slot)

    async def _run(self) -> None:
        while True:
            want = set(self.targets())
            for slot in want - set(self._tasks):
                self.peers.setdefault(slot, PeerState(slot))
                self._tasks[slot] = asyncio.create_task(self._watch(slot), name=f"watch-{slot}")
            for slot in set(self._tasks) - want:
                self._tasks.pop(slot).cancel()
                self.peers.pop(slot, None)
            await asyncio.sleep(self.heartbeat_s)

    def _mark(self, slot: str, state: str, reason: str, **kw: Any) -> None:
        ps = self.peers.setdefault(slot, PeerState(slot))
        for k, v in kw.items():
            setattr(ps, k, v)
        if state == DOWN and ps.ever_up:
            state = DEAD
        if state == UP:
            ps.ever_up = True
        ps.reason = reason
        if ps.state != state:
            ps.state, ps.since = state, time.monotonic()
            log.log(logging.WARNING if state == DEAD else logging.INFO, "slot %s is %s (%s)", slot, state, reason)
            if self.on_change is not None:
                self.on_change(slot, ps)

    async def _watch(self, slot: str) -> None:
        t = self.dead_after_s
        while True:
            try:
                addr = self.resolve(slot)
            except ConnectionError as e:
                self._mark(slot, DOWN, str(e))
                await asyncio.sleep(self.heartbeat_s)
                continue
            try:
                conn = await open_connection(*addr, self.secret, self.node_id, timeout=t, handshake_timeout=t)
            except DIAL_ERRORS as e:
                self._mark(slot, DOWN, f"unreachable at {addr[0]}:{addr[1]}: {e}", address=addr)
                await asyncio.sleep(self.heartbeat_s)
                continue
            try:
                while True:
                    self._ping_id += 1
                    t0 = time.perf_counter()
                    await asyncio.wait_for(conn.send(ping_frame(self._ping_id, time.time_ns())), t)
                    f = await asyncio.wait_for(conn.recv(), t)
                    try:
                        info = parse_pong(f)
                    except ProtocolError as e:
                        raise ConnectionError(f"answered a ping with {f.kind!r}: {e}") from None
                    self._mark(slot, UP, "answering", address=addr, rtt_ms=1000 * (time.perf_counter() - t0), info=info)
                    await asyncio.sleep(self.heartbeat_s)
                    if self.resolve(slot) != addr:  # the slot moved (takeover): watch the new holder
                        break
            except asyncio.TimeoutError:
                self._mark(slot, DOWN, f"no answer for {t:.1f} s (hung or cut off)", address=addr)
            except DIAL_ERRORS as e:
                self._mark(
                    slot, DOWN, e.reason if isinstance(e, ConnectionClosed) else f"connection lost: {e}", address=addr
                )  # a ConnectionClosed says "connection lost: ..." itself
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug must not silently end the watch
                log.exception("heartbeat of slot %s failed", slot)
                self._mark(slot, DOWN, f"heartbeat failed: {type(e).__name__}: {e}", address=addr)
            finally:
                conn.close("heartbeat done", abort=True)
            await asyncio.sleep(self.heartbeat_s)
