"""The entry's schedule (micro-batched decode, pipelined prefill) and the stage worker's choice of what to
run next; through a real ring: tokens identical to one process under every schedule (greedy, seeded,
speculating), with several units of one session and of the ring in flight."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from p2pk3.engine.reference import Pipeline
from p2pk3.engine.sampling import SamplingParams
from p2pk3.model.cache import SessionError
from p2pk3.node.entry import Entry
from p2pk3.node.stage_runner import Work
from p2pk3.node.worker import Free, StageWorker, is_decode
from p2pk3.spec.draft_len import PassCost
from p2pk3.transport.messages import Result, Segment

from ring_helpers import InProcessRing, loopback_topology
from test_ring import run, topo_split


# ------------------------------------------------------------------------------------------ the entry
def _entry(**kw):
    sent = []
    e = Entry(sent.append, lambda sessions: None, **kw)
    return e, sent


def _answer(e: Entry, *works: Work, token: int = 7) -> None:
    """What the last stage would answer for units (in one result frame): a token per sampling segment."""
    e.on_results(
        [
            Result(s.session, s.epoch, s.start_pos + s.n_tokens, token)
            if s.sample is not None
            else Result(s.session, s.epoch, s.start_pos + s.n_tokens, skip=True)
            for w in works
            for s in w.segments
        ],
        None,
    )


def test_decode_micro_batches_are_balanced_and_leave_on_their_own():
    e, sent = _entry(micro_batches=2)
    ss = [e.submit([1, 2, 3], SamplingParams(max_tokens=50)) for _ in range(5)]
    prefill = list(sent)
    sent.clear()
    _answer(e, *prefill)
    # five decoding sessions in two groups of 3 and 2, each one unit
    assert sorted(len(w.segments) for w in sent) == [2, 3]
    groups = [{s.session for s in w.segments} for w in sent]
    a, b = sent
    sent.clear()
    _answer(e, a)  # only the group whose pass is back leaves again; the other is still in flight
    assert len(sent) == 1 and {s.session for s in sent[0].segments} == groups[0]
    # a session of the bigger group finishes: the groups are rebalanced (2 and 2, or 2 and 3 minus one)
    big = groups[0] if len(groups[0]) == 3 else groups[1]
    e.cancel(next(iter(big)))
    _answer(e, sent.pop(0), b)
    sizes = sorted(len(w.segments) for w in sent)
    assert sizes == [2, 2] and {s.id for s in ss if not s.done} == {x.session for w in sent for x in w.segments}


def test_one_micro_batch_is_one_batch_of_every_decoding_session():
    e, sent = _entry(micro_batches=1)
    for _ in range(4):
        e.submit([1, 2], SamplingParams(max_tokens=5))
    _answer(e, *sent)
    assert len(sent[-1].segments) == 4 and all(is_decode(w) for w in sent[-1:])


def test_prefill_chunks_enter_back_to_back_up_to_the_depth_in_position_order():
    e, sent = _entry(prefill_chunk=4, prefill_depth=3, max_batch_tokens=64)
    s = e.submit(list(range(1, 15)), SamplingParams(max_tokens=3))  # 14 tokens: chunks at 0, 4, 8, 12
    assert [(w.segments[0].start_pos, w.segments[0].n_tokens) for w in sent] == [(0, 4), (4, 4), (8, 4)]
    assert s.inflight == 3 and all(w.segments[0].sample is None for w in sent)
    _answer(e, sent[0])
    assert (sent[-1].segments[0].start_pos, sent[-1].segments[0].n_tokens) == (12, 2)
    assert sent[-1].segments[0].sample is not None  # the last chunk samples the first token
    for w in sent[1:]:
        _answer(e, w)
    assert s.decoding and s.generated == [7] and sent[-1].segments[0].start_pos == 14
    # two prompts: one chunk of each per unit, never two of one session in a unit
    e2, sent2 = _entry(prefill_chunk=4, prefill_depth=2, max_batch_tokens=64)
    e2.pause("both arrive before the next round")
    e2.submit(list(range(1, 13)), SamplingParams(max_tokens=1))
    e2.submit(list(range(1, 13)), SamplingParams(max_tokens=1))
    e2.resume()
    assert [[(x.start_pos, x.n_tokens) for x in w.segments] for w in sent2] == [[(0, 4), (0, 4)], [(4, 4), (4, 4)]]
    assert all(len({x.session for x in w.segments}) == 2 for w in sent2)


def test_prefill_units_are_cut_to_the_cost_of_a_decode_unit_while_sessions_decode():
    cost = PassCost()
    for width in (1, 2, 4, 8, 16, 64, 256):
        cost.observe(width, 2.0 * width)  # ms on the entry's stage
    e, sent = _entry(prefill_chunk=256, max_batch_tokens=512, micro_batches=2, stage_cost=cost)
    for _ in range(8):
        e.submit([1, 2], SamplingParams(max_tokens=100))
    _answer(e, *sent)
    sent.clear()
    e.submit(list(range(1, 1000)), SamplingParams(max_tokens=1))
    # decode units of 4 cost 8 ms: a prefill unit may cost 0.5 x 8 = 4 ms, 2 tokens
    assert [w.n_tokens for w in sent] == [2]
    alone, sent3 = _entry(prefill_chunk=256, max_batch_tokens=512, stage_cost=cost)
    alone.submit(list(range(1, 1000)), SamplingParams(max_tokens=1))
    assert [w.n_tokens for w in sent3] == [256]  # nothing decodes: full chunks


def test_replay_restarts_every_unit_and_ignores_the_old_epoch():
    e, sent = _entry(prefill_chunk=4, prefill_depth=2, micro_batches=2)
    s = e.submit(list(range(1, 11)), SamplingParams(max_tokens=3))
    old = list(sent)
    e.pause("repair")
    e.replay_all()
    assert s.inflight == 0 and s.epoch == 1
    sent.clear()
    e.resume()
    assert [(w.segments[0].epoch, w.segments[0].start_pos) for w in sent] == [(1, 0), (1, 4)]
    for w in old:
        _answer(e, w)  # epoch 0: ignored
    assert s.inflight == 2 and not s.generated


def test_unit_deadline_counts_from_the_oldest_unit_in_flight():
    e, sent = _entry(prefill_chunk=2, prefill_depth=2)
    s = e.submit(list(range(1, 9)), SamplingParams(max_tokens=3))
    s.sent_at[0] -= 100.0
    assert e.expire(50.0) == [s] and s.done and "no answer" in s.error


# ------------------------------------------------------------------------------------------ the worker
class _Runner:
    epochs: dict = {}

    def free(self, sid, epoch=None):
        return True


def _unit(sid, pos, n, sample=True):
    return Work(
        [Segment(sid, 0, pos, n, SamplingParams() if sample else None)], tokens=torch.zeros(n, dtype=torch.long)
    )


def _worker(first=False, budget=64):
    async def nothing(*a):
        pass

    return StageWorker(
        _Runner(),
        None,
        slot="s1",
        max_batch_tokens=budget,
        emit=nothing,
        report=nothing,
        pass_free=nothing,
        first=first,
    )


def test_worker_runs_decodes_first_with_one_prefill_unit_between_and_keeps_session_order():
    async def go():
        w = _worker()
        p1, p2, p3 = _unit("x", 0, 8, False), _unit("x", 8, 8, False), _unit("y", 0, 8, False)
        d1, d2 = _unit("a", 5, 1), _unit("b", 5, 1)
        for u in (p1, p2, p3, d1, d2):
            w.put(u)
        first = w._take()
        assert first == [d1, d2]  # decodes first, batched (a later stage that is behind)
        assert w._take() == [p1, p3]  # one prefill batch next: x's second chunk never joins its first
        w.put(_unit("c", 5, 1))
        got = w._take()
        assert got[0].segments[0].session == "c" or got == [p2]
        # a free is a barrier: nothing moves past it
        w2 = _worker()
        fr = Free([("x", 0)], "e")
        q = [_unit("x", 0, 8, False), fr, _unit("a", 3, 1)]
        for u in q:
            w2.put(u)
        assert w2._take() == [q[0]] and w2.items[0] is fr
        # the first stage runs the entry's units one by one (micro-batches stay apart)
        w3 = _worker(first=True)
        w3.put(d1)
        w3.put(d2)
        assert w3._take() == [d1] and w3._take() == [d2]

    asyncio.run(go())


def test_stage_refuses_units_of_a_session_out_of_position_order(ckpt):
    from p2pk3.node.stage_runner import StageRunner

    pipe = Pipeline.load(ckpt, 1, max_sessions=4, max_tokens=512, block_size=8)
    stage = pipe.stages[0]
    r = StageRunner(stage, stage.new_cache(4, 512))
    r.run(Work([Segment("s", 0, 0, 4)], tokens=torch.arange(3, 7)))
    with pytest.raises(SessionError, match="position order"):
        r.run(Work([Segment("s", 0, 8, 4)], tokens=torch.arange(3, 7)))
    with pytest.raises(SessionError, match="one session in one batch"):
        r.run(Work([Segment("t", 0, 0, 2), Segment("t", 0, 2, 2)], tokens=torch.arange(3, 7)))
    assert not r.cache.has("t")  # refused before anything was opened
    r.run(Work([Segment("s", 0, 4, 4, SamplingParams())], tokens=torch.arange(3, 7)))


# ------------------------------------------------------------------------------------------ the ring
@pytest.fixture(scope="module")
def reference(ckpt):
    return Pipeline.load(ckpt, 1, max_sessions=16, max_tokens=4096, block_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("n,m,d", [(2, 3, 3), ("split", 2, 4), (3, 1, 1)])
def test_tokens_equal_one_process_under_every_schedule(ckpt, reference, n, m, d):
    """Greedy, seeded and speculating sessions of different lengths, started at different times, with
    M micro-batches and D chunks of a prompt in flight, give the tokens of one process."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 60))] for _ in range(9)]
    params = [
        SamplingParams(max_tokens=rng.randrange(4, 14))
        if i % 3 == 0
        else SamplingParams(temperature=1.1, top_p=0.9, seed=100 + i, max_tokens=rng.randrange(4, 14))
        if i % 3 == 1
        else SamplingParams(max_tokens=12, speculate="ngram", draft_tokens=3)
        for i in range(9)
    ]
    want = [reference.generate([p], q)[0] for p, q in zip(prompts, params)]
    topo = topo_split(ckpt) if n == "split" else loopback_topology(ckpt, n)

    async def go():
        async with InProcessRing(topo, ckpt, prefill_chunk=8, micro_batches=m, prefill_depth=d) as ring:

            async def one(i):
                await asyncio.sleep(0.02 * i)
                c = await ring.client()
                try:
                    return (await c.generate(prompts[i], params[i])).tokens
                finally:
                    c.close()

            outs = await asyncio.gather(*(one(i) for i in range(9)))
            sched = ring.entry.entry.schedule_stats()
            for _ in range(30):  # frees travel the ring
                if all(not d_.runner.cache.sessions for d_ in ring.daemons):
                    break
                await asyncio.sleep(0.1)
            return outs, sched, [len(d_.runner.cache.sessions) for d_ in ring.daemons]

    outs, sched, left = run(go())
    assert outs == want
    assert sched["micro_batches"] == m and sched["prefill_depth"] == d
    assert left == [0] * len(left)


@pytest.mark.slow
def test_cancel_mid_prefill_with_chunks_in_flight_frees_every_stage(ckpt, reference):
    """A client that goes away while several chunks of its prompt are in the ring: the frees travel behind
    them, every stage ends up empty, and the ring serves the next request with the right tokens."""
    long_prompt = [3 + (i * 11) % 500 for i in range(400)]
    want = reference.generate([long_prompt[:30]], SamplingParams(max_tokens=6))[0]

    async def go():
        async with InProcessRing(loopback_topology(ckpt, 3), ckpt, prefill_chunk=8, prefill_depth=3) as ring:
            c = await ring.client()
            task = asyncio.create_task(c.generate(long_prompt, SamplingParams(max_tokens=4)))
            e = ring.entry.entry
            for _ in range(200):
                if any(s.inflight >= 2 for s in e.live()):
                    break
                await asyncio.sleep(0.01)
            in_flight = max((s.inflight for s in e.live()), default=0)
            c.close()
            try:
                await task
            except Exception:  # noqa: BLE001 - the connection was closed on purpose
                pass
            for _ in range(50):
                if not e.live() and all(not d.runner.cache.sessions for d in ring.daemons):
                    break
                await asyncio.sleep(0.1)
            left = [len(d.runner.cache.sessions) for d in ring.daemons]
            c2 = await ring.client()
            r = await c2.generate(long_prompt[:30], SamplingParams(max_tokens=6))
            c2.close()
            return in_flight, left, r.tokens

    in_flight, left, tokens = run(go())
    assert in_flight >= 2  # several chunks of the prompt were in the ring when it was cancelled
    assert left == [0, 0, 0] and tokens == want


class _FastRunner(_Runner):
    prefix = None

    def run(self, work):
        time.sleep(0.01)
        return object()


def test_held_time_counts_a_stall_outside_the_compute_and_stops_when_idle():
    """The degraded detector prices a stage by the time it held work (node/degraded.py): a stall between a
    unit's arrival and its compute (a stopped process handling frames) counts there, not in busy_s."""

    async def go():
        w = StageWorker(
            _FastRunner(), None, slot="s1", max_batch_tokens=64, emit=_nothing, report=_nothing, pass_free=_nothing
        )
        w.start()
        try:
            w.put(_unit("a", 5, 1))
            time.sleep(0.3)  # the event loop is stalled: the unit waits, the worker has not computed
            for _ in range(100):
                await asyncio.sleep(0.01)
                if w.stats.batches:
                    break
            await asyncio.sleep(0.05)
            held = w.held_s()
            assert w.stats.batches == 1
            assert held >= 0.3 and w.stats.busy_s < 0.1, (held, w.stats.busy_s)
            await asyncio.sleep(0.2)  # idle: no more held time
            assert w.held_s() == held
        finally:
            w.stop()

    asyncio.run(go())


async def _nothing(*a):
    pass


def test_lost_state_replays_the_session_a_bounded_number_of_times_then_fails_it_clearly():
    from p2pk3.node.entry import MAX_LOST_REPLAYS
    from p2pk3.transport.messages import ErrorCode

    e, sent = _entry(prefill_chunk=64)
    s = e.submit(list(range(1, 9)), SamplingParams(max_tokens=3))
    for k in range(MAX_LOST_REPLAYS + 1):
        e.kick()
        unit = sent[-1]
        seg = unit.segments[0]
        assert seg.start_pos == 0 and seg.epoch == k  # each replay: from position 0 at a new epoch
        msg = f"unknown session {s.id!r} on this stage"
        e.on_results([Result(s.id, seg.epoch, 8, error=msg, code=ErrorCode.LOST_STATE)], None)
        assert s.done == (k == MAX_LOST_REPLAYS)
    assert s.error == f"unknown session {s.id!r} on this stage" and s.replays == MAX_LOST_REPLAYS


def test_a_local_ring_keeps_no_more_units_in_flight_than_the_host_has_cores(monkeypatch):
    """`p2pk3 local` / LocalRing: its daemons share one host, so auto micro-batches and prefill depth are
    capped at the host's cores (more only take the cores from the others' decode steps); a flag the user
    gives wins. Nothing is started: the flags are read off the ring before `start()`."""
    import os
    import shutil

    from p2pk3.engine.reference import default_model_dir
    from p2pk3.node.local import LocalRing

    def flags(ring):
        ex = ring.extra
        shutil.rmtree(ring.workdir)
        return {f: ex[ex.index(f) + 1] for f in ("--micro-batches", "--prefill-depth")}

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert flags(LocalRing(default_model_dir(), 4)) == {"--micro-batches": "2", "--prefill-depth": "2"}
    assert flags(LocalRing(default_model_dir(), 1)) == {"--micro-batches": "1", "--prefill-depth": "1"}
    mine = LocalRing(default_model_dir(), 4, extra_args=["--prefill-depth", "4", "--micro-batches", "3"])
    assert flags(mine) == {"--micro-batches": "3", "--prefill-depth": "4"}
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert flags(LocalRing(default_model_dir(), 4)) == {"--micro-batches": "4", "--prefill-depth": "4"}
