"""The torch side of a daemon: turn frames into a stage forward and the result back into frames.

Frames carry tensors as raw bytes (transport knows no torch); this module converts them without
copies where it can (`torch.frombuffer` over the received buffer), runs the stage, and samples on the
last stage (the sampling state — parameters, seed, position — travels in each segment's header, so any
stage can sample deterministically; see engine/sampling.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from p2pk3.engine.sampling import SamplingParams, sample_at
from p2pk3.model.cache import Segment as CacheSegment
from p2pk3.model.cache import StageCache
from p2pk3.model.kimi_k3 import Hop, K3Stage, StagePlan
from p2pk3.transport.frames import Frame, Segment, forward_frame, parse_forward

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def wire_tensor(t: torch.Tensor):
    """torch tensor -> (dtype, shape, buffer) for frames, no copy for contiguous CPU tensors."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = {v: k for k, v in TORCH_DTYPES.items()}[t.dtype]
    return (name, tuple(t.shape), t.view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy())


def torch_tensor(frame: Frame, name: str, device) -> torch.Tensor:
    d = frame.desc(name)
    buf = frame.buffer(name)
    t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    return t.view(TORCH_DTYPES[d["dtype"]]).reshape(d["shape"]).to(device)


def model_plan(tp, cfg) -> StagePlan:
    """topology.StagePlan (per-slot view) -> model StagePlan."""
    E = cfg.num_experts
    plan = StagePlan(layers=[lp.layer for lp in tp.layers], embed=tp.embed, head=tp.head)
    for lp in tp.layers:
        plan.parts[lp.layer] = lp.parts
        plan.finish[lp.layer] = lp.finish
        if lp.moe and not lp.all_experts:
            plan.experts[lp.layer] = list(lp.experts)
            plan.covered[lp.layer] = list(range(E))  # the topology is validated: the layer's slots cover all experts
    return plan


@dataclass
class Work:
    """One unit for the stage: token ids (first stage) or an incoming hop, with its segments."""

    segments: list[Segment]
    tokens: torch.Tensor | None = None
    hop: Hop | None = None

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.segments)


def work_from_forward(frame: Frame, device) -> Work:
    v = parse_forward(frame)
    prefix = torch_tensor(frame, "prefix", device)
    bank = torch_tensor(frame, "bank", device) if v.bank_rows else prefix.new_zeros(0, *prefix.shape)
    partial = torch_tensor(frame, "partial_latent", device) if v.mid_moe else None
    return Work(v.segments, hop=Hop(prefix, bank, partial))


def merge(works: list[Work]) -> Work:
    """Concatenate several units into one packed batch (continuous batching across frames)."""
    if len(works) == 1:
        return works[0]
    segs = [s for w in works for s in w.segments]
    if works[0].tokens is not None:
        return Work(segs, tokens=torch.cat([w.tokens for w in works]))
    hs = [w.hop for w in works]
    partial = torch.cat([h.partial for h in hs]) if hs[0].partial is not None else None
    return Work(segs, hop=Hop(torch.cat([h.prefix for h in hs]), torch.cat([h.bank for h in hs], 1), partial))


class StageRunner:
    def __init__(self, stage: K3Stage, cache: StageCache):
        self.stage, self.cache = stage, cache
        self.tokens_done = 0
        self.busy_seconds = 0.0

    @property
    def plan(self) -> StagePlan:
        return self.stage.plan

    def free(self, session: str) -> bool:
        if self.cache.has(session):
            self.cache.free(session)
            return True
        return False

    @torch.inference_mode()
    def run(self, work: Work):
        """Returns ("hop", Hop) or ("results", list[dict], logits rows or None). Opens the caches of new
        sessions (a segment at position 0); raises CacheFull / SessionError without side effects."""
        opened = []
        try:
            for s in work.segments:
                if s.start_pos == 0 and not self.cache.has(str(s.session)):
                    self.cache.open(str(s.session))
                    opened.append(str(s.session))
            segs = [CacheSegment(str(s.session), s.start_pos, s.n_tokens) for s in work.segments]
            want_all = self.plan.head and any((s.sample or {}).get("want") == "logits" for s in work.segments)
            out = self.stage(segs, self.cache, tokens=work.tokens, hop=work.hop,
                             logits="all" if want_all else "last")
        except Exception:
            for sid in opened:
                self.cache.free(sid)
            raise
        self.tokens_done += work.n_tokens
        if not self.plan.head:
            return ("hop", out)
        return ("results",) + self._sample(work.segments, out, want_all)

    def _sample(self, segments: list[Segment], logits: torch.Tensor, all_rows: bool):
        results, rows = [], []
        r = 0
        for s in segments:
            n = s.n_tokens if all_rows else 1
            last = logits[r + n - 1]
            spec = s.sample or {}
            res = {"session": s.session, "epoch": s.epoch, "pos": s.start_pos + s.n_tokens}
            if spec.get("want") == "logits":
                rows.append(logits[r:r + n])
                res["token"] = int(torch.argmax(last))
                res["rows"] = n
            elif spec:
                p = SamplingParams(temperature=float(spec.get("temperature", 0.0)), top_k=int(spec.get("top_k", 0)),
                                   top_p=float(spec.get("top_p", 1.0)), seed=spec.get("seed"))
                res["token"] = sample_at(last, p, s.start_pos + s.n_tokens)
            else:
                res["token"] = 0  # a prefill chunk that is not the last one: nothing to sample
                res["skip"] = True
            results.append(res)
            r += n
        return results, (torch.cat(rows) if rows else None)


def hop_frame(segments: list[Segment], hop: Hop, next_layer: int, **extra) -> Frame:
    bank = wire_tensor(hop.bank) if hop.bank.shape[0] else None
    partial = wire_tensor(hop.partial) if hop.partial is not None else None
    return forward_frame(segments, wire_tensor(hop.prefix), bank, partial, layer=next_layer,
                         mid_moe=hop.partial is not None, **extra)


def np_ids(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)
