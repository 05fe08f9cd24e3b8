"""Draft proposers at the entry: no model, a few dictionary look-ups per step (microseconds).

* `NgramProposer` (prompt lookup): find the most recent earlier occurrence of the session's last n tokens
  in its own history (prompt + output; n from `max_n` down to `min_n`) and propose what followed. The
  index of n-grams grows with the history (each token is indexed once), so a look-up costs O(max_n).
* `SuffixIndex` + `SuffixProposer` (SuffixDecoding-style): one index shared by every session of the entry
  over the recent prompts and outputs of the cluster, in a bounded token buffer (`capacity`; when it is
  full the older half is dropped and the index rebuilt, so memory stays O(capacity * orders)). The
  proposer matches the session's last up-to-`max_n` tokens in its own history and in the shared index
  and takes the longer match (its own history on a tie).

A draft that runs past the end of the history continues periodically (the match's period), which is what
a repeated run of tokens asks for. Proposers only see accepted tokens: their output never changes the
generated text (the ring verifies every draft), only how many tokens one pass settles."""

from __future__ import annotations

from typing import Protocol, Sequence

SEP = -1  # separates documents in the shared buffer (never a token id)


class Proposer(Protocol):
    def propose(self, history: Sequence[int], k: int) -> list[int]: ...


def _copy(buf: Sequence[int], start: int, end: int, k: int, periodic: bool = True) -> list[int]:
    """Up to k tokens from buf[start:end]; past `end` (the session's own history: the match's continuation
    reaches the present) the proposal repeats itself with the match's period end - start; stops at a
    document separator (and at `end` when not periodic)."""
    out: list[int] = []
    period = end - start
    for i in range(k):
        j = start + i
        if j >= end and not periodic:
            break
        t = buf[j] if j < end else out[i - period]
        if t == SEP:
            break
        out.append(t)
    return out


class NgramProposer:
    """Prompt lookup over one session's history (incremental index: order n -> n-gram -> where it was last
    followed)."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._done = 0  # n-grams ending before this position are indexed
        self.last_match = 0  # order of the last match (0: none)

    def _update(self, h: Sequence[int]) -> None:
        L = len(h)
        for e in range(self._done, L - 1):  # an n-gram ending at e is followed by h[e + 1]
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                self._index[n][tuple(h[e - n + 1 : e + 1])] = e + 1
        self._done = max(self._done, L - 1)

    def match(self, h: Sequence[int]) -> tuple[int, int]:
        """(order, where the continuation starts) of the longest match of h's suffix; (0, -1) if none."""
        self._update(h)
        L = len(h)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            f = self._index[n].get(tuple(h[L - n :]))
            if f is not None:
                return n, f
        return 0, -1

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        n, f = self.match(history)
        self.last_match = n
        if k <= 0 or n == 0:
            return []
        return _copy(history, f, len(history), k)


class SuffixIndex:
    """The cluster's recent prompts and outputs (one per entry), for `SuffixProposer`. Bounded: at most
    `capacity` tokens are kept (the oldest half is dropped when full) and the index only covers them."""

    def __init__(self, capacity: int = 1 << 16, max_n: int = 6, min_n: int = 2):
        self.capacity, self.max_n, self.min_n = capacity, max_n, min_n
        self._buf: list[int] = []
        self._base = 0  # absolute position of _buf[0]
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]

    def __len__(self) -> int:
        return len(self._buf)

    def entries(self) -> int:
        return sum(len(d) for d in self._index)

    def _index_range(self, lo: int, hi: int) -> None:
        """Index the n-grams that end at buffer positions lo .. hi - 2 (each is followed by a token)."""
        b = self._buf
        for e in range(lo, hi - 1):
            if b[e + 1] == SEP:
                continue
            for n in range(self.min_n, self.max_n + 1):
                if e - n + 1 < 0:
                    break
                key = tuple(b[e - n + 1 : e + 1])
                if SEP in key:
                    break
                self._index[n][key] = self._base + e + 1

    def add(self, tokens: Sequence[int]) -> None:
        """Add one document (a prompt, or an output with a little of its prompt before it)."""
        tokens = list(tokens)[-self.capacity // 2 :]
        if not tokens:
            return
        if len(self._buf) + len(tokens) + 1 > self.capacity:  # drop the older half, rebuild the index
            drop = max(len(self._buf) // 2, len(self._buf) + len(tokens) + 1 - self.capacity)
            self._buf = self._buf[drop:]
            self._base += drop
            self._index = [{} for _ in range(self.max_n + 1)]
            self._index_range(0, len(self._buf))
        start = len(self._buf)
        self._buf.append(SEP)
        self._buf.extend(tokens)
        self._index_range(start, len(self._buf))

    def match(self, h: Sequence[int], max_n: int | None = None) -> tuple[int, int]:
        """(order, buffer position where the continuation starts) of the longest match; (0, -1) if none."""
        L = len(h)
        for n in range(min(max_n or self.max_n, self.max_n, L), self.min_n - 1, -1):
            f = self._index[n].get(tuple(h[L - n :]))
            if f is not None and f >= self._base:
                return n, f - self._base
        return 0, -1

    def continuation(self, at: int, k: int) -> list[int]:
        b = self._buf
        return _copy(b, at, len(b), k, periodic=False)


class SuffixProposer:
    """A session's own history (orders up to `max_n`) and the shared `SuffixIndex`; the longer match wins."""

    def __init__(self, index: SuffixIndex, max_n: int = 6):
        self.index = index
        self.own = NgramProposer(max_n=max_n, min_n=1)
        self.last_match = 0

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        n_own, f = self.own.match(history)
        n_idx, g = self.index.match(history)
        self.last_match = max(n_own, n_idx)
        if k <= 0 or self.last_match == 0:
            return []
        if n_own >= n_idx:
            return _copy(history, f, len(history), k)
        return self.index.continuation(g, k)


def make_proposer(method: str, index: SuffixIndex | None = None) -> Proposer | None:
    """The per-session proposer of a request's `speculate` method (None for off)."""
    if method == "off":
        return None
    if method == "ngram":
        return NgramProposer()
    if method == "suffix":
        return SuffixProposer(index if index is not None else SuffixIndex())
    raise ValueError(f"unknown speculation method {method!r} (off, ngram, suffix)")
