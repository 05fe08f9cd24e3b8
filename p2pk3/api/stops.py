"""Stop sequences over a stream of text pieces: text is released only when it cannot be the start of a
stop sequence, and nothing after (or of) a matched stop sequence is ever released.

    m = StopMatcher(["\\n\\n", "END"])
    out = m.push(piece)        # text safe to send now ("" while a possible stop prefix is held)
    if m.stopped: ...          # a stop sequence matched: `out` is the text before it; stop generating
    out = m.flush()            # end of the stream: whatever is still held
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.stopped: str | None = None  # the stop sequence that matched
        self._held = ""

    def push(self, text: str) -> str:
        if self.stopped is not None:
            return ""
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            self.stopped, self._held = s, ""
            return buf[:i]
        keep = self._prefix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped is not None else self._held), ""
        return out

    def _prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop sequence."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
