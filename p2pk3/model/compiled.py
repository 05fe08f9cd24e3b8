"""The compiled decode step of a stage: `torch.compile` of the same layer code the eager forward runs, for
batches whose spans are all one token (decode), captured as CUDA graphs on a GPU.

Static shapes per bucket: one graph per (batch size, block-table width rounded up to a power of two); the
per-step facts (each span's KDA state row, its MLA cache row, block table and length) travel as index
tensors built outside the graph, so a graph serves every step of that bucket (no recompilation as the
sequences grow, no host sync inside). Prefill, mixed and verify batches run eager.

Exact against eager up to float rounding (tests/test_compiled.py: <= 1e-5 relative logits, the same
greedy tokens). Anything that keeps a graph from being built (an unsupported op, a graph break under
`fullgraph=True`, no compiler for the host) falls back to eager for that stage, once, with a log line that
says why. Inductor's caches (on by default, under TORCHINDUCTOR_CACHE_DIR) make a restart recompile
from cache.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from .batch import Batch

log = logging.getLogger("p2pk3.compile")

RECOMPILE_LIMIT = 64  # graphs per stage: batch sizes x block-table widths (dynamo's default, 8, is too few)


def default_compile(device: str | torch.device) -> bool:
    """Whether a stage compiles its decode step unless told: on CUDA yes (CUDA graphs remove the launch cost of
    the ~hundreds of small ops per layer); on the CPU no (measured in docs/benchmarks.md, "issue 22": the tiny
    and small checkpoints decode no faster compiled, and the start-up pays the compile).
    P2PK3_COMPILE=1/0 overrides."""
    env = os.environ.get("P2PK3_COMPILE")
    if env is not None:
        return env not in ("0", "", "false", "no")
    return torch.device(device).type == "cuda"


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class CompiledDecode:
    """The decode step of one stage, compiled; `run(batch, ...)` or None when this batch runs eager."""

    def __init__(self, stage, step: Callable, cuda_graphs: bool | None = None):
        self.stage = stage
        self.cuda = stage.device.type == "cuda"
        self.cuda_graphs = self.cuda if cuda_graphs is None else cuda_graphs
        self.failed: str | None = None  # why this stage runs eager from now on
        self.compile_s: dict[tuple, float] = {}  # bucket -> seconds of its first call (the compile)
        dyn = torch._dynamo.config
        if getattr(dyn, "recompile_limit", 0) < RECOMPILE_LIMIT:
            dyn.recompile_limit = RECOMPILE_LIMIT
        mode = "reduce-overhead" if self.cuda_graphs else None
        self.fn = torch.compile(step, fullgraph=True, dynamic=False, mode=mode)
        self._static: set[int] = set()

    def prepare(self, batch: Batch) -> tuple:
        """Fill the batch's index tensors outside the graph; the bucket key."""
        cache = batch.cache
        batch.rows  # noqa: B018 (memoised on the batch)
        batch.verify  # noqa: B018
        width = 0
        if cache.mla_kv:
            bt = cache.block_table(batch.spans, batch.device)
            width = _bucket(bt.shape[1])
            if width != bt.shape[1]:
                bt = torch.nn.functional.pad(bt, (0, width - bt.shape[1]))
            batch.memo("bt", lambda: bt)
            batch.memo("lens", lambda: torch.tensor([s.start + 1 for s in batch.spans], dtype=torch.int32,
                                                    device=batch.device))
            batch.memo("token_rows", lambda: cache.token_rows(batch.spans, batch.device))
        if self.cuda_graphs:  # the cache pools are mutated in place by the graph: fixed addresses
            for t in (*cache.kda_state.values(), *cache.conv_state.values(), *cache.mla_kv.values()):
                if id(t) not in self._static:
                    torch._dynamo.mark_static_address(t)
                    self._static.add(id(t))
        return len(batch.spans), width

    def run(self, batch: Batch, *args):
        """The compiled step's output for this decode batch, or None (the caller runs eager)."""
        if self.failed:
            return None
        key = self.prepare(batch)
        first = key not in self.compile_s
        t0 = time.perf_counter()
        try:
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = self.fn(batch, *args)
        except Exception as e:  # noqa: BLE001 (any compiler failure: run eager, say why)
            if not first:
                raise
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            log.warning("stage %s: compiled decode off, running eager (%s)", self.stage.plan.layers, self.failed)
            return None
        if first:
            self.compile_s[key] = time.perf_counter() - t0
            log.info("stage %s: decode graph for batch %d, block width %d compiled in %.1f s%s",
                     self.stage.plan.layers, key[0], key[1], self.compile_s[key],
                     " (CUDA graphs)" if self.cuda_graphs else "")
        if self.cuda_graphs:  # a graph's outputs are overwritten by its next replay
            out = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
        return out
