"""The agent-ready API (issue 24): tool calls, reasoning and the Anthropic Messages route.

In-process (no ring; a scripted cluster and the Kimi-token copy of the embedded model, tests/agent_model.py):
tool calls and thinking parsed into OpenAI's message and stream shapes as the `openai` client reads them,
tool results round-tripping through the template, the Anthropic route's blocks, events and errors through
the `anthropic` client, the same prompt by either API, and the fields refused naming them. Against a live
ring (slow, one module-scoped ring of `p2pk3 node` processes and `p2pk3 serve`): tool_choice required and
named forced by the grammar, streamed; an `openai-agents` agent with two function tools run to a final
answer; the `anthropic` client's messages, stream and tool_use."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Annotated

import aiohttp
import anthropic
import jsonschema
import openai
import pytest
from pydantic import Field
from agent_model import AB, CB, CE, SB, SE, THINK, UNTHINK, agent_checkpoint

from p2pk3.api.app import ApiConfig, create_app
from p2pk3.engine.reference import default_model_dir
from p2pk3.frontends.prompt import PromptBuilder
from p2pk3.node.local import LocalRing, free_ports
from p2pk3.tokenizer import ChatTokenizer
from conftest import api_beside

KEY = "sk-agents-0123456789"
MODEL = "k3-agents"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 16}},
    "required": ["q"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "search the docs", "parameters": SEARCH}},
]
ARGS1, ARGS2 = '{"city": "Paris", "days": 2}', '{"q": "k3 ring"}'
ASK = [{"role": "user", "content": "Weather in Paris, and what is a ring?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return agent_checkpoint(tmp_path_factory.mktemp("agent-model"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return ChatTokenizer.from_pretrained(model_dir)


class ScriptedCluster:
    """Answers request k with replies[k] (the last one again after), token by token; records every request's
    prompt and sampling parameters."""

    def __init__(self, *replies):
        self.replies, self.calls = [list(r) for r in replies], []

    @property
    def tokens(self) -> list[int]:
        return self.replies[min(len(self.calls), len(self.replies)) - 1]

    async def generate(self, prompt, params, on_token=None):
        self.calls.append((list(prompt), params))
        for t in self.tokens[: params.max_tokens]:
            await asyncio.sleep(0)
            on_token(t)


def script(tok, *parts) -> list[int]:
    """Token ids of text parts and special-token names, ending with the end of turn."""
    ids = []
    for p in parts:
        ids += [tok.special[p]] if p in tok.special else tok.encode(p)
    return ids + [tok.special["<|im_end|>"]]


def calls_output(tok) -> list[int]:
    return script(tok, "Let me check.", SB, CB, "functions.get_weather:0", AB, ARGS1, CE,
                  CB, "functions.search:1", AB, ARGS2, CE, SE)  # fmt: skip


def serve(tok, cluster, fn, api_key=None):
    """Run `await fn(base_url)` against the app on a free port (the app stopped afterwards)."""
    from aiohttp import web

    async def go():
        app = create_app(cluster, PromptBuilder(tok, 4096), ApiConfig(MODEL, api_key))
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_ports(1)[0]
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await asyncio.wait_for(fn(f"http://127.0.0.1:{port}"), 60)
        finally:
            while _clients:
                await _clients.pop().close()
            await runner.cleanup()

    return asyncio.run(go())


_clients: list = []  # the clients a `serve` body opened (closed before its loop ends)


def oai(url):
    _clients.append(openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30))
    return _clients[-1]


# ---------------------------------------------------------------- OpenAI shapes (in-process)
def test_tool_calls_message_and_stream(tok):
    cluster = ScriptedCluster(calls_output(tok))

    async def go(url):
        c = oai(url)
        full = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        chunks = [ch async for ch in await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True)]
        return full, chunks

    full, chunks = serve(tok, cluster, go)
    m = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and m.content == "Let me check."
    assert [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls] == [
        ("functions.get_weather:0", "get_weather", ARGS1),
        ("functions.search:1", "search", ARGS2),
    ]
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert deltas[0].role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls or ():
            if tc.index not in calls:  # the first delta of a call names it
                assert tc.id and tc.function.name and tc.type == "function", tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None, tc
                calls[tc.index]["args"] += tc.function.arguments
    assert [(c["id"], c["name"], json.loads(c["args"])) for c in calls.values()] == [
        (tc.id, tc.function.name, json.loads(tc.function.arguments)) for tc in m.tool_calls
    ]
    # parallel_tool_calls false: the first call only (the grammar enforces it when the call is forced)
    async def one(url):
        c = oai(url)
        full = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False)
        stream = await c.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False, stream=True
        )
        return full, [ch async for ch in stream]

    single, single_chunks = serve(tok, cluster, one)
    assert [c.id for c in single.choices[0].message.tool_calls] == ["functions.get_weather:0"]
    assert {tc.index for ch in single_chunks for tc in ch.choices[0].delta.tool_calls or ()} == {0}
    # the template was given the tools
    prompt = tok.decode(cluster.calls[0][0])
    assert "tool_declare" in prompt and '"get_weather"' in prompt


def test_tool_results_round_trip_through_the_template(tok):
    out = calls_output(tok)
    cluster = ScriptedCluster(out, script(tok, "It is sunny."))

    async def go(url):
        c = oai(url)
        first = (await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)).choices[0].message
        msgs = ASK + [first.model_dump(exclude_none=True)]
        msgs += [{"role": "tool", "tool_call_id": tc.id, "content": f"result {i}"} for i, tc in enumerate(first.tool_calls)]
        again = await c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        return msgs, again

    msgs, again = serve(tok, cluster, go)
    assert again.choices[0].message.content == "It is sunny." and again.choices[0].finish_reason == "stop"
    prompt = cluster.calls[1][0]
    assert prompt == tok.apply_chat_template(msgs, add_generation_prompt=True, tools=TOOLS)
    # the assistant turn holds exactly the tokens the model wrote (up to its end of turn)
    written = out[:-1]
    assert any(prompt[i : i + len(written)] == written for i in range(len(prompt))), tok.decode(prompt)
    assert "## Return of functions.search:1\nresult 1" in tok.decode(prompt)


def test_reasoning_message_stream_and_effort(tok):
    thought = script(tok, THINK, "The user asks.", UNTHINK, "Yes.")
    cluster = ScriptedCluster(thought, thought, script(tok, "Hmm.", UNTHINK, "Sure."))

    async def go(url):
        c = oai(url)
        full = await c.chat.completions.create(model=MODEL, messages=ASK)
        chunks = [ch async for ch in await c.chat.completions.create(model=MODEL, messages=ASK, stream=True)]
        effort = await c.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="high")
        plain = await c.chat.completions.create(model=MODEL, messages=ASK)
        return full, chunks, effort, plain

    full, chunks, effort, plain = serve(tok, cluster, go)
    m = full.choices[0].message
    assert m.content == "Yes." and m.model_extra["reasoning_content"] == "The user asks."
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "The user asks."
    assert "".join(d.content or "" for d in deltas) == "Yes."
    # reasoning_effort reaches the template: its generation prompt opens the thinking section
    assert cluster.calls[2][0][-1] == tok.special[THINK] and cluster.calls[3][0][-1] != tok.special[THINK]
    assert effort.choices[0].message.content == "Sure."
    assert effort.choices[0].message.model_extra["reasoning_content"] == "Hmm."
    # without it the prompt does not open a section: the stray end marker is text, not a reasoning split
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})


def test_without_tools_or_with_tool_choice_none_the_output_is_content(tok):
    """Tool-call markers are not parsed (and, being special tokens, not shown) unless tools may be called."""
    cluster = ScriptedCluster(calls_output(tok))

    async def go(url):
        c = oai(url)
        a = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
        b = await c.chat.completions.create(model=MODEL, messages=ASK)
        return a, b

    for r in serve(tok, cluster, go):
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
        assert r.choices[0].message.content == "Let me check.functions.get_weather:0" + ARGS1 + "functions.search:1" + ARGS2


def test_agent_fields_are_checked_naming_them(tok):
    q = {"model": MODEL, "messages": ASK}
    cases = [
        ({**q, "tool_choice": "required"}, "tool_choice"),
        ({**q, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({**q, "tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({**q, "tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
        ({**q, "tools": TOOLS + TOOLS[:1]}, "tools"),
        ({**q, "tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({**q, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"model": MODEL, "messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        (
            {"model": MODEL, "messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}]},
            "messages[1].tool_calls[0]",
        ),
    ]

    async def post_all(url):
        async with aiohttp.ClientSession() as s:
            out = []
            for body, _ in cases:
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    out.append((r.status, await r.json()))
            return out

    for (status, body), (_, field) in zip(serve(tok, ScriptedCluster([]), post_all), cases):
        assert status == 400 and body["error"]["param"] == field, (field, body)

    # a checkpoint without tool-call tokens cannot enforce a tool choice: 400 naming it, with the reason
    plain = ChatTokenizer.from_pretrained(default_model_dir().parent / "tiny-k3-pydoc")  # the older demo model

    async def forced(url):
        async with aiohttp.ClientSession() as s:
            body = {**q, "tools": TOOLS, "tool_choice": "required"}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                return r.status, await r.json()

    status, body = serve(plain, ScriptedCluster([]), forced)
    assert status == 400 and body["error"]["param"] == "tool_choice", body
    assert "no tool-call tokens" in body["error"]["message"]

    # a parameters schema the grammar engine cannot enforce (strict): refused before the ring sees it
    unique = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    bad_tools = [{"type": "function", "function": {"name": "pick", "parameters": unique}}]

    async def unenforceable(url):
        async with aiohttp.ClientSession() as s:
            body = {**q, "tools": bad_tools, "tool_choice": "required"}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                return r.status, await r.json()

    cluster = ScriptedCluster([])
    status, body = serve(tok, cluster, unenforceable)
    assert status == 400 and body["error"]["param"] == "tool_choice" and "uniqueItems" in body["error"]["message"]
    assert cluster.calls == []


def test_the_api_imports_no_torch():
    """`p2pk3 serve` starts without torch; the grammar engine (torch) loads only for a forced tool choice."""
    import subprocess
    import sys

    code = "import sys, p2pk3.api.app; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_forced_tool_choice_is_a_grammar_of_the_tool_call_section(tok):
    """tool_choice required / named -> SamplingParams.grammar: the checkpoint's section with the chosen
    tools' argument schemas (thinking first when the prompt opened it); auto -> no grammar."""
    from p2pk3.agent.grammar import GrammarMatcher, GrammarTokenizer, matcher_for

    cluster = ScriptedCluster(calls_output(tok))
    named = {"type": "function", "function": {"name": "search"}}

    async def go(url):
        c = oai(url)
        for kw in [
            {"tool_choice": "required"},
            {"tool_choice": named, "parallel_tool_calls": False},
            {"tool_choice": "required", "reasoning_effort": "high"},
            {"tool_choice": "auto"},
            {"tool_choice": "required", "reasoning_effort": "none"},
        ]:
            await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **kw)

    serve(tok, cluster, go)
    grammars = [params.grammar for _, params in cluster.calls]
    assert grammars[3] is None and all(g["type"] == "lark" for g in grammars[:3])
    gtok = GrammarTokenizer(tok)

    def accepts(grammar, ids) -> bool:
        m: GrammarMatcher = matcher_for(gtok, grammar)
        return m.validate(ids) == len(ids)

    body = calls_output(tok)[len(tok.encode("Let me check.")) : -1]  # the section, both calls
    one = script(tok, SB, CB, "functions.search:0", AB, ARGS2, CE, SE)[:-1]
    assert accepts(grammars[0], body) and accepts(grammars[0], one)
    assert not accepts(grammars[0], tok.encode("Let me check."))  # no content before the calls
    assert accepts(grammars[1], one) and not accepts(grammars[1], body)  # named: search only, one call
    thought = tok.encode("Both.") + [tok.special[UNTHINK]]
    assert accepts(grammars[2], thought + body) and not accepts(grammars[2], body)
    # no reasoning asked: the calls come at once (an untrained model could think without end)
    assert not accepts(grammars[0], [tok.special[THINK]] + thought + body)
    assert grammars[4] == grammars[0]  # reasoning_effort "none": the same
    # reasoning asked but the template did not open a section: the model may open one itself, or call at once
    from p2pk3.api.answer import AnswerFormats

    prompt = tok.apply_chat_template(ASK, add_generation_prompt=True, tools=TOOLS)
    lark = AnswerFormats(tok).forced_grammar(TOOLS, "required", True, prompt, reasoning_effort="high")
    optional = {"type": "lark", "lark": lark}
    assert accepts(optional, [tok.special[THINK]] + thought + body) and accepts(optional, body)


def agent_tools(ran: list):
    """The two function tools of the agents-SDK tests (strings bounded, so a forced call always ends)."""
    from agents import function_tool

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather in a city for some days."""
        ran.append(("get_weather", city, days))
        return f"sunny in {city} for {days} days"

    @function_tool
    def search(q: Annotated[str, Field(max_length=16)]) -> str:
        """Search the Python docs."""
        ran.append(("search", q))
        return "a ring is a loop of nodes"

    return [get_weather, search]


async def run_agent(base_url: str, ran: list, max_tokens: int, parallel: bool = True):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    oc = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)
    try:
        agent = Agent(
            name="helper",
            instructions="Use the tools, then answer.",
            tools=agent_tools(ran),
            model=OpenAIChatCompletionsModel(model=MODEL, openai_client=oc),
            # required: the embedded model never calls a tool on its own; the SDK resets the choice to auto
            # once a tool ran (reset_tool_choice), so the next turn answers
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=parallel, temperature=0, max_tokens=max_tokens
            ),
        )
        return await Runner.run(agent, "What is the weather in Paris, and what is a ring?", max_turns=4)
    finally:
        await oc.close()


def test_openai_agents_sdk_loop_on_a_scripted_model(tok):
    """The agents SDK's whole loop through the API: both tools called (parallel), run, their results sent
    back as tool messages, then the final answer."""
    args = '{"city": "Paris", "days": 2}', '{"q": "ring"}'
    calls = script(tok, SB, CB, "functions.get_weather:0", AB, args[0], CE, CB, "functions.search:1", AB, args[1], CE, SE)
    cluster = ScriptedCluster(calls, script(tok, "Sunny; a ring is a loop."))
    ran: list = []
    result = serve(tok, cluster, lambda url: run_agent(url + "/v1", ran, 64))
    assert ran == [("get_weather", "Paris", 2), ("search", "ring")]
    assert result.final_output == "Sunny; a ring is a loop."
    assert [p.grammar is not None for _, p in cluster.calls] == [True, False]  # required, then reset to auto
    second = tok.decode(cluster.calls[1][0])
    assert "## Return of functions.get_weather:0\nsunny in Paris for 2 days" in second
    assert "## Return of functions.search:1\na ring is a loop of nodes" in second


# ---------------------------------------------------------------- Anthropic Messages (in-process)
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip


def ant(url, key=KEY):
    _clients.append(anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, timeout=30))
    return _clients[-1]


def test_anthropic_tool_use_message_and_stream(tok):
    cluster = ScriptedCluster(script(tok, THINK, "Check both.", UNTHINK)[:-1] + calls_output(tok))
    ask = [{"role": "user", "content": ASK[0]["content"]}]

    async def go(url):
        c = ant(url)
        full = await c.messages.create(model=MODEL, max_tokens=200, messages=ask, tools=A_TOOLS, system="Be brief.")
        events = []
        async with c.messages.stream(model=MODEL, max_tokens=200, messages=ask, tools=A_TOOLS, system="Be brief.") as s:
            async for ev in s:
                events.append(ev)
            final = await s.get_final_message()
        return full, events, final

    full, events, final = serve(tok, cluster, go)
    assert full.stop_reason == "tool_use" and full.usage.output_tokens == len(cluster.tokens)
    assert full.usage.input_tokens == len(cluster.calls[0][0])
    assert [b.type for b in full.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert full.content[0].thinking == "Check both." and full.content[1].text == "Let me check."
    assert [(b.id, b.name, b.input) for b in full.content[2:]] == [
        ("functions.get_weather:0", "get_weather", json.loads(ARGS1)),
        ("functions.search:1", "search", json.loads(ARGS2)),
    ]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == full.usage.output_tokens
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in full.content]
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use"]
    assert kinds.count("content_block_stop") == 4
    # system, tools and the user's turn went through the same template as the OpenAI route's
    assert cluster.calls[0][0] == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *ASK], add_generation_prompt=True, tools=TOOLS
    )


def test_anthropic_tool_result_gives_the_openai_prompt(tok):
    """A conversation with tool_use / tool_result blocks is the same prompt as its OpenAI form."""
    cluster = ScriptedCluster(script(tok, "Sunny. A ring is a loop of nodes."))
    a_msgs = [
        {"role": "user", "content": ASK[0]["content"]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "functions.get_weather:0", "name": "get_weather", "input": json.loads(ARGS1)},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "functions.get_weather:0", "content": "sunny"},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    o_msgs = [
        *ASK,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "functions.get_weather:0", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps(json.loads(ARGS1))}},
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
        {"role": "user", "content": "Thanks."},
    ]

    async def go(url):
        r = await ant(url).messages.create(
            model=MODEL, max_tokens=64, messages=a_msgs, tools=A_TOOLS, stop_sequences=["loop"]
        )
        await oai(url).chat.completions.create(model=MODEL, messages=o_msgs, tools=TOOLS)
        return r

    r = serve(tok, cluster, go)
    assert cluster.calls[0][0] == cluster.calls[1][0]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "loop"
    assert [b.text for b in r.content] == ["Sunny. A ring is a "]


def test_anthropic_errors_and_key(tok):
    cluster = ScriptedCluster(script(tok, "Hi."))
    ok = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

    async def go(url):
        out = {}
        out["ok"] = (await ant(url).messages.create(**ok)).content[0].text
        for name, key in [("wrong", "sk-wrong")]:
            try:
                await ant(url, key).messages.create(**ok)
            except anthropic.AuthenticationError as e:
                out[name] = (e.status_code, e.body)
        async with aiohttp.ClientSession(headers={"x-api-key": KEY}) as s:
            for name, body in [
                ("no_max", {k: v for k, v in ok.items() if k != "max_tokens"}),
                ("image", {**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                ("temp", {**ok, "temperature": 1.5}),
                ("model", {**ok, "model": "claude-opus"}),
            ]:
                async with s.post(url + "/v1/messages", json=body) as r:
                    out[name] = (r.status, await r.json())
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            async with s.post(url + "/v1/messages", json=ok) as r:
                out["bearer"] = r.status
        return out

    out = serve(tok, cluster, go, api_key=KEY)
    assert out["ok"] == "Hi." and out["bearer"] == 200
    assert out["wrong"][0] == 401 and out["wrong"][1]["error"]["type"] == "authentication_error"
    for name, field in [("no_max", "max_tokens"), ("image", "messages[0].content[0]"), ("temp", "temperature")]:
        status, body = out[name]
        assert status == 400 and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"].startswith(field + ":")
    assert out["model"][0] == 404 and out["model"][1]["error"]["type"] == "not_found_error"


def test_anthropic_thinking_and_effort_reach_the_template(tok):
    cluster = ScriptedCluster(script(tok, "Hmm.", UNTHINK, "Sure."))
    ok = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

    async def go(url):
        c = ant(url)
        out = [await c.messages.create(**ok, thinking={"type": "enabled", "budget_tokens": 1024})]
        out.append(await c.messages.create(**ok, output_config={"effort": "max"}))
        out.append(await c.messages.create(**ok, thinking={"type": "disabled"}, output_config={"effort": "low"}))
        out.append(await c.messages.create(**ok))
        return out

    out = serve(tok, cluster, go)
    opened = [prompt[-1] == tok.special[THINK] for prompt, _ in cluster.calls]
    assert opened == [True, True, False, False]
    assert [b.type for b in out[0].content] == ["thinking", "text"] and out[0].content[0].thinking == "Hmm."
    assert out[3].content[0].text == "Hmm." + UNTHINK + "Sure."  # no section opened: all text


def test_anthropic_stream_ends_with_an_error_event_when_the_cluster_fails(tok):
    from p2pk3.api.errors import from_cluster

    class Failing(ScriptedCluster):
        async def generate(self, prompt, params, on_token=None):
            await super().generate(prompt, params, on_token)
            raise from_cluster("unavailable", "slot s2 is down")

    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}

    async def go(url):
        async with aiohttp.ClientSession(headers={"x-api-key": KEY}) as s:
            async with s.post(url + "/v1/messages", json=body) as r:
                return r.status, await r.text()

    status, text = serve(tok, Failing(tok.encode(" the") * 3), go, api_key=KEY)
    events = [e.split("\n") for e in text.split("\n\n") if e]
    names = [e[0].removeprefix("event: ") for e in events]
    assert status == 200 and names[0] == "message_start" and names[-1] == "error", names
    assert "content_block_delta" in names and "message_stop" not in names
    err = json.loads(events[-1][1].removeprefix("data: "))
    assert err["type"] == "error" and err["error"]["type"] == "api_error" and "slot s2 is down" in err["error"]["message"]


# ---------------------------------------------------------------- the live ring (slow)
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "search"}}


@pytest.fixture(scope="module")
def ring(model_dir, tmp_path_factory):
    """3 stages and a standby (the last test kills the middle stage)."""
    r = LocalRing(model_dir, 3, workdir=tmp_path_factory.mktemp("agent-ring"), standby=1)
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def api(ring, tmp_path_factory):
    with api_beside(ring, tmp_path_factory.mktemp("agent-key"), KEY, model_name=MODEL) as a:
        yield a


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.url, api_key=KEY, max_retries=0, timeout=120)


def valid_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, its arguments checked against its tool's schema."""
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def streamed_calls(chunks) -> list[tuple[str, str, str]]:
    calls: dict[int, list] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or ()) if ch.choices else ():
            if tc.id:
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                calls[tc.index][2] += tc.function.arguments
    return [tuple(c) for c in calls.values()]


@pytest.mark.slow
def test_live_tool_choice_required_and_named_streamed(client):
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 160, "temperature": 0}
    req = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
    assert req.finish_reason == "tool_calls" and req.message.tool_calls, req
    assert len(valid_calls(req.message.tool_calls)) == 1
    named = client.chat.completions.create(tool_choice=NAMED, parallel_tool_calls=False, **kw).choices[0]
    assert named.finish_reason == "tool_calls" and [n for n, _ in valid_calls(named.message.tool_calls)] == ["search"]
    chunks = list(client.chat.completions.create(tool_choice=NAMED, parallel_tool_calls=False, stream=True, **kw))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert streamed_calls(chunks) == [
        (c.id, c.function.name, c.function.arguments) for c in named.message.tool_calls
    ]


@pytest.mark.slow
def test_openai_agents_sdk_runs_two_tools_to_a_final_answer(api):
    ran: list = []
    result = asyncio.run(asyncio.wait_for(run_agent(api.url, ran, 128, parallel=False), 300))
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds, kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str) and result.final_output
    assert ran and all(r[0] in ("get_weather", "search") for r in ran), ran
    assert kinds.count("tool_call_output_item") == len(ran)


@pytest.mark.slow
def test_anthropic_client_messages_stream_and_tool_use(api, client):
    c = anthropic.Anthropic(base_url=api.base_url, api_key=KEY, max_retries=0, timeout=120)
    q = [{"role": "user", "content": "What does the yield keyword do?"}]
    msg = c.messages.create(model=MODEL, max_tokens=32, messages=q)  # this client sends no temperature: greedy
    same = client.chat.completions.create(model=MODEL, messages=q, max_tokens=32, temperature=0).choices[0]
    assert msg.content[0].type == "text" and msg.content[0].text == same.message.content
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[same.finish_reason]
    with c.messages.stream(model=MODEL, max_tokens=32, messages=q) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == msg.content[0].text and final.usage.output_tokens == msg.usage.output_tokens
    tu = c.messages.create(
        model=MODEL, max_tokens=160, messages=q, tools=A_TOOLS, tool_choice={"type": "tool", "name": "search"}
    )
    assert tu.stop_reason == "tool_use" and [b.type for b in tu.content] == ["tool_use"], tu
    jsonschema.validate(tu.content[0].input, SEARCH)


@pytest.mark.slow
def test_tool_calls_and_reasoning_survive_a_killed_middle_stage(api, ring):
    """Last of the ring tests: a forced tool call and a thinking answer, streamed, while the middle stage is
    SIGKILLed mid-answer; the standby takes over and both answers are what they are undisturbed."""
    bodies = [
        {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 160},
        {"messages": ASK, "reasoning_effort": "high", "max_tokens": 48, "extra_body": {"ignore_eos": True}},
    ]

    async def answer(c, body, seen: list):
        parts = {"reasoning": "", "content": "", "calls": []}
        chunks = []
        s = await c.chat.completions.create(model=MODEL, temperature=0, stream=True, **body)
        async for ch in s:
            chunks.append(ch)
            seen.append(1)
            if ch.choices:
                d = ch.choices[0].delta
                parts["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
                parts["content"] += d.content or ""
        parts["calls"] = streamed_calls(chunks)
        parts["finish"] = chunks[-1].choices[0].finish_reason
        return parts

    async def run_all(kill: bool):
        c = openai.AsyncOpenAI(base_url=api.url, api_key=KEY, max_retries=0, timeout=180)
        seen = [[], []]
        try:
            tasks = [asyncio.create_task(answer(c, b, seen[i])) for i, b in enumerate(bodies)]
            at_kill = None
            if kill:
                while min(map(len, seen)) < 4:
                    await asyncio.sleep(0.01)
                ring.signal(ring.topo.active[1].id, signal.SIGKILL)
                at_kill = [len(x) for x in seen]
            out = await asyncio.wait_for(asyncio.gather(*tasks), 180)
            return out, at_kill, [len(x) for x in seen]
        finally:
            await c.close()

    want, _, _ = asyncio.run(run_all(kill=False))
    got, at_kill, total = asyncio.run(run_all(kill=True))
    assert all(k < t for k, t in zip(at_kill, total)), (at_kill, total)  # killed mid-answer, both
    assert got == want
    assert want[0]["finish"] == "tool_calls" and want[0]["calls"][0][1] == "search"
    jsonschema.validate(json.loads(want[0]["calls"][0][2]), SEARCH)
    assert want[1]["reasoning"] and want[1]["content"] == "" and want[1]["finish"] == "length"
