"""The in-process test ring: `NodeDaemon`s started in the test's own event loop (real authenticated TCP over
loopback, each stage in its worker thread), always stopped at the end. `local_ring` in conftest.py is the
other kind: `p2pk3 node` processes.

    async with InProcessRing(loopback_topology(ckpt, 2), ckpt, prefill_chunk=8) as ring:
        c = await ring.client()
        spare = await ring.start("spare0")        # one more daemon, stopped with the others

`ring_in_thread` runs the same ring in a loop of its own thread, for tests whose own code blocks (the CLI
runs its own event loops): `ring.call(coro)` runs a coroutine there.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from pathlib import Path


def loopback_topology(model_dir, n: int, cfg=None):
    """`n` slots on 127.0.0.1 (free ports) splitting the model of `model_dir` evenly."""
    from p2pk3.model.config import K3Config
    from p2pk3.node.local import free_ports
    from p2pk3.topology import even_split

    cfg = cfg or K3Config.from_pretrained(model_dir)
    ports = free_ports(n)
    t = even_split(cfg, n, host="127.0.0.1", base_port=ports[0], model_path=str(model_dir))
    for s, port in zip(t.slots, ports):
        s.port = port
    return t


class InProcessRing:
    """Daemons of `topo` in this event loop: one per active slot on entry (or those of `slots`), each with
    NodeOptions(**options); `daemons` are the ones up, in start order (`entry` the first).

    Clean-up is guaranteed: every daemon this ring constructed is stopped on exit, also one whose start
    failed, and also when the start of another one or the body raised."""

    def __init__(self, topo, model_dir: str | Path, *, secret: bytes | None = None, slots=None, **options):
        self.topo, self.model_dir, self.options = topo, model_dir, options
        self.secret = secret or secrets.token_bytes(32)
        self.slots = [s.id for s in topo.active] if slots is None else list(slots)
        self.daemons: list = []
        self._constructed: list = []

    async def start(self, slot: str, model_dir: str | Path | None = None, **options):
        """Start the daemon of `slot` (options over the ring's); it is stopped with the ring."""
        from p2pk3.node.daemon import NodeDaemon
        from p2pk3.node.options import NodeOptions

        d = NodeDaemon(
            self.topo,
            slot,
            model_dir=model_dir or self.model_dir,
            secret=self.secret,
            options=NodeOptions(**{**self.options, **options}),
        )
        self._constructed.append(d)
        await d.start()
        self.daemons.append(d)
        return d

    async def __aenter__(self) -> "InProcessRing":
        try:
            for sid in self.slots:
                await self.start(sid)
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop every daemon constructed (the last started first); a failing stop does not skip the rest."""
        errors = []
        while self._constructed:
            d = self._constructed.pop()
            try:
                await d.stop("test over")
            except Exception as e:  # each daemon is stopped whatever the others do
                errors.append(e)
        self.daemons.clear()
        if errors:
            raise errors[0]

    @property
    def entry(self):
        return self.daemons[0]

    async def client(self, secret: bytes | None = None):
        from p2pk3.node.client import Client

        return await Client.connect("127.0.0.1", self.entry.port, secret or self.secret)

    async def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until the entry's failure detector has seen every slot up (stages that load slowly)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (problem := self._unhealthy()) is not None:
            assert loop.time() < deadline, f"ring not healthy after {timeout} s: {problem}"
            await asyncio.sleep(0.1)

    def _unhealthy(self) -> str | None:
        """Why the ring is not healthy yet, or None. `health()` alone is not enough: it grants a slot that has
        not answered yet a detector period's grace, so a ring checked in its first second would pass with a
        slot never seen up, and that slot refuses the next request ("not reachable") once the grace is over."""
        entry = self.entry
        problem = entry.coordinator.health()
        if problem is not None:
            return str(problem)
        for s in entry.topo.active:
            if s.id == entry.slot_id:
                continue
            ps = entry.monitor.state(s.id)
            if ps is None or ps.state != "up":
                return f"slot {s.id} not seen up yet ({ps.reason if ps else 'not watched yet'})"
        return None


class LoopThread:
    """An asyncio loop in a daemon thread; `run(coro)` runs a coroutine there and returns its result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def drain():  # cancel what the daemons left running (monitor, failover) before the loop stops
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        try:
            self.run(drain(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()


@contextlib.contextmanager
def ring_in_thread(topo, model_dir: str | Path, **kw):
    """An InProcessRing(topo, model_dir, **kw) whose loop runs in a thread; `ring.call(coro)` runs there."""
    lt = LoopThread()
    ring = InProcessRing(topo, model_dir, **kw)
    ring.call = lt.run
    try:
        lt.run(ring.__aenter__())
        yield ring
    finally:
        try:
            lt.run(ring.stop())
        finally:
            lt.close()
