"""The OpenAI-compatible API (p2pk3/api): the official `openai` client against `p2pk3 serve` in front of a
live ring of 4 `p2pk3 node` processes on the embedded model; plus in-process checks of the stop-sequence
matcher and of the error mapping (a fake cluster, a cluster with no node up)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import openai
import pytest

from p2pk3.api.app import ApiConfig, create_app
from p2pk3.api.cluster import Cluster
from p2pk3.api.errors import from_cluster
from p2pk3.api.stops import StopMatcher
from p2pk3.engine.reference import default_model_dir
from p2pk3.frontends.prompt import PromptBuilder
from p2pk3.node.local import LocalRing, free_ports, probe, write_local_topology
from p2pk3.params import SamplingParams
from p2pk3.tokenizer import ChatTokenizer
from p2pk3.topology import Topology
from conftest import api_beside

KEY = "sk-test-0123456789"
MODEL = default_model_dir().name  # the embedded default (k3-docs)
QUESTION = "What does the yield keyword do?"  # the embedded model closes this answer within 64 tokens
PROMPTS = [
    "What does the with statement do?",
    "How do I open a file?",
    "What is a list comprehension?",
    "Explain the for statement.",
    "What is a generator?",
    "How does import work?",
    "What is a dictionary?",
    "What does the yield keyword do?",
]
MAX_SESSIONS = 8
MAX_QUEUE = 4  # the entry's admission queue: requests past MAX_SESSIONS + MAX_QUEUE are refused (429)


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    r = LocalRing(
        default_model_dir(),
        4,
        workdir=tmp_path_factory.mktemp("api-ring"),
        extra_args=["--max-sessions", str(MAX_SESSIONS), "--max-queue", str(MAX_QUEUE)],
    )
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def api(ring, tmp_path_factory):
    with api_beside(ring, tmp_path_factory.mktemp("api-key"), KEY) as a:
        yield a


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient(api):
    return lambda: openai.AsyncOpenAI(base_url=api.url, api_key=KEY, max_retries=0, timeout=60)


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def stream_chat(client, **kw) -> tuple[str, str, list]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish[-1] if finish else None, chunks


async def wait_idle(ring, timeout: float = 10.0) -> list[int]:
    """Sessions on every stage, once all are 0 (raises after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        sts = await asyncio.gather(*(probe(ring.address(s.id), ring.secret) for s in ring.topo.active))
        counts = [st.get("sessions") if st else None for st in sts]
        if all(c == 0 for c in counts):
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"sessions still held on the stages after {timeout} s: {counts}")
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------- the live ring
@pytest.mark.slow
def test_models_and_auth(api, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    bad = openai.OpenAI(base_url=api.url, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2)
    assert e.value.status_code == 401 and set(e.value.body) == {"message", "type", "param", "code"}, e.value.body

    async def no_key():
        async with aiohttp.ClientSession() as s, s.get(api.url + "/models") as r:
            return r.status, await r.json()

    status, body = asyncio.run(no_key())
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body

    # /metrics needs no key
    async def get():
        async with aiohttp.ClientSession() as s, s.get(api.base_url + "/metrics") as r:
            return r.status

    assert asyncio.run(get()) == 200


@pytest.mark.slow
def test_chat_stream_equals_full_equals_cli(client, tok):
    full = client.chat.completions.create(model=MODEL, messages=chat(QUESTION), max_tokens=64, temperature=0)
    text, finish, chunks = stream_chat(
        client, messages=chat(QUESTION), max_tokens=64, temperature=0, stream_options={"include_usage": True}
    )
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert text == full.choices[0].message.content and text
    assert finish == full.choices[0].finish_reason == "stop"
    # chunk format: role first, usage last (choices empty), every chunk an OpenAI chunk
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    n_prompt = len(tok.apply_chat_template(chat(QUESTION), add_generation_prompt=True))
    # the same prompt a second time: all of it but its last token came from the stages' prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == n_prompt - 1
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.total_tokens == n_prompt + full.usage.completion_tokens
    cli = subprocess.run(
        [sys.executable, "-m", "p2pk3.cli", "generate", "--prompt", QUESTION, "--max-tokens", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.removesuffix("\n") == text


@pytest.mark.slow
def test_completions_stream_and_full(client, tok):
    prompt = "The with statement"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert full.object == "text_completion" and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert full.usage.prompt_tokens == 1 + len(tok.encode(prompt))  # BOS + the text
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == 12
    # token-id prompts give the same answer as the text they encode
    ids = [tok.bos_id] + tok.encode(prompt)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == full.choices[0].text


@pytest.mark.slow
def test_max_tokens_gives_length(client):
    for kw in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        r = client.chat.completions.create(model=MODEL, messages=chat(QUESTION), **kw)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
        text, finish, _ = stream_chat(client, messages=chat(QUESTION), **kw)
        assert finish == "length" and text == r.choices[0].message.content


@pytest.mark.slow
def test_stop_sequences(client, ring, tok):
    ids = tok.apply_chat_template(chat(QUESTION), add_generation_prompt=True)

    async def greedy():
        c = await ring.client()
        try:
            return (await c.generate(ids, SamplingParams(max_tokens=64, stop_ids=tok.stop_ids))).tokens
        finally:
            c.close()

    toks = [t for t in asyncio.run(greedy()) if t not in tok.stop_ids]
    pieces = [
        tok.decode(toks[: i + 1], skip_special=True)[len(tok.decode(toks[:i], skip_special=True)) :]
        for i in range(len(toks))
    ]
    text = "".join(pieces)
    # a stop sequence that spans two tokens: the end of token k and the start of token k + 1
    for k in range(1, len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        stop = a[-2:] + b[:2]
        at = sum(map(len, pieces[: k + 1])) - len(a[-2:])
        if len(a) >= 2 and len(b) >= 2 and text.find(stop) == at:
            break
    else:
        pytest.fail(f"no spanning stop sequence found in {pieces}")
    want = text[:at]
    full = client.chat.completions.create(model=MODEL, messages=chat(QUESTION), max_tokens=64, stop=[stop, "@@@@"])
    assert full.choices[0].message.content == want and full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == k + 2
    streamed, finish, chunks = stream_chat(client, messages=chat(QUESTION), max_tokens=64, stop=stop)
    assert streamed == want and finish == "stop"
    # a one-token stop string in completions
    word = pieces[3]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=64, stop=word)
    assert r.choices[0].text == text[: text.find(word)] and r.choices[0].finish_reason == "stop"
    asyncio.run(wait_idle(ring))  # the requests stopped early were cancelled in the ring


@pytest.mark.slow
def test_concurrent_streams_equal_sequential(client, aclient, ring):
    asyncio.run(wait_idle(ring))
    seq = [
        client.chat.completions.create(model=MODEL, messages=chat(p), max_tokens=24).choices[0].message.content
        for p in PROMPTS
    ]

    async def one(c, p):
        parts = []
        async for ch in await c.chat.completions.create(model=MODEL, messages=chat(p), max_tokens=24, stream=True):
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
        return "".join(parts)

    async def many():
        c = aclient()
        try:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))
        finally:
            await c.close()

    assert list(asyncio.run(many())) == seq
    assert len(set(seq)) > 1


@pytest.mark.slow
def test_bad_bodies_name_the_field(api, client):
    cases = [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": MODEL, "messages": chat("hi"), "temperature": 3}, "temperature"),
        ({"model": MODEL, "messages": chat("hi"), "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": chat("hi"), "top_p": 0}, "top_p"),
        ({"model": MODEL, "messages": chat("hi"), "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": chat("hi"), "max_tokens": 1.5}, "max_tokens"),
        ({"model": MODEL, "messages": chat("hi"), "n": 2}, "n"),
        ({"model": MODEL, "messages": chat("hi"), "stop": [1]}, "stop"),
        ({"model": MODEL, "messages": chat("hi"), "seed": -1}, "seed"),
    ]

    async def post_all():
        out = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            for body, _ in cases:
                async with s.post(api.url + "/chat/completions", json=body) as r:
                    out.append((r.status, await r.json()))
            async with s.post(api.url + "/chat/completions", data=b"{not json") as r:
                out.append((r.status, await r.json()))
            async with s.post(api.url + "/completions", json={"model": MODEL, "prompt": [999999]}) as r:
                out.append((r.status, await r.json()))
        return out

    res = asyncio.run(post_all())
    for (status, body), (_, field) in zip(res, cases):
        assert status == 400 and body["error"]["param"] == field, (field, body)
        assert field in body["error"]["message"]
    assert res[-2][0] == 400 and "JSON" in res[-2][1]["error"]["message"]
    assert res[-1][0] == 400 and res[-1][1]["error"]["param"] == "prompt"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=chat("hi"), max_tokens=2)
    assert client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2).choices  # still serving


@pytest.mark.slow
def test_disconnect_mid_stream_frees_the_sessions(api, ring):
    body = {"model": MODEL, "messages": chat(QUESTION), "max_tokens": 2000, "stream": True, "ignore_eos": True}

    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            r = await s.post(api.url + "/chat/completions", json=body)
            assert r.status == 200
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 30)
            assert first.startswith(b"data: ")
            sts = await asyncio.gather(*(probe(ring.address(x.id), ring.secret) for x in ring.topo.active))
            assert sts[0]["sessions"] == 1
            r.close()  # the client goes away mid-stream
        t0 = time.monotonic()
        await wait_idle(ring, timeout=10.0)  # 2000 tokens take far longer: only a cancel frees them this soon
        return time.monotonic() - t0

    asyncio.run(go())


@pytest.mark.slow
def test_busy_cluster_is_429(aclient, ring):
    asyncio.run(wait_idle(ring))

    async def one(c, i):
        try:
            s = await c.chat.completions.create(
                model=MODEL, messages=chat(PROMPTS[i % 8]), max_tokens=40, stream=True, extra_body={"ignore_eos": True}
            )
            n = 0
            async for ch in s:
                n += bool(ch.choices and ch.choices[0].delta.content)
            return n
        except openai.RateLimitError as e:
            assert e.status_code == 429 and e.body["code"] == "busy"
            assert int(e.response.headers["Retry-After"]) >= 1
            return "busy"

    async def many():
        c = aclient()
        try:
            return await asyncio.gather(*(one(c, i) for i in range(2 * MAX_SESSIONS + 4)))
        finally:
            await c.close()

    res = asyncio.run(many())
    # the queue holds MAX_QUEUE beyond the sessions (how many wait depends on when the first ones end)
    assert "busy" in res and sum(r != "busy" for r in res) >= MAX_SESSIONS + MAX_QUEUE, res


@pytest.mark.slow
def test_metrics(api):
    async def get():
        async with aiohttp.ClientSession() as s, s.get(api.base_url + "/metrics") as r:
            return await r.text()

    text = asyncio.run(get())

    def value(prefix):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    assert value('p2pk3_api_requests_total{route="/v1/chat/completions",status="200"}') >= 10
    assert value('p2pk3_api_requests_total{route="/v1/chat/completions",status="400"}') >= 10
    assert value('p2pk3_api_requests_total{route="/v1/chat/completions",status="429"}') >= 1
    assert value("p2pk3_api_time_to_first_token_seconds_count") >= 10
    assert value("p2pk3_api_inter_token_latency_seconds_count") >= 100
    assert value("p2pk3_api_generated_tokens_total") >= 100
    assert value("p2pk3_entry_queue_capacity") == MAX_QUEUE and value("p2pk3_entry_queue_refused") >= 1
    assert value("p2pk3_entry_queued_requests") == 0


@pytest.mark.slow
def test_stage_down_is_503(client, ring):
    """Last of the ring tests: a middle stage dies (no standby); the entry reports the slot unavailable."""
    ring.kill(ring.topo.active[2].id)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=4)
        except openai.APIStatusError as e:
            if e.status_code == 503:
                assert e.body["code"] == "unavailable" and e.body["message"], e.body
                break
            raise
        except openai.APITimeoutError:
            pass
        assert time.monotonic() < deadline, "no 503 within 20 s of a stage dying"
        time.sleep(0.3)


# ---------------------------------------------------------------- in-process (no ring)
def test_stop_matcher_holds_prefixes():
    m = StopMatcher(["abc", "xy"])
    assert [m.push(p) for p in ["hello a", "b", "x", "abd"]] == ["hello ", "", "ab", "xabd"]
    assert m.stopped is None and m.flush() == ""
    m = StopMatcher(["abc"])
    assert m.push("12ab") == "12" and m.push("c tail") == "" and m.stopped == "abc" and m.push("more") == ""
    m = StopMatcher(["END"])
    assert m.push("the E") == "the " and m.flush() == "E"


class FakeCluster:
    """Scripted replies: tokens, then optionally a cluster error."""

    def __init__(self, tokens, error=None):
        self.tokens, self.error = tokens, error

    async def generate(self, prompt, params, on_token=None):
        for t in self.tokens[: params.max_tokens]:
            await asyncio.sleep(0)
            on_token(t)
        if self.error:
            raise from_cluster(*self.error)


async def _serve_app(app):
    from aiohttp import web

    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_ports(1)[0]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/v1"


def test_cluster_errors_map_to_http(tok, tmp_path):
    word = tok.encode(" the")

    async def go():
        out = {}
        topo = Topology.load(write_local_topology(default_model_dir(), 2, tmp_path))  # nothing listens there
        apps = {
            "busy": FakeCluster([], ("busy", "busy: 2 sessions in flight and 8 requests queued (max 8)", 7)),
            "waited": FakeCluster([], ("queue_timeout", "waited 600 s in the entry's queue", 30)),
            "down": FakeCluster([], ("unavailable", "slot s2 is down")),
            "midstream": FakeCluster(word * 3, ("unavailable", "slot s2 is down")),
            "nobody": Cluster(topo, connect_timeout_s=0.5),
        }
        for name, cl in apps.items():
            runner, url = await _serve_app(create_app(cl, PromptBuilder(tok, 4096), ApiConfig(MODEL)))
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.post(
                        url + "/chat/completions",
                        json={"model": MODEL, "messages": chat("hi"), "stream": name == "midstream"},
                    ) as r:
                        out[name] = (r.status, await r.text(), r.headers.get("Retry-After"))
            finally:
                await runner.cleanup()
        return out

    out = asyncio.run(go())
    assert out["busy"][0] == 429 and json.loads(out["busy"][1])["error"]["code"] == "busy" and out["busy"][2] == "7"
    assert out["waited"][0] == 503 and out["waited"][2] == "30"
    assert out["down"][2] is None  # only the queue's answers carry a Retry-After
    assert out["down"][0] == 503 and "slot s2 is down" in json.loads(out["down"][1])["error"]["message"]
    assert out["nobody"][0] == 503 and "no entry" in json.loads(out["nobody"][1])["error"]["message"]
    status, body, _ = out["midstream"]
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    assert "slot s2 is down" in json.loads(events[-2])["error"]["message"]
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-2]) == " the" * 3


@pytest.mark.slow
def test_serve_cli_errors(tmp_path):
    topo = write_local_topology(default_model_dir(), 2, tmp_path)
    (tmp_path / "empty").write_text("\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2pk3.cli",
            "serve",
            "--topology",
            str(topo),
            "--api-key-file",
            str(tmp_path / "empty"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--api-key-file" in r.stderr


def test_model_is_required_and_max_tokens_errors_name_the_field_the_request_used(tok):
    """Issue 26 item 19: a request without `model` is a 400 (OpenAI requires it); a `max_tokens` that does
    not fit the context is refused naming `max_tokens`, not `max_completion_tokens`."""
    ctx = 4096
    q = [{"role": "user", "content": "What is a tuple?"}]
    cases = [
        ({"messages": q}, "chat", "model"),
        ({"prompt": "a tuple"}, "", "model"),
        ({"model": MODEL, "messages": q, "max_tokens": ctx}, "chat", "max_tokens"),
        ({"model": MODEL, "messages": q, "max_completion_tokens": ctx}, "chat", "max_completion_tokens"),
        ({"model": MODEL, "prompt": "a tuple", "max_tokens": ctx}, "", "max_tokens"),
    ]

    async def go():
        runner, url = await _serve_app(create_app(FakeCluster([5]), PromptBuilder(tok, ctx), ApiConfig(MODEL)))
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                for body, kind, _ in cases:
                    async with s.post(url + ("/chat/completions" if kind else "/completions"), json=body) as r:
                        out.append((r.status, await r.json()))
                async with s.post(url + "/chat/completions", json={"model": MODEL, "messages": q}) as r:
                    out.append((r.status, await r.json()))
        finally:
            await runner.cleanup()
        return out

    res = asyncio.run(go())
    for (status, body), (_, _, field) in zip(res, cases):
        assert status == 400 and body["error"]["param"] == field, (field, body)
        assert body["error"]["message"].startswith(field + ":"), body
    assert res[-1][0] == 200, res[-1]
