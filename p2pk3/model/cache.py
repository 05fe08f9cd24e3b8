"""Per-session state of one stage: KDA recurrent + short-conv state and the paged MLA latent cache.

Memory is allocated once, up front, from the stage's budget: `max_sessions` rows of the KDA state pools
(one row per open session) and `max_tokens` worth of MLA cache blocks shared by all sessions. When either runs out, `CacheFull` is raised
and the caller answers "busy" — never an out-of-memory in the middle of a forward.

The byte sizes of these pools are defined once, in p2pk3/model/cache_sizes.py beside this module (torch-free,
so the planner and `topology check` can use them without loading torch): `StageCache` allocates with them and
the memory estimators (p2pk3/topology/sizing.py, the planner's table in p2pk3/plan/memory.py) call
`kda_session_bytes` and `mla_pool_bytes` (tests/test_sizing.py: estimate = allocation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache_sizes import DEFAULT_BLOCK_SIZE, KDA_STATE_DTYPE_NAME, mla_blocks

KDA_STATE_DTYPE = getattr(torch, KDA_STATE_DTYPE_NAME)  # recurrent state and short-conv history


class CacheFull(RuntimeError):
    """No room for another session (or for more tokens of this one) on this stage."""


class SessionError(KeyError):
    """Unknown session, or a span that does not continue the session where it stands."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text
        return str(self.args[0]) if self.args else ""


class UnknownSession(SessionError):
    """A stage holds no state for the session (freed behind the entry's back, or the stage is new): the
    entry replays it (`lost_state`)."""


@dataclass
class KdaCheckpoint:
    """What one KDA layer needs to undo a verify pass exactly (speculative decoding): its state before the
    pass and the pass's per-position inputs, so that any accepted prefix of the pass can be replayed."""

    state: torch.Tensor  # [H, K, V] fp32 recurrent state before the pass
    conv: torch.Tensor  # [3C, conv_size - 1] fp32 short-conv history before the pass
    pre_conv: torch.Tensor  # [T, 3C] the q | k | v projections (pre-conv inputs) of the pass
    inputs: tuple[torch.Tensor, ...]  # (q, k, v, a, b) of the pass, exactly as the KDA kernel took them


@dataclass
class Checkpoint:
    """A verify pass of `width` tokens from position `start`: the session may be rolled back to any length in
    start .. start + width (the rejected drafts forgotten) until its next span arrives."""

    start: int
    width: int
    kda: dict[int, KdaCheckpoint] = field(default_factory=dict)


@dataclass
class SessionCache:
    row: int  # this session's row in the KDA state pools (`kda_state[layer][row]`, `conv_state[layer][row]`)
    blocks: list[int] = field(default_factory=list)  # MLA cache blocks, in position order
    length: int = 0  # tokens already in the cache
    ckpt: Checkpoint | None = None  # the last verify pass, while it may still be rolled back


@dataclass
class Span:
    """A run of one session's positions inside a packed batch: tokens `start .. start + length - 1`.

    (The wire protocol's `Segment` in p2pk3/transport carries the same run plus the session epoch and the
    sampling state; the stage worker turns each one into a `Span`.)"""

    session: str
    start: int  # position of the first token (= tokens the session already has on this stage)
    length: int
    verify: bool = False  # a verify pass (speculative decoding): keep a rollback checkpoint (Checkpoint)


class StageCache:
    def __init__(
        self,
        *,
        kda_layers: list[int],
        mla_layers: list[int],
        kda_heads: int,
        kda_head_dim: int,
        conv_channels: int,
        conv_size: int,
        mla_width: int,
        max_sessions: int,
        max_tokens: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        prefix_blocks: int = 0,
    ):
        self.max_sessions = max_sessions
        self.block_size = block_size
        # the sessions' blocks, plus `prefix_blocks` more for the prefix cache (p2pk3/model/prefix_cache.py):
        # one pool, so a cached block is shared by reference (`refs`) with the sessions that read it
        self.session_blocks = mla_blocks(max_tokens, max_sessions, block_size) if mla_layers else 0
        self.num_blocks = self.session_blocks + (prefix_blocks if mla_layers else 0)
        self.refs = [0] * self.num_blocks  # holders of each block: sessions and prefix-cache entries
        self.reclaim = None  # callable(n) -> None: the prefix cache gives back up to n blocks (set by it)
        K, sd = kda_head_dim, KDA_STATE_DTYPE
        # KDA: state pool [S, H, K, V] and the last (conv_size - 1) pre-conv inputs of q, k, v (kda_session_bytes)
        self.kda_state = {i: torch.zeros(max_sessions, kda_heads, K, K, dtype=sd, device=device) for i in kda_layers}
        self.conv_state = {
            i: torch.zeros(max_sessions, conv_channels, conv_size - 1, dtype=sd, device=device) for i in kda_layers
        }
        # MLA: one paged pool per layer, all indexed by the same per-session block list.
        # (the prefix cache's blocks are zeroed when first taken, so that a budget not yet used costs no memory)
        self.mla_kv = {
            i: torch.empty(self.num_blocks, block_size, mla_width, dtype=dtype, device=device) for i in mla_layers
        }
        for t in self.mla_kv.values():
            t[: self.session_blocks].zero_()
        self._fresh = bytearray(self.num_blocks - self.session_blocks)  # 1: a prefix block never zeroed yet
        self._fresh[:] = b"\x01" * len(self._fresh)
        self.sessions: dict[str, SessionCache] = {}
        self._free_rows = list(range(max_sessions - 1, -1, -1))
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))

    # ------------------------------------------------------------------ bookkeeping
    def bytes(self) -> int:
        """The sessions' part (what the planner sizes); the prefix cache's blocks are `prefix_pool_bytes`."""
        ts = [*self.kda_state.values(), *self.conv_state.values(), *self.mla_kv.values()]
        return sum(t.numel() * t.element_size() for t in ts) - self.prefix_pool_bytes()

    def block_bytes(self) -> int:
        """One block of every MLA layer of this stage."""
        return sum(t[0].numel() * t.element_size() for t in self.mla_kv.values())

    def prefix_pool_bytes(self) -> int:
        return (self.num_blocks - self.session_blocks) * self.block_bytes()

    # ------------------------------------------------------------------ blocks (shared by reference)
    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def take_block(self) -> int:
        """A free block, held once (CacheFull when none is free even after the prefix cache gave some back)."""
        if not self._free_blocks and self.reclaim is not None:
            self.reclaim(1)
        if not self._free_blocks:
            raise CacheFull("busy: no free MLA cache block")
        return self._pop_block()

    def _pop_block(self) -> int:
        b = self._free_blocks.pop()
        self.refs[b] = 1
        if b >= self.session_blocks and self._fresh[b - self.session_blocks]:
            self._fresh[b - self.session_blocks] = 0
            for t in self.mla_kv.values():
                t[b].zero_()
        return b

    def share(self, block: int) -> None:
        """One more holder of `block` (it is read-only while it has more than one)."""
        self.refs[block] += 1

    def unref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free_blocks.append(block)

    def copy_block(self, src: int, dst: int) -> None:
        for t in self.mla_kv.values():
            t[dst].copy_(t[src])

    def has(self, session: str) -> bool:
        return session in self.sessions

    def open(self, session: str) -> SessionCache:
        if session in self.sessions:
            raise SessionError(f"session {session!r} is already open on this stage")
        if not self._free_rows:
            raise CacheFull(f"busy: all {self.max_sessions} sessions of this stage are in use")
        row = self._free_rows.pop()
        for t in self.kda_state.values():
            t[row].zero_()
        for t in self.conv_state.values():
            t[row].zero_()
        sc = self.sessions[session] = SessionCache(row=row)
        return sc

    def free(self, session: str) -> None:
        sc = self.sessions.pop(session, None)
        if sc is None:
            raise SessionError(f"unknown session {session!r}")
        self._free_rows.append(sc.row)
        for b in reversed(sc.blocks):
            self.unref(b)

    def get(self, session: str) -> SessionCache:
        try:
            return self.sessions[session]
        except KeyError:
            raise UnknownSession(f"unknown session {session!r} on this stage") from None

    def reserve(self, spans: list[Span]) -> None:
        """Check positions and make room for every span before anything is computed (all or nothing)."""
        need = 0
        for sp in spans:
            sc = self.get(sp.session)
            if sp.start != sc.length:
                raise SessionError(
                    f"session {sp.session!r}: span starts at position {sp.start} but the stage holds {sc.length} tokens"
                )
            if self.mla_kv:
                need += max(0, -(-(sc.length + sp.length) // self.block_size) - len(sc.blocks))
        if need > len(self._free_blocks) and self.reclaim is not None:
            self.reclaim(need - len(self._free_blocks))
        if need > len(self._free_blocks):
            raise CacheFull(f"busy: MLA cache needs {need} more blocks, {len(self._free_blocks)} free")
        if self.mla_kv:
            for sp in spans:
                sc = self.sessions[sp.session]
                while len(sc.blocks) * self.block_size < sc.length + sp.length:
                    sc.blocks.append(self._pop_block())
        for sp in spans:  # a new span settles the previous verify pass: keep a checkpoint only for this one
            self.sessions[sp.session].ckpt = Checkpoint(sp.start, sp.length) if sp.verify else None

    # ------------------------------------------------------------------ rollback (speculative decoding)
    def check_rollback(self, session: str, length: int) -> Checkpoint:
        """The checkpoint that lets `session` go back to `length` tokens; SessionError when none does."""
        sc = self.get(session)
        ck = sc.ckpt
        if ck is None or not ck.start <= length <= ck.start + ck.width or sc.length != ck.start + ck.width:
            raise SessionError(
                f"session {session!r}: cannot roll back to position {length} (the stage holds "
                f"{sc.length} tokens"
                + (
                    f", its last verify pass covers {ck.start}..{ck.start + ck.width})"
                    if ck
                    else " and no verify pass)"
                )
            )
        return ck

    def truncate(self, session: str, length: int) -> None:
        """Forget the MLA rows from `length` on (they are overwritten by the next span) and the checkpoint;
        the KDA rows are restored by the model (K3Stage.rollback), which calls this last."""
        sc = self.get(session)
        sc.length = length
        sc.ckpt = None
        while self.mla_kv and len(sc.blocks) * self.block_size >= length + self.block_size:
            self.unref(sc.blocks.pop())

    def checkpoint_bytes(self) -> int:
        """Memory held by rollback checkpoints now (all sessions)."""
        n = 0
        for sc in self.sessions.values():
            for k in sc.ckpt.kda.values() if sc.ckpt else ():
                for t in (k.state, k.conv, k.pre_conv, *k.inputs):
                    n += t.numel() * t.element_size()
        return n

    def commit(self, spans: list[Span]) -> None:
        for sp in spans:
            self.sessions[sp.session].length += sp.length

    # ------------------------------------------------------------------ views for the layers
    def rows(self, spans: list[Span], device) -> torch.Tensor:
        """KDA state-pool row of each span's session, [len(spans)] long."""
        return torch.tensor([self.sessions[s.session].row for s in spans], dtype=torch.long, device=device)

    def block_table(self, spans: list[Span], device) -> torch.Tensor:
        width = max(1, max(len(self.sessions[s.session].blocks) for s in spans))
        bt = torch.zeros(len(spans), width, dtype=torch.int32)
        for i, s in enumerate(spans):
            b = self.sessions[s.session].blocks
            bt[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        return bt.to(device)

    def token_rows(self, spans: list[Span], device) -> torch.Tensor:
        """Flat row index (block * block_size + offset) of each new token in the MLA pools."""
        rows = []
        bs = self.block_size
        for s in spans:
            b = torch.tensor(self.sessions[s.session].blocks, dtype=torch.long)
            p = torch.arange(s.start, s.start + s.length)
            rows.append(b[p // bs] * bs + p % bs)
        return torch.cat(rows).to(device)
