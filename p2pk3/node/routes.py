"""Where each ring slot is served now: the route table every daemon and client consults.

A slot's address comes from, in order: a `route` announcement (a takeover moved the slot to another
node; the highest epoch wins), the live claimant heard by discovery beacons, the topology's static
address. One resolver for the successor link, the failure detector and the entry link."""

from __future__ import annotations

from typing import Any, Callable

from p2pk3.transport.messages import Route  # the `route` frame's contents


class NoRoute(ConnectionError):
    pass


class RouteTable:
    def __init__(self, static: dict[str, tuple[str, int]], discovery: Any = None):
        self.static = dict(static)
        self.discovery = discovery  # node.discovery.Discovery or None
        self.routes: dict[str, Route] = {}
        self.listeners: list[Callable[[Route], None]] = []

    def announce(self, r: Route) -> bool:
        """Take in a route; True when it changed where the slot is served."""
        old = self.routes.get(r.slot)
        if old is not None and (old.epoch > r.epoch or old == r):
            return False
        self.routes[r.slot] = r
        for fn in self.listeners:
            fn(r)
        return True

    def address(self, slot: str) -> tuple[str, int]:
        r = self.routes.get(slot)
        if r is not None:
            return r.address
        if self.discovery is not None:
            p = self.discovery.resolve_slot(slot)
            if p is not None:
                return p.address
        a = self.static.get(slot)
        if a is None or not a[0] or not a[1]:
            raise NoRoute(f"no address known for slot {slot} (not announced, not discovered, none in the topology)")
        return a

    def address_or_none(self, slot: str) -> tuple[str, int] | None:
        try:
            return self.address(slot)
        except ConnectionError:
            return None
