"""Structured outputs and logprobs with the real clients (issue 24): `p2pk3 serve` in front of a live ring of
`p2pk3 node` processes (3 stages and a standby) on the embedded model. The official `openai` package asks
for json_schema (also through its pydantic `parse`), chat logprobs (full and streamed) and completions
logprobs with echo; lm-eval's `local-completions` computes loglikelihoods of a small local dataset file;
constrained requests over 10 schemas at temperature 1.5 all parse and validate; and a SIGKILL of the
middle stage mid-answer under json_schema gives the same tokens as an undisturbed run (the last test: it
uses the standby)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from p2pk3.api.errors import ApiError
from p2pk3.api.schema import parse_request
from p2pk3.engine.reference import Pipeline, default_model_dir
from p2pk3.frontends.prompt import PromptBuilder
from p2pk3.node.local import LocalRing
from p2pk3.params import SamplingParams
from conftest import api_beside

sys.path.insert(0, str(Path(__file__).parent))
from test_agent_grammar import SCHEMAS  # noqa: E402  (the 10 schemas: nested objects, arrays, enums, required)

MODEL_DIR = default_model_dir()
MODEL = MODEL_DIR.name
KEY = "sk-test-agent"
DOC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["io", "text", "net"]}},
    },
}


def rf(schema, name="doc"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_schema_maps_the_agent_fields():
    body = {
        "model": MODEL,
        "messages": chat("hi"),
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "logit_bias": {"12": -100, "7": 3.5},
        "response_format": rf(DOC),
        "logprobs": True,
        "top_logprobs": 4,
    }
    s = parse_request(body, "chat", 1000).sampling
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty, s.min_p) == (0.5, -0.5, 1.1, 0.05)
    assert s.logit_bias == ((12, -100.0), (7, 3.5)) and s.grammar == rf(DOC) and s.logprobs == 4
    assert s.prompt_logprobs is None
    c = parse_request({"model": MODEL, "prompt": [1, 2], "logprobs": 1, "echo": True}, "completion", 1000)
    assert (c.sampling.logprobs, c.sampling.prompt_logprobs, c.echo) == (1, 1, True)
    assert parse_request({"model": MODEL, "prompt": "x", "echo": True}, "completion", 1000).sampling.prompt_logprobs is None
    assert parse_request({**body, "response_format": {"type": "text"}}, "chat", 1000).sampling.grammar is None
    with pytest.raises(ApiError, match="logprobs: must be true or false"):
        parse_request({**body, "logprobs": 3}, "chat", 1000)
    with pytest.raises(ApiError, match='response_format: response_format json_schema needs "json_schema"'):
        parse_request({**body, "response_format": {"type": "json_schema"}}, "chat", 1000)
    assert json.loads((Path(__file__).parent / "data/json_schemas.json").read_text()) == SCHEMAS  # the tool's copy


@pytest.fixture(scope="module")
def prompts():
    return PromptBuilder.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def ref():
    return Pipeline.load(MODEL_DIR, 1, max_sessions=8, max_tokens=4096)


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    r = LocalRing(MODEL_DIR, 3, workdir=tmp_path_factory.mktemp("agent-ring"), standby=1)
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def api(ring, tmp_path_factory):
    with api_beside(ring, tmp_path_factory.mktemp("agent-key"), KEY) as a:
        yield a


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.url, api_key=KEY, max_retries=0, timeout=120)


def chat(text):
    return [{"role": "user", "content": text}]


@pytest.mark.slow  # the module's ring of processes and the API
def test_json_schema_and_chat_logprobs(client, ref, prompts):
    msgs = chat("Answer in JSON: a module and its tags.")
    kw = dict(model=MODEL, messages=msgs, response_format=rf(DOC), max_tokens=400, temperature=0, frequency_penalty=1.0)
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), DOC)
    assert r.choices[0].finish_reason == "stop"
    lps = r.choices[0].logprobs.content
    assert "".join(t.token for t in lps) == text and all(len(t.top_logprobs) == 3 for t in lps)
    # the single-process engine, same prompt path and parameters: the request sets no repetition penalty, so
    # the API applies the model's generation_config default (1.2 for the shipped model), and so must this
    rep = prompts.tok.generation_defaults.repetition_penalty
    p = SamplingParams(
        max_tokens=400, stop_ids=prompts.tok.stop_ids, grammar=rf(DOC), frequency_penalty=1.0, logprobs=3,
        repetition_penalty=rep,
    )
    want = ref.generate([prompts.chat_ids(msgs)], p)[0]
    assert prompts.answer_text(want) == text
    assert [t.logprob for t in lps] == pytest.approx([e.logprob for e in ref.last_logprobs[0][: len(lps)]], abs=1e-3)
    # streamed: the same text, the logprobs split over the chunks
    chunks = list(client.chat.completions.create(stream=True, logprobs=True, top_logprobs=1, **kw))
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert got == text and "".join(t.token for t in streamed) == text
    # the openai package's structured-output helper (a pydantic model -> strict json_schema)
    from pydantic import BaseModel

    class Doc(BaseModel):
        name: str
        count: int

    parsed = client.chat.completions.parse(
        model=MODEL, messages=msgs, response_format=Doc, max_tokens=400, temperature=0.7, seed=1, frequency_penalty=1.0
    )
    assert isinstance(parsed.choices[0].message.parsed, Doc)


@pytest.mark.slow  # the module's ring of processes and the API
def test_bad_fields_are_clear_400s(client):
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}), "response_format"),
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(logit_bias={"abc": 1}), "logit_bias"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(extra_body={"min_p": 1.5}), "min_p"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (dict(logit_bias={"999999": 1}), "logit_bias"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=4, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)


@pytest.mark.slow  # the module's ring of processes and the API
def test_completions_logprobs_and_echo(client, ref, prompts):
    ids = prompts.text_ids("The with statement wraps a block")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    lsm = torch.log_softmax(ref.score(ids).float(), -1)
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([float(lsm[i, ids[i + 1]]) for i in range(len(ids) - 1)], abs=1e-3)
    assert r.choices[0].text.startswith(prompts.tok.decode(ids))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=0)
    pl = plain.choices[0].logprobs
    assert len(pl.tokens) == 3 and pl.token_logprobs == pytest.approx(lp.token_logprobs[-3:], abs=1e-4)
    assert pl.text_offset[0] == len(prompts.tok.decode(ids)) and pl.top_logprobs == [{}, {}, {}]


@pytest.mark.slow  # the module's ring of processes and the API
def test_lm_eval_local_completions_loglikelihood(api, ref, prompts, tmp_path, monkeypatch):
    """lm-eval's `local-completions` against the API: loglikelihoods of a local multiple-choice file are the
    single-process engine's."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    docs = [
        {"question": "The with statement calls", "choices": ["__enter__ and __exit__", "print twice"], "answer": 0},
        {"question": "A list comprehension builds", "choices": ["a new list", "a socket"], "answer": 0},
        {"question": "The yield keyword makes a", "choices": ["file", "generator"], "answer": 1},
    ]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tiny.yaml").write_text(
        "task: p2pk3_tiny\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={MODEL},base_url={api.url}/completions,tokenizer={MODEL_DIR},tokenizer_backend=huggingface,"
            "tokenized_requests=True,num_concurrent=2,max_retries=1"
        ),
        tasks=["p2pk3_tiny"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = out["samples"]["p2pk3_tiny"]
    assert len(samples) == len(docs)
    for s in samples:
        d = s["doc"]
        for choice, resp in zip(d["choices"], s["resps"]):
            ll, _greedy = resp[0]
            ctx = prompts.tok.encode(d["question"])
            whole = prompts.tok.encode(d["question"] + " " + choice)  # lm-eval's target_delimiter " "
            cont = whole[len(ctx) :]
            lsm = torch.log_softmax(ref.score(whole).float(), -1)
            want = sum(float(lsm[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
            assert len(cont) > 0 and ll == pytest.approx(want, abs=1e-2), (d, choice)
    assert 0.0 <= out["results"]["p2pk3_tiny"]["acc,none"] <= 1.0


@pytest.mark.slow  # the module's ring of processes and the API
def test_constrained_requests_over_10_schemas_parse_and_validate(api):
    """The embedded model at its worst (temperature 1.5): every answer parses and validates. (The figure
    over 200 requests is tools/bench_structured.py; here one per schema.)"""
    aclient = openai.AsyncOpenAI(base_url=api.url, api_key=KEY, max_retries=0, timeout=300)

    async def one(k, j, sem):
        async with sem:
            r = await aclient.chat.completions.create(
                model=MODEL,
                messages=chat("Answer in JSON."),
                response_format=rf(SCHEMAS[k], f"s{k}"),
                temperature=1.5,
                seed=100 * k + j,
                max_tokens=1500,
            )
            return k, r.choices[0].message.content, r.choices[0].finish_reason

    async def go():
        sem = asyncio.Semaphore(8)
        return await asyncio.gather(*(one(k, j, sem) for k in range(len(SCHEMAS)) for j in range(1)))

    outs = asyncio.run(go())
    for k, text, finish in outs:
        assert finish == "stop", (k, text)
        jsonschema.validate(json.loads(text), SCHEMAS[k])
    assert len(outs) == len(SCHEMAS)


@pytest.mark.slow  # the module's ring of processes and the API
def test_sigkill_of_the_middle_stage_mid_answer_keeps_the_tokens(ring, ref, prompts):
    """Last in the module (it uses the standby): s1 is killed while json_schema answers stream; the standby
    takes it over, the entry replays, and every answer has exactly the undisturbed tokens and validates."""
    msgs = chat("Answer in JSON: a module and its tags.")
    ids = prompts.chat_ids(msgs)
    jobs = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=600, stop_ids=prompts.tok.stop_ids, grammar=rf(DOC), frequency_penalty=fp)
        for s, fp in ((1, 0.5), (2, 1.0), (3, 0.0))
    ]
    want = ref.generate([ids] * len(jobs), jobs)
    assert min(len(w) for w in want) >= 12, [len(w) for w in want]

    async def go():
        started = asyncio.Event()
        counts = [0] * len(jobs)

        def on_token(i):
            def f(_t):
                counts[i] += 1
                if min(counts) >= 6:
                    started.set()

            return f

        async def one(i, p):
            c = await ring.client()
            try:
                return await c.generate(ids, p, on_token=on_token(i))
            finally:
                c.close()

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(jobs)]
        await asyncio.wait_for(started.wait(), 120)
        ring.signal("s1", signal.SIGKILL)
        at_kill = list(counts)
        return await asyncio.wait_for(asyncio.gather(*tasks), 240), at_kill

    got, at_kill = asyncio.run(go())
    for r, w, n in zip(got, want, at_kill):
        assert r.tokens == w
        if n < len(w) - 1:  # still answering when s1 died: it was replayed through the standby
            assert r.stats["replays"] >= 1, r.stats
        jsonschema.validate(json.loads(prompts.answer_text(r.tokens)), DOC)
    assert any(n < len(w) - 1 for n, w in zip(at_kill, want)), (at_kill, [len(w) for w in want])
