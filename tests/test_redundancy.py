"""Back to full redundancy (docs/architecture.md, "Back to full redundancy"): a 4-stage ring of `p2pk3 node`
processes with one standby slot loses a slot, then another, then a third; after each takeover one spare
is added the way the docs say (`p2pk3 node --standby`, no slot, no port). Every session of every round
has exactly the tokens of an undisturbed run, no killed node is restarted, the entry never runs out of
standbys. Then the killed node of the first slot is restarted: refused with the hint how to rejoin, and
with --rejoin-as-standby (what the systemd unit passes) it joins the spare pool by itself; the
dashboard shows the pool."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from p2pk3.engine.reference import Pipeline
from p2pk3.frontends.cluster_view import ClusterView
from p2pk3.node.local import LocalRing, probe
from p2pk3.params import SamplingParams

pytestmark = pytest.mark.slow  # three failures of a ring of processes, one after the other

PROMPTS = [[(5 * i + 11 * j) % 400 + 7 for j in range(3 + 2 * i)] for i in range(6)]
LENGTHS = [40, 28, 36, 24, 32, 20]


@pytest.fixture(scope="module")
def want(ckpt):
    ref = Pipeline.load(ckpt, 1, max_sessions=6, max_tokens=4096)
    return [ref.generate([p], SamplingParams(max_tokens=n))[0] for p, n in zip(PROMPTS, LENGTHS)]


async def _entry_status(ring) -> dict:
    for name in ring.procs:
        st = await probe(ring.address(name), ring.secret)
        if st and st.get("role") == "entry":
            return st
    raise AssertionError("no node holds the entry role")


async def _round(ring, victim: str) -> list:
    """Six sessions; `victim` is killed once the first has streamed 6 tokens."""
    streamed = asyncio.Event()
    first: list[int] = []

    def on_first(t):
        first.append(t)
        if len(first) == 6:
            streamed.set()

    async def one(i):
        await asyncio.sleep(0.1 * i)
        c = await ring.client()
        try:
            on_token = on_first if i == 0 else None
            return (await c.generate(PROMPTS[i], SamplingParams(max_tokens=LENGTHS[i]), on_token=on_token)).tokens
        finally:
            c.close()

    tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
    await asyncio.wait_for(streamed.wait(), 60)
    ring.signal(victim, signal.SIGKILL)
    return await asyncio.wait_for(asyncio.gather(*tasks), 180)


async def _wait_spares(ring, n: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = await _entry_status(ring)
        if sum(r["ready"] for r in st.get("spares", [])) >= n:
            return st
        assert time.monotonic() < deadline, st.get("spares")
        await asyncio.sleep(0.2)


def _serving(state: dict, slot: str) -> str | None:
    return next((n["started_on"] for n in state["nodes"] if n["slot"] == slot and n["role"] == "stage"), None)


def test_kill_three_slots_adding_one_spare_after_each_takeover(ckpt, want):
    with LocalRing(ckpt, 4, standby=1) as ring:

        async def go():
            assert await _round(ring, "s1") == want
            assert _serving(await ring.state(), "s1") == "s4"  # the topology's standby
            # the docs' advice: `p2pk3 node --standby` (s4's port is taken: any free port, the spare pool)
            await asyncio.to_thread(ring.spawn_spare, any_port=True)
            await _wait_spares(ring, 1)
            assert await _round(ring, "s2") == want
            assert _serving(await ring.state(), "s2") == "pool1"
            await asyncio.to_thread(ring.spawn_spare)
            await _wait_spares(ring, 1)
            assert await _round(ring, "s3") == want
            assert _serving(await ring.state(), "s3") == "pool2"
            st = await _entry_status(ring)
            events = [e["event"] for e in st["events"]]
            assert events.count("takeover") == 3 and "unavailable" not in events, events
            assert st["down"] == [] and st["unavailable"] is None

        asyncio.run(go())
        assert sorted(ring.exited()) == ["s1", "s2", "s3"]  # nothing restarted them

        # the first killed node comes back: refused, with the way back; then by itself with the unit's flag
        p = ring.spawn("s1")
        assert p.wait(60) == 1
        log = ring.log_path("s1").read_text()
        assert "cannot claim slot s1: slot s1 is held by node s4@" in log and "--rejoin-as-standby" in log, log[-2000:]
        ring.spawn("s1", ["--rejoin-as-standby"])

        async def rejoined():
            st = await _wait_spares(ring, 1)
            assert "joining the spare pool instead" in ring.log_path("s1").read_text()
            snap = await ClusterView(ring.topo, ring.secret).poll()
            pool = [r for r in snap["slots"] if r["slot"] == "pool"]
            assert [r["state"] for r in pool] == ["standby"] and pool[0]["node"].startswith("spare@"), snap["slots"]
            assert snap["queue"]["queued"] == 0 and snap["queue"]["max_queue"] >= 4 * snap["queue"]["capacity"]
            return st

        st = asyncio.run(rejoined())
        assert [r["ready"] for r in st["spares"]] == [True]
