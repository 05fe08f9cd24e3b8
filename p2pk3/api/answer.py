"""The shape of a chat answer: generated text -> `reasoning_content`, `tool_calls` and `content`, complete and
streamed, for the OpenAI chat route and the Anthropic Messages route alike.

    formats = AnswerFormats(tok)                       # once per checkpoint: its thinking and tool-call markers
    shape = formats.shaper(tools, tool_choice, prompt_ids)   # one per request
    shape.keep_ids                                     # special-token ids the decoder must keep (the markers)
    for piece in gen.pieces(): deltas = shape.feed(piece)      # [{"reasoning_content"}, {"content"},
    deltas = shape.finish()                                    #  {"tool_calls": [...]}] in OpenAI's order
    shape.message(), shape.finish_reason(gen.finish_reason)
    formats.forced_grammar(tools, tool_choice, parallel_tool_calls, prompt_ids)   # Lark, or None

The markers are the checkpoint's own (agent/reasoning.py, agent/toolcalls.py find them among the tokenizer's
special tokens and in its chat template). The text goes through the thinking parser first; what is not
reasoning goes through the tool-call parser; what is neither is content. A checkpoint without thinking
tokens, or a request without tools (or with tool_choice "none"), is not parsed for them: its text is all
content, exactly as before (special tokens other than the markers are dropped from the text, as they always
were). A malformed tool call (bad JSON, unknown name, cut off) is left out of
tool_calls and logged; so are the calls after the first with parallel_tool_calls false.

The output starts inside a thinking section when the prompt ends with the thinking begin marker (templates
whose generation prompt opens it, e.g. when `reasoning_effort` asks for thinking): then everything up to the
end marker is reasoning. tool_choice "required" or a named function is enforced by a grammar of the
checkpoint's tool-call section (agent/toolgrammar.py) that the last stage samples under; thinking, where the
checkpoint has it, comes first when the prompt opened it or the request asked for reasoning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace

from p2pk3.agent.reasoning import ReasoningStream, discover_reasoning_format
from p2pk3.agent.toolcalls import NoToolFormat, ToolCallFormat, ToolCallStream, discover_tool_format

log = logging.getLogger("p2pk3.api")

__all__ = ["AnswerFormats", "AnswerShaper", "with_grammar"]


def with_grammar(params, lark: str):
    """SamplingParams that sample under the Lark grammar `lark` (on the last stage)."""
    return replace(params, grammar={"type": "lark", "lark": lark, "what": "tool_choice"})


class AnswerFormats:
    """One checkpoint's thinking and tool-call markers (each falsy, with its reason, when it has none)."""

    def __init__(self, tok):
        """tok: the checkpoint's ChatTokenizer (its templates' sources are where the markers must appear)."""
        source = "\n".join(src for src, _ in tok.templates.values())
        self.tok = tok
        self.tools: ToolCallFormat | NoToolFormat = discover_tool_format(tok.special, source)
        self.reasoning = discover_reasoning_format(tok.special, source)
        self.special: Mapping[str, int] = dict(tok.special)  # special-token text -> id
        self._gtok = None
        self._gtok_lock = threading.Lock()

    def check_grammar(self, grammar: Mapping) -> None:
        """Compile a SamplingParams grammar against this tokenizer, as the last stage will; GrammarError
        names what cannot be enforced. The engine's view of the tokenizer is built on first use (seconds
        at a 160k vocabulary: call this off the event loop)."""
        from p2pk3.agent.grammar import GrammarTokenizer, matcher_for

        with self._gtok_lock:
            if self._gtok is None:
                self._gtok = GrammarTokenizer(self.tok)
        matcher_for(self._gtok, grammar)

    def starts_inside(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt ends with the thinking begin marker (the output then starts as reasoning)."""
        fmt = self.reasoning
        if not fmt or not prompt_ids:
            return False
        if fmt.begin in self.special:
            return prompt_ids[-1] == self.special[fmt.begin]
        return self.tok.decode(list(prompt_ids[-8:])).rstrip().endswith(fmt.begin)  # a plain-text marker

    def parses_tools(self, tools: Sequence[Mapping] | None, tool_choice) -> bool:
        return bool(self.tools) and bool(tools) and tool_choice != "none"

    def shaper(
        self, tools: Sequence[Mapping] | None, tool_choice, prompt_ids: Sequence[int], parallel_tool_calls: bool = True
    ) -> AnswerShaper:
        tools = tools if self.parses_tools(tools, tool_choice) else None
        return AnswerShaper(self, tools, prompt_ids, max_calls=None if parallel_tool_calls else 1)

    def forced_grammar(
        self,
        tools: Sequence[Mapping] | None,
        tool_choice,
        parallel_tool_calls: bool,
        prompt_ids: Sequence[int],
        reasoning_effort: str | None = None,
    ) -> str | None:
        """The Lark grammar that enforces tool_choice "required" / named (None for auto / none); raises
        GrammarError (naming the reason) when it cannot be enforced on this checkpoint. Thinking may come
        first where the prompt opened a section (then it must) or the request asks for it (a
        reasoning_effort other than "none": the model may open one); otherwise the calls come at once (a
        model could think without end, and the grammar cannot bound it)."""
        if tool_choice in (None, "auto", "none"):
            return None
        from p2pk3.agent.toolgrammar import tool_call_grammar  # torch (via the grammar engine): only when forced

        inside = self.starts_inside(prompt_ids)
        thinks = bool(self.reasoning) and (inside or reasoning_effort not in (None, "none"))
        return tool_call_grammar(
            self.tools,
            tools,
            tool_choice,
            self.special,
            parallel_tool_calls=parallel_tool_calls,
            reasoning=self.reasoning if thinks else None,
            starts_inside=inside,
        )


class AnswerShaper:
    """One request's answer: text pieces in, OpenAI delta dicts out; the complete message at the end."""

    def __init__(
        self,
        formats: AnswerFormats,
        tools: Sequence[Mapping] | None,
        prompt_ids: Sequence[int],
        max_calls: int | None = None,
    ):
        """max_calls: 1 for parallel_tool_calls false (later calls are left out, and logged)."""
        self.max_calls = max_calls
        self._reasoning = ReasoningStream(formats.reasoning, formats.starts_inside(prompt_ids))
        self._tools = ToolCallStream(formats.tools if tools else NoToolFormat("not asked"), tools)
        markers = [*(formats.reasoning.begin, formats.reasoning.end)] if formats.reasoning else []
        markers += list(formats.tools.markers) if tools else []
        self.keep_ids = frozenset(formats.special[m] for m in markers if m in formats.special)
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self._announced = False  # a call was streamed (its name and id sent), valid or not

    def _route(self, deltas: list[dict], last: bool) -> list[dict]:
        out: list[dict] = []
        for d in deltas:
            if "reasoning_content" in d:
                self.reasoning_parts.append(d["reasoning_content"])
                out.append(d)
            else:
                out += self._tools.feed(d["content"])
        if last:
            tail, called = self._tools.finish()
            out += tail
            self._announced = called == "tool_calls"
            for e in self._tools.errors:
                log.warning("a malformed tool call was left out of the answer: %s", e)
        if self.max_calls is not None:
            out = [d for d in (self._limit(d) for d in out) if d]
        for d in out:
            if "content" in d:
                self.content_parts.append(d["content"])
        return out

    def _limit(self, d: dict) -> dict:
        """The delta without the calls past max_calls."""
        if "tool_calls" not in d:
            return d
        calls = [c for c in d["tool_calls"] if c["index"] < self.max_calls]
        if len(calls) < len(d["tool_calls"]) and any("id" in c for c in d["tool_calls"] if c not in calls):
            log.warning("parallel_tool_calls is false: a call after the first was left out of the answer")
        return {**d, "tool_calls": calls} if calls else {}

    def feed(self, piece: str) -> list[dict]:
        """The deltas (each a chunk's `choices[0].delta` less its role) for one more text piece."""
        return self._route(self._reasoning.feed(piece), last=False) if piece else []

    def finish(self) -> list[dict]:
        """The last deltas (held-back text, the end of an open call)."""
        return self._route(self._reasoning.finish(), last=True)

    @property
    def tool_calls(self) -> list[dict]:
        """The valid calls, as a message carries them (id, type, function {name, arguments})."""
        calls = self._tools.tool_calls[: self.max_calls]
        return [{k: v for k, v in c.items() if k != "index"} for c in calls]

    @property
    def reasoning_content(self) -> str | None:
        """The thinking text; None when the answer had no thinking section."""
        return "".join(self.reasoning_parts) if self._reasoning.had_reasoning else None

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    def finish_reason(self, raw: str | None, streamed: bool = False) -> str | None:
        """"tool_calls" when the answer ended (not cut off) with calls (streamed: with a call announced, the
        client has seen its deltas); else the generation's own."""
        called = self._announced if streamed else bool(self.tool_calls)
        return "tool_calls" if raw == "stop" and called else raw

    def message(self) -> dict:
        """The OpenAI assistant message (content null when the answer is only tool calls)."""
        msg: dict = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
            msg["content"] = self.content or None
        return msg
