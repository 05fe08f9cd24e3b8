"""tools/tune_defaults.py's tool-call figures, on outputs written here (a stand-in for the model: which call a
small trained model writes is not something a test can choose) with the shipped model's tokenizer and index."""

from __future__ import annotations

from pathlib import Path

from p2pk3.frontends.prompt import PromptBuilder
from tools.tune_defaults import score_tools

MODEL = Path(__file__).resolve().parents[1] / "p2pk3" / "assets" / "k3-docs"


def _call(tool: str, arg: str) -> str:
    return (
        "<|tool_calls_section_begin|><|tool_call_begin|>"
        f"functions.{tool}:0<|tool_call_argument_begin|>{arg}<|tool_call_end|><|tool_calls_section_end|>"
    )


class Written:
    """Answers each prompt with the text given for it."""

    def __init__(self, outputs: list[str]):
        self.dir = MODEL
        self.prompts = PromptBuilder.from_pretrained(MODEL)
        self.outputs = outputs

    def answers(self, messages, **_):
        assert len(messages) == len(self.outputs)
        return [(t, []) for t in self.outputs]


def test_tool_figures_right_tool_exact_name_and_the_entry_the_call_finds():
    prompts = [
        ("What does the ctan() function do?", "man_page", "ctan"),
        ("What does the ctan() function do?", "man_page", "ctan"),
        ("What does the ctan() function do?", "man_page", "ctan"),
        ("What is the base64 module?", "python_doc", "base64"),
        ("What is the base64 module?", "python_doc", "base64"),
        ("What does `re.sub` do?", "python_doc", "re.sub"),
        ("What does `re.sub` do?", "python_doc", "re.sub"),
        ("What does `re.sub` do?", "python_doc", "re.sub"),
    ]
    outputs = [
        _call("man_page", '{"name": "ctan"}'),  # exact
        _call("man_page", '{"name": " ctan"}'),  # the question's token, space and all: the tool finds it
        _call("man_page", '{"name": "glog2"}'),  # the right tool, a wrong name
        _call("python_doc", '{"name": " base64 module?'),  # unterminated: no call parses
        _call("man_page", '{"name": "base64"}'),  # the wrong tool
        _call("python_doc", '{"name": "`re.sub`"}'),  # backticks: found
        "It replaces text.",  # no call
        _call("python_doc", '{"name": "SUB"}'),  # neither exact nor found (no such entry)
    ]
    got = score_tools(Written(outputs), prompts)
    rows = got["rows"]
    assert [r["right_tool"] for r in rows] == [True, True, True, False, False, True, False, True]
    assert [r["right_name"] for r in rows] == [True, False, False, False, False, False, False, False]
    assert [r["right_doc"] for r in rows] == [True, True, False, False, False, True, False, False]
    assert (got["right_tool"], got["right_name"], got["right_doc"]) == (5 / 8, 1 / 8, 3 / 8)
