"""The session sampler of the last stage (p2pk3/engine/sampler.py) without a ring: neutral parameters are
sample_at itself, penalties count the history the ids give, the grammar matcher follows the ids through
rollbacks and replays, drafts are verified under the mask, prompt logprobs line up with their rows."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from p2pk3.agent.grammar import GrammarTokenizer
from p2pk3.agent.logprobs import token_logprobs
from p2pk3.agent.penalties import Penalties, apply_penalties
from p2pk3.engine.reference import default_model_dir
from p2pk3.engine.sampler import SamplerError, SessionSampler
from p2pk3.engine.sampling import sample_at
from p2pk3.params import SamplingParams, TokenLogprob
from p2pk3.tokenizer import ChatTokenizer

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
}
GRAMMAR = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def gtok(tok):
    return GrammarTokenizer(tok, vocab_size=tok.vocab_size)


def rows(n, v, seed=0, scale=4.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def test_neutral_and_stateless_parameters_are_sample_at():
    r = rows(6, 300)
    for p in (SamplingParams(), SamplingParams(temperature=0.9, seed=5, top_k=40), SamplingParams(min_p=0.2, seed=1)):
        smp = SessionSampler(p)
        for i in range(6):
            assert smp.sample(r[i], 10 + i)[0] == sample_at(r[i], p, 10 + i)
    # logit_bias: +100 on one id makes it the greedy choice; the logprob is the model's own (raw row)
    p = SamplingParams(logit_bias=((17, 100.0),), logprobs=2)
    tok, lp = SessionSampler(p).sample(r[0], 3)
    want = token_logprobs(r[0], [17], 2)
    assert tok == 17 and lp.logprob == pytest.approx(want.logprobs[0]) and list(lp.top_ids) == want.top_ids[0]


def test_penalties_count_the_fed_history():
    v = 50
    p = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    smp = SessionSampler(p)
    prompt, out = [3, 4, 4, 9], [7, 7, 8]
    smp.feed(0, prompt + out, len(prompt))
    r = rows(1, v, 3)[0]
    x = r.clone()
    apply_penalties(x[None], [Penalties(1.5, 0.5, 1.3)], prompt_ids=[prompt], output_ids=[out])
    assert smp.sample(r, len(prompt) + len(out))[0] == int(torch.argmax(x))
    assert not torch.equal(x, r)
    with pytest.raises(SamplerError, match="position 9 needs 9"):
        smp.sample(r, 9)  # ids of positions 7, 8 never came
    with pytest.raises(SamplerError, match="lost on the way"):
        smp.feed(12, [1], 4)


def _run(smp, n_prompt, v, seed, n_max=200, temperature=1.5):
    """Sample like the last stage: the entry feeds each new token back as the next segment's ids."""
    pos = len(smp.ids)
    out = []
    for i in range(n_max):
        tok, _ = smp.sample(rows(1, v, seed * 1000 + i)[0], pos)
        out.append(tok)
        smp.feed(pos, [tok], n_prompt)
        pos += 1
        if tok in smp.matcher.gtok.stop_ids:
            break
    return out


def test_grammar_follows_rollbacks_and_replays(tok, gtok):
    p = SamplingParams(temperature=1.5, seed=11, grammar=GRAMMAR)
    prompt = [5, 6, 7]
    smp = SessionSampler(p, gtok)
    smp.feed(0, prompt, 3)
    out = _run(smp, 3, gtok.vocab_size, 1)
    assert out[-1] in gtok.stop_ids
    jsonschema.validate(json.loads(tok.decode(out[:-1])), SCHEMA)
    # a replay: a fresh sampler fed prompt + output so far continues with the same tokens
    k = len(out) // 2
    again = SessionSampler(p, gtok)
    again.feed(0, prompt + out[:k], 3)
    pos = 3 + k
    for i in range(k, len(out)):
        t, _ = again.sample(rows(1, gtok.vocab_size, 1000 + i)[0], pos)
        assert t == out[i]
        again.feed(pos, [t], 3)
        pos += 1
    # a rollback: ids fed again from an earlier position; the matcher follows them, not its own past
    smp.feed(3 + 2, [out[2]], 3)
    t, _ = smp.sample(rows(1, gtok.vocab_size, 1003)[0], 3 + 3)
    assert t == out[3] and smp.matcher.tokens == out[:4]


def test_drafts_are_verified_under_the_mask(tok, gtok):
    v = gtok.vocab_size
    p = SamplingParams(grammar=GRAMMAR, frequency_penalty=0.3)  # greedy
    plain = SessionSampler(p, gtok)
    plain.feed(0, [5, 6], 2)
    want = []
    r = rows(12, v, 7)
    for i in range(12):
        t, _ = plain.sample(r[i], 2 + i)
        want.append(t)
        plain.feed(2 + i, [t], 2)
    # drafts: the true continuation with one wrong token (a forbidden one: a letter where JSON needs '{')
    bad = tok.encode("x")[0]
    spec = SessionSampler(p, gtok)
    spec.feed(0, [5, 6], 2)
    r0 = rows(12, v, 7)
    t, _ = spec.sample(r0[0], 2)
    assert t == want[0]
    spec.feed(2, [t], 2)
    draft = [want[1], want[2], bad, want[4]]
    acc, tok_, _ = spec.verify(r0[1:6], draft, 2)
    assert acc == want[1:3] and tok_ == want[3] != bad
    assert spec.ids == [5, 6, want[0], want[1], want[2]]  # the accepted drafts are history now
    spec.feed(5, [tok_], 2)
    acc, tok_, _ = spec.verify(r0[4:8], want[4:7], 5)
    assert acc == want[4:7] and tok_ == want[7]


def test_prompt_logprobs_line_up_with_rows():
    v = 40
    ids = [1, 5, 9, 2, 7, 3, 8]
    r = rows(7, v, 9)
    smp = SessionSampler(SamplingParams(prompt_logprobs=3))
    smp.feed(0, ids[:4], 6)  # chunk 0..2 with the lookahead id at 3
    f, e = smp.prompt_logprobs(r[0:3], 0, 3)
    assert f == 1 and [x.token for x in e] == [5, 9, 2]
    smp.feed(3, ids[3:7], 6)  # the last chunk 3..6 (6 is output: not scored)
    f, e2 = smp.prompt_logprobs(r[3:7], 3, 3)
    assert f == 4 and [x.token for x in e2] == [7, 3]
    want = token_logprobs(r[:5], ids[1:6], 3)
    assert [x.logprob for x in e + e2] == pytest.approx(want.logprobs)
    assert [list(x.top_ids) for x in e + e2] == want.top_ids


def test_grammar_errors_fail_the_session(gtok):
    with pytest.raises(SamplerError, match="cannot be enforced: type must be a string"):
        SessionSampler(SamplingParams(grammar={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}), gtok)
    with pytest.raises(SamplerError, match="no tokenizer"):
        SessionSampler(SamplingParams(grammar={"type": "json_object"}))


def test_the_last_stage_fails_only_the_session_it_cannot_sample(ckpt):
    """A grammar on a stage without the checkpoint's tokenizer, and ids that skip positions, fail their own
    session with a clear error; the batch-mates get their tokens, as sample_at draws them."""
    from p2pk3.engine.reference import Pipeline
    from p2pk3.node.stage_runner import StageRunner, Work
    from p2pk3.transport.messages import Segment

    pipe = Pipeline.load(ckpt, 1, max_sessions=4, max_tokens=512, block_size=8)
    r = StageRunner(pipe.stages[0], pipe.stages[0].new_cache(4, 512))  # no grammar_tokenizer
    g = SamplingParams(grammar={"type": "json_object"})
    segs = [
        Segment("a", 0, 0, 3, g, ids=(3, 4, 5), output_from=3),
        Segment("b", 0, 0, 3, SamplingParams(temperature=0.7, seed=2)),
        Segment("c", 0, 0, 3, SamplingParams(frequency_penalty=1.0), ids=(3, 4, 5), output_from=3),
    ]
    out = r.run(Work(segs, tokens=torch.tensor([3, 4, 5] * 3)))
    a, b, c = out.results
    assert a.error and "without the checkpoint's tokenizer" in a.error and a.code == "bad_request"
    assert not b.error and not c.error
    want = pipe.score([3, 4, 5])[-1]
    assert b.token == sample_at(want, SamplingParams(temperature=0.7, seed=2), 3)
    # c's next segment lacks position 3's id: c fails, saying so
    out = r.run(Work([Segment("c", 0, 3, 1, SamplingParams(frequency_penalty=1.0))], tokens=torch.tensor([9])))
    assert "knows 3 ids of the session; position 4 needs 4" in out.results[0].error


def test_cli_sampling_options_reach_the_overrides():
    """Every CLI front end (chat, generate, local --prompt) takes the penalties through sampling_options;
    unset they stay None, so PromptBuilder fills in the checkpoint's generation_config."""
    import click
    from click.testing import CliRunner

    from p2pk3.cli.options import sampling_options

    got = {}

    @click.command()
    @sampling_options
    def cmd(sampling):
        got["s"] = sampling

    r = CliRunner().invoke(cmd, ["--min-p", "0.1", "--repetition-penalty", "1.2", "--frequency-penalty", "-0.5"])
    assert r.exit_code == 0, r.output
    s = got["s"]
    assert (s.min_p, s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (0.1, 1.2, -0.5, None)
    r = CliRunner().invoke(cmd, ["--presence-penalty", "3"])
    assert r.exit_code == 2 and "--presence-penalty" in r.output


def test_the_entry_sends_ids_and_the_grammar_once_per_epoch():
    """Segments of a stateful session carry its ids (with the next id for a chunk that has more history
    after it); the grammar rides only on the prompt's last chunk of each epoch, not on decode steps."""
    from p2pk3.node.entry import Entry
    from p2pk3.transport.messages import Result

    sent = []
    e = Entry(sent.append, lambda _s: None, prefill_chunk=4)
    p = SamplingParams(max_tokens=5, grammar={"type": "json_object"}, prompt_logprobs=1)
    s = e.submit([10, 11, 12, 13, 14, 15], p)
    (w1,) = sent
    (seg,) = w1.segments
    assert seg.ids == (10, 11, 12, 13, 14) and seg.sample is None and seg.prompt_logprobs == 1  # chunk 0..3 + next
    lp = [TokenLogprob(t, -1.0) for t in (11, 12, 13, 14, 15)]
    e.on_results([Result(s.id, 0, 4, skip=True, prompt_logprobs=tuple(lp[:4]), prompt_from=1)], None)
    seg = sent[-1].segments[0]
    assert seg.start_pos == 4 and seg.ids == (14, 15) and seg.sample.grammar == p.grammar and seg.output_from == 6
    e.on_results([Result(s.id, 0, 6, 20, prompt_logprobs=tuple(lp[4:]), prompt_from=5)], None)
    assert s.prompt_lps[1:] == lp
    seg = sent[-1].segments[0]
    assert seg.start_pos == 6 and seg.ids == (20,) and seg.sample.grammar is None and seg.prompt_logprobs is None
    e.replay_all()  # a repair: the new epoch's last chunk carries the grammar again
    e.resume()
    assert sent[-1].segments[0].prompt_logprobs is None  # the prompt's logprobs all came back: not asked again
    e.on_results([Result(s.id, 1, 4, skip=True)], None)
    seg = sent[-1].segments[0]
    assert seg.epoch == 1 and seg.ids == (14, 15, 20) and seg.sample.grammar == p.grammar
    assert seg.prompt_logprobs is None
