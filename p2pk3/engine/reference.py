"""In-process engine: a chain of stages on this host (one stage = the whole model, or several layer
ranges that pass a Hop exactly as the ring does). Used by `p2pk3 score`, the tests, and as the
single-process oracle the distributed ring must match."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from p2pk3.checkpoint.loader import load_stage_weights
from p2pk3.model.cache import Span
from p2pk3.model.config import K3Config
from p2pk3.model.dtypes import torch_dtype
from p2pk3.model.kimi_k3 import K3Stage, StagePlan, build_stage

from .sampling import SamplingParams, fresh_seed, sample_at


def default_model_dir() -> Path:
    """The embedded default model (a small K3 trained on the CPython docs, shipped with the package)."""
    return Path(__file__).resolve().parent.parent / "assets" / "tiny-k3-pydoc"


def configure_cpu_threads(cfg: K3Config, threads: int | None = None) -> int:
    """Intra-op threads for CPU runs. Small models run far faster on one thread: their ops are too small to
    split, and on a loaded machine OpenMP workers spinning for a core cost 10-100x (measured: a tiny-K3
    decode step 26 ms on 1 thread vs 2.1 s on 2 threads with the other core busy). Explicit `threads` wins;
    P2PK3_THREADS overrides the automatic choice."""
    import os
    if threads is None:
        env = os.environ.get("P2PK3_THREADS")
        threads = int(env) if env else (1 if cfg.hidden_size < 2048 else (os.cpu_count() or 1))
    torch.set_num_threads(max(1, threads))
    return threads


def load_stage(model_dir: str | Path, plan: StagePlan, dtype="float32", device="cpu",
               cfg: K3Config | None = None) -> K3Stage:
    cfg = cfg or K3Config.from_pretrained(model_dir)
    state = load_stage_weights(model_dir, cfg, layers=plan.layers, experts=plan.experts or None, embed=plan.embed,
                               head=plan.head, layer_parts=plan.parts or None)
    return build_stage(cfg, plan, state, torch_dtype(dtype), device)


class Pipeline:
    """Stages run one after another in this process, each with its own bounded cache."""

    def __init__(self, stages: list[K3Stage], max_sessions: int = 16, max_tokens: int = 8192, block_size: int = 64):
        self.stages = stages
        self.cfg = stages[0].cfg
        self.caches = [s.new_cache(max_sessions, max_tokens, block_size) for s in stages]

    @classmethod
    def load(cls, model_dir: str | Path, n_stages: int = 1, dtype="float32", device="cpu",
             plans: list[StagePlan] | None = None, **cache_kw) -> "Pipeline":
        cfg = K3Config.from_pretrained(model_dir)
        if torch.device(device).type == "cpu":
            configure_cpu_threads(cfg)
        plans = plans or StagePlan.split_even(cfg, n_stages)
        return cls([load_stage(model_dir, p, dtype, device, cfg) for p in plans], **cache_kw)

    def open(self, session: str) -> None:
        opened = []
        try:
            for c in self.caches:
                c.open(session)
                opened.append(c)
        except Exception:
            for c in opened:
                c.free(session)
            raise

    def close(self, session: str) -> None:
        for c in self.caches:
            if c.has(session):
                c.free(session)

    def length(self, session: str) -> int:
        return self.caches[0].get(session).length

    @torch.inference_mode()
    def forward(self, spans: list[Span], tokens: torch.Tensor, logits: str = "last") -> torch.Tensor:
        hop = None
        for stage, cache in zip(self.stages, self.caches):
            out = stage(spans, cache, tokens=tokens if stage.plan.embed else None, hop=hop, logits=logits)
            hop = out
        return out

    # ------------------------------------------------------------------ convenience
    def score(self, tokens: list[int], incremental: bool = False, session: str = "score") -> torch.Tensor:
        """Logits [T, V] (fp32) for every position, by one prefill or token by token (decode path)."""
        self.open(session)
        try:
            t = torch.tensor(tokens, dtype=torch.long)
            if not incremental:
                return self.forward([Span(session, 0, len(tokens))], t, logits="all")
            return torch.cat([self.forward([Span(session, i, 1)], t[i:i + 1], logits="all")
                              for i in range(len(tokens))])
        finally:
            self.close(session)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 prefill_chunk: int = 512) -> list[list[int]]:
        """Batched generation: prompts prefilled together (in chunks), then one decode step per round for
        every live session."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        ids = [f"gen{i}" for i in range(len(prompts))]
        params = [p if p.seed is not None or p.temperature == 0 else
                  SamplingParams(**{**p.__dict__, "seed": fresh_seed()}) for p in params]
        outs: list[list[int]] = [[] for _ in prompts]
        for s in ids:
            self.open(s)
        try:
            pos = [0] * len(prompts)
            last = [None] * len(prompts)
            while any(pos[i] < len(p) for i, p in enumerate(prompts)):  # chunked prefill
                spans, toks, who = [], [], []
                for i, p in enumerate(prompts):
                    if pos[i] < len(p):
                        n = min(prefill_chunk, len(p) - pos[i])
                        spans.append(Span(ids[i], pos[i], n))
                        toks.extend(p[pos[i]:pos[i] + n])
                        pos[i] += n
                        who.append(i)
                lg = self.forward(spans, torch.tensor(toks, dtype=torch.long))
                for row, i in enumerate(who):
                    last[i] = lg[row]
            live = [i for i in range(len(prompts)) if params[i].max_tokens > 0]
            while live:
                nxt = []
                for i in live:
                    tok = sample_at(last[i], params[i], len(prompts[i]) + len(outs[i]))
                    outs[i].append(tok)
                    if tok in params[i].stop_ids or len(outs[i]) >= params[i].max_tokens:
                        continue
                    nxt.append(i)
                live = nxt
                if not live:
                    break
                spans = [Span(ids[i], pos[i] + len(outs[i]) - 1, 1) for i in live]
                lg = self.forward(spans, torch.tensor([outs[i][-1] for i in live], dtype=torch.long))
                for row, i in enumerate(live):
                    last[i] = lg[row]
            return outs
        finally:
            for s in ids:
                self.close(s)


def nll(logits: torch.Tensor, tokens: Iterable[int]) -> tuple[float, float]:
    """Mean next-token NLL over positions 0..T-2 and its perplexity."""
    t = torch.tensor(list(tokens), dtype=torch.long)
    loss = torch.nn.functional.cross_entropy(logits[:-1].float(), t[1:])
    return float(loss), float(torch.exp(loss))
