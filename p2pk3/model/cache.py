"""Per-session state of one stage: KDA recurrent + short-conv state and the paged MLA latent cache.

Memory is allocated once, up front, from the stage's budget: `max_sessions` KDA state slots and
`max_tokens` worth of MLA cache blocks shared by all sessions. When either runs out, `CacheFull` is raised
and the caller answers "busy" — never an out-of-memory in the middle of a forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class CacheFull(RuntimeError):
    """No room for another session (or for more tokens of this one) on this stage."""


class SessionError(KeyError):
    """Unknown session, or a segment that does not continue the session where it stands."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text
        return str(self.args[0]) if self.args else ""


@dataclass
class SessionCache:
    slot: int  # KDA state slot
    blocks: list[int] = field(default_factory=list)  # MLA cache blocks, in position order
    length: int = 0  # tokens already in the cache


@dataclass
class Segment:
    """A contiguous run of tokens of one session inside a packed batch."""

    session: str
    start: int  # position of the first token (= tokens the session already has on this stage)
    length: int


class StageCache:
    def __init__(self, *, kda_layers: list[int], mla_layers: list[int], kda_heads: int, kda_head_dim: int,
                 conv_channels: int, conv_size: int, mla_width: int, max_sessions: int, max_tokens: int,
                 block_size: int = 64, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.max_sessions = max_sessions
        self.block_size = block_size
        # max_tokens across all sessions, plus one partly filled block per session
        self.num_blocks = (max_tokens + block_size - 1) // block_size + max_sessions if mla_layers else 0
        K = kda_head_dim
        # KDA: state pool [S, H, K, V] fp32 and the last (conv_size - 1) pre-conv inputs of q, k, v.
        self.kda_state = {i: torch.zeros(max_sessions, kda_heads, K, K, dtype=torch.float32, device=device) for i in kda_layers}
        self.conv_state = {i: torch.zeros(max_sessions, conv_channels, conv_size - 1, dtype=torch.float32, device=device)
                           for i in kda_layers}
        # MLA: one paged pool per layer, all indexed by the same per-session block list.
        self.mla_kv = {i: torch.zeros(self.num_blocks, block_size, mla_width, dtype=dtype, device=device) for i in mla_layers}
        self.sessions: dict[str, SessionCache] = {}
        self._free_slots = list(range(max_sessions - 1, -1, -1))
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))

    # ------------------------------------------------------------------ bookkeeping
    def bytes(self) -> int:
        ts = [*self.kda_state.values(), *self.conv_state.values(), *self.mla_kv.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    def has(self, session: str) -> bool:
        return session in self.sessions

    def open(self, session: str) -> SessionCache:
        if session in self.sessions:
            raise SessionError(f"session {session!r} is already open on this stage")
        if not self._free_slots:
            raise CacheFull(f"busy: all {self.max_sessions} session slots of this stage are in use")
        slot = self._free_slots.pop()
        for t in self.kda_state.values():
            t[slot].zero_()
        for t in self.conv_state.values():
            t[slot].zero_()
        sc = self.sessions[session] = SessionCache(slot=slot)
        return sc

    def free(self, session: str) -> None:
        sc = self.sessions.pop(session, None)
        if sc is None:
            raise SessionError(f"unknown session {session!r}")
        self._free_slots.append(sc.slot)
        self._free_blocks.extend(reversed(sc.blocks))

    def get(self, session: str) -> SessionCache:
        try:
            return self.sessions[session]
        except KeyError:
            raise SessionError(f"unknown session {session!r} on this stage") from None

    def reserve(self, segments: list[Segment]) -> None:
        """Check positions and make room for every segment before anything is computed (all or nothing)."""
        need = 0
        for seg in segments:
            sc = self.get(seg.session)
            if seg.start != sc.length:
                raise SessionError(f"session {seg.session!r}: segment starts at position {seg.start} "
                                   f"but the stage holds {sc.length} tokens")
            if self.mla_kv:
                need += max(0, -(-(sc.length + seg.length) // self.block_size) - len(sc.blocks))
        if need > len(self._free_blocks):
            raise CacheFull(f"busy: MLA cache needs {need} more blocks, {len(self._free_blocks)} free")
        if self.mla_kv:
            for seg in segments:
                sc = self.sessions[seg.session]
                while len(sc.blocks) * self.block_size < sc.length + seg.length:
                    sc.blocks.append(self._free_blocks.pop())

    def commit(self, segments: list[Segment]) -> None:
        for seg in segments:
            self.sessions[seg.session].length += seg.length

    # ------------------------------------------------------------------ views for the layers
    def slots(self, segments: list[Segment], device) -> torch.Tensor:
        return torch.tensor([self.sessions[s.session].slot for s in segments], dtype=torch.long, device=device)

    def block_table(self, segments: list[Segment], device) -> torch.Tensor:
        width = max(1, max(len(self.sessions[s.session].blocks) for s in segments))
        bt = torch.zeros(len(segments), width, dtype=torch.int32)
        for i, s in enumerate(segments):
            b = self.sessions[s.session].blocks
            bt[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        return bt.to(device)

    def token_rows(self, segments: list[Segment], device) -> torch.Tensor:
        """Flat row index (block * block_size + offset) of each new token in the MLA pools."""
        rows = []
        bs = self.block_size
        for s in segments:
            b = torch.tensor(self.sessions[s.session].blocks, dtype=torch.long)
            p = torch.arange(s.start, s.start + s.length)
            rows.append(b[p // bs] * bs + p % bs)
        return torch.cat(rows).to(device)
