"""Incremental detokenization: text of a token stream, never a broken character mid-stream.

    dec = StreamDecoder(lambda ids: tok.decode(ids, skip_special=True))   # or ChatTokenizer.stream_decoder()
    for t in generated_ids:
        print(dec.push(t), end="", flush=True)     # only complete text; "" while a character is incomplete
    print(dec.flush())                             # whatever is still held (incomplete bytes -> U+FFFD)

Two things make per-token decoding wrong, and both are handled by decoding a short *window* of recent
tokens and emitting only what the window's text adds beyond what was already emitted:

* byte-level BPE (Kimi's tiktoken, GPT-2-style `tokenizer.json`, SentencePiece byte fallback) splits a
  multi-byte UTF-8 character over several tokens; decoding a prefix then ends in U+FFFD. Trailing U+FFFD
  characters are held back until the character completes (or `max_hold` tokens have passed without it
  completing: then the bytes really are invalid and are emitted as U+FFFD, so a bad stream cannot stall
  the output forever);
* some decoders depend on context (SentencePiece's Metaspace strips the leading space of the first token
  of a decode), so a token decoded alone differs from the same token decoded after others. The window keeps
  at least one earlier token as context, and the emitted text is `decode(window)[len(emitted part):]`.

Emitted text is final: it is never taken back. The decoder assumes (as every BPE / SentencePiece decoder
does) that appending tokens only appends text, apart from a trailing incomplete character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["StreamDecoder", "REPLACEMENT_CHAR"]

REPLACEMENT_CHAR = "\ufffd"
_MAX_CONTEXT = 4  # tokens of left context kept in the window
_MAX_WINDOW = 256  # a window that never finds a clean boundary is cut here (pathological decoders only)


class StreamDecoder:
    """Incremental decoder over `decode(ids) -> str` (see the module doc).

    push(token_id) -> str: the newly complete text (possibly "").
    flush() -> str: the rest, including an incomplete trailing character as U+FFFD; the decoder is then
    empty and can be reused for a new stream.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], max_hold: int = 8):
        if max_hold < 1:
            raise ValueError(f"max_hold must be >= 1, got {max_hold}")
        self._decode = decode
        self.max_hold = max_hold  # tokens an incomplete character may stay held (UTF-8 needs at most 3 more)
        self._window: list[int] = []  # left context + tokens not yet fully emitted
        self._done = 0  # chars of decode(self._window) already emitted (or context)
        self._held = 0  # tokens pushed since the window last decoded to complete text

    def push(self, token_id: int) -> str:
        self._window.append(int(token_id))
        self._held += 1
        text = self._decode(self._window)
        stable = text.rstrip(REPLACEMENT_CHAR)
        complete = len(stable) == len(text)
        if not complete and self._held <= self.max_hold:
            text = stable  # hold the bytes of an incomplete character back
        out = text[self._done :] if len(text) > self._done else ""
        self._done = max(self._done, len(text))
        if complete or self._held > self.max_hold:
            self._held = 0
            self._rebase(text)
        return out

    def flush(self) -> str:
        text = self._decode(self._window) if self._window else ""
        out = text[self._done :] if len(text) > self._done else ""
        self._window, self._done, self._held = [], 0, 0
        return out

    def _rebase(self, text: str) -> None:
        """Shorten the window to the last k <= _MAX_CONTEXT tokens, whose text is then context. Only where
        those tokens decode on their own to a clean suffix of `text` (not starting inside a character)."""
        for k in range(1, min(_MAX_CONTEXT, len(self._window)) + 1):
            ctx = self._decode(self._window[-k:])
            if not ctx.startswith(REPLACEMENT_CHAR) and text.endswith(ctx):
                self._window = self._window[-k:]
                self._done = len(ctx)
                return
        if len(self._window) > _MAX_WINDOW:
            self._window, self._done = [], 0
