"""The compiled decode step of a stage: `torch.compile` of the same layer code the eager forward runs, for
batches whose spans are all one token (decode), captured as CUDA graphs on a GPU.

Static shapes per bucket: one graph per (batch size, block-table width rounded up to a power of two); the
per-step facts (each span's KDA state row, its MLA cache row, block table and length) travel as index
tensors built outside the graph, so a graph serves every step of that bucket (no recompilation as the
sequences grow, no host sync inside). Prefill, mixed and verify batches run eager.

Exact against eager up to float rounding (tests/test_compiled.py: <= 1e-5 relative logits, the same
greedy tokens). Anything that keeps a graph from being built (an unsupported op, a graph break under
`fullgraph=True`, no compiler for the host) falls back, once, with a log line that says why: on CUDA to
the eager step captured per bucket by `torch.cuda.CUDAGraph` (the kernels are sync-free), else (or when
that capture fails too) to eager for that stage. Inductor's caches (on by default, under TORCHINDUCTOR_CACHE_DIR) make a restart recompile
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
    the tens of small kernels per layer); on the CPU no (docs/benchmarks.md, "issue 22": compiled steps are
    1.3-2.7x faster on the tiny and small checkpoints, but every new batch size compiles its own graph, 15-120 s
    on the dev host while the stage waits). P2PK3_COMPILE=1/0 overrides."""
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
        self.step = step
        self.fn = torch.compile(step, fullgraph=True, dynamic=False, mode=mode)
        self._static: set[int] = set()
        # CUDA, torch.compile failed: the eager step captured per bucket by torch.cuda.CUDAGraph instead
        self.explicit = False
        self._graphs: dict[tuple, tuple] = {}

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
            batch.memo(
                "lens", lambda: torch.tensor([s.start + 1 for s in batch.spans], dtype=torch.int32, device=batch.device)
            )
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
        if self.explicit:
            return self._replay(key, batch, args)
        first = key not in self.compile_s
        t0 = time.perf_counter()
        try:
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = self.fn(batch, *args)
        except Exception as e:  # noqa: BLE001 (any compiler failure: run eager, say why)
            if not first:
                raise
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            if self.cuda and self.cuda_graphs:  # this call runs eager (the warm-up); later ones replay a capture
                self.explicit = True
                log.warning(
                    "stage %s: torch.compile failed (%s); capturing the eager decode step as CUDA graphs",
                    self.stage.plan.layers,
                    why,
                )
                return None
            self.failed = why
            log.warning("stage %s: compiled decode off, running eager (%s)", self.stage.plan.layers, self.failed)
            return None
        if first:
            self.compile_s[key] = time.perf_counter() - t0
            log.info(
                "stage %s: decode graph for batch %d, block width %d compiled in %.1f s%s",
                self.stage.plan.layers,
                key[0],
                key[1],
                self.compile_s[key],
                " (CUDA graphs)" if self.cuda_graphs else "",
            )
        if self.cuda_graphs:  # a graph's outputs are overwritten by its next replay
            out = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
        return out

    def _replay(self, key: tuple, batch: Batch, args: tuple):
        """The eager step as a torch.cuda.CUDAGraph of this bucket: captured on the bucket's first call here (the
        capture records, the replay runs it once), then replayed with the step's inputs copied into the
        captured buffers. A capture that fails (a host sync in the step) turns the stage eager, with why."""
        if key not in self._graphs:
            memo = {k: v.clone() for k, v in batch._memo.items()}
            static = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            batch._memo.update(memo)  # the captured kernels read these buffers
            g = torch.cuda.CUDAGraph()
            t0 = time.perf_counter()
            try:
                with torch.cuda.graph(g):
                    out = self.step(batch, *static)
            except Exception as e:  # noqa: BLE001
                self.failed = f"CUDA graph capture: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[
                    :300
                ]
                log.warning("stage %s: compiled decode off, running eager (%s)", self.stage.plan.layers, self.failed)
                return None
            self._graphs[key] = (g, memo, static, out)
            self.compile_s[key] = time.perf_counter() - t0
            log.info(
                "stage %s: decode step for batch %d, block width %d captured as a CUDA graph in %.1f s",
                self.stage.plan.layers,
                key[0],
                key[1],
                self.compile_s[key],
            )
        else:
            g, memo, static, out = self._graphs[key]
            for k, v in memo.items():
                v.copy_(batch._memo[k])
            for s, a in zip(static, args):
                if isinstance(s, torch.Tensor):
                    s.copy_(a)
        self._graphs[key][0].replay()
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in self._graphs[key][3])
