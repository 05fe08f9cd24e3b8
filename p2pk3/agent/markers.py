"""Finding marker strings (`<|tool_call_begin|>`, `</think>`, ...) in text that arrives in pieces.

    s = MarkerSplitter(["<think>", "</think>"])
    s.feed("a<th")     # -> [("text", "a")]            "<th" is held back: it may become "<think>"
    s.feed("ink>b")    # -> [("marker", "<think>"), ("text", "b")]
    s.flush()          # -> []                           (the held-back rest as text, at the end)

Token texts come one at a time; a marker that is one special token arrives whole, but a marker the
checkpoint writes as plain text (`<think>` in some templates) can be split across tokens. The splitter holds
back only the longest suffix that is a prefix of some marker, so ordinary text is never delayed longer than
a marker could be. The parsers of `toolcalls.py` and `reasoning.py` are built on it; `find_markers` is the
same search for a complete text.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MarkerSplitter", "find_markers"]


def find_markers(text: str, markers: Iterable[str]) -> list[tuple[str, str]]:
    """Split a complete text into ("text", s) and ("marker", m) pieces, in order (longest marker first
    where two start at the same place); empty text pieces are dropped."""
    s = MarkerSplitter(markers)
    return _merge(s.feed(text) + s.flush())


def _merge(events: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, s in events:
        if kind == "text" and out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + s)
        elif kind != "text" or s:
            out.append((kind, s))
    return out


class MarkerSplitter:
    """Incremental split of a text stream into text pieces and markers (module doc)."""

    def __init__(self, markers: Iterable[str]):
        self.markers = sorted({m for m in markers if m}, key=len, reverse=True)
        if not self.markers:
            raise ValueError("MarkerSplitter needs at least one non-empty marker")
        self._prefixes = {m[:k] for m in self.markers for k in range(1, len(m))}
        self._held = ""

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """Events for `piece`: ("text", s) and ("marker", m), in order; may hold back a partial marker."""
        buf = self._held + piece
        events: list[tuple[str, str]] = []
        start = 0
        while True:
            hits = [(i, m) for m in self.markers if (i := buf.find(m, start)) >= 0]
            if not hits:
                break
            i, m = min(hits, key=lambda h: (h[0], -len(h[1])))
            events.append(("text", buf[start:i]))
            events.append(("marker", m))
            start = i + len(m)
        rest = buf[start:]
        keep = next(
            (k for k in range(min(len(rest), len(self.markers[0]) - 1), 0, -1) if rest[-k:] in self._prefixes), 0
        )
        events.append(("text", rest[: len(rest) - keep]))
        self._held = rest[len(rest) - keep :]
        return _merge(events)

    def flush(self) -> list[tuple[str, str]]:
        """The held-back rest as text (end of the stream)."""
        rest, self._held = self._held, ""
        return [("text", rest)] if rest else []
