"""`Batch`: what the layers of `p2pk3.model.kimi_k3` know about a packed batch of token spans from many
sessions (offsets, which spans are decode steps or verify spans, the cache rows), computed once per
stage forward and shared by every layer. Below the model file, so that the layers and the stage that
builds the batch (`p2pk3.model.stage`) both import it without a cycle."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import Span, StageCache


@dataclass
class Batch:
    """Everything the layers need to know about a packed batch of spans."""

    spans: list[Span]
    cache: StageCache
    device: torch.device
    cu_seqlens: list[int] = field(init=False)
    decode: bool = field(init=False)  # every span is exactly one token

    def __post_init__(self) -> None:
        cu = [0]
        for s in self.spans:
            cu.append(cu[-1] + s.length)
        self.cu_seqlens = cu
        self.decode = all(s.length == 1 for s in self.spans)
        self._memo: dict[str, torch.Tensor] = {}

    def memo(self, key: str, fn) -> torch.Tensor:
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    @property
    def rows(self) -> torch.Tensor:
        """[len(spans)] long: each span's session row in the KDA state pools."""
        return self.memo("rows", lambda: self.cache.rows(self.spans, self.device))

    @property
    def parts(self) -> tuple[list[int], list[int]] | None:
        """For a batch that mixes one-token spans (decode steps) with longer ones (prefill chunks, verify
        spans): (indices of the one-token spans, indices of the others), so that each group takes its own
        fast path; None when the batch is all one kind."""
        if not hasattr(self, "_parts"):
            one = [i for i, s in enumerate(self.spans) if s.length == 1]
            self._parts = (
                (one, [i for i in range(len(self.spans)) if self.spans[i].length != 1])
                if one and len(one) < len(self.spans)
                else None
            )
        return self._parts

    def sub(self, idx: list[int]) -> "Batch":
        """The batch of just these spans (their token rows are `token_index(idx)` of this one)."""
        return Batch([self.spans[i] for i in idx], self.cache, self.device)

    def token_index(self, idx: list[int]) -> torch.Tensor:
        cu = self.cu_seqlens
        return torch.tensor([t for i in idx for t in range(cu[i], cu[i + 1])], dtype=torch.long, device=self.device)

    @property
    def verify(self) -> list[int]:
        """Indices of the verify spans (speculative decoding), whose layers keep a rollback checkpoint."""
        if not hasattr(self, "_verify"):
            self._verify = [i for i, s in enumerate(self.spans) if s.verify]
        return self._verify
