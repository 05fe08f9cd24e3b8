"""What the dashboard shows: one status probe of every node the topology names, turned into rows in ring
order (standbys last) and cluster totals.

    view = ClusterView(topo)
    snap = await view.poll()          # rates (batches/s, tokens/s) from the delta to the previous poll
    snap["slots"][0]["state"], snap["totals"]["tokens_per_s"]

A row's `state`: `up` (entry or stage serving), `degraded` (serving, but the entry found it persistently
slower than its expected time per token: node/degraded.py; `slowdown` is the factor), `loading`, `standby` (a spare holding nothing), `moved`
(a standby slot whose node serves another slot now), `dead` (connection refused, or the entry's failure
detector lists the slot as down), `unreachable` (no answer within the probe timeout: hung, stopped or cut
off). Slots that moved by takeover are found where their new holder answers: every node reports the slot
it serves now, and the entry address every node knows is probed too. `hop_ms` is the probe's status
round trip (after the handshake), `compute_ms` the stage's last batch, `busy` its compute time / wall time
over the last 5 s.

The entry's spare pool (standbys no topology slot names, node/spares.py) gives rows of slot `pool` after
the topology's, and its admission queue (node/admission.py) is the snapshot's `queue`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from p2pk3.node.spares import POOL_SLOT
from p2pk3.topology import Slot
from p2pk3.transport.connection import open_connection
from p2pk3.transport.messages import parse_status, status_frame

SERVING = ("entry", "stage")


@dataclass
class Probe:
    address: tuple[str, int]
    status: dict | None
    rtt_ms: float | None = None
    error: str | None = None  # "dead" (refused) or "unreachable" (no answer / not authenticated)
    reason: str = ""


async def probe(addr: tuple[str, int], secret: bytes, timeout: float = 1.0) -> Probe:
    """One authenticated status request; never raises."""
    try:
        conn = await open_connection(*addr, secret, "dashboard", timeout=timeout, handshake_timeout=timeout)
    except (ConnectionRefusedError, ConnectionResetError) as e:
        return Probe(addr, None, error="dead", reason=f"connection refused ({e.strerror or e})")
    except (asyncio.TimeoutError, TimeoutError):
        return Probe(addr, None, error="unreachable", reason=f"no answer within {timeout:g} s")
    except Exception as e:  # noqa: BLE001 - auth failure, host unreachable, ...
        return Probe(addr, None, error="unreachable", reason=f"{type(e).__name__}: {e}")
    try:
        t0 = time.perf_counter()
        await asyncio.wait_for(conn.send(status_frame()), timeout)
        f = await asyncio.wait_for(conn.recv(), timeout)
        rtt = 1000 * (time.perf_counter() - t0)
        if f.kind != "status":
            return Probe(addr, None, error="unreachable", reason=f"answered status with {f.kind!r}")
        return Probe(addr, parse_status(f), rtt_ms=round(rtt, 3))
    except (asyncio.TimeoutError, TimeoutError):
        return Probe(addr, None, error="unreachable", reason=f"no status answer within {timeout:g} s")
    except Exception as e:  # noqa: BLE001
        return Probe(addr, None, error="unreachable", reason=f"{type(e).__name__}: {e}")
    finally:
        conn.close("dashboard probe done", abort=True)


def _addr(a) -> tuple[str, int] | None:
    if isinstance(a, (list, tuple)) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], int):
        return a[0], a[1]
    return None


def _fmt(a: tuple[str, int] | None) -> str | None:
    return f"{a[0]}:{a[1]}" if a else None


class ClusterView:
    """Polls the cluster of a topology; keeps the previous poll's counters to turn them into rates."""

    def __init__(self, topo, secret: bytes | None = None, timeout: float = 1.0):
        self.topo = topo
        self.secret = secret if secret is not None else topo.secret()
        self.timeout = timeout
        self._prev: dict[str, tuple[float, int, int]] = {}  # node id -> (time, batches, tokens)

    async def _probe_all(self) -> dict[tuple[str, int], Probe]:
        addrs = list(dict.fromkeys(self.topo.static_addresses().values()))
        found = dict(zip(addrs, await asyncio.gather(*(probe(a, self.secret, self.timeout) for a in addrs))))
        # the entry address every node knows (it moves with a takeover of the entry slot)
        extra = {e for p in found.values() if p.status for e in [_addr(p.status.get("entry"))] if e and e not in found}
        extra |= {
            a
            for p in found.values()
            if p.status
            for a in [_addr(p.status.get("address"))] + [_addr(x.get("address")) for x in p.status.get("spares") or []]
            if a and a not in found and a not in extra
        }
        if extra:
            more = list(extra)
            found.update(zip(more, await asyncio.gather(*(probe(a, self.secret, self.timeout) for a in more))))
        return found

    async def poll(self) -> dict:
        now = time.monotonic()
        found = await self._probe_all()
        serving: dict[str, Probe] = {}  # slot -> the probe of the node serving it now (highest epoch)
        for p in found.values():
            st = p.status
            if st is None or not isinstance(st.get("slot"), str):
                continue
            old = serving.get(st["slot"])
            rank = (st.get("role") in SERVING, st.get("epoch") or 0)
            if old is None or rank > (old.status.get("role") in SERVING, old.status.get("epoch") or 0):
                serving[st["slot"]] = p
        entry = next((p.status for p in serving.values() if p.status.get("role") == "entry"), None)
        down = set(entry.get("down") or []) if entry else set()
        static = self.topo.static_addresses()
        rows, prev = [], {}
        for s in [*self.topo.active, *self.topo.standby]:
            p = serving.get(s.id)
            if p is None:  # nobody says it serves this slot: what answered at its address?
                p = found.get(static.get(s.id)) if static.get(s.id) else None
            rows.append(self._row(s, p, down, now, prev))
        for sp in (entry.get("spares") or []) if entry else []:  # the pool spares, as the entry knows them
            a = _addr(sp.get("address"))
            row = self._row(Slot(POOL_SLOT, standby=True), found.get(a), down, now, prev)
            if row["node"] is None:
                row.update(node=sp.get("node"), address=_fmt(a))
            rows.append(row)
        self._prev = prev
        mark_degraded(rows, entry.get("degraded") if entry else None)
        up = [r for r in rows if r["state"] in ("up", "degraded")]
        tps = [r["tokens_per_s"] for r in up if r["tokens_per_s"] is not None]
        spares = sum(r["state"] == "standby" for r in rows)
        # `up`: healthy nodes (serving or a standby ready to take over); `serving` of `active` ring slots
        totals = {
            "tokens_per_s": max(tps) if tps else None,
            "nodes": len(rows),
            "up": len(up) + spares,
            "serving": len(up),
            "active": len(self.topo.active),
            "standby": spares,
            "live_sessions": entry.get("live_sessions") if entry else None,
            "finished": entry.get("finished") if entry else None,
            "failed": entry.get("failed") if entry else None,
            "paused": entry.get("paused") if entry else None,
            "unavailable": entry.get("unavailable") if entry else None,
            # prompt tokens started from the prefix cache / all prompt tokens (the entry's count)
            "prefix_hit_rate": (entry.get("prefix_entry") or {}).get("hit_rate") if entry else None,
        }
        queue = entry.get("admission") if entry else None
        return {
            "time": time.time(),
            "cluster": self.topo.cluster.name,
            "topology": self.topo.source,
            "entry": _fmt(_addr(entry.get("address"))) if entry else None,
            "slots": rows,
            "totals": totals,
            "queue": queue,
        }

    def _row(self, s, p: Probe | None, down: set[str], now: float, prev: dict) -> dict:
        row = {
            "slot": s.id,
            "standby_slot": s.standby,
            "state": "unreachable",
            "node": None,
            "role": None,
            "address": _fmt((s.host, s.port)) if s.host and s.port else None,
            "epoch": None,
            "layers": list(s.layers) if s.layers else None,
            "sessions": None,
            "queue": None,
            "batches_per_s": None,
            "tokens_per_s": None,
            "compute_ms": None,
            "busy": None,
            "hop_ms": None,
            "memory": None,
            "prefix_hit_rate": None,  # sessions this stage started at a cached prefix / all it opened
            "prefix_bytes": None,  # {"device": ..., "host": ...} its prefix cache holds
            "errors": None,
            "uptime_s": None,
            "slowdown": None,
            "reason": "no address known",
        }
        if p is None:
            if s.id in down:
                row.update(state="dead", reason="the entry's failure detector reports it down")
            return row
        row["address"] = _fmt(p.address)
        st = p.status
        if st is None:
            dead = p.error == "dead" or s.id in down
            why = p.reason + ("; the entry's failure detector reports it down" if s.id in down else "")
            row.update(state="dead" if dead else "unreachable", reason=why)
            return row
        role = st.get("role")
        if st.get("slot") != s.id:  # a standby slot whose node took another slot over
            row.update(state="moved", node=st.get("node"), role=role, reason=f"serves slot {st.get('slot')} now")
            return row
        state = "up" if role in SERVING else "standby" if role == "standby" else "loading"
        row.update(
            state=state,
            node=st.get("node"),
            role=role,
            epoch=st.get("epoch"),
            sessions=st.get("sessions"),
            queue=st.get("queue"),
            compute_ms=st.get("last_batch_ms"),
            busy=st.get("busy"),
            hop_ms=p.rtt_ms,
            memory=st.get("memory"),
            prefix_hit_rate=(st.get("prefix") or {}).get("hit_rate"),
            prefix_bytes=(
                {"device": st["prefix"].get("device_bytes"), "host": st["prefix"].get("host_bytes")}
                if isinstance(st.get("prefix"), dict)
                else None
            ),
            errors=st.get("errors"),
            uptime_s=st.get("uptime_s"),
            reason="answering",
        )
        if st.get("layers"):
            row["layers"] = list(st["layers"])
        node, b, t = st.get("node"), int(st.get("batches") or 0), int(st.get("tokens") or 0)
        if node:
            prev[node] = (now, b, t)
            last = self._prev.get(node)
            if last is not None and now > last[0] and b >= last[1] and t >= last[2]:
                dt = now - last[0]
                row["batches_per_s"] = round((b - last[1]) / dt, 2)
                row["tokens_per_s"] = round((t - last[2]) / dt, 2)
        return row


def mark_degraded(rows: list[dict], verdicts: dict | None) -> None:
    """Put the entry's verdicts on slow stages (its status' `degraded` table, node/degraded.py) on the
    rows of the slots it serves: their `slowdown`, and state `degraded` with the reason and what was done."""
    for r in rows:
        d = (verdicts or {}).get(r["slot"])
        if d and r["state"] == "up":
            r["slowdown"] = d.get("persistent_slowdown") or d.get("slowdown")
            if d.get("degraded"):
                r.update(state="degraded", reason=f"degraded: {r['slowdown']}x its expected time per token; {d.get('action')}")
