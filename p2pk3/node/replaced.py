"""Telling a replaced holder that its slot moved on, until it hears it.

A takeover replaces a holder the failure detector declared dead; but a holder that was only cut off (a
partition), stopped (SIGSTOP) or flapping comes back, still believing it holds the slot at its old epoch.
The `route` broadcast of the takeover went out while it could not hear, so the new holder keeps telling
it: every `every_s` it dials the replaced holder's last address, expecting that node's id (a restarted
node, or another node now at that address, is not the holder it replaced: then it stops), and sends the
new `route`; a node that learns from a route that its slot moved to a higher epoch steps down
(node/daemon.py). It gives up after `give_up_s` (a holder that never comes back is gone)."""

from __future__ import annotations

import asyncio
import logging

from p2pk3.transport.connection import AuthenticationError, open_connection
from p2pk3.transport.messages import Route, route_frame

from .links import DIAL_ERRORS

log = logging.getLogger("p2pk3.node")


async def tell_replaced(
    addr: tuple[str, int],
    node: str,
    route: Route,
    secret: bytes,
    node_id: str,
    *,
    every_s: float = 1.0,
    give_up_s: float = 600.0,
) -> bool:
    """Deliver `route` to `node` at `addr`; True once it took the frame, False when another node answers
    there or `give_up_s` passed."""
    loop = asyncio.get_running_loop()
    end = loop.time() + give_up_s
    while loop.time() < end:
        try:
            conn = await open_connection(*addr, secret, node_id, timeout=2.0, handshake_timeout=2.0, expect_peer=node)
        except AuthenticationError as e:
            log.info("slot %s: the node at %s:%d is not the replaced holder %s (%s)", route.slot, *addr, node, e)
            return False
        except DIAL_ERRORS:
            await asyncio.sleep(every_s)
            continue
        try:
            await asyncio.wait_for(conn.send(route_frame(route)), 2.0)
            log.warning("slot %s: told the replaced holder %s that the slot moved to epoch %d", route.slot, node,
                        route.epoch)
            return True
        except (*DIAL_ERRORS, asyncio.TimeoutError):
            await asyncio.sleep(every_s)
        finally:
            conn.close("route told")
    return False
