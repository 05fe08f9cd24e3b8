"""The prefix cache: outputs with it equal outputs without it, on the stages (logits within 1e-5, hits that
end inside a block, evictions, the host tier, misses) and through a live ring (greedy tokens, speculation,
a stage that lost the prefix, the usage's cached tokens)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from p2pk3.engine.reference import Pipeline
from p2pk3.engine.sampling import SamplingParams
from p2pk3.model.prefix_cache import PrefixCache, PrefixMiss
from p2pk3.node.entry import Session
from p2pk3.node.prefix_match import PrefixMatcher
from p2pk3.node.stage_runner import HopOut, StageRunner, Work
from p2pk3.transport.messages import Segment
from conftest import rel
from conftest import run as _run
from ring_helpers import InProcessRing, loopback_topology

B = 4  # tokens per block: small, so that short prompts cross many boundaries


class Chain:
    """The stages of a ring in this process, fed segment by segment as the entry feeds them (the entry's
    matcher decides where each prompt starts and what the stages keep)."""

    def __init__(self, stages, budget: int = 0, host: int = 0, k: int = 2):
        self.runners = []
        for st in stages:
            kda, mla = st.cache_layers()
            bb = len(mla) * B * st.cfg.mla_cache_width * 4
            c = st.new_cache(8, 1024, B, prefix_blocks=budget // bb if bb and budget else 0)
            self.runners.append(StageRunner(st, c, PrefixCache(c, budget=budget, host_budget=host) if budget else None))
        self.m = PrefixMatcher([f"s{i}" for i in range(len(stages))], block=B, snapshot_every=k)
        self.n = 0

    def report(self):
        for i, r in enumerate(self.runners):
            if r.prefix is not None:
                a, e = r.prefix.take_report()
                self.m.on_report(f"s{i}", "h", a, e, stateless=r.prefix.stateless)

    def score(self, tokens, chunk: int = 6, start_at: int | None = None):
        """(the position it started at, logits [len - start, V] of the positions from there)."""
        self.n += 1
        s = Session(f"q{self.n}", 0, list(tokens), len(tokens), SamplingParams())
        self.m.begin(s)
        if start_at is not None:  # force a named prefix (a stage may not hold it: a miss)
            s.sent = s.cached = start_at
            s.prefix = self.m.point_key(s.chain, s.tokens, start_at)
        while True:
            try:
                rows = self._run(s, chunk)
                break
            except PrefixMiss:
                for r in self.runners:
                    r.free(s.id)
                s.epoch += 1
                self.m.missed(s)
        for r in self.runners:
            r.free(s.id)
        self.report()
        return s.cached, torch.cat(rows)

    def _run(self, s, chunk):
        rows = []
        while s.sent < len(s.tokens):
            n, keys = self.m.cut(s, min(chunk, len(s.tokens) - s.sent))
            seg = Segment(s.id, s.epoch, s.sent, n, None, True, **keys)
            work = Work([seg], tokens=torch.tensor(s.tokens[s.sent : s.sent + n]))
            for r in self.runners:
                out = r.run(work)
                if isinstance(out, HopOut):
                    work = Work([seg], hop=out.hop)
            rows.append(out.logits)
            s.sent += n
        return rows


@pytest.fixture(scope="module")
def stages(ckpt):
    return Pipeline.load(ckpt, 2).stages


def prompts(seed: int):
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(23)]
    return system, [system + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))] for _ in range(6)]


def test_hits_equal_the_uncached_logits_also_inside_a_block_and_after_evictions(stages):
    plain, cached = Chain(stages), Chain(stages, budget=1 << 20)
    system, turns = prompts(1)
    history = list(system)
    starts = []
    for t in turns[:4]:  # a chat: each prompt extends the previous one (hits end inside a block: a tail)
        history = history + t[len(system) :]
        p, got = cached.score(history)
        _, want = plain.score(history)
        starts.append(p)
        assert rel(got, want[p:]) < 1e-5, (p, len(history))
        assert torch.equal(got.argmax(-1), want[p:].argmax(-1))
    assert starts[0] == 0 and all(p > len(system) for p in starts[1:]), starts
    assert any(p % B for p in starts), starts  # some hit ended inside a block
    # a budget of a few blocks: every insert evicts; answers stay the same
    tight = Chain(stages, budget=3 * 2 * B * stages[0].cfg.mla_cache_width * 4)
    for t in turns[:3]:
        p, got = tight.score(t)
        _, want = plain.score(t)
        assert rel(got, want[p:]) < 1e-5
    assert sum(r.prefix.stats.evictions for r in tight.runners) > 0


def test_the_host_tier_brings_evicted_points_back_with_the_same_answers(stages):
    plain = Chain(stages)
    mla_block = B * stages[0].cfg.mla_cache_width * 4
    c = Chain(stages, budget=4 * mla_block, host=1 << 20)
    system, turns = prompts(2)
    first = c.score(turns[0])[0]
    for t in turns[1:]:  # the other prompts push the shared system prompt out to the host tier
        c.score(t)
    assert first == 0
    assert sum(r.prefix.stats.to_host for r in c.runners) > 0
    p, got = c.score(turns[0] + [7, 8, 9])
    _, want = plain.score(turns[0] + [7, 8, 9])
    assert p >= len(system) and rel(got, want[p:]) < 1e-5
    assert sum(r.prefix.stats.from_host for r in c.runners) > 0
    assert all(r.prefix.device_bytes <= r.prefix.budget for r in c.runners)
    assert all(r.prefix.host_bytes <= r.prefix.host_budget for r in c.runners)


def test_a_stage_that_lost_the_prefix_answers_a_miss_and_the_entry_falls_back(stages):
    plain, c = Chain(stages), Chain(stages, budget=1 << 20)
    system, turns = prompts(3)
    c.score(turns[0])
    c.runners[1].prefix.clear()  # behind the entry's back: it still believes both stages hold it
    c.runners[1].prefix.take_report()
    p, got = c.score(turns[1])
    _, want = plain.score(turns[1])
    assert p == 0 and c.m.misses >= 1
    assert rel(got, want) < 1e-5
    assert c.runners[1].prefix.stats.misses >= 1
    # an empty cache (a new holder after a takeover) misses as well: a named prefix is never an error
    fresh = Chain(stages, budget=1 << 20)
    p, got = fresh.score(turns[2], start_at=8)
    assert p == 0 and rel(got, plain.score(turns[2])[1]) < 1e-5


def test_shared_blocks_are_counted_and_given_back(stages):
    c = Chain(stages, budget=1 << 20)
    system, turns = prompts(4)
    for t in turns:
        c.score(t)
    for r in c.runners:
        cache = r.cache
        held = [n.block for n in r.prefix.nodes.values() if n.block is not None]
        assert all(cache.refs[b] == 1 for b in held)  # no session open: only the cache holds them
        assert cache.free_blocks + len(held) == cache.num_blocks
        r.prefix.clear()
        assert cache.free_blocks == cache.num_blocks and r.prefix.device_bytes == 0


def test_matcher_keys_and_cuts():
    m = PrefixMatcher(["a", "b"], block=4, snapshot_every=2)
    toks = list(range(10, 31))  # 21 tokens: 5 blocks and a tail of 1
    s = Session("x", 0, toks, len(toks), SamplingParams())
    m.begin(s)
    assert s.snap_points == [8, 16, 20]  # every 2nd boundary, the last boundary before 20, the end (21 - 1)
    cuts = []
    while s.sent < len(toks):
        n, f = m.cut(s, 100)
        cuts.append((s.sent, n, len(f["blocks"]), "snap" in f))
        s.sent += n
    assert cuts == [(0, 8, 2, True), (8, 8, 2, True), (16, 4, 1, True), (20, 1, 0, False)]
    toks = toks[:-2]  # 19 tokens: the end is a tail (18, inside block 4)
    s = Session("y", 0, toks, len(toks), SamplingParams())
    m.begin(s)
    assert s.snap_points == [8, 16, 18]
    assert m.match(toks + [1], s.chain) == (0, None)  # nothing reported yet
    tail = m.point_key(s.chain, toks, 18)
    for _ in range(3):
        m.cut(s, 100)[0]
        s.sent = {0: 8, 8: 16, 16: 18}[s.sent]
    m.on_report("a", "h1", [(tail, 18)], [])
    assert m.match(toks + [1], s.chain) == (0, None)  # b does not hold it
    m.on_report("b", "h2", [(tail, 18), (s.chain[1], 8)], [])
    assert m.match(toks, s.chain) == (18, tail)  # the same prompt again: all but its last token
    assert m.match(toks[:18], s.chain) == (0, None)  # a shorter one: at least one token is computed
    m.on_report("a", "h1", [(s.chain[1], 8)], [])
    assert m.match(toks[:18], s.chain) == (8, s.chain[1])
    m.on_report("a", "h3", [], [])  # a new holder (a takeover): what h1 reported is gone
    assert m.match(toks + [1], s.chain) == (0, None)


# ------------------------------------------------------------------------------------------- ring
class WrongGuesses:
    """A draft proposer that always drafts: the last token + 1, + 2, ... (rejected but for a coincidence)."""

    def propose(self, tokens, k):
        return [(tokens[-1] + 1 + i) % 500 for i in range(k)]


def run(coro):
    return _run(coro, 240.0)


@pytest.fixture(scope="module")
def reference(ckpt):
    return Pipeline.load(ckpt, 1, max_sessions=16, max_tokens=4096, block_size=8)


def test_ring_greedy_tokens_with_the_cache_equal_the_reference_and_report_cached_tokens(ckpt, reference):
    system, turns = prompts(5)
    # turns 1 and 3 speculate; turn 1 ends at a stop id inside a verify pass (its drafts after the stop are
    # rolled back before the stages keep its reply)
    stop = reference.generate([turns[1]], SamplingParams(max_tokens=6))[0][3]
    plain = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, stop_ids=(stop,))] * 2
    params = [
        p if i % 2 == 0 else dataclasses.replace(p, speculate="ngram", draft_tokens=3) for i, p in enumerate(plain)
    ]

    async def main():
        topo = loopback_topology(ckpt, 3)
        async with InProcessRing(topo, ckpt, prefill_chunk=8, prefix_block=B, snapshot_every=2) as ring:
            # always k drafts, of tokens the model mostly rejects: verify passes and rollbacks on every stage
            ring.entry.entry.draft_policy = "fixed"
            ring.entry.entry.proposer_factories["ngram"] = WrongGuesses
            c = await ring.client()
            try:
                got, again, spec = [], [], []
                for i, t in enumerate(turns[:4]):
                    r = await c.generate(t, params[i])
                    got.append((r.tokens, r.stats["cached_tokens"]))
                    spec.append(r.stats.get("proposed", 0) - r.stats.get("accepted", 0))
                # the next turn of the first conversation: its reply was kept too (all of it but the last
                # token, which was never fed), whether it was drafted (turn 1) or not (turn 0)
                for i in (0, 1):
                    nxt = turns[i] + got[i][0] + [11, 12]
                    r = await c.generate(nxt, params[0])
                    again.append((nxt, r.tokens, r.stats["cached_tokens"]))
                ring.daemons[2].runner.prefix.clear()  # the last stage lost everything: misses, fallbacks
                ring.daemons[2].runner.prefix.take_report()
                r = await c.generate(turns[4], params[0])
                got.append((r.tokens, r.stats["cached_tokens"]))
                st = ring.entry.entry.prefixes.status()
                return got, again, st, spec
            finally:
                c.close()

    got, again, st, spec = run(main())
    assert spec[1] > 0, spec  # drafts were rejected: the stages rolled back (also before keeping the reply)
    for i, (nxt, toks, cached) in enumerate(again):
        assert toks == reference.generate([nxt], SamplingParams(max_tokens=6))[0]
        assert cached == len(turns[i]) + len(got[i][0]) - 1, (i, cached)
    for i, (toks, _) in enumerate(got):
        want = reference.generate([turns[i]], plain[i] if i < 4 else plain[0])[0]
        assert toks == want, i
    assert len(got[1][0]) == 4  # stopped at the stop id
    # distinct suffixes after the shared system prompt: each later turn starts at the last snapshot (every
    # 2nd block) inside the shared part
    shared = len(system) // (2 * B) * 2 * B
    assert got[0][1] == 0 and all(c >= shared for _, c in got[1:4]), got
    assert got[4][1] == 0 and st["misses"] >= 1
    assert st["hit_tokens"] > 0


def test_sessions_with_penalties_hit_the_cache_and_sample_as_one_process(ckpt, reference):
    """Frequency / presence penalties read only the output: such a session starts at a cached prefix (its
    last-stage sampler holds the positions below as unknown). The repetition penalty counts the prompt's ids:
    that session starts at the cached prefix too, its first segment carrying the ids below it
    (Segment.history). Both give the single-process tokens, which the penalties changed."""
    system, turns = prompts(7)
    out_pen = SamplingParams(max_tokens=8, frequency_penalty=-2.0, presence_penalty=-2.0)  # repeat yourself
    rep_pen = SamplingParams(max_tokens=8, repetition_penalty=1.8)
    # seed 8: the plain answer repeats an id of the cached part (checked below), so a sampler that did not
    # count the cached ids could not avoid every prompt id under a huge penalty
    _, turns8 = prompts(8)
    huge = SamplingParams(max_tokens=8, repetition_penalty=1e4)

    async def main():
        topo = loopback_topology(ckpt, 3)
        async with InProcessRing(topo, ckpt, prefill_chunk=8, prefix_block=B, snapshot_every=2) as ring:
            c = await ring.client()
            try:
                first = await c.generate(turns[0], SamplingParams(max_tokens=2))  # fills the caches
                a = await c.generate(turns[1], out_pen)
                b = await c.generate(turns[2], rep_pen)
                await c.generate(turns8[0], SamplingParams(max_tokens=2))
                h = await c.generate(turns8[2], huge)
                return first, a, b, h
            finally:
                c.close()

    first, a, b, h = run(main())
    assert first.stats["cached_tokens"] == 0
    assert a.stats["cached_tokens"] > 0 and b.stats["cached_tokens"] > 0, (a.stats, b.stats)
    assert a.tokens == reference.generate([turns[1]], out_pen)[0]
    assert b.tokens == reference.generate([turns[2]], rep_pen)[0]
    assert a.tokens != reference.generate([turns[1]], SamplingParams(max_tokens=8))[0]  # the penalties acted
    assert b.tokens != reference.generate([turns[2]], SamplingParams(max_tokens=8))[0]
    n = h.stats["cached_tokens"]
    plain8 = reference.generate([turns8[2]], SamplingParams(max_tokens=8))[0]
    assert n > 0 and set(plain8) & set(turns8[2][:n]), (n, plain8)  # the precondition
    assert h.tokens == reference.generate([turns8[2]], huge)[0] and not set(h.tokens) & set(turns8[2])


def ring_with_a_spare(ckpt):
    """A 3-stage loopback topology with a standby slot `spare0`, and ring options that fail over fast."""
    from p2pk3.node.local import free_ports
    from p2pk3.topology import Slot, Topology

    topo = loopback_topology(ckpt, 3)
    topo.slots.append(Slot("spare0", None, 2, "127.0.0.1", free_ports(1)[0], standby=True))
    opts = dict(prefill_chunk=8, prefix_block=B, snapshot_every=2, heartbeat_s=0.2, dead_after_s=1.0)
    return Topology.from_dict(topo.to_dict()), opts


async def spare_known(ring, slot: str = "spare0", timeout: float = 30.0) -> None:
    """Until the entry's monitor has heard `slot` answer as a standby: a stage killed before that is down with
    no standby to take it over (a kill 0.3 s after the spare started failed the request in one suite run)."""
    from p2pk3.node.monitor import UP

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        ps = ring.entry.monitor.state(slot)
        if ps is not None and ps.state == UP and ps.info.get("role") == "standby":
            return
        assert loop.time() < deadline, f"the entry never heard {slot} as a standby: {ps}"
        await asyncio.sleep(0.05)


@pytest.mark.slow
def test_after_a_takeover_the_new_holder_misses_and_the_answers_stay_right(ckpt, reference):
    system, turns = prompts(6)
    topo, opts = ring_with_a_spare(ckpt)

    async def main():
        async with InProcessRing(topo, ckpt, **opts) as ring:
            spare = await ring.start("spare0")
            await spare_known(ring)
            c = await ring.client()
            try:
                got = [await c.generate(t, SamplingParams(max_tokens=5)) for t in turns[:2]]
                await ring.daemons[1].stop("killed by the test")  # s1: the spare takes it over
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 60
                while not (spare.role == "stage" and ring.entry.coordinator.health() is None):
                    assert loop.time() < deadline, "the spare did not take s1 over"
                    await asyncio.sleep(0.1)
                got += [await c.generate(t, SamplingParams(max_tokens=5)) for t in turns[2:4]]
                return got
            finally:
                c.close()

    got = run(main())
    for t, r in zip(turns, got):
        assert r.tokens == reference.generate([t], SamplingParams(max_tokens=5))[0]
    cached = [r.stats["cached_tokens"] for r in got]
    assert cached[0] == 0 and cached[1] > 0, cached
    assert cached[2] == 0 and cached[3] > 0, cached  # the new holder's cache starts empty, then fills


@pytest.mark.slow
def test_a_penalised_session_that_hit_the_cache_keeps_its_tokens_when_the_last_stage_dies_mid_answer(ckpt, reference):
    """A repetition-penalty session starts at a cached prefix (its first segment carries the ids below it,
    Segment.history); the last stage, whose sampler holds those ids, is killed after the first tokens. The
    spare takes the slot over with an empty cache, the session is replayed there, and its tokens still equal
    one process's under the penalty."""
    _, turns8 = prompts(8)
    huge = SamplingParams(max_tokens=12, repetition_penalty=1e4)
    topo, opts = ring_with_a_spare(ckpt)

    async def main():
        async with InProcessRing(topo, ckpt, **opts) as ring:
            spare = await ring.start("spare0")
            await spare_known(ring)
            c = await ring.client()
            try:
                await c.generate(turns8[0], SamplingParams(max_tokens=2))  # fills the caches
                seen = asyncio.Event()
                got: list[int] = []

                def on_token(t):
                    got.append(t)
                    if len(got) == 3:
                        seen.set()

                task = asyncio.create_task(c.generate(turns8[2], huge, on_token=on_token))
                await asyncio.wait_for(seen.wait(), 60)
                hit = ring.entry.entry.prefixes.hit_tokens  # it started at the cached prefix
                await ring.daemons[2].stop("killed by the test")  # the last stage, mid-answer
                reply = await asyncio.wait_for(task, 120)
                assert spare.role == "stage"
                return reply, hit
            finally:
                c.close()

    r, hit = run(main())
    assert hit > 0 and r.stats["replays"] >= 1, (hit, r.stats)  # a hit, then replayed after the takeover
    assert r.tokens == reference.generate([turns8[2]], huge)[0] and not set(r.tokens) & set(turns8[2])


def test_live_sessions_take_back_blocks_only_the_cache_holds(stages):
    c = Chain(stages, budget=1 << 20)
    system, turns = prompts(7)
    for t in turns:
        c.score(t)
    r = c.runners[-1]
    cache, held = r.cache, len(r.prefix.nodes)
    assert held and cache.free_blocks < cache.num_blocks
    need = cache.free_blocks + 2  # more than the pool has free: the cache gives blocks back
    r.cache.open("big")
    from p2pk3.model.cache import Span

    cache.reserve([Span("big", 0, need * B)])
    assert len(cache.get("big").blocks) == need and r.prefix.stats.evictions > 0
    cache.free("big")


def test_the_planner_lists_the_budget_and_the_simulator_models_a_hit(ckpt):
    from p2pk3.model.config import KIMI_K3
    from p2pk3.plan.memory import memory_table
    from p2pk3.sim import load_profile, simulate_sweep
    from p2pk3.topology import GiB

    topo = loopback_topology(ckpt, 2)
    cfg = topo.model_config()
    sp = topo.slot_plan(topo.active[0], cfg)
    t = memory_table(cfg, sp, topo.memory, 8.0)
    item, detail, b = t.rows()[-1]
    assert item.startswith("prefix cache") and b == int(0.25 * t.free) and "prefix cache" in t.render()
    assert memory_table(cfg, sp, topo.memory, 8.0, prefix_cache_gb=2).rows()[-1][2] == 2 * GiB
    hw = load_profile(None)
    kw = dict(prompt=32000, new_tokens=2, context=0)  # an agent turn: 30k cached, 2k new
    cold = simulate_sweep(KIMI_K3, topo_k3(), hw, [1], **kw)[0]
    hit = simulate_sweep(KIMI_K3, topo_k3(), hw, [1], cached_prefix=30000, **kw)[0]
    assert hit.ttft_s < 0.5 * cold.ttft_s and hit.meta["cached_prefix"] == 30000
    assert hit.ttft_s <= 1.5  # the figure; 2.14 s with the hit's 2k cut into 8 chunks of 256


def test_a_hits_remainder_is_cut_to_fill_the_pipeline():
    """chunk_after_hit: ceil(remainder / depth) chunks, between HIT_CHUNK_MIN and the prefill chunk."""
    from p2pk3.node.options import HIT_CHUNK_MIN, chunk_after_hit

    assert HIT_CHUNK_MIN == 32
    assert chunk_after_hit(2000, 78, 256) == 32  # ceil(2000 / 78) = 26, raised to the minimum
    assert chunk_after_hit(6000, 78, 256) == 77  # ceil(6000 / 78)
    assert chunk_after_hit(100_000, 78, 256) == 256  # capped by the prefill chunk
    assert chunk_after_hit(10, 4, 256) == 32 and chunk_after_hit(10, 4, 16) == 16
    assert chunk_after_hit(5, 0, 256) == 32  # depth 0 counts as 1


def topo_k3():
    from pathlib import Path

    from p2pk3.topology import Topology

    return Topology.load(Path(__file__).parent.parent / "topology" / "k3-80x5090.toml")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU: the host tier's pinned, asynchronous copies")
def test_the_host_tier_on_a_gpu_copies_through_pinned_memory(ckpt):
    stages = Pipeline.load(ckpt, 2, device="cuda").stages
    plain = Chain(stages)
    c = Chain(stages, budget=4 * B * stages[0].cfg.mla_cache_width * 4, host=1 << 20)
    system, turns = prompts(8)
    for t in turns:
        c.score(t)
    hosted = [n for r in c.runners for n in r.prefix.nodes.values() if n.tier == "host"]
    assert hosted and all(t.is_pinned() for n in hosted for t in (n.host_block or {}).values())
    p, got = c.score(turns[0] + [7, 8, 9])
    _, want = plain.score(turns[0] + [7, 8, 9])
    assert p >= len(system) and rel(got, want[p:]) < 1e-5
    assert sum(r.prefix.stats.from_host for r in c.runners) > 0
