"""The demo model's documentation tools (p2pk3/agent/doctools.py), their index and training conversations
(tools/doc_corpus/agent.py), and the REPL's tool loop (p2pk3/frontends/tool_use.py, `p2pk3 chat --tools`)."""

from __future__ import annotations

import asyncio
import io
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from p2pk3.agent.doctools import SCHEMAS, DocTools
from tools.doc_corpus import agent

ITEMS = [  # (kind, question, answer, document): the shape of doc_corpus.qa._qa_items
    ("py-callable", "What does `os.path.join` do?", "Join one or more path segments.", "py/library/os.path"),
    ("py-object", "What is `str`?", "Text sequence type.", "py/library/stdtypes"),
    ("py-section", "What is the json module?", "JSON encoder and decoder.", "py/library/json"),
    ("py-section", "Tell me about Logging.", "How to log.", "py/howto/logging"),
    ("man", "What does the printf command do?", "Format and print data.", "man/printf.1"),
    ("man", "What does the printf() function do?", "Formatted output conversion.", "man/printf.3"),
    ("man", "What does the fork() system call do?", "Create a child process.", "man/fork.2"),
    ("man", "What is the null device?", "Data sink.", "man/null.4"),
]


def test_item_keys_name_the_tool_and_the_name_a_question_is_about():
    keys = [agent.item_key(k, q) for k, q, _, _ in ITEMS]
    assert keys == [
        ("python_doc", "os.path.join"),
        ("python_doc", "str"),
        ("python_doc", "json"),
        None,  # a section heading names nothing to look up
        ("man_page", "printf"),
        ("man_page", "printf"),
        ("man_page", "fork"),
        ("man_page", "null"),
    ]


def test_index_lookup_exact_case_dotted_tail_sections_and_misses():
    tools = DocTools(agent.doc_index(ITEMS))
    assert tools.lookup("python_doc", "os.path.join") == "Join one or more path segments."
    assert tools.lookup("python_doc", "`STR`") == "Text sequence type."
    assert tools.lookup("python_doc", "join") == "Join one or more path segments."  # the only *.join
    assert tools.lookup("man_page", "printf()") == (
        "printf(1): Format and print data.\nprintf(3): Formatted output conversion."
    )
    assert tools.lookup("man_page", "nosuch") == "No entry for 'nosuch'."
    assert tools.call("man_page", '{"name": "fork"}') == "fork(2): Create a child process."
    assert tools.call("man_page", "{not json").startswith("error: the arguments are not JSON")
    assert tools.call("man_page", '{"page": "fork"}') == 'error: call with {"name": "..."}'
    assert tools.call("shell", '{"name": "ls"}').startswith("error: unknown tool 'shell'")


def test_missing_index_says_which_model_has_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="doc_index.json.*--tools docs"):
        DocTools.load(tmp_path)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """The shipped tokenizer, its special slots named and its template set as p2pk3.tokenizer.bpe has them
    today (what train_docs --init-from trains with)."""
    from p2pk3.engine.reference import default_model_dir
    from p2pk3.tokenizer.chat import ChatTokenizer
    from tools.trainlib.warm_start import upgrade_tokenizer

    d = upgrade_tokenizer(default_model_dir(), tmp_path_factory.mktemp("tok"))
    return ChatTokenizer.from_pretrained(d)


def test_training_conversations_parse_back_to_their_calls(chat_tok):
    """Every tool conversation, rendered with the chat template, is read back by the API's parser as the
    calls it was made of (the model learns exactly the format the API parses)."""
    from p2pk3.agent.toolcalls import discover_tool_format, parse_tool_calls

    fmt = discover_tool_format(chat_tok.special, "\n".join(s for s, _ in chat_tok.templates.values()))
    assert fmt, fmt
    tools = DocTools(agent.doc_index(ITEMS))
    convs = agent.tool_conversations(ITEMS * 3, tools, seed=0)
    assert any(len(m[1]["tool_calls"]) == 2 for m, _ in convs)  # some ask both tools at once
    for msgs, schemas in convs:
        assert schemas == SCHEMAS and msgs[-1]["role"] == "assistant"
        prompt = chat_tok.render(msgs[:1], add_generation_prompt=True, tools=schemas)
        full = chat_tok.render(msgs[:2], add_generation_prompt=False, tools=schemas)
        out = parse_tool_calls(full[len(prompt) :], fmt, schemas)
        assert (
            out.errors == []
            and [{k: v for k, v in c.items() if k != "index"} for c in out.tool_calls] == (msgs[1]["tool_calls"])
        )
        for call, res in zip(msgs[1]["tool_calls"], msgs[2:-1]):
            f = call["function"]
            assert res["tool_call_id"] == call["id"] and res["content"] == tools.call(f["name"], f["arguments"])
            assert res["content"].split("\n")[0].split(": ", 1)[-1] in msgs[-1]["content"]


def test_multi_turn_conversations_keep_a_document_together():
    convs = agent.multi_turn(ITEMS, seed=1)
    for msgs, _ in convs:
        users = [m["content"] for m in msgs if m["role"] == "user"]
        docs = {d for _, q, _, d in ITEMS if q in users}
        assert len(docs) == 1 and 2 <= len(users) <= 3
    assert agent.paraphrased(ITEMS, 0)[0][0][1]["content"] == ITEMS[0][2]


def test_section_questions_are_reworded_as_a_user_would_ask_them():
    items = [
        ("py-section", "Tell me about The with statement.", "Wraps a block.", "py/reference/compound_stmts"),
        ("py-section", "Tell me about Logging.", "How to log.", "py/howto/logging"),
    ]
    for seed in range(8):
        *stmts, (section, _) = agent.paraphrased(items, seed)
        assert [m[0]["content"] for m, _ in stmts] == [  # a statement in every wording, the README's among them
            "What does the with statement do?",
            "What is the with statement?",
            "How does the with statement work?",
            "Explain the with statement.",
        ]
        assert all(m[1]["content"] == "Wraps a block." for m, _ in stmts)
        assert section[0]["content"] in ("What is Logging?", "Explain Logging.", "What can you tell me about Logging?")
        assert section[1]["content"] == "How to log."


def test_renamed_conversations_can_only_be_answered_by_copying_the_made_up_name():
    items = ITEMS + [
        ("man", "What does the ldd command do?", "ldd prints the shared objects; see ldd.so.", "man/ldd.1")
    ]
    tools = DocTools(agent.doc_index(items))
    known = {n for table in tools.index.values() for n in table}
    seen = {"pair": 0, "call": 0}
    for it in items:
        for seed in range(6):
            for msgs, t in agent.renamed([it], tools, seed):
                tool, new = agent.item_key(it[0], msgs[0]["content"])
                assert new not in known and it[1] != msgs[0]["content"]  # the question is about a made-up name
                if t is None:  # a pair whose answer names its subject: the made-up name, never the real one
                    seen["pair"] += 1
                    assert msgs[1]["content"] == it[2].replace("ldd ", new + " ", 1)  # `ldd.so` is another name
                else:
                    seen["call"] += 1
                    call = msgs[1]["tool_calls"][0]["function"]
                    assert (call["name"], json.loads(call["arguments"])) == (tool, {"name": new})
                    head = msgs[2]["content"].split("\n")[0]  # the answer: the renamed result's first paragraph
                    assert msgs[3]["content"] == (head.split(": ", 1)[-1] if tool == "man_page" else head)
                    assert "manual page says" not in msgs[3]["content"]
    assert seen["pair"] == 2 * 6 and seen["call"] == 6 * sum(agent.item_key(k, q) is not None for k, q, _, _ in items)
    rng = random.Random(0)
    for name in ("re.sub", "PyCodec_Unregister", "memusage", "os.path.join", "x"):
        fake = agent.fake_name(name, rng)
        assert fake != name and fake.count(".") == name.count(".") and fake.count("_") == name.count("_")
        assert fake.startswith("Py") == name.startswith("Py")


def test_unquoted_items_are_the_man_pages_and_modules_and_the_training_set_weights_them_up(monkeypatch):
    """agent.unquoted: the questions that name their subject without backticks (man pages, modules); the chat
    set of tools/train_docs with --unquoted-copies has each of their tool conversations once more per copy, once
    with the real name and once with a made-up one, and nothing else more."""
    from tools import train_docs as td

    unq = agent.unquoted(ITEMS)
    assert [q for _, q, _, _ in unq] == [
        "What is the json module?",
        "What does the printf command do?",
        "What does the printf() function do?",
        "What does the fork() system call do?",
        "What is the null device?",
    ]
    index = agent.doc_index(ITEMS)

    seen: list[list[dict]] = []  # what is rendered: the conversations themselves, not token ids
    monkeypatch.setattr(td, "conversation_example", lambda tok, msgs, tools: seen.append(msgs) or ([], []))
    rendered = {}
    for n in (0, 2):
        seen.clear()
        td.conversation_set(None, ITEMS, index, 3, renamed=0, unquoted=n)
        rendered[n] = [[m for m in msgs if m["role"] != "system"] for msgs in seen]
    asked = {n: [c[0]["content"] for c in rendered[n]] for n in rendered}
    unquoted_qs = {it[1] for it in unq}
    for kind, q, _, _ in ITEMS:
        if agent.item_key(kind, q) is None:
            continue
        more = asked[2].count(q) - asked[0].count(q)
        assert more == (2 if q in unquoted_qs else 0), q  # the real question: twice more, a quoted one never
    known = {name for table in index.values() for name in table}
    made_up = [c for c in rendered[2] if len(c) > 1 and c[1].get("tool_calls") and c[0]["content"] not in asked[0]]
    assert len(made_up) == 2 * len(unq)  # a made-up-name call per unquoted item and copy, nothing else new
    for c in made_up:
        call = c[1]["tool_calls"][0]["function"]
        name = json.loads(call["arguments"])["name"]
        assert name not in known and name in c[0]["content"] and c[2]["content"].split("\n")[0].endswith(c[3]["content"])


class ScriptedModel:
    """Stands in for the model's choices (which a test cannot make a small trained model take): the first
    generation of a turn is a tool call written in the checkpoint's own format, the second a plain answer.
    It records every prompt; the tokens go through the real tokenizer, parser and REPL."""

    def __init__(self, tok, call_text: str, answer: str):
        self.tok, self.prompts = tok, []
        self.replies = [self._ids(call_text), self._ids(answer)]

    def _ids(self, text: str) -> list[int]:
        """Special-token strings -> their ids, the text between -> plain BPE ids, then <|im_end|>."""
        sp = self.tok.special
        ids: list[int] = []
        for piece in re.split("(" + "|".join(map(re.escape, sp)) + ")", text):
            ids += [sp[piece]] if piece in sp else self.tok.encode(piece) if piece else []
        return ids + [sp["<|im_end|>"]]

    async def generate(self, ids, params, on_token=None, **kw):
        self.prompts.append(ids)
        toks = self.replies[min(len(self.prompts), len(self.replies)) - 1]
        for t in toks:
            on_token(t)
        return SimpleNamespace(tokens=toks, stats={"prompt_tokens": len(ids), "ttft_s": 0.0}, stage_stats={})

    async def status(self):
        return {}

    def close(self):
        pass


def test_repl_runs_the_models_call_and_answers_with_its_result(chat_tok):
    from p2pk3.frontends.prompt import PromptBuilder
    from p2pk3.frontends.repl import run_chat
    from p2pk3.frontends.tool_use import ToolUse

    prompts = PromptBuilder(chat_tok)
    use = ToolUse(prompts, DocTools(agent.doc_index(ITEMS)))
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.man_page:0<|tool_call_argument_begin|>"
        '{"name": "fork"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    model = ScriptedModel(chat_tok, call, "It creates a child process.")
    out, err = io.StringIO(), io.StringIO()
    rc = run_chat(
        lambda: asyncio.sleep(0, model),
        prompts,
        stdin=io.StringIO("What does fork do?\n"),
        out=out,
        err=err,
        interactive=False,
        tools=use,
    )
    assert rc == 0, err.getvalue()
    assert out.getvalue().strip() == "It creates a child process."  # no call markup on screen
    assert '[man_page {"name": "fork"}: fork(2): Create a child process.]' in err.getvalue()
    first, second = model.prompts
    calls = [
        {
            "id": "functions.man_page:0",
            "type": "function",
            "function": {"name": "man_page", "arguments": '{"name": "fork"}'},
        }
    ]
    user = {"role": "user", "content": "What does fork do?"}
    assert first == chat_tok.apply_chat_template([user], add_generation_prompt=True, tools=SCHEMAS)
    assert second == chat_tok.apply_chat_template(
        [
            user,
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "functions.man_page:0", "content": "fork(2): Create a child process."},
        ],
        add_generation_prompt=True,
        tools=SCHEMAS,
    )
    assert json.loads(calls[0]["function"]["arguments"]) == {"name": "fork"}


def test_tools_need_a_model_that_can_call_them():
    from p2pk3.frontends.prompt import PromptBuilder
    from p2pk3.frontends.tool_use import ToolUse
    from p2pk3.tokenizer.chat import ChatTokenizer

    old = ChatTokenizer.from_pretrained(Path(__file__).parents[1] / "p2pk3/assets/tiny-k3-pydoc")
    with pytest.raises(ValueError, match="cannot call tools"):
        ToolUse(PromptBuilder(old), DocTools({}))
