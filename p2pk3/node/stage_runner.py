"""The torch side of a daemon: turn frames into a stage forward and the result back into frames.

Frames carry tensors as raw bytes (transport knows no torch); this module converts them without
copies where it can (`torch.frombuffer` over the received buffer), runs the stage, and samples on the
last stage (the sampling parameters travel in each segment, and the random stream is a function of
(seed, position), so any stage can sample deterministically; see engine/sampling.py).

Sessions are versioned by `epoch`: a segment at position 0 with a newer epoch than the stage holds
(the entry replays a session after a failure) drops the old state and opens the session afresh; a
segment of an older epoch is refused (`SessionError`).

The last stage keeps a `SessionSampler` (engine/sampler.py) per session whose sampling is stateful
(penalties, grammar, prompt logprobs): the segments' `ids` feed its history, its parameters are the first
`sample` of the epoch (the prompt's last chunk; later segments omit the grammar), it lives and dies with
the session's epoch here, and its errors (a grammar that does not compile) fail only that session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from p2pk3.engine.sampler import SamplerError, SessionSampler
from p2pk3.engine.sampling import sample_at
from p2pk3.model.cache import CacheFull, SessionError, Span, StageCache
from p2pk3.model.dtypes import TORCH_DTYPES
from p2pk3.model.kimi_k3 import Hop
from p2pk3.model.prefix_cache import PrefixCache, PrefixMiss
from p2pk3.model.stage import K3Stage, StagePlan
from p2pk3.spec.verify import verify_draft
from p2pk3.transport.codec import Frame
from p2pk3.transport.messages import Result, Segment, forward_frame, parse_forward
from p2pk3.topology.sizing import loaded_weight_bytes

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

    def __init__(
        self,
        stage: K3Stage,
        cache: StageCache,
        prefix: PrefixCache | None = None,
        grammar_tokenizer: Callable | None = None,
    ):
        """prefix: the stage's prefix cache (p2pk3/model/prefix_cache.py), None: off. grammar_tokenizer: () ->
        the checkpoint's `GrammarTokenizer` (called on the first grammar; None: requests with a grammar fail
        with a clear error)."""
        self.stage, self.cache = stage, cache
        self.weight_bytes = loaded_weight_bytes(stage)  # the status's memory.weights (fixed once loaded)
        self.prefix = prefix
        self.grammar_tokenizer = grammar_tokenizer
        self.epochs: dict[str, int] = {}
        self.samplers: dict[str, SessionSampler] = {}  # last stage: the stateful sessions' sampler state
        # speculative decoding, for the status: passes by batch width (EMA ms, count), verify segments by
        # width (k + 1), rollbacks
        self.pass_ms: dict[int, float] = {}
        self.passes: dict[int, int] = {}
        self.verify_widths: dict[int, int] = {}
        self.rollbacks = 0

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
        if self.prefix is not None:
            self.prefix.forget(session)
        self.samplers.pop(session, None)
        return True

    @torch.inference_mode()
    def keep(self, session: str, k) -> None:
        """Before a finished session is freed: register its generated part in the prefix cache (a `Keep`).
        Rejected drafts of its last verify pass are rolled back first; a session that holds other than
        start + n tokens is left alone."""
        if self.prefix is None or not self.cache.has(session):
            return
        end = k.start + k.n
        try:
            if self.cache.get(session).length > end:
                self.stage.rollback(self.cache, session, end)
            if self.cache.get(session).length == end:
                self.prefix.insert(session, k.start, k.n, list(k.blocks), k.snap)
        except (SessionError, CacheFull):
            pass

    def free_all(self) -> int:
        n = len(self.epochs)
        for sid in list(self.epochs):
            self.free(sid)
        return n

    def _admit(self, work: Work) -> list[str]:
        """Open the sessions that start here (position 0), replacing an older epoch's state; refuse
        segments of an epoch older than the one held, and units of a session out of position order
        (checked for every segment before anything is opened). Returns the sessions opened."""
        seen, opening = set(), []
        for s in work.segments:
            sid, held = str(s.session), self.epochs.get(str(s.session))
            if sid in seen:
                raise SessionError(
                    f"session {sid}: two units of one session in one batch; a stage runs a "
                    f"session's chunks one after the other, in position order"
                )
            seen.add(sid)
            if held is not None and s.epoch < held:
                raise SessionError(f"session {sid}: epoch {s.epoch} is older than the stage's {held} (replayed)")
            if (s.start_pos == 0 or s.prefix is not None) and (held is None or s.epoch > held):
                opening.append((sid, s.epoch, held, s))
            elif held is not None and s.epoch > held:
                raise SessionError(
                    f"session {sid}: epoch {s.epoch} must restart at position 0 or at a cached prefix, "
                    f"not {s.start_pos}"
                )
            elif held is not None and self.cache.has(sid) and s.start_pos > self.cache.get(sid).length:
                raise SessionError(
                    f"session {sid}: a unit at position {s.start_pos} arrived before positions "
                    f"{self.cache.get(sid).length}..{s.start_pos - 1}; a stage runs one session's "
                    f"chunks in position order (a unit was lost or reordered on the way here)"
                )
        opened = []
        try:
            for sid, epoch, held, seg in opening:
                if held is not None:
                    self.free(sid)
                self.cache.open(sid)
                self.epochs[sid] = epoch
                opened.append(sid)
                if seg.prefix is not None:  # starts at a cached prefix (PrefixMiss when not held here)
                    if self.prefix is None:
                        raise PrefixMiss(f"prefix_miss: session {sid} names a cached prefix; this stage caches none")
                    self.prefix.attach(sid, seg.prefix, seg.start_pos)
                elif self.prefix is not None:
                    self.prefix.stats.cold += 1
        except (CacheFull, SessionError):
            for sid in opened:
                self.free(sid)
            raise
        return opened

    def _rollback(self, segments: list[Segment], opened: list[str]) -> None:
        """A segment that starts below what this stage holds of its session follows a verify pass whose
        tail was rejected: roll the session back to its start (checked for every segment first)."""
        back = [
            (str(s.session), s.start_pos)
            for s in segments
            if str(s.session) not in opened
            and self.cache.has(str(s.session))
            and s.start_pos < self.cache.get(str(s.session)).length
        ]
        for sid, pos in back:
            self.cache.check_rollback(sid, pos)
        for sid, pos in back:
            self.stage.rollback(self.cache, sid, pos)
            self.rollbacks += 1

    @torch.inference_mode()
    def run(self, work: Work) -> HopOut | HeadOut:
        """Raises CacheFull / SessionError / ExpertNotHeld without side effects (a rollback that a segment
        asked for stays done: it only forgets rejected drafts)."""
        t0 = time.perf_counter()
        opened = self._admit(work)
        try:
            self._rollback(work.segments, opened)
            spans = [Span(str(s.session), s.start_pos, s.n_tokens, verify=bool(s.draft)) for s in work.segments]
            want_all = self.plan.head and any(s.want_logits for s in work.segments)
            # rows per segment: every position of a verify segment and of a scored prompt chunk, else the last
            counts = [s.n_tokens if want_all or s.draft or s.prompt_logprobs is not None else 1 for s in work.segments]
            select = self.plan.head and not want_all and any(c > 1 for c in counts)
            out = self.stage(
                spans,
                self.cache,
                tokens=work.tokens,
                hop=work.hop,
                logits="all" if want_all else "none" if select else "last",
            )
        except Exception:
            for sid in opened:
                self.free(sid)
            raise
        if self.prefix is not None:
            self._keep_prefixes(work.segments)
        if select:
            idx, r = [], 0
            for sg, c in zip(work.segments, counts):
                idx.extend(range(r + sg.n_tokens - c, r + sg.n_tokens))
                r += sg.n_tokens
            out = self._project(out[torch.tensor(idx, device=out.device)])
        res = HopOut(out) if not self.plan.head else self._sample(work.segments, out, counts)
        self._account(work, time.perf_counter() - t0)
        return res

    def _keep_prefixes(self, segments: list[Segment]) -> None:
        """Register the blocks and snapshots prefill segments ask for (a full pool only keeps less)."""
        for s in segments:
            if s.blocks or s.snap is not None:
                try:
                    self.prefix.insert(str(s.session), s.start_pos, s.n_tokens, list(s.blocks), s.snap)
                except CacheFull:
                    pass

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states (after the norm) -> fp32 logits, as K3Stage.head does."""
        m = self.stage.model
        w = m.embed_tokens.weight if self.stage.cfg.tie_word_embeddings else self.stage.lm_head.weight
        return (h @ w.T).float()

    def _account(self, work: Work, dt: float) -> None:
        n = work.n_tokens
        w = n if n <= 16 else 1 << (n - 1).bit_length()  # widths above 16 in power-of-two buckets
        ms = 1000 * dt
        self.pass_ms[w] = ms if w not in self.pass_ms else 0.8 * self.pass_ms[w] + 0.2 * ms
        self.passes[w] = self.passes.get(w, 0) + 1
        for sg in work.segments:
            if sg.draft:
                self.verify_widths[sg.n_tokens] = self.verify_widths.get(sg.n_tokens, 0) + 1

    def spec_stats(self) -> dict:
        """Passes by batch width (count, EMA ms), verify segments by width, rollbacks, checkpoint bytes."""
        return {
            "passes_by_width": {str(k): v for k, v in sorted(self.passes.items())},
            "pass_ms_by_width": {str(k): round(v, 3) for k, v in sorted(self.pass_ms.items())},
            "verify_segments_by_width": {str(k): v for k, v in sorted(self.verify_widths.items())},
            "rollbacks": self.rollbacks,
            "checkpoint_bytes": self.cache.checkpoint_bytes(),
        }

    def _sample(self, segments: list[Segment], logits: torch.Tensor, counts: list[int]) -> HeadOut:
        results, rows = [], []
        r = 0
        for s, n in zip(segments, counts):
            if s.want_logits:
                rows.append(logits[r : r + n])
                pos = s.start_pos + s.n_tokens
                results.append(Result(s.session, s.epoch, pos, int(torch.argmax(logits[r + n - 1])), rows=n))
            else:
                try:
                    results.append(self._sample_one(s, logits[r : r + n]))
                except (RuntimeError, SamplerError) as e:  # e.g. temperature 1e-300: inf/nan probabilities, or a
                    # grammar that does not compile. Only this session fails (the batch is already committed,
                    # a rerun would fail its batch-mates)
                    pos = s.start_pos + s.n_tokens
                    results.append(Result(s.session, s.epoch, pos, error=f"sampling failed: {e}", code="bad_request"))
            r += n
        return HeadOut(results, torch.cat(rows) if rows else None)

    def _sampler(self, s: Segment) -> SessionSampler | None:
        """The session's sampler state, fed with the segment's ids (None: a stateless session)."""
        sid = str(s.session)
        if not s.ids:
            return self.samplers.get(sid)
        smp = self.samplers.get(sid)
        if smp is None or s.start_pos == 0 or s.history:
            smp = self.samplers[sid] = SessionSampler()
        if s.history:  # a session started at a cached prefix whose sampler counts the prompt's ids
            smp.feed(0, s.history, s.output_from)
        smp.feed(s.start_pos, s.ids, s.output_from)
        if s.sample is not None and smp.params is None:
            smp.configure(s.sample, self._grammar_tokenizer() if s.sample.grammar is not None else None)
        return smp

    def _grammar_tokenizer(self):
        """The checkpoint's GrammarTokenizer (built on first use), or SamplerError saying why there is none."""
        if self.grammar_tokenizer is None:
            raise SamplerError("this stage was started without the checkpoint's tokenizer (structured outputs)")
        try:
            return self.grammar_tokenizer()
        except (OSError, ImportError, ValueError) as e:  # no tokenizer files, no llguidance, a bad vocabulary
            raise SamplerError(f"the grammar engine cannot start on this stage: {e}") from None

    def _sample_one(self, s: Segment, rows: torch.Tensor) -> Result:
        """One segment's result from its logits rows (the last one, or all of a verify / scored segment)."""
        smp = self._sampler(s)
        pfrom, plps = 0, []
        if s.prompt_logprobs is not None and smp is not None:
            pfrom, plps = smp.prompt_logprobs(rows, s.start_pos, s.prompt_logprobs)
        pos = s.start_pos + s.n_tokens
        p = s.sample
        if p is None:  # a prefill chunk that is not the prompt's last: nothing to sample
            return Result(s.session, s.epoch, pos, skip=True, prompt_logprobs=tuple(plps), prompt_from=pfrom)
        plain = smp is None and not p.penalized and p.logprobs is None
        if smp is None and not plain:
            smp = SessionSampler(p)  # logit_bias / min_p / logprobs need no history
        if s.draft:  # verify: rows are positions start_pos .. start_pos + k
            if plain:
                acc, tok = verify_draft(rows, s.draft, p, s.start_pos)
                lps = None
            else:
                acc, tok, lps = smp.verify(rows, s.draft, s.start_pos)
            return Result(
                s.session, s.epoch, s.start_pos + len(acc) + 1, tok, accepted=tuple(acc), logprobs=tuple(lps or ())
            )
        if plain:
            return Result(s.session, s.epoch, pos, sample_at(rows[-1], p, pos))
        tok, lp = smp.sample(rows[-1], pos)
        return Result(
            s.session,
            s.epoch,
            pos,
            tok,
            logprobs=(lp,) if lp is not None else (),
            prompt_logprobs=tuple(plps),
            prompt_from=pfrom,
        )


def hop_frame(segments: list[Segment], hop: Hop, next_layer: int) -> Frame:
    bank = wire_tensor(hop.bank) if hop.bank.shape[0] else None
    partial = wire_tensor(hop.partial) if hop.partial is not None else None
    return forward_frame(
        segments, wire_tensor(hop.prefix), bank, partial, layer=next_layer, mid_moe=hop.partial is not None
    )
