"""The stage side of the prefix cache: what one stage keeps of finished prompts, for its own layers, so that
a later request that starts with the same tokens computes only what is new.

**Points.** A prompt is cut into blocks of B tokens (B = the MLA cache's block size, `--prefix-block`). A
*point* is a position p named by the chained hash of the tokens before it (computed at the entry,
p2pk3/node/prefix_match.py; a stage never sees tokens): every block boundary p = b * B, and a prompt's
end inside a block (a *tail*). Each point the stage keeps is a `Node` of a tree (its parent: the boundary
at or below p - 1, rounded down to a block; the root is position 0):

* a block node holds one reference to the MLA block of positions [p - B, p) of every MLA layer: the very
  block the session that computed it wrote, shared read-only from then on (`StageCache.refs`);
* a tail node holds its own copy of the partly filled block [B * (p // B), p) (the session that computed
  it goes on writing its own); a session that starts at a tail gets a copy of that copy (copy-on-write at
  the first divergent block);
* a node may hold a snapshot of the KDA recurrent and short-conv state after position p - 1. The entry
  asks for snapshots sparsely (the end of each prompt, the last boundary before it, every k-th block).

A point is *resumable* when a session can start there: its node has a snapshot, or the stage has no KDA
layer. `attach` starts a session there (or raises `PrefixMiss`); `insert` registers what a prefill
chunk computed. What becomes resumable or stops being so is queued in `added` / `evicted` for the entry.

**Memory.** The device tier holds at most `budget` bytes (blocks and snapshots); beyond it, the least
recently used node without children on the device leaves it: into the host tier when there is one
(`host_budget` > 0: its block and snapshot copied to host memory, pinned and asynchronous on CUDA; on a
CPU-only host the same code copies into a separate pool of tensors), else out of the cache. A hit on a
host node copies it back. The host tier evicts its least recently used leaves. When sessions need MLA
blocks the pool lacks, the cache gives back blocks only it holds (`StageCache.reclaim`).
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field

import torch

from .cache import SessionError, StageCache


class PrefixMiss(SessionError):
    """A request named a prefix this stage does not hold (evicted, or never cached here): the entry starts
    the session again at a shorter prefix, or at position 0."""


def stage_namespace(model: str, formats: str, layers: str, dtype: str, block: int) -> str:
    """What makes one stage's cached state valid: the model, its weight formats, the stage's layers, the
    activation dtype and the block size. Part of every key this stage stores."""
    h = hashlib.blake2b(f"{model}|{formats}|{layers}|{dtype}|{block}".encode(), digest_size=8)
    return h.hexdigest()


@dataclass
class Snapshot:
    """KDA recurrent state [H, K, K] and short-conv history [3C, conv - 1] of every KDA layer of the stage."""

    state: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.state.values(), *self.conv.values()))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory: pinned and asynchronous from a GPU (the stream orders it before any
    later write of the source); a fresh tensor of the host pool on the CPU."""
    if t.device.type == "cuda":
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        return h
    return t.clone()


def to_device(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    return h.to(device, non_blocking=True) if device.type == "cuda" else h.clone()


@dataclass(eq=False)
class Node:
    key: str
    pos: int
    parent: "Node | None"
    tail: bool = False
    block: int | None = None  # its MLA block in the device pool (device tier)
    host_block: dict[int, torch.Tensor] | None = None  # the block's rows per MLA layer (host tier)
    snap: Snapshot | None = None
    children: dict[str, "Node"] = field(default_factory=dict)
    tier: str = "device"

    def path(self) -> list["Node"]:
        """The nodes from the first block down to this one (the root left out)."""
        out, n = [], self
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        return out[::-1]


@dataclass
class PrefixStats:
    hits: int = 0
    hit_tokens: int = 0
    misses: int = 0
    cold: int = 0  # sessions opened at position 0
    inserted: int = 0
    to_host: int = 0  # moved from the device tier to the host tier
    from_host: int = 0  # brought back on a hit
    evictions: int = 0  # left the cache


class PrefixCache:
    def __init__(self, cache: StageCache, *, budget: int, host_budget: int = 0, namespace: str = ""):
        self.cache = cache
        self.budget, self.host_budget = int(budget), int(host_budget)
        self.namespace = namespace
        self.kda, self.mla = bool(cache.kda_state), bool(cache.mla_kv)
        self.B = cache.block_size
        pools = [*cache.mla_kv.values(), *cache.kda_state.values()]
        self.device = pools[0].device if pools else torch.device("cpu")
        self.root = Node("", 0, None)
        self.nodes: collections.OrderedDict[str, Node] = collections.OrderedDict()  # least recently used first
        self.chains: dict[str, list[str]] = {}  # session -> keys of its blocks 0, 1, ...
        self.device_bytes = self.host_bytes = 0
        self.added: list[tuple[str, int]] = []
        self.evicted: list[str] = []
        self.stats = PrefixStats()
        self._busy: set[str] = set()  # nodes being attached or inserted: not evicted meanwhile
        cache.reclaim = self._reclaim

    @property
    def stateless(self) -> bool:
        """No attention layer on this stage: it can start a session at any position."""
        return not (self.kda or self.mla)

    def _k(self, key: str) -> str:
        """The key a point is stored under: the entry's chained hash within this stage's namespace."""
        return f"{self.namespace}:{key}" if self.namespace else key

    @staticmethod
    def _ext(key: str) -> str:
        """The entry's hash of a stored key (what reports name)."""
        return key.rsplit(":", 1)[-1]

    def resumable(self, node: Node) -> bool:
        return node.snap is not None or not self.kda

    def holds(self, key: str) -> bool:
        n = self.nodes.get(self._k(key))
        return self.stateless or (n is not None and self.resumable(n))

    # ------------------------------------------------------------------ starting a session at a point
    def attach(self, session: str, key: str, pos: int) -> None:
        """Start `session` (opened, empty) at the point `key` of `pos` tokens: its MLA blocks shared from the
        cache (a tail block copied), its KDA rows restored. PrefixMiss when the stage does not hold it."""
        sc = self.cache.get(session)
        if self.stateless:
            sc.length = pos
            self.stats.hits += 1
            self.stats.hit_tokens += pos
            return
        node = self.nodes.get(self._k(key))
        if node is None or node.pos != pos or not self.resumable(node):
            self.stats.misses += 1
            raise PrefixMiss(
                f"prefix_miss: this stage holds no prefix {key[:16]} of {pos} tokens (evicted, or never "
                f"cached here); the entry starts the session at a shorter prefix"
            )
        path = node.path()
        self._busy = {n.key for n in path}
        try:
            for n in path:
                self._touch(n)
                if n.tier == "host":
                    self._bring_back(n)
            blocks = []
            if self.mla:
                if node.tail:
                    b = self.cache.take_block()
                    self.cache.copy_block(node.block, b)
                    blocks = [n.block for n in path[:-1]] + [b]
                else:
                    blocks = [n.block for n in path]
                for b in blocks[: len(blocks) - node.tail]:
                    self.cache.share(b)
            self._fit()
        finally:
            self._busy = set()
        sc.blocks, sc.length, sc.ckpt = blocks, pos, None
        if self.kda:
            for i, t in node.snap.state.items():
                self.cache.kda_state[i][sc.row].copy_(t)
                self.cache.conv_state[i][sc.row].copy_(node.snap.conv[i])
        self.chains[session] = [n.key for n in path if not n.tail]
        self.stats.hits += 1
        self.stats.hit_tokens += pos

    def forget(self, session: str) -> None:
        """The session ended: its blocks stay cached (the nodes hold their own references); a hit that
        brought more back than the budget allows gives the excess back now."""
        self.chains.pop(session, None)
        self._fit()

    # ------------------------------------------------------------------ registering what a chunk computed
    def insert(self, session: str, start: int, n: int, blocks: list[str], snap: str | None) -> None:
        """After a forward of `session`'s positions start .. start + n - 1: `blocks` are the keys of the block
        boundaries in (start, start + n], `snap` the key of the end point when the entry wants a snapshot
        there. A session whose earlier blocks were not registered (started without keys) is left alone."""
        if self.stateless or self.budget <= 0:
            return
        B, sc = self.B, self.cache.get(session)
        end = start + n
        chain = self.chains.setdefault(session, [])
        if len(chain) != start // B or len(blocks) != end // B - start // B:
            return
        chain.extend(self._k(k) for k in blocks)
        self._busy = set(chain)
        try:
            parent = self._ensure(sc, chain, end // B)
            if snap is not None:
                self._snapshot(sc, chain, parent, end, self._k(snap))
            self._fit()
        finally:
            self._busy = set()

    def _ensure(self, sc, chain: list[str], upto: int) -> Node:
        """Nodes for the session's blocks 0 .. upto - 1 (made from its own blocks where missing; a host node
        it holds the block of comes back to the device on that block). Returns the last one (or the root)."""
        parent = self.root
        for b in range(upto):
            key = chain[b]
            node = self.nodes.get(key)
            if node is None:
                node = Node(key, (b + 1) * self.B, parent)
                if self.mla:
                    node.block = sc.blocks[b]
                    self.cache.share(node.block)
                    self.device_bytes += self.cache.block_bytes()
                parent.children[key] = node
                self.nodes[key] = node
                self.stats.inserted += 1
                if not self.kda:
                    self.added.append((self._ext(key), node.pos))
            else:
                if node.tier == "host":
                    self._promote(node, sc.blocks[b] if self.mla else None)
                if not self.kda:  # said again: an entry that started after the first report learns it
                    self.added.append((self._ext(key), node.pos))
            self._touch(node)
            parent = node
        return parent

    def _snapshot(self, sc, chain: list[str], parent: Node, end: int, key: str) -> None:
        if end % self.B == 0:
            node = self.nodes.get(chain[end // self.B - 1])
            if node is None or node.key != key:
                return
        else:
            node = self.nodes.get(key)
            if node is None:
                node = Node(key, end, parent, tail=True)
                if self.mla:
                    node.block = self.cache.take_block()
                    self.cache.copy_block(sc.blocks[end // self.B], node.block)
                    self.device_bytes += self.cache.block_bytes()
                parent.children[key] = node
                self.nodes[key] = node
                self.stats.inserted += 1
            elif node.tier == "host":
                self._bring_back(node)
        self._touch(node)
        if self.kda and node.snap is None:
            node.snap = Snapshot(
                {i: t[sc.row].clone() for i, t in self.cache.kda_state.items()},
                {i: t[sc.row].clone() for i, t in self.cache.conv_state.items()},
            )
            self.device_bytes += node.snap.bytes()
        if self.resumable(node):  # (again when it was: an entry that started since learns it)
            self.added.append((self._ext(node.key), node.pos))

    # ------------------------------------------------------------------ tiers
    def _touch(self, node: Node) -> None:
        self.nodes.move_to_end(node.key)

    def _node_bytes(self, node: Node) -> int:
        return (self.cache.block_bytes() if node.block is not None or node.host_block else 0) + (
            node.snap.bytes() if node.snap else 0
        )

    def _bring_back(self, node: Node) -> None:
        """A host node back to the device (its block into a pool block, its snapshot onto the device)."""
        dev = self.device
        if node.host_block is not None:
            node.block = self.cache.take_block()
            for i, h in node.host_block.items():
                self.cache.mla_kv[i][node.block].copy_(to_device(h, dev))
            node.host_block = None
        if node.snap is not None:
            node.snap = Snapshot(
                {i: to_device(t, dev) for i, t in node.snap.state.items()},
                {i: to_device(t, dev) for i, t in node.snap.conv.items()},
            )
        b = self._node_bytes(node)
        self.host_bytes -= b
        self.device_bytes += b
        node.tier = "device"
        self.stats.from_host += 1

    def _promote(self, node: Node, block: int | None) -> None:
        """A host node whose block a live session holds on the device: share that block again."""
        if block is not None:
            node.host_block = None
            node.block = block
            self.cache.share(block)
        b = self._node_bytes(node)
        if node.snap is not None:
            dev = self.device
            node.snap = Snapshot(
                {i: to_device(t, dev) for i, t in node.snap.state.items()},
                {i: to_device(t, dev) for i, t in node.snap.conv.items()},
            )
        self.host_bytes -= b
        self.device_bytes += b
        node.tier = "device"
        self.stats.from_host += 1

    def _demote(self, node: Node) -> None:
        """A device leaf leaves the device: into the host tier when it fits there, else out of the cache."""
        b = self._node_bytes(node)
        if b > self.host_budget:
            self._drop(node)
            return
        if node.block is not None:
            node.host_block = {i: to_host(t[node.block]) for i, t in self.cache.mla_kv.items()}
            self.cache.unref(node.block)
            node.block = None
        if node.snap is not None:
            node.snap = Snapshot(
                {i: to_host(t) for i, t in node.snap.state.items()}, {i: to_host(t) for i, t in node.snap.conv.items()}
            )
        node.tier = "host"
        self.device_bytes -= b
        self.host_bytes += b
        self.stats.to_host += 1
        while self.host_bytes > self.host_budget:
            leaf = next(
                (
                    n
                    for n in self.nodes.values()
                    if n.tier == "host" and not n.children and n is not node and n.key not in self._busy
                ),
                None,
            )
            if leaf is None:
                break
            self._drop(leaf)

    def _drop(self, node: Node) -> None:
        """Out of the cache, with everything below it."""
        for c in list(node.children.values()):
            self._drop(c)
        b = self._node_bytes(node)
        if node.tier == "device":
            self.device_bytes -= b
            if node.block is not None:
                self.cache.unref(node.block)
        else:
            self.host_bytes -= b
        if self.resumable(node):
            self.evicted.append(self._ext(node.key))
        node.parent.children.pop(node.key, None)
        del self.nodes[node.key]
        self.stats.evictions += 1

    def _device_leaf(self, only_held: bool) -> Node | None:
        """The least recently used device node with no child on the device (and, when `only_held`, whose
        block nobody but the cache holds)."""
        for n in self.nodes.values():
            if n.tier != "device" or n.key in self._busy:
                continue
            if any(c.tier == "device" for c in n.children.values()):
                continue
            if only_held and (n.block is None or self.cache.refs[n.block] != 1):
                continue
            return n
        return None

    def _fit(self) -> None:
        while self.device_bytes > self.budget:
            n = self._device_leaf(False)
            if n is None:
                return
            self._demote(n)

    def _reclaim(self, blocks: int) -> None:
        freed = 0
        while freed < blocks:
            n = self._device_leaf(True)
            if n is None:
                return
            self._demote(n)
            freed += 1

    def clear(self) -> None:
        for n in list(self.root.children.values()):
            self._drop(n)

    # ------------------------------------------------------------------ for the entry and the status
    def take_report(self) -> tuple[list[tuple[str, int]], list[str]]:
        """(points that became resumable, points that stopped being so) since the last call."""
        a, self.added = self.added, []
        e, self.evicted = self.evicted, []
        return a, e

    def status(self) -> dict:
        s = self.stats
        return {
            "block": self.B,
            "budget_bytes": self.budget,
            "host_budget_bytes": self.host_budget,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "points": len(self.nodes),
            "hits": s.hits,
            "hit_tokens": s.hit_tokens,
            "misses": s.misses,
            "hit_rate": s.hits / (s.hits + s.misses + s.cold) if s.hits + s.misses + s.cold else None,
            "to_host": s.to_host,
            "from_host": s.from_host,
            "evictions": s.evictions,
        }
