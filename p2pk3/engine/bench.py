"""`p2pk3 bench reference`: decode tokens/s of the in-process reference engine."""

from __future__ import annotations

import os
import platform
import tempfile
import time

import torch

from p2pk3.model.cache import Span

from .reference import Pipeline


def bench_reference_decode(model: str | None, batches: list[int], steps: int, prompt_len: int) -> list[dict]:
    tmp = None
    if model is None:
        from p2pk3.checkpoint.tiny import write_checkpoint
        from p2pk3.model.config import TINY_K3

        tmp = tempfile.TemporaryDirectory()
        write_checkpoint(tmp.name, TINY_K3, seed=0)
        model = tmp.name
    pipe = Pipeline.load(model, 1, max_sessions=max(batches), max_tokens=max(batches) * (prompt_len + steps + 8))
    cfg = pipe.cfg
    print(
        f"model: {model}  layers {cfg.num_hidden_layers} hidden {cfg.hidden_size} experts {cfg.num_experts} "
        f"top-{cfg.num_experts_per_token}  vocab {cfg.vocab_size}"
    )
    print(
        f"host: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    rows = []
    g = torch.Generator().manual_seed(0)
    base = None
    for b in batches:
        ids = [f"b{i}" for i in range(b)]
        for s in ids:
            pipe.open(s)
        prompt = torch.randint(0, cfg.vocab_size, (b * prompt_len,), generator=g)
        pipe.forward([Span(s, 0, prompt_len) for s in ids], prompt)
        tok = torch.randint(0, cfg.vocab_size, (b,), generator=g)
        pipe.forward([Span(s, prompt_len, 1) for s in ids], tok)  # warm-up
        t0 = time.perf_counter()
        for k in range(steps):
            lg = pipe.forward([Span(s, prompt_len + 1 + k, 1) for s in ids], tok)
            tok = lg.argmax(-1)
        dt = time.perf_counter() - t0
        for s in ids:
            pipe.close(s)
        tps = b * steps / dt
        if b == 1:
            base = tps  # the baseline: batch 1, measured in this run (the CLI always includes it)
        rows.append({"batch": b, "steps": steps, "seconds": dt, "tokens_per_s": tps, "ms_per_step": 1000 * dt / steps})
        print(
            f"batch {b:3d}: {tps:9.1f} tok/s  {1000 * dt / steps:8.2f} ms/step  "
            + (f"(x{tps / base:.2f} of batch-1 tok/s)" if base else "(no batch-1 baseline in this run)")
        )
    if tmp:
        tmp.cleanup()
    return rows
