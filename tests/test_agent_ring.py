"""Penalties, logit_bias, min_p, structured outputs and logprobs through a live ring (issue 24): a 3-slot
in-process ring of the embedded model (a middle stage; prompts cut into chunks of 8) gives the tokens and
logprobs of the single-process engine, with speculation too; prompt logprobs (echo) are the scoring
logits'; a grammar the engine refuses fails only its request."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from p2pk3.engine.reference import Pipeline, default_model_dir
from p2pk3.frontends.prompt import PromptBuilder, SamplingOverrides
from p2pk3.node.client import RequestError
from p2pk3.params import SamplingParams
from ring_helpers import loopback_topology, ring_in_thread

pytestmark = pytest.mark.slow  # one 3-slot ring of the embedded model for the module

MODEL = default_model_dir()
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["io", "text", "net"]}},
    },
}
GRAMMAR = {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def prompts():
    return PromptBuilder.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def ref():
    return Pipeline.load(MODEL, 1, max_sessions=8, max_tokens=4096)


@pytest.fixture(scope="module")
def ring():
    with ring_in_thread(loopback_topology(MODEL, 3), MODEL, prefill_chunk=8, max_sessions=16) as r:
        r.call(r.wait_healthy(), timeout=90)
        r.entry.entry.draft_policy = "fixed"  # always draft (the adaptive policy may not, on a loaded host)
        yield r


def generate_all(ring, jobs):
    """Run (prompt ids, SamplingParams) jobs concurrently on the ring -> replies (or RequestErrors)."""

    async def one(ids, p):
        c = await ring.client()
        try:
            return await c.generate(ids, p)
        except RequestError as e:
            return e
        finally:
            c.close()

    async def go():
        return await asyncio.gather(*(one(ids, p) for ids, p in jobs))

    return ring.call(go(), timeout=240)


def test_ring_samples_as_one_process(ring, ref, prompts):
    q = prompts.chat_ids([{"role": "user", "content": "What does the with statement do?"}])
    j = prompts.chat_ids([{"role": "user", "content": "Answer in JSON: a module, its year and tags."}])
    stops = prompts.tok.stop_ids
    bias_id = prompts.tok.encode(" file")[0]
    cases = [
        (q, SamplingParams(max_tokens=40, stop_ids=stops)),  # neutral: as before
        (q, SamplingParams(max_tokens=40, stop_ids=stops, frequency_penalty=1.2, presence_penalty=0.6, logprobs=3)),
        (q, SamplingParams(max_tokens=40, stop_ids=stops, logit_bias=((bias_id, 6.0),), logprobs=0)),
        (q, SamplingParams(temperature=0.9, seed=7, max_tokens=40, stop_ids=stops, repetition_penalty=1.4, min_p=0.1)),
        # greedy under the mask; the penalty keeps the whitespace-loving tiny model from padding
        (j, SamplingParams(max_tokens=600, stop_ids=stops, grammar=GRAMMAR, logprobs=2, frequency_penalty=1.0)),
        (j, SamplingParams(temperature=1.5, seed=3, max_tokens=600, stop_ids=stops, grammar=GRAMMAR)),
        # speculation under the mask: the same tokens as plain decoding
        (
            j,
            SamplingParams(
                max_tokens=600, stop_ids=stops, grammar=GRAMMAR, frequency_penalty=1.0, speculate="ngram", draft_tokens=4
            ),
        ),
        (
            q,
            SamplingParams(
                max_tokens=40, stop_ids=stops, frequency_penalty=0.8, speculate="ngram", draft_tokens=4, logprobs=1
            ),
        ),
    ]
    got = generate_all(ring, cases)
    want, want_lps = [], []
    for group in ([c for c in cases if not c[1].speculating], [c for c in cases if c[1].speculating]):
        want += ref.generate([ids for ids, _ in group], [p for _, p in group])  # one batch, as the ring runs them
        want_lps += ref.last_logprobs
    order = [c for c in cases if not c[1].speculating] + [c for c in cases if c[1].speculating]
    want = [want[order.index(c)] for c in cases]
    want_lps = [want_lps[order.index(c)] for c in cases]
    print("tokens per case:", [len(w) for w in want])
    for (_, p), r, w, wl in zip(cases, got, want, want_lps):
        assert not isinstance(r, RequestError), r
        assert r.tokens == w, p
        if p.logprobs is not None:
            assert [e.token for e in r.logprobs] == r.tokens
            assert [e.logprob for e in r.logprobs] == pytest.approx([e.logprob for e in wl], abs=1e-3)
            assert [e.top_ids for e in r.logprobs] == [e.top_ids for e in wl]
        if p.grammar is not None:
            text = prompts.answer_text(r.tokens)
            jsonschema.validate(json.loads(text), SCHEMA)
            assert r.tokens[-1] in stops  # the grammar ended with a stop token, not max_tokens
    assert got[6].stats["proposed"] > 0 and got[7].stats["proposed"] > 0  # verify passes ran, under the mask too
    plain, penalized = got[0].tokens, got[1].tokens
    assert plain != penalized  # the penalties did something
    assert bias_id in got[2].tokens and bias_id not in plain


def test_prompt_logprobs_are_the_scoring_logits(ring, ref, prompts):
    ids = prompts.text_ids("The with statement wraps a block in the methods of a context manager.")
    assert len(ids) > 16  # several prefill chunks of 8
    (r,) = generate_all(ring, [(ids, SamplingParams(max_tokens=2, prompt_logprobs=4, logprobs=4))])
    lsm = torch.log_softmax(ref.score(ids).float(), -1)
    plp = r.prompt_logprobs
    assert [e.token for e in plp] == ids and plp[0].logprob is None
    assert [e.logprob for e in plp[1:]] == pytest.approx([float(lsm[i, ids[i + 1]]) for i in range(len(ids) - 1)], abs=1e-3)
    assert [list(e.top_ids) for e in plp[1:]] == [lsm[i].topk(4).indices.tolist() for i in range(len(ids) - 1)]
    # the first generated token's logprob is the last prompt row's
    assert r.logprobs[0].logprob == pytest.approx(float(lsm[-1, r.tokens[0]]), abs=1e-3)


def test_a_refused_grammar_fails_only_its_request(ring, prompts):
    ids = prompts.text_ids("The with statement")
    bad = SamplingParams(max_tokens=8, grammar={"type": "lark", "lark": "start: undefined_rule"})
    good = SamplingParams(max_tokens=8, grammar={"type": "json_object"})
    r_bad, r_good, r_plain = generate_all(ring, [(ids, bad), (ids, good), (ids, SamplingParams(max_tokens=8))])
    assert isinstance(r_bad, RequestError) and r_bad.code == "bad_request", r_bad
    assert "sampling failed" in r_bad.message and "undefined_rule" in r_bad.message, r_bad.message
    assert not isinstance(r_good, RequestError) and len(r_good.tokens) == 8
    assert not isinstance(r_plain, RequestError) and len(r_plain.tokens) == 8
    (r,) = generate_all(ring, [(ids, SamplingParams(max_tokens=2, logit_bias=((10**6, 1.0),)))])
    assert isinstance(r, RequestError) and r.code == "bad_request" and "outside the vocabulary" in r.message


def test_generation_config_defaults_apply(tmp_path, prompts):
    """The penalties and min_p of generation_config.json are the defaults of every front end."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(MODEL, d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(
        json.dumps({**cfg, "repetition_penalty": 1.3, "min_p": 0.05, "frequency_penalty": 0.4})
    )
    pb = PromptBuilder.from_pretrained(d)
    p = pb.text("The with statement", SamplingOverrides()).params
    assert (p.repetition_penalty, p.min_p, p.frequency_penalty, p.presence_penalty) == (1.3, 0.05, 0.4, 0.0)
    asked = SamplingOverrides(repetition_penalty=1.0, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.3)
    p = pb.text("The with statement", asked).params
    assert (p.repetition_penalty, p.min_p, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0, 0.3)
    shipped = json.loads((MODEL / "generation_config.json").read_text()).get("repetition_penalty", 1.0)
    assert prompts.text("x", SamplingOverrides()).params.repetition_penalty == shipped  # the embedded model's


def test_a_resumed_request_continues_under_its_grammar(ring, prompts):
    """A client resuming at a new entry sends prompt + the tokens it has, saying how many are output
    (`generate.generated`): the grammar and the penalties count them, so the rest is the undisturbed run's."""
    from dataclasses import replace

    from p2pk3.transport.messages import GenerateRequest

    j = prompts.chat_ids([{"role": "user", "content": "Answer in JSON: a module, its year and tags."}])
    p = SamplingParams(
        temperature=1.2, seed=5, max_tokens=300, stop_ids=prompts.tok.stop_ids, grammar=GRAMMAR, frequency_penalty=0.5
    )
    (full,) = generate_all(ring, [(j, p)])
    k = len(full.tokens) // 2
    assert k >= 4

    async def resumed():
        c = await ring.client()
        try:
            c._rid += 1
            req = GenerateRequest(c._rid, j + full.tokens[:k], replace(p, max_tokens=p.max_tokens - k), generated=k)
            await c.conn.send(req.frame())
            toks = []
            while True:
                f = await c.conn.recv()
                if f.kind == "token":
                    toks.append(f.header["token"])
                elif f.kind == "done":
                    return toks
                else:
                    raise AssertionError(f.header)
        finally:
            c.close()

    assert ring.call(resumed(), timeout=120) == full.tokens[k:]
