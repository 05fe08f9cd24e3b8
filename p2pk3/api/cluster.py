"""The API server's side of the cluster: `Cluster.generate` runs one request on the ring.

A `Client` connection carries one request at a time, so every concurrent HTTP request gets its own
connection (and the entry batches them). Connections whose request ended cleanly go back to a small pool
of idle ones (saving a connect + handshake + entry probe per request); a connection whose request was
cancelled or failed is closed. At most DIALS_AT_ONCE new connections are set up at a time, so that a
burst of hundreds of requests queues here (and then in the entry's admission queue) instead of
overflowing the entry's listen backlog, whose dropped SYNs would fail connects after seconds. `Client.for_topology` finds whichever node holds the entry role now and
resumes a request when the entry dies (a standby takes over)."""

from __future__ import annotations

import asyncio
from typing import Callable

from p2pk3.node.client import Client, Reply, RequestError
from p2pk3.params import SamplingParams

from .errors import ApiError, from_cluster

POOL_SIZE = 32
DIALS_AT_ONCE = 16  # connections to the entry being set up at once: a burst must not overflow its listen backlog


class Cluster:
    def __init__(
        self,
        topo,
        *,
        connect_timeout_s: float = 5.0,
        pool_size: int = POOL_SIZE,
        max_queue: int | None = None,
        queue_timeout: float | None = None,
    ):
        self.topo = topo
        self.secret = topo.secret()
        self.connect_timeout_s = connect_timeout_s
        self.pool_size = pool_size
        self.queue = {"max_queue": max_queue, "queue_timeout": queue_timeout}  # tighter than the entry's (serve)
        self._dials = asyncio.Semaphore(DIALS_AT_ONCE)
        self._idle: list[Client] = []

    async def _client(self) -> Client:
        while self._idle:
            c = self._idle.pop()
            if c.conn is not None and not c.conn.closed:
                return c
            c.close()
        try:
            async with self._dials:  # the others wait their turn here, not in the entry's SYN queue
                return await Client.for_topology(self.topo, self.secret, node_id="api", timeout=self.connect_timeout_s)
        except RequestError as e:
            raise ApiError(
                503,
                f"no entry node of the cluster is reachable: {e.message}",
                type="service_unavailable",
                code="unavailable",
            ) from None

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        on_token: Callable[[int], None] | None = None,
        on_logprob: Callable | None = None,
    ) -> Reply:
        """The reply; cluster errors become ApiError (busy 429, unavailable 503, ...). Cancelling the
        awaiting task cancels the request in the ring. on_logprob(token, TokenLogprob): as Client.generate."""
        c = await self._client()
        ok = False
        try:
            r = await c.generate(prompt, params, on_token=on_token, on_logprob=on_logprob, **self.queue)
            ok = True
            return r
        except RequestError as e:
            if e.code in ("busy", "queue_timeout", "bad_request"):
                ok = True  # the connection is fine; the entry refused this request
            raise from_cluster(e.code, e.message, e.retry_after) from None
        finally:
            if ok and len(self._idle) < self.pool_size:
                self._idle.append(c)
            else:
                c.close()

    async def entry_status(self, timeout: float = 1.0) -> dict | None:
        """The entry's status (its queue for /metrics), or None when it does not answer in time."""
        try:
            c = await asyncio.wait_for(self._client(), timeout)
        except (ApiError, asyncio.TimeoutError):
            return None
        try:
            st = await asyncio.wait_for(c.status(), timeout)
        except Exception:  # noqa: BLE001 - a broken connection: no figures this scrape
            c.close()
            return None
        if len(self._idle) < self.pool_size:
            self._idle.append(c)
        else:
            c.close()
        return st

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
