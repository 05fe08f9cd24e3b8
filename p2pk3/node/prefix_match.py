"""The entry side of the prefix cache: block hashes, what the stages of the route hold, where a request
starts, and what each prefill chunk asks the stages to keep (the stage side: p2pk3/model/prefix_cache.py).

**Hashes.** A prompt is cut into blocks of B tokens; block b's key is the hash of block b - 1's key and
block b's tokens (the first block's parent is a root that names the model and B), so one key names a
whole prefix. The end of a prompt inside a block is a point too: the hash of the last boundary's key and
the tokens after it (a tail).

**Matching.** Every stage reports the points it can resume at (`on_report`: added, evicted; a stage with
no attention layer holds everything). A request starts at the longest point of its prompt that every
slot of the route holds, leaving at least one token to compute; its first segment names it (`prefix`), and
a stage that no longer holds it answers `prefix_miss`: the entry forgets that point and starts the
session again, at a new epoch, from the next longest point (or position 0) — a wrong answer is never
possible, a miss costs one retry. A holder that changed (a takeover) reports an empty cache first.

**What stages keep.** Every full block of a prompt (its MLA rows, shared by reference), and KDA
snapshots sparsely: at the prompt's end (its last position but one: a request computes at least one
token, so this is where the same prompt or a longer one starts), at the last boundary before it, and
every `snapshot_every`-th block. A prefill chunk is cut to end at the next such point, so the stage takes the snapshot at the end
of a forward (a chunk is one call of the KDA kernel, which keeps only its final state).
"""

from __future__ import annotations

import array
import hashlib
from typing import Sequence

from p2pk3.transport.messages import Keep

DEFAULT_BLOCK = 64
MAX_TAIL_PARENTS = 1 << 16  # boundaries whose tails the entry remembers (the least recent forgotten)
DEFAULT_SNAPSHOT_EVERY = 16  # k: a KDA snapshot every k-th block (docs/benchmarks.md, "Prefix cache": k measured)


def chain_key(parent: str, tokens: Sequence[int]) -> str:
    h = hashlib.blake2b(parent.encode(), digest_size=16)
    h.update(array.array("q", tokens).tobytes())
    return h.hexdigest()


def root_key(model: str, block: int) -> str:
    return hashlib.blake2b(f"p2pk3-prefix|{model}|{block}".encode(), digest_size=16).hexdigest()


class PrefixMatcher:
    def __init__(
        self, slots: Sequence[str], *, block: int = DEFAULT_BLOCK, snapshot_every: int = DEFAULT_SNAPSHOT_EVERY, model=""
    ):
        if block < 1 or snapshot_every < 1:
            raise ValueError(f"prefix block ({block}) and snapshot_every ({snapshot_every}) must be >= 1")
        self.slots = list(slots)  # the route: every slot must hold a point for a request to start there
        self.B, self.k = block, snapshot_every
        self.root = root_key(model, block)
        self.held: dict[str, set[str]] = {s: set() for s in self.slots}
        self.stateless: set[str] = set()
        self.holders: dict[str, str] = {}
        self.tails: dict[str, set[int]] = {}  # boundary key -> tail positions asked for under it (oldest first)
        self.kept: dict[str, Keep] = {}  # finished sessions -> what the stages keep of their generated part
        self.hit_tokens = self.miss_tokens = 0  # prompt tokens started from the cache / computed
        self.misses = 0  # prefix_miss answers

    # ------------------------------------------------------------------ reports from the stages
    def on_report(self, slot: str, holder: str, added, evicted, *, reset: bool = False, stateless: bool = False):
        if slot not in self.held:
            return
        if reset or self.holders.get(slot) != holder:
            self.held[slot] = set()
        self.holders[slot] = holder
        if stateless:
            self.stateless.add(slot)
        else:
            self.stateless.discard(slot)
        h = self.held[slot]
        h.difference_update(evicted)
        h.update(k for k, _ in added)

    def forget_slot(self, slot: str) -> None:
        """The slot's holder is gone (a takeover comes): nothing of it is held any more."""
        if slot in self.held:
            self.held[slot] = set()
            self.stateless.discard(slot)
            self.holders.pop(slot, None)

    def held_by_all(self, key: str) -> bool:
        return bool(self.slots) and all(s in self.stateless or key in self.held[s] for s in self.slots)

    # ------------------------------------------------------------------ keys of a prompt
    def chain(self, tokens: Sequence[int]) -> list[str]:
        """Keys of the full blocks of `tokens`."""
        keys, parent = [], self.root
        for b in range(len(tokens) // self.B):
            parent = chain_key(parent, tokens[b * self.B : (b + 1) * self.B])
            keys.append(parent)
        return keys

    def _parent(self, chain: list[str], pos: int) -> str:
        m = pos // self.B
        return chain[m - 1] if m else self.root

    def point_key(self, chain: list[str], tokens: Sequence[int], pos: int) -> str:
        if pos % self.B == 0:
            return chain[pos // self.B - 1]
        return chain_key(self._parent(chain, pos), tokens[(pos // self.B) * self.B : pos])

    def match(self, tokens: Sequence[int], chain: list[str]) -> tuple[int, str | None]:
        """(position, key) of the longest point of `tokens` every slot holds, at most len - 1; (0, None)."""
        limit = len(tokens) - 1
        for m in range(min(len(chain), limit // self.B), -1, -1):
            parent = chain[m - 1] if m else self.root
            for q in sorted(self.tails.get(parent, ()), reverse=True):
                if q <= limit:
                    key = chain_key(parent, tokens[m * self.B : q])
                    if self.held_by_all(key):
                        return q, key
            if m and self.held_by_all(chain[m - 1]):
                return m * self.B, chain[m - 1]
        return 0, None

    def snapshot_points(self, prompt_len: int) -> list[int]:
        """Where a prompt of this length asks for KDA snapshots, in order: its end (the last position a
        request can start at: prompt_len - 1, so that the same prompt again, and any longer one, finds it),
        the last boundary before that, and every k-th boundary."""
        end = prompt_len - 1
        pts = {end, ((end - 1) // self.B) * self.B}
        pts.update(range(self.k * self.B, end, self.k * self.B))
        return sorted(p for p in pts if p > 0)

    # ------------------------------------------------------------------ sessions
    def begin(self, s) -> None:
        """A new session (an entry.Session): its keys, and where it starts."""
        s.chain = self.chain(s.tokens[: s.prompt_len])
        s.snap_points = self.snapshot_points(s.prompt_len)
        self.restart(s)

    def restart(self, s) -> None:
        """Start (again) at the longest point every slot holds. None for scoring (every position's logits) and
        for prompt logprobs (the prompt's rows must be computed); a grammar and the frequency / presence
        penalties read only the output, and the repetition penalty's prompt ids travel in the first segment
        (`Segment.history`), so those sessions start at a cached prefix like any other."""
        skip = s.want_logits or s.params.prompt_logprobs is not None
        pos, key = (0, None) if skip else self.match(s.tokens[: s.prompt_len], s.chain)
        s.sent, s.cached, s.prefix = pos, pos, key

    def missed(self, s) -> None:
        """A stage answered prefix_miss for the point `s` started at: no slot is trusted with it any more."""
        self.misses += 1
        for h in self.held.values():
            h.discard(s.prefix)
        self.restart(s)

    def cut(self, s, n: int) -> tuple[int, dict]:
        """A prefill chunk of `s` from s.sent of at most n tokens -> (its length, the segment's prefix fields):
        cut at the next snapshot point; the keys of the boundaries it completes; the snapshot it asks for."""
        start = s.sent
        fields: dict = {}
        if start == s.cached and s.prefix is not None:
            fields["prefix"] = s.prefix
        if start >= s.prompt_len:
            return n, fields
        nxt = next((p for p in s.snap_points if p > start), s.prompt_len)
        n = min(n, nxt - start)
        end = start + n
        fields["blocks"] = tuple(s.chain[start // self.B : end // self.B])
        if end in s.snap_points:
            key = self.point_key(s.chain, s.tokens, end)
            fields["snap"] = key
            if end % self.B:
                self._add_tail(self._parent(s.chain, end), end)
        return n, fields

    def finished(self, s) -> None:
        """`s` ended after decoding: the stages keep what it generated too (a chat's or an agent's next
        prompt repeats the reply), registered before they free it (`take_kept`: the free frame's `keep`)."""
        if s.want_logits or s.sent <= s.prompt_len or s.sent > len(s.tokens):
            return
        toks = s.tokens[: s.sent]
        chain = list(s.chain)
        for b in range(len(chain), s.sent // self.B):
            chain.append(chain_key(chain[-1] if chain else self.root, toks[b * self.B : (b + 1) * self.B]))
        start = s.prompt_len
        snap = self.point_key(chain, toks, s.sent)
        if s.sent % self.B:
            self._add_tail(self._parent(chain, s.sent), s.sent)
        self.kept[s.id] = Keep(start, s.sent - start, tuple(chain[start // self.B : s.sent // self.B]), snap)

    def take_kept(self, sessions: list[str]) -> dict:
        return {sid: self.kept.pop(sid) for sid in sessions if sid in self.kept}

    def _add_tail(self, parent: str, pos: int) -> None:
        t = self.tails.pop(parent, set())
        t.add(pos)
        self.tails[parent] = t  # most recent last
        while len(self.tails) > MAX_TAIL_PARENTS:
            self.tails.pop(next(iter(self.tails)))

    def account(self, s) -> None:
        """A prompt done: its cached and computed tokens into the totals."""
        self.hit_tokens += s.cached
        self.miss_tokens += s.prompt_len - s.cached

    def status(self) -> dict:
        total = self.hit_tokens + self.miss_tokens
        return {
            "block": self.B,
            "snapshot_every": self.k,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "hit_rate": self.hit_tokens / total if total else None,
            "misses": self.misses,
            "points": {s: len(h) for s, h in self.held.items()},
        }
