"""Control frames between daemons: slot claims (`claim` / `claim_result`; node/claims.py runs the
protocol), failure handling (`takeover`, `route`, `retain`; node/failover.py decides when; `handover`: a
degraded stage's holder steps down, node/degraded.py) and the spare pool (`join` / `joined`; node/spares.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..codec import Frame, ProtocolError
from .fields import brief, count, expect, is_int, name, unix_time, MAX_NAME

CLAIM_OPS = ("request", "commit", "release")
CLAIM_CODES = ("granted", "held", "stale", "competing", "forbidden")


def _replaces_wire(rep: tuple[str, int] | None) -> dict[str, Any]:
    return {"replaces": {"node": rep[0], "epoch": int(rep[1])}} if rep else {}


def _parse_replaces(h: Mapping[str, Any], where: str) -> tuple[str, int] | None:
    rep = h.get("replaces")
    if rep is None:
        return None
    if not isinstance(rep, dict):
        raise ProtocolError(f"{where}: 'replaces' must be {{node: str, epoch: int}}, got {brief(rep)}")
    return name(rep.get("node"), f"{where}: replaces.node"), count(rep.get("epoch"), f"{where}: replaces.epoch")


@dataclass(frozen=True)
class ClaimMessage:
    """A `claim` (node/claims.py runs the protocol): `node` asks whether it may take `slot` at `epoch`
    (op "request"), announces that it took it ("commit") or that it gave it up ("release"). `since`: when
    the holder took the slot (unix time). `replaces`: (node, epoch) of a holder the failure detector
    declared dead (a takeover)."""

    slot: str
    node: str
    epoch: int
    op: str = "request"
    since: float | None = None
    replaces: tuple[str, int] | None = None


def claim_frame(
    slot: str,
    node: str,
    epoch: int,
    op: str = "request",
    since: float | None = None,
    replaces: tuple[str, int] | None = None,
) -> Frame:
    if op not in CLAIM_OPS:
        raise ValueError(f"claim op must be one of {CLAIM_OPS}, not {op!r}")
    return Frame.make("claim", slot=slot, node=node, epoch=int(epoch), op=op, since=since, **_replaces_wire(replaces))


def parse_claim(frame: Frame) -> ClaimMessage:
    h = expect(frame, "claim")
    op = h.get("op", "request")
    if op not in CLAIM_OPS:
        raise ProtocolError(f"claim frame: op must be one of {CLAIM_OPS}, got {brief(op)}")
    return ClaimMessage(
        name(h.get("slot"), "claim frame: slot"),
        name(h.get("node"), "claim frame: node"),
        count(h.get("epoch"), "claim frame: epoch"),
        op,
        unix_time(h.get("since"), "claim frame: since"),
        _parse_replaces(h, "claim frame"),
    )


@dataclass(frozen=True)
class ClaimHolder:
    """The deciding node's record of a slot: who holds it, at which epoch, since when, and whether that
    holder is live in the decider's view."""

    node: str
    epoch: int
    since: float | None = None
    live: bool = False


@dataclass(frozen=True)
class ClaimResult:
    """`claim_result`, the answer to a claim request: `granted`, `code` (one of CLAIM_CODES), `reason`
    (for humans), the decider's `holder` record (or None) and `epoch`, the highest epoch it knows."""

    slot: str
    granted: bool
    code: str
    reason: str
    holder: ClaimHolder | None = None
    epoch: int = 0


def claim_result_frame(r: ClaimResult) -> Frame:
    h = r.holder
    holder = {"node": h.node, "epoch": h.epoch, "since": h.since, "live": h.live} if h is not None else None
    return Frame.make(
        "claim_result", slot=r.slot, granted=r.granted, code=r.code, reason=r.reason, holder=holder, epoch=r.epoch
    )


def parse_claim_result(frame: Frame) -> ClaimResult:
    h = expect(frame, "claim_result")
    w = "claim_result frame"
    granted, code, reason = h.get("granted"), h.get("code"), h.get("reason")
    if not isinstance(granted, bool):
        raise ProtocolError(f"{w}: granted must be a bool, got {brief(granted)}")
    if code not in CLAIM_CODES:
        raise ProtocolError(f"{w}: code must be one of {CLAIM_CODES}, got {brief(code)}")
    if not isinstance(reason, str):
        raise ProtocolError(f"{w}: reason must be a string, got {brief(reason)}")
    holder, hd = None, h.get("holder")
    if hd is not None:
        if not isinstance(hd, dict) or not isinstance(hd.get("live", False), bool):
            raise ProtocolError(f"{w}: holder must be {{node, epoch, since, live}} or nil, got {brief(hd)}")
        holder = ClaimHolder(
            name(hd.get("node"), f"{w}: holder.node"),
            count(hd.get("epoch"), f"{w}: holder.epoch"),
            unix_time(hd.get("since"), f"{w}: holder.since"),
            hd.get("live", False),
        )
    return ClaimResult(
        name(h.get("slot"), f"{w}: slot"), granted, code, reason, holder, count(h.get("epoch", 0), f"{w}: epoch")
    )


# ------------------------------------------------------------------------------ failure handling
def takeover_frame(slot: str, replaces: tuple[str, int] | None) -> Frame:
    """The entry asks a standby to take `slot` over; `replaces`: (node, epoch) of the dead holder."""
    return Frame.make("takeover", slot=slot, **_replaces_wire(replaces))


def parse_takeover(frame: Frame) -> tuple[str, tuple[str, int] | None]:
    """(slot, replaces)."""
    h = expect(frame, "takeover")
    return name(h.get("slot"), "takeover frame: slot"), _parse_replaces(h, "takeover frame")


def handover_frame(slot: str, epoch: int, reason: str) -> Frame:
    """The entry asks the holder of `slot` at claim `epoch` to step down (it is degraded: `reason` says how
    slow) so that a standby takes the slot over; the holder answers with the same frame, then stops."""
    return Frame.make("handover", slot=slot, epoch=int(epoch), reason=reason)


def parse_handover(frame: Frame) -> tuple[str, int, str]:
    """(slot, epoch, reason)."""
    h = expect(frame, "handover")
    reason = h.get("reason", "")
    if not isinstance(reason, str) or len(reason) > 4 * MAX_NAME:
        raise ProtocolError(f"handover frame: reason must be a string of at most {4 * MAX_NAME} characters")
    return name(h.get("slot"), "handover frame: slot"), count(h.get("epoch"), "handover frame: epoch"), reason


@dataclass(frozen=True)
class Route:
    """`route`: `slot` is served by `node` at `host`:`port` now, at claim `epoch` (the highest wins)."""

    slot: str
    node: str
    host: str
    port: int
    epoch: int

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


def route_frame(r: Route) -> Frame:
    return Frame.make("route", slot=r.slot, node=r.node, host=r.host, port=r.port, epoch=r.epoch)


def parse_route(frame: Frame) -> Route:
    h = expect(frame, "route")
    port = h.get("port")
    if not is_int(port) or not 0 < port < 65536:
        raise ProtocolError(f"route frame: port must be an integer in 1..65535, got {brief(port)}")
    host = h.get("host")
    if not isinstance(host, str) or not 0 < len(host) <= MAX_NAME:
        raise ProtocolError(f"route frame: host must be a non-empty string of at most {MAX_NAME} characters")
    return Route(
        name(h.get("slot"), "route frame: slot"),
        name(h.get("node"), "route frame: node"),
        host,
        port,
        count(h.get("epoch"), "route frame: epoch"),
    )


def retain_frame(sessions: Iterable[tuple[str, int]]) -> Frame:
    """The entry's live sessions: every stage frees every other session and older epochs."""
    return Frame.make("retain", sessions=[[s, e] for s, e in sessions])


def parse_retain(frame: Frame) -> dict[str, int]:
    """session -> epoch."""
    ss = expect(frame, "retain").get("sessions")
    if not isinstance(ss, list):
        raise ProtocolError("retain frame: 'sessions' must be a list of [session, epoch]")
    out = {}
    for i, x in enumerate(ss):
        if not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and is_int(x[1]) and x[1] >= 0):
            raise ProtocolError(f"retain frame: sessions[{i}] must be [session (string), epoch (>= 0)], got {brief(x)}")
        out[x[0]] = x[1]
    return out


# ------------------------------------------------------------------------------ the spare pool
def join_frame(node: str, host: str, port: int) -> Frame:
    """A pool spare (node/spares.py) tells the entry it is there: `node` listens at `host`:`port`."""
    return Frame.make("join", node=node, host=host, port=int(port))


def parse_join(frame: Frame) -> tuple[str, str, int]:
    """(node, host, port)."""
    h = expect(frame, "join")
    port = h.get("port")
    if not is_int(port) or not 0 < port < 65536:
        raise ProtocolError(f"join frame: port must be an integer in 1..65535, got {brief(port)}")
    return name(h.get("node"), "join frame: node"), name(h.get("host"), "join frame: host"), port


def joined_frame(entry_node: str, spares: int) -> Frame:
    """The entry's answer to a `join`: its node id and how many spares its pool holds now."""
    return Frame.make("joined", entry=entry_node, spares=int(spares))


def parse_joined(frame: Frame) -> tuple[str, int]:
    """(entry node, spares)."""
    h = expect(frame, "joined")
    return name(h.get("entry"), "joined frame: entry"), count(h.get("spares"), "joined frame: spares")
