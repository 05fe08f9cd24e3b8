"""Thinking sections -> `reasoning_content`, the rest -> `content`; complete and streamed.

    fmt = discover_reasoning_format(tok.special, template_source)   # ReasoningFormat, or NoReasoningFormat
    parsed = split_reasoning(text, fmt)          # .reasoning_content (None when there was none), .content
    stream = ReasoningStream(fmt)
    for piece in token_texts: deltas = stream.feed(piece)   # [{"reasoning_content": ...}, {"content": ...}]
    deltas = stream.finish()

The thinking markers are the checkpoint's: a begin / end pair among its special tokens whose names say
think / thinking / reasoning (`<think>` `</think>`, `<|think_begin|>` `<|think_end|>`, ...) used by the chat
template, or else such a literal tag pair written in the template text (templates that spell `<think>` as
plain text). A checkpoint with neither gets `NoReasoningFormat`: its output is all content, unchanged.

`starts_inside=True` is for templates whose generation prompt already opens the thinking section (the
prompt ends with the begin marker): the output then starts as reasoning. An unclosed section at the end is
reasoning (the output was cut off while thinking). A marker split across token texts is recognised (see
`markers.py`). Several sections in one output all go to reasoning_content, in order.

Called by the API (p2pk3/api/answer.py): the decoded output (the markers kept) goes through this first;
its content then goes through `toolcalls.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .markers import MarkerSplitter

__all__ = [
    "ReasoningFormat",
    "NoReasoningFormat",
    "discover_reasoning_format",
    "split_reasoning",
    "ParsedReasoning",
    "ReasoningStream",
]

_WORDS = ("think", "thinking", "reasoning", "thought")
_TAG = re.compile(r"<(/?)(think|thinking|reasoning|thought)>")


@dataclass(frozen=True)
class ReasoningFormat:
    begin: str
    end: str

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class NoReasoningFormat:
    reason: str

    def __bool__(self) -> bool:
        return False


def _edge(token: str) -> str | None:
    w = set(re.findall(r"[a-z]+", token.lower()))
    if not w & set(_WORDS):
        return None
    if "end" in w or token.startswith("</") or "close" in w:
        return "end"
    return "begin"


def discover_reasoning_format(
    special_tokens: Iterable[str], template: str | None
) -> ReasoningFormat | NoReasoningFormat:
    """The thinking begin / end markers of a checkpoint (module doc); NoReasoningFormat (falsy) otherwise.
    template None: special tokens are not checked against it, and no literal tags are looked for."""
    found: dict[str, list[str]] = {}
    for tok in special_tokens:
        if (e := _edge(tok)) and (template is None or tok in template):
            found.setdefault(e, []).append(tok)
    if len(found.get("begin", ())) == 1 and len(found.get("end", ())) == 1:
        return ReasoningFormat(found["begin"][0], found["end"][0])
    if found.get("begin") or found.get("end"):
        return NoReasoningFormat(f"thinking tokens do not form one begin/end pair: {found}")
    if template:
        tags = {(m.group(1), m.group(2)) for m in _TAG.finditer(template)}
        for word in _WORDS:
            if ("", word) in tags and ("/", word) in tags:
                return ReasoningFormat(f"<{word}>", f"</{word}>")
    return NoReasoningFormat(
        "this checkpoint has no thinking tokens: no special token named think / thinking / "
        "reasoning used by its chat template, and no <think>...</think> tag pair in it"
    )


@dataclass
class ParsedReasoning:
    reasoning_content: str | None  # None: the output had no thinking section
    content: str


def split_reasoning(
    text: str, fmt: ReasoningFormat | NoReasoningFormat, starts_inside: bool = False
) -> ParsedReasoning:
    """reasoning_content and content of a complete output."""
    s = ReasoningStream(fmt, starts_inside)
    deltas = s.feed(text) + s.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    return ParsedReasoning(reasoning if s.had_reasoning else None, content)


class ReasoningStream:
    """Token texts in, `{"reasoning_content": s}` / `{"content": s}` deltas out (module doc)."""

    def __init__(self, fmt: ReasoningFormat | NoReasoningFormat, starts_inside: bool = False):
        self.fmt = fmt
        self._split = MarkerSplitter([fmt.begin, fmt.end]) if fmt else None
        self.inside = bool(fmt) and starts_inside
        self.had_reasoning = self.inside

    def _deltas(self, events: list[tuple[str, str]]) -> list[dict]:
        out: list[dict] = []
        for kind, s in events:
            if kind == "marker":
                if s == self.fmt.begin and not self.inside:
                    self.inside = self.had_reasoning = True
                elif s == self.fmt.end and self.inside:
                    self.inside = False
                else:  # a stray marker (end outside, begin inside): keep it where it is, as text
                    kind = "text"
            if kind == "text" and s:
                key = "reasoning_content" if self.inside else "content"
                if out and key in out[-1]:
                    out[-1][key] += s
                else:
                    out.append({key: s})
        return out

    def feed(self, piece: str) -> list[dict]:
        if not self.fmt:
            return [{"content": piece}] if piece else []
        return self._deltas(self._split.feed(piece))

    def finish(self) -> list[dict]:
        if not self.fmt:
            return []
        return self._deltas(self._split.flush())
