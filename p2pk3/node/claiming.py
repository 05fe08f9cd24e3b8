"""A daemon taking its slot: check the cluster secret against the reachable peers, then run the claim
protocol (node/claims.py) with every discovered node and every other slot's address."""

from __future__ import annotations

import asyncio
import logging

from p2pk3.transport.connection import AuthenticationError, open_connection

from .claims import Claim, connection_asker, negotiate_claim

log = logging.getLogger("p2pk3.node")


class WrongSecret(RuntimeError):
    """Every reachable peer refused this node's handshake proof."""


async def claim_slot(d, slot_id: str, replaces: tuple[str, int] | None = None) -> Claim:
    """Take `slot_id` with an epoch above any seen: ask every discovered node and the static address of
    every other slot; a live holder refuses and we stop with its reason (ClaimRefused)."""
    addrs: dict[str, tuple[str, int]] = {}
    if d.discovery is not None:
        for nid, p in d.discovery.peers().items():
            addrs[nid] = p.address
    mine = {(d.host, d.port), (d.advertised_host, d.port)}
    for sid in [s.id for s in d.topo.slots]:
        try:
            a = d.routes.address(sid)
        except ConnectionError:
            continue
        if a not in mine and a not in addrs.values():
            addrs[f"addr:{sid}"] = a
    await check_secret(d, addrs)
    by_id = connection_asker(addrs, d.secret, d.node_id, connect_timeout=1.0)

    async def ask(peer, frame):
        if not peer.startswith("addr:"):
            return await by_id(peer, frame)
        conn = await open_connection(*addrs[peer], d.secret, d.node_id, timeout=1.0, handshake_timeout=1.0)
        try:  # we do not know its node id: ask whoever answers there
            await conn.send(frame)
            return await conn.recv() if frame.header.get("op", "request") == "request" else None
        finally:
            conn.close("claim done")

    async def notify(peer, frame):
        try:
            await ask(peer, frame)
        except Exception:
            pass

    claim = await negotiate_claim(d.claims, slot_id, list(addrs), ask, timeout=2.0, notify=notify, replaces=replaces)
    if d.discovery is not None:
        d.discovery.update(
            slot=slot_id,
            epoch=claim.epoch,
            since=claim.since,
            standby=False if not d.topo.slot(slot_id).standby else True,
        )
    log.info("claimed slot %s (epoch %d)", slot_id, claim.epoch)
    return claim


async def check_secret(d, addrs: dict[str, tuple[str, int]]) -> None:
    """Refuse to claim a slot when every peer we reach refuses our proof: our secret is wrong (a node
    alone by design — no other reachable peer — may go on)."""

    async def one(a):
        try:
            c = await open_connection(*a, d.secret, d.node_id, timeout=1.0, handshake_timeout=1.0)
            c.close("secret check")
            return "ok"
        except AuthenticationError as e:
            return e
        except Exception:
            return None  # unreachable: cannot tell

    res = await asyncio.gather(*(one(a) for a in addrs.values()))
    refused = [r for r in res if isinstance(r, AuthenticationError)]
    if refused and "ok" not in res:
        raise WrongSecret(
            f"every peer reached ({len(refused)}) refused this node's proof: the cluster secret "
            f"({d.topo.cluster.secret_file}) differs from theirs ({refused[0]})"
        )
