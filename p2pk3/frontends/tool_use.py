"""Tools in the chat REPL (`p2pk3 chat --tools docs`): the model calls them, the REPL runs them, the model
answers with their results.

    use = ToolUse(prompts, DocTools.load(model_dir))
    use.schemas                      # the `tools` of every prompt of the conversation
    reader = use.reader()            # per model turn: feed(token_id) -> text to show; .calls when done
    msgs = use.run(reader.calls)     # [assistant message with its tool_calls, one `tool` message per call]

The calls are parsed from the model's own format (p2pk3/agent/toolcalls.py, the parser of the API), so
what the REPL runs is what an API client would be given. A turn of the REPL is at most `max_rounds` tool
rounds and then one more generation; a model that still calls tools then is answered with its text so far.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from p2pk3.agent.toolcalls import ToolCallStream, discover_tool_format

__all__ = ["ToolUse", "ToolReader"]


class ToolReader:
    """One generation's token ids -> the text to show (tool-call markup hidden) and its complete calls."""

    def __init__(self, prompts, fmt, schemas: Sequence[Mapping]):
        keep = [prompts.tok.special[m] for m in fmt.markers if m in prompts.tok.special]
        self._dec = prompts.tok.stream_decoder(keep=keep)
        self._stream = ToolCallStream(fmt, schemas)

    def _shown(self, deltas: list[dict]) -> str:
        return "".join(d.get("content") or "" for d in deltas)

    def feed(self, token_id: int) -> str:
        return self._shown(self._stream.feed(self._dec.push(token_id)))

    def finish(self) -> str:
        text = self._shown(self._stream.feed(self._dec.flush()))
        deltas, _ = self._stream.finish()
        return text + self._shown(deltas)

    @property
    def calls(self) -> list[dict]:
        return [{k: v for k, v in c.items() if k != "index"} for c in self._stream.tool_calls]


class ToolUse:
    """A chat's tools (module doc). Raises ValueError when the model cannot call tools."""

    def __init__(self, prompts, tools, max_rounds: int = 3):
        tok = prompts.tok
        source = "\n".join(src for src, _ in tok.templates.values())
        self.fmt = discover_tool_format(tok.special, source)
        if not self.fmt:
            raise ValueError(f"this model cannot call tools: {self.fmt.reason}")
        self.prompts, self.tools, self.max_rounds = prompts, tools, max_rounds

    @property
    def schemas(self) -> list[dict]:
        return self.tools.schemas

    def reader(self) -> ToolReader:
        return ToolReader(self.prompts, self.fmt, self.schemas)

    def run(self, calls: list[dict], content: str = "") -> list[dict]:
        """The assistant message that made `calls` and one `tool` message with each call's result."""
        out: list[dict] = [{"role": "assistant", "content": content, "tool_calls": calls}]
        for c in calls:
            f = c["function"]
            out.append({"role": "tool", "tool_call_id": c["id"], "content": self.tools.call(f["name"], f["arguments"])})
        return out

    @staticmethod
    def describe(call: dict, result: str, width: int = 100) -> str:
        """One line for the user: `[python_doc {"name": "len"}: Return the length ...]`."""
        f = call["function"]
        first = " ".join(result.split())
        return f"[{f['name']} {f['arguments']}: {first[:width]}{'...' if len(first) > width else ''}]"
