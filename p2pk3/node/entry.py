"""The entry role: owns sessions (token history, sampling parameters), schedules them into the ring and
streams tokens out.

**Scheduling: keep every stage busy.** A ring of N stages works on N things at once only if N units are
in flight, so the entry keeps several independent units in the ring (docs/architecture.md, "The
scheduler"):

* Decoding sessions are spread over `micro_batches` groups (M; the daemon's default is the number of
  active slots), balanced by the tokens each puts in a pass (1, or 1 + k when it speculates). A group
  leaves as one unit as soon as its own previous pass is back, never in lockstep with the others; a new
  or finished session rebalances the groups (a session only moves while it has nothing in flight). M = 1
  is one decode batch of every decoding session, the schedule before micro-batches.
* Prompts are prefilled in chunks (at most `prefill_chunk` tokens) that enter the ring back to back: up
  to `prefill_depth` chunks (D) of one session in flight, the chunks of several sessions packed into
  units of at most `max_batch_tokens` (one chunk per session and unit: a stage runs one session's chunks
  in position order, one after the other). While sessions decode, a prefill unit is cut to cost no more
  than PREFILL_SHARE of a decode unit on the entry's own stage (`stage_cost`, measured), and every stage
  runs decode units first with at most one prefill unit between two decode batches (worker.py), so a
  long prompt never slows the others' tokens by more than a factor of two, and is never starved.

The whole token history stays here, which is what makes failures survivable: `replay_all()` gives every
live session a new epoch and restarts it from position 0, so its history (prompt + tokens generated so
far) is prefilled again through the repaired ring like any prompt (every stage drops the old epoch's
state when the new epoch arrives at position 0), and generation continues where it was: greedy and
seeded output are the same as without the failure (sampling is a function of seed and position).
While the ring is being repaired the entry is `paused`: nothing is scheduled, results of the old epoch
are ignored, and new requests wait in the session table.

Speculative decoding (a request's `speculate`, p2pk3/spec): a decode step of such a session carries its
last accepted token plus k drafted tokens (its proposer's guess; k from the session's recent acceptance
and the measured ring time of passes by width, 0 included). The last stage accepts the longest prefix the
target itself would have produced and adds the token after it; the entry appends them (up to a stop id or
max_tokens) and the session's next segment starts after them, which tells every stage how far to roll
back. Only accepted tokens enter the history, so a replay never sees a draft.

Stateful sampling (penalties, grammar, prompt logprobs; `SamplingParams.stateful`): the last stage keeps
the session's sampler state, fed by the token ids the entry sends with each segment (`Segment.ids`,
`output_from`: where the output starts), so a replay rebuilds it from the history like the caches.
Logprobs come back with the tokens (`Session.logprobs`, aligned with `generated`); prompt logprobs
(echo) with the prefill chunks (`Session.prompt_lps`; a chunk asks only for positions still missing, so a
replay does not score the prompt again).

Over 500 lines as one module because the session table, the schedule that reads it and the results that
update it are one state machine: split, each part would reach into the others' fields.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from p2pk3.engine.sampling import SamplingParams, fresh_seed
from p2pk3.params import MAX_DRAFT, TokenLogprob
from p2pk3.spec.draft_len import DraftLength, PassCost
from p2pk3.spec.proposers import NgramProposer, SuffixIndex, SuffixProposer
from p2pk3.transport.codec import MAX_HEADER_LEN
from p2pk3.transport.messages import ErrorCode, Result, Segment

from .options import chunk_after_hit
from .stage_runner import Work


PROMPT_LOGPROB_BYTES = 13  # a prompt logprob entry on the wire, per (1 + top) ids and logprobs, about

log = logging.getLogger("p2pk3.node")

# while sessions decode, a prefill unit costs at most this share of a decode unit: a stage runs at most one
# prefill unit between two decode batches, so the others' inter-token time grows by at most 1 + this
PREFILL_SHARE = 0.5
MAX_LOST_REPLAYS = 3  # lost_state replays of one session before it fails with the stage's message


class Busy(RuntimeError):
    pass


@dataclass
class Session:
    id: str
    epoch: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    want_logits: bool = False
    incremental: bool = False
    sent: int = 0  # tokens of `tokens` sent into the ring in this epoch
    sent_at: collections.deque = field(default_factory=collections.deque)  # send times of the units in flight
    decoding: bool = False  # its prefill of this epoch is done: it takes decode steps in a micro-batch
    group: int | None = None  # its decode micro-batch
    done: bool = False
    error: str | None = None
    error_code: str | None = None
    replays: int = 0
    lost: int = 0  # replays after a stage said it held no state for it (lost_state)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    logits: list[torch.Tensor] = field(default_factory=list)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_done: float | None = None
    # speculative decoding
    seg_params: SamplingParams | None = None  # what segments carry (params without the speculation options)
    # what decode segments carry: seg_params without the grammar, which the last stage took from the prompt's
    # last chunk (its sampler state keeps it for the epoch), so a schema does not travel with every token
    decode_params: SamplingParams | None = None
    proposer: object | None = None  # p2pk3.spec.proposers, None: no speculation
    draft_len: DraftLength | None = None
    inflight_draft: int = 0  # drafted tokens in the unit in flight
    sent_width: int = 0  # tokens of the batch the unit in flight went in
    sent_verify: bool = False  # whether that batch had drafts
    passes: int = 0  # decode passes (results that added tokens)
    pass_tokens: int = 0  # tokens those passes added
    proposed: int = 0
    accepted: int = 0
    shadow: int | None = None  # the proposer's first guess for the next token while not drafting
    draft_ns: int = 0  # time spent drafting
    drafts: int = 0  # proposer calls
    # prefix cache (p2pk3/node/prefix_match.py): block keys of the prompt, where KDA snapshots are asked for,
    # the prompt tokens this epoch starts with from the cache, and the point it names
    chain: list[str] = field(default_factory=list)
    snap_points: list[int] = field(default_factory=list)
    cached: int = 0
    prefix: str | None = None
    # stateful sampling and logprobs
    output_from: int = 0  # the first position of the output (below: the prompt; < prompt_len when resumed)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when asked
    prompt_lps: list[TokenLogprob | None] = field(default_factory=list)  # per prompt position, when asked

    def ids_at(self, start: int, n: int, lookahead: bool) -> tuple[int, ...]:
        """What a segment of n tokens at `start` carries for the last stage's sampler (Segment.ids)."""
        if not self.params.stateful:
            return ()
        return tuple(self.tokens[start : min(start + n + (1 if lookahead else 0), len(self.tokens))])

    def scores_prompt(self, start: int, n: int) -> int | None:
        """Segment.prompt_logprobs of a prefill chunk: the top N when the chunk predicts prompt tokens
        still missing, else None."""
        if self.params.prompt_logprobs is None:
            return None
        hi = min(start + n + 1, self.output_from)
        return self.params.prompt_logprobs if any(e is None for e in self.prompt_lps[start + 1 : hi]) else None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def inflight(self) -> int:
        """Units of this session in the ring (prefill chunks, or the one decode step)."""
        return len(self.sent_at)

    @property
    def weight(self) -> int:
        """Tokens it puts in a decode pass (what micro-batches are balanced by)."""
        return 1 + (min(self.params.draft_tokens, MAX_DRAFT) if self.proposer is not None else 0)

    def stats(self) -> dict:
        n = len(self.generated)
        ttft = (self.t_first - self.t_submit) if self.t_first else None
        total = (self.t_done or time.perf_counter()) - self.t_submit
        decode = (self.t_done - self.t_first) if (self.t_done and self.t_first and n > 1) else None
        st = {
            "prompt_tokens": self.prompt_len,
            "generated_tokens": n,
            "ttft_s": ttft,
            "total_s": total,
            "decode_tokens_per_s": (n - 1) / decode if decode else None,
            "replays": self.replays,
            "cached_tokens": self.cached,
        }
        if self.proposer is not None:
            st.update(
                {
                    "speculate": self.params.speculate,
                    "proposed": self.proposed,
                    "accepted": self.accepted,
                    "acceptance": self.accepted / self.proposed if self.proposed else None,
                    "passes": self.passes,
                    "tokens_per_pass": self.pass_tokens / self.passes if self.passes else None,
                    "draft_us": self.draft_ns / 1000 / self.drafts if self.drafts else None,
                }
            )
        return st


class Entry:
    def __init__(
        self,
        submit_work,
        free_sessions,
        *,
        prefill_chunk: int = 256,
        max_batch_tokens: int = 2048,
        max_sessions: int = 64,
        micro_batches: int = 1,
        prefill_depth: int = 1,
        stage_cost: PassCost | None = None,
    ):
        self._submit_work = submit_work  # callable(Work) -> None (first stage queue)
        self._free_sessions = free_sessions  # callable(list[(session, epoch)]) -> None (free along the ring)
        self.prefill_chunk, self.max_batch_tokens, self.max_sessions = prefill_chunk, max_batch_tokens, max_sessions
        if micro_batches < 1 or prefill_depth < 1:
            raise ValueError(f"micro_batches ({micro_batches}) and prefill_depth ({prefill_depth}) must be >= 1")
        self.micro_batches, self.prefill_depth = micro_batches, prefill_depth
        # compute ms of the entry's own stage by batch width (the worker feeds it): what a prefill unit may
        # cost while sessions decode. None: prefill units are not cut
        self.stage_cost = stage_cost
        self.units_sent = {"decode": 0, "prefill": 0}
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self.node_tag = f"{time.time_ns() % 10**9:x}"
        self.paused: str | None = None  # why scheduling is paused (a ring repair), or None
        self.finished = 0
        self.failed = 0
        self.cancelled = 0  # stopped by their client (Ctrl-C, a disconnect): not failures
        self.on_finish = None  # callable(Session) after a session ended (admission.py admits the next)
        # speculative decoding: the cluster's recent prompts and outputs (suffix proposer), the ring time of
        # passes by width as measured here (send -> result), how each method makes a session's proposer,
        # and how k is chosen ("adaptive": expected tokens per ring time; "fixed": always the request's
        # draft_tokens, for tests and benchmarks)
        self.suffix_index = SuffixIndex()
        self.pass_cost = PassCost()  # batches without drafts
        self.verify_cost = PassCost()  # batches with drafts (a different, per-span compute path on the stages)
        self.proposer_factories = {"ngram": NgramProposer, "suffix": lambda: SuffixProposer(self.suffix_index)}
        self.draft_policy = "adaptive"
        self.spec_totals = {"passes": 0, "proposed": 0, "accepted": 0}
        self.prefixes = None  # a PrefixMatcher (p2pk3/node/prefix_match.py) when the stages cache prefixes

    # ------------------------------------------------------------------ public
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        want_logits: bool = False,
        incremental: bool = False,
        generated: int = 0,
    ) -> Session:
        """`generated`: the prompt's last ids that are output already (a resumed request)."""
        live = sum(1 for s in self.sessions.values() if not s.done)
        if live >= self.max_sessions:
            raise Busy(f"busy: {live} sessions in flight (max {self.max_sessions}); retry later")
        if not prompt:
            raise ValueError("empty prompt")
        if params.temperature > 0 and params.seed is None:
            params = params.with_seed(fresh_seed())
        if params.prompt_logprobs is not None:
            need = (len(prompt) - generated) * PROMPT_LOGPROB_BYTES * (1 + params.prompt_logprobs)
            if need > MAX_HEADER_LEN * 0.9:
                raise ValueError(
                    f"prompt logprobs of {len(prompt) - generated} tokens with top {params.prompt_logprobs} need about "
                    f"{need >> 10} KiB, more than a done frame carries ({MAX_HEADER_LEN >> 10} KiB): ask fewer top "
                    "logprobs or score a shorter prompt"
                )
        sid = f"s{self.node_tag}-{next(self._ids)}"
        s = Session(sid, 0, list(prompt), len(prompt), params, want_logits, incremental)
        s.seg_params = params.sampler()
        s.decode_params = replace(s.seg_params, grammar=None) if params.grammar is not None else s.seg_params
        s.output_from = len(prompt) - generated
        if params.prompt_logprobs is not None:
            s.prompt_lps = [TokenLogprob(prompt[0], None)] + [None] * (s.output_from - 1)
        if params.speculating and not want_logits:
            s.proposer = self.proposer_factories[params.speculate]()
            s.draft_len = DraftLength()
            if params.speculate == "suffix":
                self.suffix_index.add(prompt)
        self.sessions[sid] = s
        if self.prefixes is not None:
            self.prefixes.begin(s)  # s starts at the longest cached prefix
        if params.max_tokens == 0 and not want_logits:
            self._finish(s)  # nothing to generate
            return s
        self.kick()
        return s

    def cancel(self, sid: str, reason: str = "cancelled", code: str = "cancelled") -> None:
        s = self.sessions.get(sid)
        if s and not s.done:
            self._finish(s, error=reason, code=code)

    def live(self) -> list[Session]:
        return [s for s in self.sessions.values() if not s.done]

    # ------------------------------------------------------------------ failures
    def pause(self, reason: str) -> None:
        """Stop scheduling (a slot is down; a repair is under way). Units in flight are abandoned."""
        self.paused = reason

    def replay_all(self) -> int:
        """Restart every live session at a new epoch from position 0 (its whole history). Returns how many."""
        n = 0
        for s in self.live():
            self._replay(s)
            n += 1
        return n

    def _replay(self, s: Session) -> None:
        """Restart `s` at a new epoch from position 0 with its whole history (prompt and tokens so far): every
        stage drops the old epoch's state and computes it afresh, so its next tokens are the same."""
        s.epoch += 1
        s.sent, s.inflight_draft, s.decoding, s.group = 0, 0, False, None
        s.cached, s.prefix = 0, None
        s.sent_at.clear()
        s.logits.clear()
        s.replays += 1

    def resume(self) -> None:
        self.paused = None
        self.kick()

    def fail_all(self, reason: str, code: str = "failed") -> None:
        for s in self.live():
            self._finish(s, error=reason, code=code)

    def expire(self, timeout_s: float) -> list[Session]:
        """Fail the sessions whose unit in flight has had no answer for `timeout_s` (nothing waits forever)."""
        now = time.perf_counter()
        late = [s for s in self.live() if s.sent_at and now - s.sent_at[0] > timeout_s]
        for s in late:
            self._finish(
                s, error=f"no answer from the ring for {timeout_s:.0f} s (a stage lost the request)", code="failed"
            )
        return late

    # ------------------------------------------------------------------ scheduling
    def kick(self) -> None:
        """Send every unit that may leave now: each idle decode micro-batch, then prefill chunks."""
        if self.paused:
            return
        now = time.perf_counter()
        decoding = [s for s in self.sessions.values() if not s.done and s.decoding]
        self._balance(decoding)
        widest = 0
        for g in range(self.micro_batches):
            members = [s for s in decoding if s.group == g]
            widest = max(widest, sum(s.weight for s in members))
            if members and not any(s.inflight for s in members):  # its previous pass is back
                self._send_decodes([s for s in members if s.sent < len(s.tokens)], now)
        self._send_prefills(now, widest)

    def _balance(self, decoding: list[Session]) -> None:
        """Give new decoding sessions the lightest micro-batch (an idle one among equals); move an idle
        session from the heaviest to the lightest group while that narrows the gap (after a finish)."""
        M = self.micro_batches
        load = [0] * M
        busy = [False] * M
        for s in decoding:
            if s.group is not None and s.group < M:
                load[s.group] += s.weight
                busy[s.group] = busy[s.group] or bool(s.inflight)
        for s in sorted((s for s in decoding if s.group is None or s.group >= M), key=lambda s: s.t_submit):
            g = min(range(M), key=lambda g: (load[g], busy[g], g))
            s.group = g
            load[g] += s.weight
        for _ in range(len(decoding)):
            hi, lo = max(range(M), key=lambda g: load[g]), min(range(M), key=lambda g: load[g])
            movable = [s for s in decoding if s.group == hi and not s.inflight and load[hi] - load[lo] > s.weight]
            if not movable:
                break
            s = movable[-1]
            s.group = lo
            load[hi] -= s.weight
            load[lo] += s.weight

    def _send_decodes(self, group: list[Session], now: float) -> None:
        """One decode unit: a token per session of the group (plus its drafts when it speculates)."""
        if not group:
            return
        segs, ids, budget = [], [], self.max_batch_tokens
        width = len(group)
        drafting = False
        for s in group:
            if budget <= 0:
                break
            draft: tuple[int, ...] = ()
            if s.proposer is not None and not s.want_logits:
                draft = self._draft(s, budget - 1, width, drafting)
                width += len(draft)
                drafting = drafting or bool(draft)
            known = s.ids_at(s.sent, 1, False)
            segs.append(
                Segment(
                    s.id, s.epoch, s.sent, 1 + len(draft), s.decode_params, s.want_logits, draft, known, s.output_from
                )
            )
            ids.append(s.tokens[s.sent])
            ids.extend(draft)
            s.sent += 1
            s.sent_at.append(now)
            s.inflight_draft = len(draft)
            budget -= 1 + len(draft)
        for s in group[: len(segs)]:
            s.sent_width, s.sent_verify = len(ids), drafting
        self.units_sent["decode"] += 1
        self._submit_work(Work(segs, tokens=torch.tensor(ids, dtype=torch.long)))

    def _send_prefills(self, now: float, decode_width: int) -> None:
        """Chunks of the sessions still prefilling, up to `prefill_depth` per session in flight, packed
        into units (one chunk per session and unit). While sessions decode a unit is cut to the width
        whose measured cost is PREFILL_SHARE of the widest decode unit's."""
        budget_cap = self.max_batch_tokens
        if decode_width:
            budget_cap = min(budget_cap, self._prefill_budget(decode_width))
        while True:
            ready = [
                s
                for s in self.sessions.values()
                if not s.done and not s.decoding and s.sent < len(s.tokens) and s.inflight < self.prefill_depth
            ]
            if not ready:
                return
            ready.sort(key=lambda s: s.t_submit)
            segs, ids, budget = [], [], budget_cap
            for s in ready:
                chunk = (
                    chunk_after_hit(s.prompt_len - s.cached, self.prefill_depth, self.prefill_chunk)
                    if s.cached
                    else self.prefill_chunk
                )
                n = 1 if s.incremental else min(len(s.tokens) - s.sent, chunk, budget)
                if n <= 0:
                    break
                keys = {}
                if self.prefixes is not None:  # cut at the next snapshot point; the keys the stages keep
                    n, keys = self.prefixes.cut(s, n)
                last = s.sent + n == len(s.tokens)
                sample = s.seg_params if last and not s.want_logits else None
                known = s.ids_at(s.sent, n, True)
                history = (  # the cached prefix's ids, for a sampler that counts the prompt (Segment.history)
                    tuple(s.tokens[: s.sent]) if "prefix" in keys and s.params.needs_prompt_ids else ()
                )
                segs.append(
                    Segment(
                        s.id,
                        s.epoch,
                        s.sent,
                        n,
                        sample,
                        s.want_logits,
                        (),
                        known,
                        s.output_from,
                        s.scores_prompt(s.sent, n) if known else None,
                        history=history,
                        **keys,
                    )
                )
                ids.extend(s.tokens[s.sent : s.sent + n])
                s.sent += n
                s.sent_at.append(now)
                s.inflight_draft = 0
                budget -= n
            for s in ready[: len(segs)]:
                s.sent_width, s.sent_verify = len(ids), False
            self.units_sent["prefill"] += 1
            self._submit_work(Work(segs, tokens=torch.tensor(ids, dtype=torch.long)))

    def _prefill_budget(self, decode_width: int) -> int:
        """Tokens of a prefill unit that cost (on the entry's stage, as measured) at most PREFILL_SHARE of
        a decode unit of `decode_width` tokens: the largest such width, at least 1."""
        cost = self.stage_cost
        ref = cost.estimate(decode_width) if cost is not None else None
        if ref is None:
            return self.max_batch_tokens
        ref *= PREFILL_SHARE
        lo, hi = 1, self.max_batch_tokens
        if (cost.estimate(hi) or 0.0) <= ref:
            return hi
        while hi - lo > 1:  # the estimate grows with the width
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if cost.estimate(mid) <= ref else (lo, mid)
        return lo

    def _cost(self, width: int, verify: bool) -> float | None:
        """Estimated ring ms of a batch of `width` tokens, with drafts (verify) or without."""
        plain = self.pass_cost.estimate(width)
        return plain if not verify else (self.verify_cost.estimate(width) or plain)

    def _draft(self, s: Session, room: int, width: int, drafting: bool) -> tuple[int, ...]:
        """The tokens to draft after s's last accepted token; `width`: the batch's tokens without them;
        `drafting`: whether an earlier session of the batch drafts (the batch pays for drafts already)."""
        kmax = min(s.params.draft_tokens, s.params.max_tokens - len(s.generated) - 1, room, MAX_DRAFT)
        if kmax <= 0:
            return ()
        if self.draft_policy == "adaptive":
            k = s.draft_len.choose(kmax, lambda k: self._cost(width + k, drafting or k > 0))
        else:
            k = kmax
        if k == 0:
            # a shadow guess: what the proposer would draft first, checked against the token the ring
            # returns, so the session keeps learning its acceptance while it does not speculate (and
            # starts again when drafting would pay)
            t0 = time.perf_counter_ns()
            d = s.proposer.propose(s.tokens, 1)
            s.draft_ns += time.perf_counter_ns() - t0
            s.shadow = d[0] if d else None
            return ()
        t0 = time.perf_counter_ns()
        d = s.proposer.propose(s.tokens, k)
        s.draft_ns += time.perf_counter_ns() - t0
        s.drafts += 1
        return tuple(d[:k])

    def schedule_stats(self) -> dict:
        """For the status: the schedule, and the units it keeps in the ring now."""
        live = self.live()
        return {
            "micro_batches": self.micro_batches,
            "prefill_depth": self.prefill_depth,
            "units_sent": dict(self.units_sent),
            "decoding": sum(1 for s in live if s.decoding),
            "prefilling": sum(1 for s in live if not s.decoding),
            "in_flight": sum(s.inflight for s in live),
        }

    def spec_stats(self) -> dict:
        """For the status: the measured ring time by pass width and the totals of speculating sessions."""
        t = self.spec_totals
        return {
            "ring_ms_by_width": self.pass_cost.table(),
            "ring_ms_by_width_with_drafts": self.verify_cost.table(),
            "draft_policy": self.draft_policy,
            "spec_passes": t["passes"],
            "spec_proposed": t["proposed"],
            "spec_accepted": t["accepted"],
            "suffix_index_tokens": len(self.suffix_index),
        }

    def on_results(self, results: list[Result], logits: torch.Tensor | None) -> None:
        row = 0
        for r in results:
            s = self.sessions.get(str(r.session))
            if s is None or s.done or r.epoch != s.epoch:  # finished, or a unit of an epoch before a replay
                row += r.rows
                continue
            if r.code == ErrorCode.PREFIX_MISS and self.prefixes is not None:
                # a stage lost the prefix: again, from a shorter one. A session that named none gets the code
                # too when it shared the unit with one that did (a failed unit's segments share its error)
                self._prefix_missed(s)
                continue
            if r.code == ErrorCode.LOST_STATE and s.lost < MAX_LOST_REPLAYS:
                # a stage lost the session's state (a retain that raced its replay, a restarted stage): the
                # unit's earlier stages advanced theirs, so the session starts again everywhere. Every session
                # of the failed unit gets the code (a failed unit's segments share its error)
                s.lost += 1
                log.warning("session %s: %s; replaying it (%d of %d)", s.id, r.error, s.lost, MAX_LOST_REPLAYS)
                self._replay(s)
                continue
            if r.error is not None:
                self._finish(s, error=r.error, code=r.code or ErrorCode.FAILED)
                continue
            if not s.sent_at:  # nothing of it is in flight: a stray answer (a unit answered twice)
                row += r.rows
                continue
            t_sent = s.sent_at.popleft()  # a session's units come back in the order they left
            if s.want_logits:
                s.logits.append(logits[row : row + r.rows].clone())
                row += r.rows
                if s.sent >= len(s.tokens) and not s.sent_at:
                    self._finish(s)
                continue
            for k, e in enumerate(r.prompt_logprobs):  # echo: the prompt tokens this chunk's rows predict
                q = r.prompt_from + k
                if 0 < q < len(s.prompt_lps):
                    s.prompt_lps[q] = e
            if r.skip:
                continue
            now = time.perf_counter()
            if s.t_first is None:
                s.t_first = now
                if self.prefixes is not None:
                    self.prefixes.account(s)
            if len(r.accepted) > s.inflight_draft:
                self._finish(
                    s,
                    error=f"the ring accepted {len(r.accepted)} drafted tokens of {s.inflight_draft}",
                    code=ErrorCode.FAILED,
                )
                continue
            if s.decoding:  # ring time of decode passes (prefill chunks wait behind each other)
                (self.verify_cost if s.sent_verify else self.pass_cost).observe(s.sent_width, 1000 * (now - t_sent))
            s.decoding = True
            if s.proposer is not None:
                if s.inflight_draft == 0 and s.shadow is not None and r.tokens:
                    s.draft_len.observe(1, int(r.tokens[0] == s.shadow))  # the shadow guess, verified for free
                else:
                    s.draft_len.observe(s.inflight_draft, len(r.accepted))
                s.shadow = None
                s.proposed += s.inflight_draft
                s.accepted += len(r.accepted)
                s.passes += 1
                t = self.spec_totals
                t["passes"], t["proposed"], t["accepted"] = (
                    t["passes"] + 1,
                    t["proposed"] + s.inflight_draft,
                    t["accepted"] + len(r.accepted),
                )
            s.sent += len(r.accepted)  # the ring holds the accepted drafts already
            s.inflight_draft = 0
            added = 0
            lps = r.logprobs if s.params.logprobs is not None else ()
            if s.params.logprobs is not None and len(lps) != len(r.tokens):
                self._finish(s, error=f"the ring sent {len(lps)} logprobs for {len(r.tokens)} tokens", code="failed")
                continue
            # accepted drafts, then the token after them; a stop id or max_tokens ends it
            for k, tok in enumerate(r.tokens):
                s.tokens.append(tok)
                if lps:
                    s.logprobs.append(lps[k])
                s.out.put_nowait(tok)
                added += 1
                if tok in s.params.stop_ids or len(s.generated) >= s.params.max_tokens:
                    self._finish(s)
                    break
            s.pass_tokens += added
        self.kick()

    def _prefix_missed(self, s: Session) -> None:
        """Start `s` again at a new epoch (the stages drop the old one's state) from the next longest prefix."""
        s.epoch += 1
        s.inflight_draft, s.decoding, s.group = 0, False, None
        s.sent_at.clear()
        self.prefixes.missed(s)

    def _finish(self, s: Session, error: str | None = None, code: str | None = None) -> None:
        s.done, s.error, s.error_code = True, error, code
        s.sent_at.clear()
        s.t_done = time.perf_counter()
        if isinstance(s.proposer, SuffixProposer) and len(s.tokens) > s.prompt_len:
            self.suffix_index.add(s.tokens[max(0, s.prompt_len - 8) :])  # the output, with a little context
        s.out.put_nowait(None)
        if code == "cancelled":
            self.cancelled += 1
        elif error:
            self.failed += 1
        else:
            self.finished += 1
        if self.prefixes is not None and code in (None, ErrorCode.CANCELLED):
            self.prefixes.finished(s)  # the stages keep its reply too, before they free it
        self._free_sessions([(s.id, s.epoch)])
        self.sessions.pop(s.id, None)
        if self.on_finish is not None:
            self.on_finish(s)
