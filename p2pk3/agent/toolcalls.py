"""Tool calls in the checkpoint's own format -> OpenAI `tool_calls`, complete and streamed.

    fmt = discover_tool_format(tok.special, template_source)   # ToolCallFormat, or NoToolFormat(reason)
    parsed = parse_tool_calls(text, fmt, tools=request_tools)  # .content, .tool_calls, .errors
    stream = ToolCallStream(fmt, tools=request_tools)
    for piece in token_texts: deltas = stream.feed(piece)      # OpenAI chunk deltas, in order
    deltas, finish_reason = stream.finish()                    # "tool_calls" when a call was made

Kimi K2 / K3 write a tool-call section as

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>

The five markers are found by role, not by name: a section begin / end, a call begin / end and an argument
begin are recognised by the words their token names are made of (tool, call, section, argument; begin or
start, end), among the tokenizer's special tokens, and each must be written by the chat template (which
renders past assistant `tool_calls` with them). A checkpoint without them gets `NoToolFormat` with the
reason; the API then treats tool-call requests as it must for a model that cannot call tools. The section
markers may be absent from a checkpoint (then calls stand alone). The call header is `functions.NAME:IDX`
(Kimi's convention, also accepted: `NAME:IDX`, `NAME`); the header is the OpenAI call id, as vLLM's Kimi
parser does, so an assistant message sent back with its `tool_calls` renders the same text again.

A malformed call (arguments not a JSON object, a name not in the request's `tools`, a call cut off by the
end of the output) never raises: it is left out of `tool_calls` and described in `errors`. When streaming,
a call is announced only once its name is known and valid; its arguments stream as they come, so bad JSON
can only be found at the call's end: it is reported in `errors` (the client has seen the fragments).

Called by the API's chat and Messages routes (p2pk3/api/answer.py): on the decoded output with the markers
kept, after `reasoning.py` has taken the thinking out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .markers import MarkerSplitter, find_markers

__all__ = [
    "ToolCallFormat",
    "NoToolFormat",
    "discover_tool_format",
    "parse_tool_calls",
    "ParsedToolCalls",
    "ToolCallStream",
    "tool_names",
]

_HEADER = re.compile(r"\s*(?:functions\.)?(?P<name>[A-Za-z0-9_\-.]+?)(?::(?P<idx>\d+))?\s*")


@dataclass(frozen=True)
class ToolCallFormat:
    """The markers of one checkpoint's tool calls (section ones None when it has none)."""

    call_begin: str
    argument_begin: str
    call_end: str
    section_begin: str | None = None
    section_end: str | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(
            m for m in (self.section_begin, self.section_end, self.call_begin, self.argument_begin, self.call_end) if m
        )

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class NoToolFormat:
    """This checkpoint has no tool-call tokens (reason says what was looked for)."""

    reason: str

    def __bool__(self) -> bool:
        return False


def _words(token: str) -> set[str]:
    return set(re.findall(r"[a-z]+", token.lower()))


def _role(token: str) -> str | None:
    w = _words(token)
    if not ({"tool", "tools", "function"} & w) or not ({"call", "calls"} & w) and "argument" not in w:
        return None
    edge = "begin" if w & {"begin", "start"} else "end" if "end" in w else None
    if edge is None:
        return None
    if w & {"argument", "arguments", "arg", "args"}:
        return "argument_begin" if edge == "begin" else None
    if "section" in w or "calls" in w:
        return f"section_{edge}"
    return f"call_{edge}"


def discover_tool_format(special_tokens: Iterable[str], template: str | None) -> ToolCallFormat | NoToolFormat:
    """The tool-call markers among `special_tokens` (the tokenizer's special-token strings) that the chat
    `template` source uses; NoToolFormat (falsy) with the reason otherwise. template None: not checked."""
    roles: dict[str, list[str]] = {}
    for tok in special_tokens:
        if (r := _role(tok)) and (template is None or tok in template):
            roles.setdefault(r, []).append(tok)
    for r, toks in roles.items():
        if len(toks) > 1:
            return NoToolFormat(f"ambiguous tool-call tokens for {r}: {sorted(toks)}")
    need = ("call_begin", "argument_begin", "call_end")
    missing = [r for r in need if r not in roles]
    if missing:
        where = " used by the chat template" if template is not None else ""
        return NoToolFormat(
            f"this checkpoint has no tool-call tokens: no special token{where} for "
            f"{', '.join(missing)} (looked for names like <|tool_call_begin|>, "
            "<|tool_call_argument_begin|>, <|tool_call_end|>)"
        )
    if ("section_begin" in roles) != ("section_end" in roles):
        return NoToolFormat(f"tool-call section tokens come in pairs; found only {sorted(roles)}")
    one = {r: t[0] for r, t in roles.items()}
    return ToolCallFormat(
        one["call_begin"], one["argument_begin"], one["call_end"], one.get("section_begin"), one.get("section_end")
    )


def tool_names(tools: Sequence[Mapping] | None) -> set[str] | None:
    """The function names of an OpenAI `tools` list (None: no list given, any name is accepted)."""
    if tools is None:
        return None
    names = set()
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def _check_header(header: str, names: set[str] | None) -> tuple[str | None, str, str | None]:
    """(name, id, error) of a call header."""
    m = _HEADER.fullmatch(header)
    call_id = header.strip()
    if not m:
        return None, call_id, f"tool call header {header!r} is not functions.NAME:IDX"
    name = m.group("name")
    if names is not None and name not in names:
        return None, call_id, f"tool call names {name!r}, which is not among the request's tools {sorted(names)}"
    return name, call_id, None


def _check_arguments(args: str) -> str | None:
    try:
        value = json.loads(args)
    except json.JSONDecodeError as e:
        return f"arguments are not valid JSON ({e.msg} at character {e.pos}): {args[:200]!r}"
    if not isinstance(value, dict):
        return f"arguments must be a JSON object, got {type(value).__name__}: {args[:200]!r}"
    return None


@dataclass
class ParsedToolCalls:
    content: str
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI message tool_calls
    errors: list[str] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        """ "tool_calls" when there is one (else the caller's own: stop or length)."""
        return "tool_calls" if self.tool_calls else None


class _Machine:
    """The state machine shared by the complete and the streaming parser: events in, actions out."""

    def __init__(self, fmt: ToolCallFormat, names: set[str] | None):
        self.fmt, self.names = fmt, names
        self.state = "content"  # content | section | header | arguments | skip
        self.header = ""
        self.args = ""
        self.call: dict | None = None  # the call being read (valid header)
        self.calls: list[dict] = []
        self.errors: list[str] = []
        self.n = 0  # calls seen, valid or not
        self._in_section = False

    def event(self, kind: str, s: str, out: list[tuple]) -> None:
        f, st = self.fmt, self.state
        if kind == "text":
            if st == "content":
                out.append(("content", s))
            elif st == "header":
                self.header += s
            elif st == "arguments":
                self.args += s
                if self.call is not None:
                    out.append(("arguments", (self.call["index"], s)))
            return  # text between calls in a section, or in a skipped call, is dropped
        if s == f.section_begin and st == "content":
            self.state = "section"
        elif s == f.section_end and st in ("section", "content"):
            self.state = "content"
        elif s == f.call_begin and st in ("content", "section"):
            self.state, self.header, self.args, self.call = "header", "", "", None
            self._in_section = st == "section"
        elif s == f.argument_begin and st == "header":
            name, call_id, err = _check_header(self.header, self.names)
            self.n += 1
            if err:
                self.errors.append(f"tool call {self.n - 1}: {err}")
            else:
                self.call = {
                    "index": len(self.calls),
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
                out.append(("call", self.call))
            self.state = "arguments"
        elif s == f.call_end and st == "arguments":
            if self.call is not None:
                err = _check_arguments(self.args)
                if err:
                    self.errors.append(f"tool call {self.n - 1} ({self.call['function']['name']}): {err}")
                else:
                    self.call["function"]["arguments"] = self.args.strip()
                    self.calls.append(self.call)
            self.call = None
            self.state = "section" if self._in_section else "content"
        else:
            self.errors.append(f"tool-call marker {s} out of place (while reading {st}); ignored")

    def end(self) -> None:
        if self.state in ("header", "arguments"):
            what = self.call["function"]["name"] if self.call else self.header.strip() or "?"
            self.errors.append(f"tool call {max(self.n - 1, 0)} ({what}) was cut off before {self.fmt.call_end}")
            self.call = None


def parse_tool_calls(
    text: str, fmt: ToolCallFormat | NoToolFormat, tools: Sequence[Mapping] | None = None
) -> ParsedToolCalls:
    """Content and OpenAI tool_calls of a complete output (decoded with special tokens kept)."""
    if not fmt:
        return ParsedToolCalls(text)
    m = _Machine(fmt, tool_names(tools))
    out: list[tuple] = []
    for kind, s in find_markers(text, fmt.markers):
        m.event(kind, s, out)
    m.end()
    content = "".join(s for k, s in out if k == "content")
    return ParsedToolCalls(content, [dict(c, function=dict(c["function"])) for c in m.calls], m.errors)


class ToolCallStream:
    """The streaming parser: token texts in, OpenAI chunk deltas out (module doc)."""

    def __init__(self, fmt: ToolCallFormat | NoToolFormat, tools: Sequence[Mapping] | None = None):
        self.fmt = fmt
        self._split = MarkerSplitter(fmt.markers) if fmt else None
        self._m = _Machine(fmt, tool_names(tools)) if fmt else None
        self.errors: list[str] = self._m.errors if self._m else []
        self._announced = 0

    def _deltas(self, events: list[tuple[str, str]]) -> list[dict]:
        out: list[tuple] = []
        for kind, s in events:
            self._m.event(kind, s, out)
        deltas: list[dict] = []
        for kind, v in out:
            if kind == "content" and v:
                if deltas and "content" in deltas[-1]:
                    deltas[-1]["content"] += v
                else:
                    deltas.append({"content": v})
            elif kind == "call":
                self._announced += 1
                fn = {"name": v["function"]["name"], "arguments": ""}
                deltas.append(
                    {"tool_calls": [{"index": v["index"], "id": v["id"], "type": "function", "function": fn}]}
                )
            elif kind == "arguments" and v[1]:
                idx, v = v
                last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
                if last is not None and last["index"] == idx and "id" not in last:
                    last["function"]["arguments"] += v
                else:
                    deltas.append({"tool_calls": [{"index": idx, "function": {"arguments": v}}]})
        return deltas

    def feed(self, piece: str) -> list[dict]:
        """Deltas (each a chunk's `choices[0].delta`) for one more token text."""
        if not self.fmt:
            return [{"content": piece}] if piece else []
        return self._deltas(self._split.feed(piece))

    def finish(self) -> tuple[list[dict], str | None]:
        """(last deltas, finish_reason): "tool_calls" when a call was announced, else None (the caller's)."""
        if not self.fmt:
            return [], None
        deltas = self._deltas(self._split.flush())
        self._m.end()
        return deltas, "tool_calls" if self._announced else None

    @property
    def tool_calls(self) -> list[dict]:
        """The complete, valid calls so far (as parse_tool_calls gives them)."""
        return list(self._m.calls) if self._m else []
