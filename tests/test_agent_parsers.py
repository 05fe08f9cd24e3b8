"""Tool-call and reasoning parsers (p2pk3.agent.toolcalls, reasoning, markers): discovery from a Kimi-style
tokenizer + template and none from the embedded model; complete parse; streaming deltas in OpenAI's order
that add up to the complete parse for every way of cutting the text; malformed calls reported; round trip of
the parsed calls through the template."""

import json
import random
from pathlib import Path

import pytest

from p2pk3.agent.markers import MarkerSplitter, find_markers
from p2pk3.agent.reasoning import (
    NoReasoningFormat,
    ReasoningFormat,
    ReasoningStream,
    discover_reasoning_format,
    split_reasoning,
)
from p2pk3.agent.toolcalls import NoToolFormat, ToolCallFormat, ToolCallStream, discover_tool_format, parse_tool_calls
from p2pk3.tokenizer import ChatTokenizer
from p2pk3.tokenizer.chat import compile_chat_template

MODEL = Path(__file__).resolve().parents[1] / "p2pk3/assets/k3-docs"
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# A Kimi K2-style template (the shape of the published one: assistant tool_calls, tool results, <think>).
KIMI_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>{%- endif -%}"
    "{{ m.get('content') or '' }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>{%- for tc in m['tool_calls'] -%}"
    "<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>{{ tc['function']['arguments'] }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}\n"
    "{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_user|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
KIMI_SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    SB,
    SE,
    CB,
    AB,
    CE,
    "<|reserved_token_7|>",
    "<think>",
    "</think>",
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]
ARGS1, ARGS2 = '{"city": "Paris", "days": [1, 2]}', '{"q": "k3 \\"ring\\"", "n": 3}'
OUTPUT = f"Let me check.{SB}{CB}functions.get_weather:0{AB}{ARGS1}{CE}{CB}functions.search:1{AB}{ARGS2}{CE}{SE}"


@pytest.fixture
def fmt():
    f = discover_tool_format(KIMI_SPECIALS, KIMI_TEMPLATE)
    assert f == ToolCallFormat(CB, AB, CE, SB, SE)
    return f


def test_discovery_by_role_and_template():
    assert discover_tool_format(KIMI_SPECIALS, None) == ToolCallFormat(CB, AB, CE, SB, SE)
    # other spellings of the same roles
    alt = [
        "<|tool_calls_start|>",
        "<|tool_calls_end|>",
        "<|tool_call_start|>",
        "<|tool_call_arguments_begin|>",
        "<|tool_call_end|>",
    ]
    assert discover_tool_format(alt, "".join(alt)) == ToolCallFormat(alt[2], alt[3], alt[4], alt[0], alt[1])
    # without section tokens: calls stand alone
    assert discover_tool_format([CB, AB, CE], CB + AB + CE) == ToolCallFormat(CB, AB, CE)
    # tokens the template never writes do not count
    none = discover_tool_format(KIMI_SPECIALS, "<|im_user|>{{ x }}<|im_end|>")
    assert isinstance(none, NoToolFormat) and not none and "no tool-call tokens" in none.reason
    assert "pairs" in discover_tool_format([CB, AB, CE, SB], None).reason
    assert discover_reasoning_format(KIMI_SPECIALS, KIMI_TEMPLATE) == ReasoningFormat("<think>", "</think>")
    assert discover_reasoning_format(["<|think_begin|>", "<|think_end|>"], None) == ReasoningFormat(
        "<|think_begin|>", "<|think_end|>"
    )
    # literal tags in a template whose tokenizer has no thinking token
    assert discover_reasoning_format(["<|im_end|>"], "{{ '<think>' }}{{ r }}{{ '</think>' }}") == ReasoningFormat(
        "<think>", "</think>"
    )


def test_embedded_model_writes_kimis_tool_calls_and_the_older_one_neither():
    tok = ChatTokenizer.from_pretrained(MODEL)
    source = tok.templates[tok.template_for()[0]][0]
    assert discover_tool_format(tok.special, source) == ToolCallFormat(
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
    )
    assert discover_reasoning_format(tok.special, source) == ReasoningFormat("<think>", "</think>")
    old = ChatTokenizer.from_pretrained(MODEL.parent / "tiny-k3-pydoc")
    source = old.templates[old.template_for()[0]][0]
    tf = discover_tool_format(old.special, source)
    rf = discover_reasoning_format(old.special, source)
    assert isinstance(tf, NoToolFormat) and "this checkpoint has no tool-call tokens" in tf.reason
    assert isinstance(rf, NoReasoningFormat) and "no thinking tokens" in rf.reason
    text = "plain <|tool_call_begin|> text <think>x</think>"
    assert parse_tool_calls(text, tf).content == text and split_reasoning(text, rf).content == text
    assert split_reasoning(text, rf).reasoning_content is None


def test_complete_parse(fmt):
    p = parse_tool_calls(OUTPUT, fmt, tools=TOOLS)
    assert p.errors == [] and p.content == "Let me check." and p.finish_reason == "tool_calls"
    assert p.tool_calls == [
        {
            "index": 0,
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ARGS1},
        },
        {
            "index": 1,
            "id": "functions.search:1",
            "type": "function",
            "function": {"name": "search", "arguments": ARGS2},
        },
    ]
    assert json.loads(p.tool_calls[1]["function"]["arguments"]) == {"q": 'k3 "ring"', "n": 3}
    plain = parse_tool_calls("no calls here", fmt, tools=TOOLS)
    assert plain.content == "no calls here" and plain.tool_calls == [] and plain.finish_reason is None


def test_malformed_calls_are_reported_not_raised(fmt):
    text = (
        f"{SB}{CB}functions.get_weather:0{AB}{{bad json{CE}{CB}functions.launch:1{AB}{{}}{CE}"
        f"{CB}functions.search:2{AB}[1, 2]{CE}{CB}functions.search:3{AB}{ARGS2}{CE}{SE}"
    )
    p = parse_tool_calls(text, fmt, tools=TOOLS)
    assert [c["function"]["name"] for c in p.tool_calls] == ["search"] and p.tool_calls[0]["index"] == 0
    assert len(p.errors) == 3
    assert "not valid JSON" in p.errors[0] and "'launch'" in p.errors[1] and "JSON object" in p.errors[2]
    cut = parse_tool_calls(f'{SB}{CB}functions.search:0{AB}{{"q": ', fmt, tools=TOOLS)
    assert cut.tool_calls == [] and "cut off" in cut.errors[0]
    stray = parse_tool_calls(f"a{AB}b", fmt)
    assert stray.content == "ab" and "out of place" in stray.errors[0]
    # without a tools list any well-formed name is accepted
    assert parse_tool_calls(text, fmt).tool_calls[0]["function"]["name"] == "launch"


def pieces(text: str, markers, rng: random.Random) -> list[str]:
    """Token texts: markers whole (special tokens), or (every other time) cut anywhere, markers included."""
    if rng.random() < 0.5:
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
        return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    out = []
    for kind, s in find_markers(text, markers):
        while kind == "text" and s:
            n = rng.randint(1, 4)
            out.append(s[:n])
            s = s[n:]
        if kind == "marker":
            out.append(s)
    return out


def collect(deltas):
    """Rebuild content and tool_calls from OpenAI deltas as a client (the openai package) does."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function"
                assert tc["function"]["arguments"] == "" and tc["function"]["name"]
                calls[tc["index"]] = {
                    "index": tc["index"],
                    "id": tc["id"],
                    "type": "function",
                    "function": {"name": tc["function"]["name"], "arguments": ""},
                }
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def test_streaming_equals_complete_for_every_cut(fmt, seed):
    rng = random.Random(seed)
    for text in [OUTPUT, "Hi <|tool_call_be", f"x{CB}functions.search:0{AB}{ARGS2}{CE} after", "plain"]:
        want = parse_tool_calls(text, fmt, tools=TOOLS)
        for _ in range(30):
            s = ToolCallStream(fmt, tools=TOOLS)
            deltas = [d for p in pieces(text, fmt.markers, rng) for d in s.feed(p)]
            tail, finish = s.finish()
            content, calls = collect(deltas + tail)
            assert content == want.content, (seed, text)
            assert [
                dict(c, function=dict(c["function"], arguments=c["function"]["arguments"].strip())) for c in calls
            ] == want.tool_calls, seed
            assert finish == want.finish_reason and s.errors == want.errors and s.tool_calls == want.tool_calls


def test_stream_delta_order(fmt):
    s = ToolCallStream(fmt, tools=TOOLS)
    out = []
    for p in ["Let me", " check.", SB, CB, "functions.get_", "weather:0", AB, '{"city"', ': "Paris"}', CE, SE]:
        out.append(s.feed(p))
    tail, finish = s.finish()
    assert out[:5] == [[{"content": "Let me"}], [{"content": " check."}], [], [], []]
    assert out[6] == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        }
    ]
    assert out[7] == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}]
    assert out[8] == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}}]}]
    assert out[9:] == [[], []] and tail == [] and finish == "tool_calls"
    unknown = ToolCallStream(fmt, tools=TOOLS)
    got = [d for p in [CB, "functions.rm_rf:0", AB, "{}", CE] for d in unknown.feed(p)]
    assert got == [] and unknown.finish() == ([], None) and "'rm_rf'" in unknown.errors[0]


def test_round_trip_through_the_template(fmt):
    p = parse_tool_calls(OUTPUT, fmt, tools=TOOLS)
    render = compile_chat_template(KIMI_TEMPLATE, "kimi-style test template")
    msg = {"role": "assistant", "content": p.content, "tool_calls": p.tool_calls}
    rendered = render.render(messages=[msg], add_generation_prompt=False)
    assert rendered == f"<|im_assistant|>assistant<|im_middle|>{OUTPUT}<|im_end|>"
    tool = render.render(messages=[{"role": "tool", "tool_call_id": p.tool_calls[0]["id"], "content": "21 C"}])
    assert tool == "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n21 C<|im_end|>"


def test_reasoning_complete_and_streamed(seed):
    rng = random.Random(seed)
    fmt = ReasoningFormat("<think>", "</think>")
    cases = [
        ("<think>plan it</think>The answer.", "plan it", "The answer."),
        ("Direct answer.", None, "Direct answer."),
        ("<think>cut off while thin", "cut off while thin", ""),
        ("a<think>r1</think>b<think>r2</think>c", "r1r2", "abc"),
        ("x </think> y", None, "x </think> y"),
    ]
    for text, reasoning, content in cases:
        p = split_reasoning(text, fmt)
        assert (p.reasoning_content, p.content) == (reasoning, content), text
        for _ in range(20):
            s = ReasoningStream(fmt)
            deltas = [d for piece in pieces(text, [fmt.begin, fmt.end], rng) for d in s.feed(piece)] + s.finish()
            assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)
            assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or ""), seed
            assert "".join(d.get("content", "") for d in deltas) == content, seed
    # the template opened the section in the prompt
    assert split_reasoning("thinking</think>done", fmt, starts_inside=True).reasoning_content == "thinking"
    s = ReasoningStream(fmt)
    assert s.feed("<thi") == [] and s.feed("nk>ab") == [{"reasoning_content": "ab"}]
    assert s.feed("</thi") == [] and s.feed("nk>") == [] and s.feed("ok") == [{"content": "ok"}]


def test_marker_splitter_holds_back_only_prefixes():
    s = MarkerSplitter(["<think>", "<|tool_call_begin|>"])
    assert s.feed("a<") == [("text", "a")]
    assert s.feed("b") == [("text", "<b")]
    assert s.feed("<|tool_") == []
    assert s.feed("call_begin|><think") == [("marker", "<|tool_call_begin|>")]
    assert s.flush() == [("text", "<think")]
    assert find_markers("<think><think>x", ["<think>"]) == [("marker", "<think>"), ("marker", "<think>"), ("text", "x")]
    with pytest.raises(ValueError):
        MarkerSplitter([""])
