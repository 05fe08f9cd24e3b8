"""The torch side of a daemon: turn frames into a stage forward and the result back into frames.

Frames carry tensors as raw bytes (transport knows no torch); this module converts them without
copies where it can (`torch.frombuffer` over the received buffer), runs the stage, and samples on the
last stage (the sampling parameters travel in each segment, and the random stream is a function of
(seed, position), so any stage can sample deterministically; see engine/sampling.py).

Sessions are versioned by `epoch`: a segment at position 0 with a newer epoch than the stage holds
(the entry replays a session after a failure) drops the old state and opens the session afresh; a
segment of an older epoch is refused (`SessionError`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from p2pk3.engine.sampling import sample_at
from p2pk3.model.cache import SessionError, Span, StageCache
from p2pk3.model.dtypes import TORCH_DTYPES
from p2pk3.model.kimi_k3 import Hop, K3Stage, StagePlan
from p2pk3.transport.codec import Frame
from p2pk3.transport.messages import Result, Segment, forward_frame, parse_forward

_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def wire_tensor(t: torch.Tensor):
    """torch tensor -> (dtype, shape, buffer) for frames, no copy for contiguous CPU tensors."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = _DTYPE_NAMES[t.dtype]
    return (name, tuple(t.shape), t.view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy())


def torch_tensor(frame: Frame, name: str, device) -> torch.Tensor:
    d = frame.desc(name)
    if d["dtype"] not in TORCH_DTYPES:
        raise ValueError(f"tensor {name!r}: dtype {d['dtype']} is not an activation dtype ({', '.join(TORCH_DTYPES)})")
    buf = frame.buffer(name)
    t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    return t.view(TORCH_DTYPES[d["dtype"]]).reshape(d["shape"]).to(device)


def model_plan(sp, cfg) -> StagePlan:
    """topology SlotPlan (the per-slot view of the topology) -> the model's StagePlan."""
    E = cfg.num_experts
    plan = StagePlan(layers=[lp.layer for lp in sp.layers], embed=sp.embed, head=sp.head)
    for lp in sp.layers:
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


@dataclass
class HopOut:
    """A middle stage's output: the hop for the next stage."""

    hop: Hop


@dataclass
class HeadOut:
    """The last stage's output: one Result per segment, and the logits rows segments asked for."""

    results: list[Result]
    logits: torch.Tensor | None


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
    """Runs packed batches through one stage and its caches; owns which epoch of each session it holds."""

    def __init__(self, stage: K3Stage, cache: StageCache):
        self.stage, self.cache = stage, cache
        self.epochs: dict[str, int] = {}

    @property
    def plan(self) -> StagePlan:
        return self.stage.plan

    @property
    def sessions(self) -> int:
        return len(self.epochs)

    def free(self, session: str, epoch: int | None = None) -> bool:
        """Drop a session's state (only the given epoch's, or any when None)."""
        held = self.epochs.get(session)
        if held is None or (epoch is not None and epoch < held):
            return False
        self.cache.free(session)
        del self.epochs[session]
        return True

    def free_all(self) -> int:
        n = len(self.epochs)
        for sid in list(self.epochs):
            self.free(sid)
        return n

    def _admit(self, work: Work) -> list[str]:
        """Open the sessions that start here (position 0), replacing an older epoch's state; refuse
        segments of an epoch older than the one held. Returns the sessions opened."""
        opened = []
        for s in work.segments:
            sid, held = str(s.session), self.epochs.get(str(s.session))
            if held is not None and s.epoch < held:
                raise SessionError(f"session {sid}: epoch {s.epoch} is older than the stage's {held} (replayed)")
            if s.start_pos == 0 and (held is None or s.epoch > held):
                if held is not None:
                    self.free(sid)
                self.cache.open(sid)
                self.epochs[sid] = s.epoch
                opened.append(sid)
            elif held is not None and s.epoch > held:
                raise SessionError(f"session {sid}: epoch {s.epoch} must restart at position 0, not {s.start_pos}")
        return opened

    @torch.inference_mode()
    def run(self, work: Work) -> HopOut | HeadOut:
        """Raises CacheFull / SessionError / ExpertNotHeld without side effects."""
        opened = self._admit(work)
        try:
            spans = [Span(str(s.session), s.start_pos, s.n_tokens) for s in work.segments]
            want_all = self.plan.head and any(s.want_logits for s in work.segments)
            out = self.stage(spans, self.cache, tokens=work.tokens, hop=work.hop,
                             logits="all" if want_all else "last")
        except Exception:
            for sid in opened:
                self.free(sid)
            raise
        if not self.plan.head:
            return HopOut(out)
        return self._sample(work.segments, out, want_all)

    def _sample(self, segments: list[Segment], logits: torch.Tensor, all_rows: bool) -> HeadOut:
        results, rows = [], []
        r = 0
        for s in segments:
            n = s.n_tokens if all_rows else 1
            last = logits[r + n - 1]
            pos = s.start_pos + s.n_tokens
            if s.want_logits:
                rows.append(logits[r:r + n])
                results.append(Result(s.session, s.epoch, pos, int(torch.argmax(last)), rows=n))
            elif s.sample is not None:
                results.append(Result(s.session, s.epoch, pos, sample_at(last, s.sample, pos)))
            else:  # a prefill chunk that is not the prompt's last: nothing to sample
                results.append(Result(s.session, s.epoch, pos, skip=True))
            r += n
        return HeadOut(results, torch.cat(rows) if rows else None)


def hop_frame(segments: list[Segment], hop: Hop, next_layer: int) -> Frame:
    bank = wire_tensor(hop.bank) if hop.bank.shape[0] else None
    partial = wire_tensor(hop.partial) if hop.partial is not None else None
    return forward_frame(segments, wire_tensor(hop.prefix), bank, partial, layer=next_layer,
                         mid_moe=hop.partial is not None)
