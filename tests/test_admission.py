"""Admission at the entry (p2pk3/node/admission.py): requests beyond the session capacity wait in a bounded
FIFO queue, are admitted in order as sessions finish, leave it when cancelled, and only a full queue
refuses (with a Retry-After). First against an entry with no ring (sessions end when cancelled), then over
real TCP against an in-process ring: queued, cancelled while queued, a client gone while queued, refused."""

from __future__ import annotations

import asyncio
import time

import pytest

from p2pk3.node.admission import Admission, QueueFull, QueueTimeout
from p2pk3.node.entry import Entry
from p2pk3.node.options import QUEUE_FACTOR
from p2pk3.params import SamplingParams

from conftest import run
from ring_helpers import InProcessRing, loopback_topology


def _entry(cap: int) -> Entry:
    return Entry(lambda work: None, lambda sessions: None, max_sessions=cap)


def _submitter(entry: Entry, log: list, i: int):
    def submit():
        log.append(i)
        return entry.submit([1, 2, 3], SamplingParams(max_tokens=4))

    return submit


def test_default_queue_holds_four_times_the_capacity_and_waits_long_enough():
    a = Admission(_entry(32))
    assert QUEUE_FACTOR >= 4 and a.max_queue == QUEUE_FACTOR * 32
    assert a.timeout_s >= 600


def test_waiters_are_admitted_in_order_as_sessions_finish():
    async def go():
        e = _entry(2)
        a = Admission(e, max_queue=8)
        order: list[int] = []
        tasks = [asyncio.create_task(a.admit(_submitter(e, order, i))) for i in range(6)]
        await asyncio.sleep(0.01)
        assert order == [0, 1] and len(a.queue) == 4 and a.stats()["queued"] == 4
        for want in ([0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]):
            first = next(iter(e.sessions))
            e.cancel(first)  # a session ends: the oldest waiter takes its place
            await asyncio.sleep(0.01)
            assert order == want
            assert len(e.sessions) == 2
        sessions = await asyncio.gather(*tasks)
        assert len({s.id for s in sessions}) == 6
        st = a.stats()
        assert st["admitted"] == 6 and st["waited"] == 4 and st["queued"] == 0 and st["refused"] == 0

    run(go())


def test_a_full_queue_refuses_with_retry_after_and_a_request_may_tighten_it():
    async def go():
        e = _entry(1)
        a = Admission(e, max_queue=2)
        tasks = [asyncio.create_task(a.admit(_submitter(e, [], i))) for i in range(3)]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull) as full:
            await a.admit(_submitter(e, [], 9))
        assert full.value.retry_after >= 1 and "2 requests queued (max 2)" in str(full.value)
        assert not isinstance(full.value, QueueTimeout)
        e.cancel(next(iter(e.sessions)))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull):  # its own bound: no one may wait before it
            await a.admit(_submitter(e, [], 10), max_queue=0)
        assert a.refused == 2
        for t in tasks:
            t.cancel()

    run(go())


def test_retry_after_is_the_time_the_queue_takes_to_drain_at_the_measured_rate():
    async def go():
        e = _entry(1)
        a = Admission(e, max_queue=20)
        assert a.retry_after() == 5  # nothing measured yet
        t = [asyncio.create_task(a.admit(_submitter(e, [], i))) for i in range(11)]
        await asyncio.sleep(0.01)
        now = time.monotonic()
        a._finishes.extend([now - 2.0, now - 1.0, now])  # 1 session / s; 10 queued: 11 s to drain
        assert a.retry_after() == 11
        for x in t:
            x.cancel()

    run(go())


def test_a_waiter_that_times_out_or_is_cancelled_leaves_the_queue():
    async def go():
        e = _entry(1)
        a = Admission(e, max_queue=4, timeout_s=60)
        order: list[int] = []
        first = await a.admit(_submitter(e, order, 0))
        late = asyncio.create_task(a.admit(_submitter(e, order, 1), timeout_s=0.05))
        gone = asyncio.create_task(a.admit(_submitter(e, order, 2)))
        kept = asyncio.create_task(a.admit(_submitter(e, order, 3)))
        with pytest.raises(QueueTimeout) as timeout:
            await late
        assert timeout.value.retry_after >= 1 and "waited 0 s in the entry's queue" in str(timeout.value)
        gone.cancel()
        await asyncio.sleep(0.01)
        assert len(a.queue) == 1 and a.timed_out == 1 and a.left == 1
        e.cancel(first.id)
        s = await asyncio.wait_for(kept, 1)
        assert order == [0, 3] and s.id in e.sessions

    run(go())


# ---------------------------------------------------------------- over TCP, on a ring
def test_queue_over_the_wire(ckpt):
    """A ring with room for one session and a queue of two: a second request waits and is served once
    the first ends; one cancelled while queued and one whose client goes away leave the queue; past the
    queue, `busy` with retry_after."""
    from p2pk3.node.client import RequestError

    async def go():
        topo = loopback_topology(ckpt, 1)
        async with InProcessRing(topo, ckpt, max_sessions=1, max_queue=2) as ring:
            adm = ring.entry.clients.admission
            long = await ring.client()
            first = asyncio.create_task(long.generate([5, 6, 7], SamplingParams(max_tokens=40)))
            while not ring.entry.entry.sessions:
                await asyncio.sleep(0.01)
            waiting = await ring.client()
            second = asyncio.create_task(waiting.generate([5, 6, 8], SamplingParams(max_tokens=4)))
            quitter = await ring.client()
            third = asyncio.create_task(quitter.generate([5, 6, 9], SamplingParams(max_tokens=4), resume=False))
            while len(adm.queue) < 2:
                await asyncio.sleep(0.01)
            refused = await ring.client()
            with pytest.raises(RequestError) as busy:
                await refused.generate([5, 6], SamplingParams(max_tokens=4))
            assert busy.value.code == "busy" and busy.value.retry_after >= 1
            quitter.close()  # its client goes away while queued
            deadline = time.monotonic() + 10
            while len(adm.queue) > 1:
                assert time.monotonic() < deadline, adm.stats()
                await asyncio.sleep(0.01)
            assert adm.left == 1
            r1, r2 = await asyncio.wait_for(asyncio.gather(first, second), 60)
            assert len(r1.tokens) == 40 and len(r2.tokens) == 4
            st = ring.entry.public_stats()["admission"]
            assert st["waited"] == 1 and st["refused"] == 1 and st["queued"] == 0
            third.cancel()
            for c in (long, waiting, refused):
                c.close()

    run(go(), timeout=120)


def test_cancel_while_queued_answers_cancelled(ckpt):
    from p2pk3.node.client import RequestError  # noqa: F401 - the error type the client raises

    async def go():
        topo = loopback_topology(ckpt, 1)
        async with InProcessRing(topo, ckpt, max_sessions=1, max_queue=2) as ring:
            adm = ring.entry.clients.admission
            a = await ring.client()
            first = asyncio.create_task(a.generate([5, 6, 7], SamplingParams(max_tokens=30)))
            while not ring.entry.entry.sessions:
                await asyncio.sleep(0.01)
            b = await ring.client()
            queued = asyncio.create_task(b.generate([5, 6, 8], SamplingParams(max_tokens=4)))
            while not adm.queue:
                await asyncio.sleep(0.01)
            queued.cancel()  # the client sends `cancel` for a request still in the queue
            with pytest.raises(asyncio.CancelledError):
                await queued
            f = await asyncio.wait_for(b.conn.recv(), 10)
            assert f.kind == "error" and f.header["code"] == "cancelled", f.header
            assert not adm.queue and adm.left == 1
            await asyncio.wait_for(first, 60)
            a.close()
            b.close()

    run(go(), timeout=120)
