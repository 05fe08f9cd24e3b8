"""Speculative decoding (p2pk3/spec): drafts verified in one pass, exact rollback, same output as without.

Greedy and seeded output with speculation must be token-for-token that of plain decoding, in one process
(Pipeline) and through a 4-node ring (in-process NodeDaemons), for the embedded model and a random tiny K3.
An "oracle" proposer (it knows the plain output and corrupts it on a schedule) makes every case happen:
full acceptance, a rejection at each depth, no draft right after accepted drafts, a stop id inside an
accepted run; ngram / suffix proposers run on real text."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from p2pk3.engine.reference import Pipeline, default_model_dir
from p2pk3.engine.sampling import sample_at
from p2pk3.model.cache import SessionError, Span
from p2pk3.model.config import K3Config
from p2pk3.node.entry import Entry
from p2pk3.node.stage_runner import StageRunner, Work
from p2pk3.params import SamplingParams
from p2pk3.spec.draft_len import DraftLength, PassCost
from p2pk3.spec.proposers import NgramProposer, SuffixIndex, SuffixProposer
from p2pk3.spec.verify import verify_draft
from p2pk3.transport.codec import ProtocolError
from p2pk3.transport.messages import Result, Segment
from ring_helpers import InProcessRing, loopback_topology

EMBEDDED = default_model_dir()


# ------------------------------------------------------------------------------------------ helpers
class Oracle:
    """Knows the plain output of each prompt; drafts it, corrupted by a schedule of modes per pass:
    full (the true continuation), none (no draft), cut<j> (wrong at depth j), zero (wrong first token)."""

    MODES = ("full", "none", "cut1", "cut0", "full", "full", "none", "cut2", "cut3", "none", "cut5")

    def __init__(self, want: dict[tuple[int, ...], list[int]], vocab: int):
        self.want, self.vocab, self.calls = want, vocab, 0

    def propose(self, history, k):
        found = [(p, o) for p, o in self.want.items() if tuple(history[: len(p)]) == p]
        if not found:
            return []
        prompt, out = found[0]
        g = len(history) - len(prompt)
        if list(history[len(prompt) :]) != out[:g]:  # left the plain output (a bug the test then reports)
            return []
        true = out[g : g + k]
        mode = self.MODES[self.calls % len(self.MODES)]
        self.calls += 1
        if mode == "none" or not true:
            return []
        if mode.startswith("cut"):
            j = int(mode[3:]) % len(true)
            true = true[:j] + [(true[j] + 1) % self.vocab] + true[j + 1 :]
        return true


def oracle_factory(want, vocab):
    return lambda: Oracle(want, vocab)


@pytest.fixture(scope="module")
def emb():
    return Pipeline.load(EMBEDDED, 2, max_sessions=16, max_tokens=8192, block_size=8)


@pytest.fixture(scope="module")
def tiny(ckpt):
    return Pipeline.load(ckpt, 2, max_sessions=16, max_tokens=8192, block_size=8)


def emb_prompts():
    from p2pk3.tokenizer import load_tokenizer

    tok = load_tokenizer(EMBEDDED)
    texts = [
        "The with statement is used to wrap the execution of a block with methods defined by a context manager.",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
        "What does the with statement do?",
    ]
    return [tok.encode(t) for t in texts]


def rand_prompts(n, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


# ------------------------------------------------------------------------------------------ units
def test_ngram_proposer_matches_longest_recent_ngram_and_continues_periods():
    p = NgramProposer(max_n=3)
    h = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert p.propose(h, 3) == [4, 5, 1] and p.last_match == 3  # the most recent "1 2 3" was followed by 4 5
    assert NgramProposer().propose([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]  # runs past the present: periodic
    assert NgramProposer().propose([1, 2, 3], 4) == []  # nothing repeats
    q = NgramProposer()
    for n in range(2, 40):  # incremental index: same answers as a fresh proposer at every length
        h = [i % 7 for i in range(n)] + [3]
        assert q.propose(h, 4) == NgramProposer().propose(h, 4)


def test_suffix_index_shares_outputs_and_stays_bounded():
    ix = SuffixIndex(capacity=256, max_n=4)
    ix.add([50, 51, 52, 53, 54, 55])
    sp = SuffixProposer(ix)
    assert sp.propose([9, 51, 52, 53], 3) == [54, 55]  # from another document, stops at its end
    assert sp.propose([9, 8, 7], 3) == []
    for i in range(500):
        ix.add([1000 + i, 1001 + i, 1002 + i, 1003 + i])
    assert len(ix) <= 256 and ix.entries() <= 256 * 4
    assert sp.propose([1, 1497, 1498], 2) == [1499, 1500]  # recent documents are still found
    assert sp.propose([9, 51, 52, 53], 3) == []  # the old one was dropped


def test_draft_length_maximises_tokens_per_ring_time():
    flat, steep = PassCost(), PassCost()
    for w in (1, 2, 4, 8, 9):
        flat.observe(w, 10.0)
        steep.observe(w, 10.0 * w)
    good, bad = DraftLength(), DraftLength()
    for _ in range(10):
        good.observe(8, 8)
        bad.observe(8, 0)
    assert good.alpha > 0.9 and bad.alpha < 0.2
    assert good.choose(8, lambda k: flat.estimate(1 + k)) == 8
    assert bad.choose(8, lambda k: steep.estimate(1 + k)) == 0
    assert bad.choose(8, lambda k: None) == 8  # nothing measured yet: explore
    for _ in range(30):
        bad.observe(0, 0)  # no drafts: back towards the prior, so it tries again
    assert bad.alpha > 0.4
    assert steep.estimate(3) == pytest.approx(30.0) and steep.estimate(16) == pytest.approx(160.0)


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_verify_accepts_exactly_what_plain_sampling_draws(temperature):
    torch.manual_seed(0)
    params = SamplingParams(temperature=temperature, top_k=20, seed=11)
    for trial in range(30):
        k = 1 + trial % 8
        logits = torch.randn(k + 1, 64) * 3
        plain = [sample_at(logits[i], params, 40 + i + 1) for i in range(k + 1)]
        cut = trial % (k + 1)  # drafts agree with plain sampling up to `cut`
        draft = plain[:k]
        if cut < k:
            draft = draft[:cut] + [(draft[cut] + 1) % 64] + draft[cut + 1 :]
        acc, tok = verify_draft(logits, draft, params, 40)
        assert acc == plain[: min(cut, k)] and tok == plain[len(acc)]


def test_segment_and_result_carry_drafts():
    p = SamplingParams(seed=3)
    s = Segment("x", 2, 10, 4, p, draft=(5, 6, 7))
    assert Segment.from_wire(s.to_wire()) == s
    assert "draft" not in Segment("x", 0, 0, 1, p).to_wire()
    for bad in ({"n_tokens": 3}, {"sample": None}, {"draft": [1, -2, 3]}, {"draft": list(range(17)), "n_tokens": 18}):
        d = {**s.to_wire(), **bad}
        d = {k: v for k, v in d.items() if v is not None}
        with pytest.raises(ProtocolError):
            Segment.from_wire(d)
    r = Result("x", 2, 12, 9, accepted=(5, 6))
    assert Result.from_wire(r.to_wire(), "r") == r and r.tokens == [5, 6, 9]
    assert SamplingParams.from_wire(SamplingParams(speculate="suffix", draft_tokens=3).to_wire()).speculate == "suffix"
    assert "speculate" not in SamplingParams().to_wire()
    with pytest.raises(ValueError):
        SamplingParams(speculate="magic")


# ------------------------------------------------------------------------------------------ rollback
def _snapshot(pipe, sid):
    """KDA state rows, conv rows and MLA rows up to the length, per stage."""
    out = []
    for c in pipe.caches:
        sc = c.get(sid)
        st = {f"kda{i}": t[sc.row].clone() for i, t in c.kda_state.items()}
        st.update({f"conv{i}": t[sc.row].clone() for i, t in c.conv_state.items()})
        for i, t in c.mla_kv.items():
            flat, bs = t.view(-1, t.shape[-1]), c.block_size
            b, pos = torch.tensor(sc.blocks, dtype=torch.long), torch.arange(sc.length)
            st[f"mla{i}"] = flat[b[pos // bs] * bs + pos % bs].clone() if sc.length else flat[:0].clone()
        st["length"] = sc.length
        out.append(st)
    return out


def _rel(a, b):
    """Largest relative difference tensor by tensor (lengths must match exactly)."""
    m = 0.0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if k == "length":
                assert x[k] == y[k]
            else:
                assert x[k].shape == y[k].shape, k
                m = max(m, float((x[k] - y[k]).abs().max() / (y[k].abs().max() + 1e-12)) if x[k].numel() else 0.0)
    return m


@pytest.mark.parametrize("which", ["emb", "tiny"])
def test_rollback_leaves_no_trace_of_rejected_drafts(which, request):
    """After a verify pass [t, d1, x, y] rolled back to 2 tokens, every stage's KDA state, short-conv state
    and MLA rows equal those of a run that only ever processed [t, d1] (to float rounding, which depends on
    the batch width even without speculation; the state without the rollback is off by O(1)), a rollback
    to the pass start restores it bit for bit, and the next pass gives the same logits."""
    pipe = request.getfixturevalue(which)
    h = list(range(5, 29))
    p = len(h)
    for sid in ("A", "B"):
        pipe.open(sid)
        pipe.forward([Span(sid, 0, p)], torch.tensor(h))
    try:
        before = _snapshot(pipe, "A")
        pipe.forward([Span("A", p, 4, verify=True)], torch.tensor([30, 31, 99, 98]), logits="all")
        unrolled = _snapshot(pipe, "A")
        for stage, cache in zip(pipe.stages, pipe.caches):
            stage.rollback(cache, "A", p + 2)
            assert cache.get("A").ckpt is None and cache.get("A").length == p + 2
        pipe.forward([Span("B", p, 2)], torch.tensor([30, 31]), logits="all")
        a, b = _snapshot(pipe, "A"), _snapshot(pipe, "B")
        assert _rel(a, b) < 1e-5
        kda_off = max(
            float((x[k] - y[k]).abs().max() / y[k].abs().max())
            for x, y in zip(unrolled, b)
            for k in x
            if k.startswith("kda")
        )
        assert kda_off > 1e-2  # what the rollback removed is far above the tolerance
        la = pipe.forward([Span("A", p + 2, 3)], torch.tensor([40, 41, 42]), logits="all")
        lb = pipe.forward([Span("B", p + 2, 3)], torch.tensor([40, 41, 42]), logits="all")
        assert (la - lb).abs().max() < 1e-4 and torch.equal(la.argmax(-1), lb.argmax(-1))
        assert before[0]["length"] == p
    finally:
        pipe.close("A")
        pipe.close("B")


def test_rollback_to_pass_start_is_bitwise_and_bad_rollbacks_change_nothing(emb):
    pipe = emb
    h = list(range(40, 60))
    pipe.open("C")
    try:
        pipe.forward([Span("C", 0, len(h))], torch.tensor(h))
        before = _snapshot(pipe, "C")
        pipe.forward([Span("C", len(h), 5, verify=True)], torch.tensor([1, 2, 3, 4, 5]), logits="all")
        for stage, cache in zip(pipe.stages, pipe.caches):
            stage.rollback(cache, "C", len(h))
        after = _snapshot(pipe, "C")
        for x, y in zip(after, before):
            for k in x:
                assert (x[k] == y[k]) if k == "length" else torch.equal(x[k], y[k]), k
        # no checkpoint any more: a second rollback is refused and changes nothing
        with pytest.raises(SessionError, match="cannot roll back"):
            pipe.stages[0].rollback(pipe.caches[0], "C", len(h) - 1)
        pipe.forward([Span("C", len(h), 3, verify=True)], torch.tensor([1, 2, 3]), logits="all")
        with pytest.raises(SessionError, match="cannot roll back"):  # outside the pass
            pipe.stages[0].rollback(pipe.caches[0], "C", len(h) - 1)
        assert pipe.caches[0].get("C").length == len(h) + 3
    finally:
        pipe.close("C")


def test_stage_runner_rolls_back_when_a_segment_starts_below_the_held_length(ckpt):
    """The rollback point travels with the next segment; a stale start without a checkpoint is refused."""
    from p2pk3.checkpoint.stage import load_stage
    from p2pk3.model.stage import StagePlan

    cfg = K3Config.from_pretrained(ckpt)
    stage = load_stage(ckpt, StagePlan.whole(cfg), cfg=cfg)
    ra, rb = StageRunner(stage, stage.new_cache(4, 512, 8)), StageRunner(stage, stage.new_cache(4, 512, 8))
    sp = SamplingParams()
    h = [5, 9, 13, 200, 17, 4]
    for r in (ra, rb):
        r.run(Work([Segment("s", 0, 0, len(h), sp)], tokens=torch.tensor(h)))
    out = ra.run(Work([Segment("s", 0, 6, 4, sp, draft=(7, 8, 9))], tokens=torch.tensor([1, 7, 8, 9])))
    res = out.results[0]
    assert ra.cache.get("s").length == 10 and res.pos == 6 + len(res.accepted) + 1
    toks = [1, *res.accepted, res.token]
    a = ra.run(Work([Segment("s", 0, res.pos, 1, sp)], tokens=torch.tensor([res.token])))  # rollback here
    b = rb.run(Work([Segment("s", 0, 6, len(toks), sp)], tokens=torch.tensor(toks)))
    assert a.results[0].token == b.results[0].token
    assert ra.cache.get("s").length == rb.cache.get("s").length == 6 + len(toks)
    assert ra.rollbacks == (1 if len(res.accepted) < 3 else 0)
    with pytest.raises(SessionError):
        ra.run(Work([Segment("s", 0, 3, 1, sp)], tokens=torch.tensor([1])))
    assert ra.cache.get("s").length == 6 + len(toks)  # nothing changed
    st = ra.spec_stats()
    assert st["verify_segments_by_width"] == {"4": 1} and sum(st["passes_by_width"].values()) == 3


# ------------------------------------------------------------------------------------------ one process
@pytest.mark.slow
@pytest.mark.parametrize("which", ["emb", "tiny"])
def test_pipeline_greedy_speculation_equals_plain_for_every_k(which, request):
    pipe = request.getfixturevalue(which)
    prompts = emb_prompts() if which == "emb" else rand_prompts(3)
    V = pipe.cfg.vocab_size
    plain = SamplingParams(max_tokens=24)
    want = pipe.generate(prompts, plain)
    oracle = {tuple(p): w for p, w in zip(prompts, want)}
    for k in range(1, 9):
        spec = SamplingParams(max_tokens=24, speculate="ngram", draft_tokens=k)
        assert pipe.generate(prompts, spec, proposers={"ngram": oracle_factory(oracle, V)}) == want, k
        st = pipe.last_stats
        assert sum(s["accepted"] for s in st) > 0 and sum(s["proposed"] for s in st) > sum(s["accepted"] for s in st)
        # mixed batch: speculating and plain sessions together, and the real n-gram proposer
        mixed = [spec, plain, SamplingParams(max_tokens=24, speculate="ngram", draft_tokens=9 - k)]
        assert pipe.generate(prompts, mixed) == want, k
    # a stop id inside an accepted draft: the output ends there (plain: the same)
    stop = want[0][5]
    sp = SamplingParams(max_tokens=24, stop_ids=(stop,))
    want_stop = pipe.generate(prompts, sp)
    assert want_stop[0] == want[0][: want[0].index(stop) + 1]
    full = {tuple(p): w for p, w in zip(prompts, want)}

    class Full(Oracle):
        MODES = ("full",)

    got = pipe.generate(
        prompts,
        SamplingParams(max_tokens=24, stop_ids=(stop,), speculate="ngram", draft_tokens=8),
        proposers={"ngram": lambda: Full(full, V)},
    )
    assert got == want_stop


@pytest.mark.slow
def test_pipeline_seeded_sampling_with_speculation_equals_without(tiny):
    prompts = rand_prompts(3, seed=9)
    p = SamplingParams(temperature=1.1, top_p=0.95, seed=77, max_tokens=20)
    want = tiny.generate(prompts, p)
    oracle = {tuple(q): w for q, w in zip(prompts, want)}
    for k in (1, 3, 8):
        s = SamplingParams(temperature=1.1, top_p=0.95, seed=77, max_tokens=20, speculate="ngram", draft_tokens=k)
        assert tiny.generate(prompts, s, proposers={"ngram": oracle_factory(oracle, tiny.cfg.vocab_size)}) == want
        assert tiny.generate(prompts, s) == want
    suffix = SamplingParams(temperature=1.1, top_p=0.95, seed=77, max_tokens=20, speculate="suffix", draft_tokens=4)
    assert tiny.generate(prompts, suffix) == want


# ------------------------------------------------------------------------------------------ the entry
def test_entry_truncates_an_accepted_run_at_max_tokens_and_stop_ids():
    sent, freed = [], []
    e = Entry(sent.append, freed.extend)
    e.draft_policy = "fixed"

    class Fixed:
        def propose(self, history, k):
            return [100 + i for i in range(k)]

    e.proposer_factories["ngram"] = Fixed
    s = e.submit([1, 2, 3], SamplingParams(max_tokens=6, stop_ids=(0,), speculate="ngram", draft_tokens=8))
    e.on_results([Result(s.id, 0, 3, 50)], None)  # the prefill's token
    seg = sent[-1].segments[0]
    assert seg.start_pos == 3 and seg.draft == (100, 101, 102, 103) and seg.n_tokens == 5  # k <= 6 - 1 - 1
    assert sent[-1].tokens.tolist() == [50, 100, 101, 102, 103]
    e.on_results([Result(s.id, 0, 6, 7, accepted=(100, 101))], None)
    seg = sent[-1].segments[0]
    assert s.generated == [50, 100, 101, 7] and seg.start_pos == 6  # rolls the ring back to 6
    assert seg.draft == (100,) and sent[-1].tokens.tolist() == [7, 100]
    e.on_results([Result(s.id, 0, 8, 9, accepted=(100,))], None)
    assert s.done and s.generated == [50, 100, 101, 7, 100, 9] and freed == [(s.id, 0)]
    # a stop id inside an accepted run ends the output there; the bonus token is dropped
    t = e.submit([1, 2], SamplingParams(max_tokens=20, stop_ids=(101,), speculate="ngram"))
    e.on_results([Result(t.id, 0, 2, 5)], None)
    e.on_results([Result(t.id, 0, 6, 9, accepted=(100, 101, 102))], None)
    assert t.done and t.generated == [5, 100, 101]
    st = t.stats()
    assert st["proposed"] == 8 and st["accepted"] == 3 and st["passes"] == 2
    # a ring that claims more accepted tokens than were drafted fails the session
    u = e.submit([1, 2], SamplingParams(max_tokens=20, speculate="ngram"))
    e.on_results([Result(u.id, 0, 2, 5)], None)
    e.on_results([Result(u.id, 0, 20, 9, accepted=tuple(range(10)))], None)
    assert u.done and u.error and "accepted 10" in u.error


# ------------------------------------------------------------------------------------------ the ring
def _ring(model_dir, n=4, **kw):
    return InProcessRing(loopback_topology(model_dir, n), model_dir, **kw)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 400))


async def _gen_all(ring, prompts, params, delay=0.03, on_token=None):
    await ring.wait_healthy()

    async def one(i):
        await asyncio.sleep(delay * i)
        c = await ring.client()
        try:
            return await c.generate(prompts[i], params[i], on_token=on_token(i) if on_token else None)
        finally:
            c.close()

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


async def _settled(ring):
    for _ in range(50):  # frees travel the ring
        if all(not d.runner.cache.sessions for d in ring.daemons):
            return True
        await asyncio.sleep(0.1)
    return False


@pytest.mark.slow
def test_ring_greedy_speculation_equals_plain_embedded(emb):
    prompts = emb_prompts()
    want = emb.generate(prompts, SamplingParams(max_tokens=20))
    V = emb.cfg.vocab_size
    stop = want[1][6]
    want_stop = emb.generate([prompts[1]], SamplingParams(max_tokens=20, stop_ids=(stop,)))[0]
    oracle = {tuple(p): w for p, w in zip(prompts, want)}
    oracle[tuple(prompts[1])] = want[1]

    async def go():
        async with _ring(EMBEDDED, prefill_chunk=16) as ring:
            entry = ring.entry.entry
            entry.draft_policy = "fixed"
            entry.proposer_factories["suffix"] = oracle_factory(oracle, V)  # "suffix" = the oracle here
            ps = [
                SamplingParams(max_tokens=20, speculate="ngram", draft_tokens=4),  # real prompt lookup
                SamplingParams(max_tokens=20, stop_ids=(stop,), speculate="suffix", draft_tokens=8),
                SamplingParams(max_tokens=20),  # plain, in the same batches
                SamplingParams(max_tokens=20, speculate="suffix", draft_tokens=3),
            ]
            outs = await _gen_all(
                ring,
                [prompts[0], prompts[1], prompts[2], prompts[2], prompts[0]],
                ps + [SamplingParams(max_tokens=20, speculate="suffix", draft_tokens=6)],
            )
            c = await ring.client()
            st = await c.status()
            c.close()
            return outs, st, await _settled(ring)

    outs, st, settled = _run(go())
    assert [o.tokens for o in outs] == [want[0], want_stop, want[2], want[2], want[0]]
    assert outs[3].stats["accepted"] > 0 and outs[3].stats["tokens_per_pass"] > 1
    assert "proposed" in outs[0].stats and "proposed" not in outs[2].stats
    spec = st["spec"]
    assert spec["spec_accepted"] > 0 and any(int(w) > 1 for w in spec["verify_segments_by_width"])
    assert spec["rollbacks"] > 0 and spec["passes_by_width"]
    assert settled, "sessions (and their checkpoints) must be freed on every stage"


@pytest.mark.slow
def test_ring_every_k_mixed_batches_and_seeded_sampling_tiny(tiny, ckpt):
    prompts = rand_prompts(8, seed=5)
    want = tiny.generate(prompts, SamplingParams(max_tokens=16))
    sp = SamplingParams(temperature=1.2, top_k=50, seed=4321, max_tokens=16)
    want_s = tiny.generate(prompts[:2], sp)
    V = tiny.cfg.vocab_size
    oracle = {**{tuple(p): w for p, w in zip(prompts, want)}}

    async def go():
        async with _ring(ckpt, prefill_chunk=8) as ring:
            entry = ring.entry.entry
            entry.draft_policy = "fixed"
            entry.proposer_factories["ngram"] = oracle_factory(oracle, V)
            ps = [SamplingParams(max_tokens=16, speculate="ngram", draft_tokens=k) for k in range(1, 9)]
            ps.insert(3, SamplingParams(max_tokens=16))  # a plain session among them
            outs = await _gen_all(ring, prompts[:3] + [prompts[3]] + prompts[3:], ps)
            seeded = await _gen_all(
                ring,
                prompts[:2],
                [
                    SamplingParams(
                        temperature=1.2, top_k=50, seed=4321, max_tokens=16, speculate="suffix", draft_tokens=5
                    ),
                    SamplingParams(
                        temperature=1.2, top_k=50, seed=4321, max_tokens=16, speculate="suffix", draft_tokens=2
                    ),
                ],
            )
            widths = {}
            for d in ring.daemons:
                for w, n in d.runner.spec_stats()["verify_segments_by_width"].items():
                    widths[int(w)] = widths.get(int(w), 0) + n
            return outs, seeded, widths, await _settled(ring)

    outs, seeded, widths, settled = _run(go())
    assert [o.tokens for o in outs] == want[:3] + [want[3]] + want[3:]
    assert [o.tokens for o in seeded] == want_s
    assert set(range(2, 10)) <= set(widths)  # verify passes of every width 1 + k, k = 1..8
    assert settled


@pytest.mark.slow
def test_ring_replay_and_cancel_mid_verification(tiny, ckpt):
    """A replay (new epoch from position 0) while verify passes are in flight, and a cancelled speculating
    session: outputs stay those of plain decoding, nothing is left on any stage."""
    prompts = rand_prompts(4, seed=8)
    want = tiny.generate(prompts, SamplingParams(max_tokens=30))
    oracle = {tuple(p): w for p, w in zip(prompts, want)}

    async def go():
        async with _ring(ckpt, prefill_chunk=8) as ring:
            entry = ring.entry.entry
            entry.draft_policy = "fixed"
            entry.proposer_factories["ngram"] = oracle_factory(oracle, tiny.cfg.vocab_size)
            counts = [0] * 4
            replayed = []

            def on_token(i):
                def f(_t):
                    counts[i] += 1
                    if i == 0 and counts[0] >= 8 and not replayed:
                        replayed.append(entry.replay_all())
                        entry.kick()

                return f

            ps = [SamplingParams(max_tokens=30, speculate="ngram", draft_tokens=4)] * 4
            await ring.wait_healthy()
            victim_client = await ring.client()
            victim = asyncio.create_task(
                victim_client.generate(prompts[3], SamplingParams(max_tokens=200, speculate="ngram", draft_tokens=6))
            )
            outs = await _gen_all(ring, prompts[:3], ps[:3], on_token=on_token)
            victim.cancel()
            try:
                await victim
            except asyncio.CancelledError:
                pass
            victim_client.close()
            return outs, replayed, await _settled(ring)

    outs, replayed, settled = _run(go())
    assert replayed and replayed[0] >= 1
    assert [o.tokens for o in outs] == want[:3]
    assert all(o.stats["replays"] == 1 for o in outs)
    assert settled


def test_speculation_options_reach_the_api_and_chat():
    """The API takes `speculate` / `draft_tokens` (extension fields) into the request's SamplingParams and
    refuses bad values naming the field; `p2pk3 chat` has the same flags as `generate`."""
    from click.testing import CliRunner

    from p2pk3.api.errors import ApiError
    from p2pk3.api.schema import parse_request
    from p2pk3.cli import main

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "speculate": "ngram", "draft_tokens": 4}
    req = parse_request(body, "chat", 1000)
    assert (req.sampling.speculate, req.sampling.draft_tokens) == ("ngram", 4)
    assert parse_request({**body, "speculate": None, "draft_tokens": None}, "chat", 1000).sampling.speculate == "off"
    for bad, field in (({"speculate": "eagle"}, "speculate"), ({"draft_tokens": 0}, "draft_tokens")):
        with pytest.raises(ApiError) as e:
            parse_request({**body, **bad}, "chat", 1000)
        assert e.value.param == field
    out = CliRunner().invoke(main, ["chat", "--help"]).output
    assert "--speculate [off|ngram|suffix]" in out and "--draft-tokens" in out
