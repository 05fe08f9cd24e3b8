"""The discrete-event ring, scheduled as the daemon schedules it (p2pk3/node/entry.py, worker.py).

Streams start together. The entry (stage 0) keeps `micro_batches` decode groups (M; 0: one per stage, the
daemon's default), balanced by tokens, each leaving as one unit as soon as its own previous pass is back,
and up to `prefill_depth` chunks (D; 0: one per stage) of each prompt in flight, packed one chunk per
stream into units of at most `max_batch_tokens`; while streams decode, a prefill unit is cut to
PREFILL_SHARE of the cost of the widest decode unit on stage 0. A free stage takes decode units before
prefill units, with at most one prefill unit between two decode batches; stage 0 runs the entry's units as they are, every other stage
batches what is queued of one kind (up to `max_batch_tokens`, never two units of one stream), runs it for
`CostModel.pass_s`, and sends it on after the hop; the last stage returns results to the entry. M = D = 1
is the schedule before micro-batches (one decode batch, one chunk of a prompt in flight). With speculation
every decode pass of a stream is (k + 1) tokens wide and yields `accept` tokens on average.
Stages on a shared CPU (`cpu.cores` > 0) run under processor sharing: with n passes running and b
runnable processes of others, each pass advances at min(1, cores / (n + b)). Optionally (`sleep_gap_s`, off
by default: on this host it did not hold from one run to the next) a pass whose stage waited longer than
that for its input is treated as a woken sleeper and shares the cores only with our own passes."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from p2pk3.node.options import chunk_after_hit

from .model import CostModel, Unit

PREFILL_SHARE = 0.5  # as p2pk3/node/entry.py: a prefill unit costs at most this share of a decode unit


@dataclass
class Workload:
    streams: int
    prompt: int = 1024
    new_tokens: int = 256
    context: int = 32768  # context at decode (MLA read); 0: prompt + tokens so far
    accept: float = 1.0  # tokens accepted per decode pass
    width: int = 1  # tokens per decode pass (k + 1)
    prefill_chunk: int = 2048
    max_batch_tokens: int = 2048
    micro_batches: int = 0  # decode groups in flight (0: one per stage, as the daemon's default)
    prefill_depth: int = 0  # chunks of one prompt in flight (0: one per stage, as the daemon's default)
    cached: int = 0  # prompt tokens the stages hold in their prefix caches already (a hit): not computed
    snapshot_span: int = 0  # with the prefix cache: chunks end at multiples of this (k x B: KDA snapshots)


@dataclass
class SimResult:
    streams: int
    per_stream_tps: float  # decode tokens/s of one stream, first token to last (mean over streams)
    aggregate_tps: float  # the sum of the streams' decode speeds (tokens/s of the ring while they all decode)
    ttft_s: float  # mean time to first token
    token_ms_1: float  # one stream alone: ms per decode pass (analytic sum, for the breakdown)
    stages: list[dict] = field(default_factory=list)  # per stage: mean batch, pass ms, busy fraction, items
    meta: dict = field(default_factory=dict)


def run(
    cost: CostModel, w: Workload, cores: int = 0, background: float = 0.0, sleep_gap_s: float = math.inf
) -> SimResult:
    S = len(cost.stages)
    M = w.micro_batches or S
    D = w.prefill_depth or S
    # a hit's remainder is cut finer, as the entry cuts it (node/options.py chunk_after_hit)
    chunk = chunk_after_hit(w.prompt - w.cached, D, w.prefill_chunk) if w.cached else w.prefill_chunk
    queues: list[list[list[Unit]]] = [[] for _ in range(S)]  # per stage: units (lists of Unit) in arrival order
    busy = [False] * S
    owed = [False] * S  # a prefill unit waited behind the last decode batch: it goes next
    busy_time = [0.0] * S
    passes = [0] * S
    tok_in = [0] * S
    items: list[dict] = [dict() for _ in range(S)]
    ev: list = []
    seq = 0
    now = 0.0
    # processor sharing state (cores > 0): running job -> remaining work
    running: dict[int, list] = {}  # stage -> [remaining work s, units, start, woken]
    version = 0
    last = 0.0

    def push(t, kind, data):
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (t, seq, kind, data))

    if not 0 <= w.cached < w.prompt:
        raise ValueError(f"cached prefix {w.cached} must be below the prompt's {w.prompt} tokens (one is computed)")
    sent_prompt = [w.cached] * w.streams  # a hit: the stages start the session there (prefix_cache.py)
    done_prompt = [w.cached] * w.streams
    inflight = [0] * w.streams
    group: list[int | None] = [None] * w.streams
    made = [0.0] * w.streams
    t_first = [None] * w.streams
    t_last = [0.0] * w.streams

    idle_since = [0.0] * S

    def rate(k: int) -> float:
        """A pass that follows a wait for input (a woken sleeper) shares the cores only with our other
        running passes; a stage that runs back to back also shares them with the others' runnable processes
        (the fair scheduler's treatment of sleepers vs always-runnable processes)."""
        if cores <= 0:
            return 1.0
        bg = background if running[k][3] else 0.0
        return min(1.0, cores / max(1e-9, len(running) + bg))

    def advance(t):
        nonlocal last
        if running:
            for k, job in running.items():
                job[0] -= (t - last) * rate(k)
        last = t

    def reschedule():
        nonlocal version
        version += 1
        if running:
            k = min(running, key=lambda j: running[j][0] / rate(j))
            push(last + max(0.0, running[k][0]) / rate(k), "ps_done", (k, version))

    def decoding(i: int) -> bool:
        return t_first[i] is not None and made[i] < w.new_tokens

    def ctx(i: int) -> int:
        return w.context if w.context else w.prompt + int(made[i])

    caps: dict[int, int] = {}

    def prefill_cap(width: int) -> int:
        """Tokens of a prefill unit costing (on stage 0) at most PREFILL_SHARE of a decode unit of `width` streams."""
        if width not in caps:
            caps[width] = _cap(width)
        return caps[width]

    def _cap(width: int) -> int:
        ref = PREFILL_SHARE * cost.pass_s(0, [Unit(0, w.width, ctx(0), False)] * width)
        lo, hi = 1, w.max_batch_tokens
        if cost.pass_s(0, [Unit(0, hi, hi, True)]) <= ref:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if cost.pass_s(0, [Unit(0, mid, mid, True)]) <= ref else (lo, mid)
        return lo

    def kick():
        """The entry: every idle decode group leaves, then prefill chunks up to the depth."""
        dec = [i for i in range(w.streams) if decoding(i)]
        load = [0] * M
        for i in dec:
            if group[i] is None:
                group[i] = min(range(M), key=lambda g: (load[g], any(inflight[j] for j in dec if group[j] == g), g))
            load[group[i]] += 1
        while True:  # a finished stream rebalances: move an idle one from the heaviest to the lightest group
            hi, lo = max(range(M), key=lambda g: load[g]), min(range(M), key=lambda g: load[g])
            if load[hi] - load[lo] <= 1:
                break
            mv = [i for i in dec if group[i] == hi and not inflight[i]]
            if not mv:
                break
            group[mv[-1]] = lo
            load[hi] -= 1
            load[lo] += 1
        groups: list[list[int]] = [[] for _ in range(M)]
        for i in dec:
            groups[group[i]].append(i)
        for members in groups:
            if members and not any(inflight[i] for i in members):
                for i in members:
                    inflight[i] += 1
                queues[0].append([Unit(i, w.width, ctx(i), False) for i in members])
        cap = min(w.max_batch_tokens, prefill_cap(max(load))) if dec else w.max_batch_tokens
        while True:
            ready = [i for i in range(w.streams) if sent_prompt[i] < w.prompt and inflight[i] < D]
            if not ready:
                break
            unit, budget = [], cap
            for i in ready:
                n = min(chunk, w.prompt - sent_prompt[i], budget)
                if w.snapshot_span:  # the entry cuts a chunk at the next snapshot point (prefix_match.py)
                    n = min(n, w.snapshot_span - sent_prompt[i] % w.snapshot_span)
                if n <= 0:
                    break
                sent_prompt[i] += n
                inflight[i] += 1
                budget -= n
                unit.append(Unit(i, n, sent_prompt[i], True))
            queues[0].append(unit)
        try_start(0)

    def take(k: int) -> list[Unit]:
        """What stage k runs next, as worker.py chooses it."""
        q = queues[k]
        kinds = [not u[0].prefill for u in q]
        has_prefill = not all(kinds)
        want = any(kinds) and not (owed[k] and has_prefill)
        owed[k] = want and has_prefill
        got, seen, blocked, n, rest = [], set(), set(), 0, []
        for kind, u in zip(kinds, q):
            ids = {x.stream for x in u}
            tokens = sum(x.n_tokens for x in u)
            if kind != want or ids & (seen | blocked) or (got and n + tokens > w.max_batch_tokens) or (got and k == 0):
                blocked |= ids
                rest.append(u)
                continue
            got.extend(u)
            seen |= ids
            n += tokens
        queues[k] = rest
        return got

    def try_start(k: int):
        if busy[k] or not queues[k]:
            return
        take_ = take(k)
        n = sum(u.n_tokens for u in take_)
        busy[k] = True
        d = cost.pass_s(k, take_)
        for name, v in cost.stages[k].breakdown.items():
            items[k][name] = items[k].get(name, 0.0) + v
        passes[k] += 1
        tok_in[k] += n
        if cores > 0:
            advance(now)
            running[k] = [d, take_, now, now - idle_since[k] < sleep_gap_s]
            reschedule()
        else:
            busy_time[k] += d
            push(now + d, "done", (k, take_))

    def finish(k: int, take_: list[Unit]):
        busy[k] = False
        hop = cost.hop_out_s(k, take_) if S > 1 else 0.0
        push(now + hop, "arrive", ((k + 1) % S, take_, k == S - 1))
        try_start(k)

    kick()
    guard = 0
    while ev:
        now, _, kind, data = heapq.heappop(ev)
        guard += 1
        if guard > 20_000_000:
            raise RuntimeError("simulation did not converge (over 20 M events)")
        if kind == "done":
            finish(*data)
        elif kind == "ps_done":
            k, ver = data
            if ver != version:
                continue
            advance(now)
            job = running.pop(k)
            busy_time[k] += now - job[2]
            idle_since[k] = now
            reschedule()
            finish(k, job[1])
        else:
            k, take_, result = data
            if result:  # back at the entry: the streams' next units
                for u in take_:
                    i = u.stream
                    inflight[i] -= 1
                    if u.prefill:
                        done_prompt[i] += u.n_tokens
                        if done_prompt[i] >= w.prompt:
                            made[i] += 1  # the prefill's last position samples the first token
                            t_first[i] = now
                            t_last[i] = now
                    else:
                        made[i] = min(w.new_tokens, made[i] + w.accept)
                        t_last[i] = now
                kick()
            else:
                queues[k].append(take_)
                try_start(k)
    makespan = max(t_last) if w.streams else 0.0

    per = [(w.new_tokens - 1) / (t_last[i] - t_first[i]) for i in range(w.streams) if t_last[i] > t_first[i]]
    aggregate = sum(per) if per else math.nan  # concurrent streams: the sum of their decode speeds
    stages = []
    for k, s in enumerate(cost.stages):
        stages.append(
            {
                "stage": s.slot,
                "passes": passes[k],
                "mean_batch_tokens": tok_in[k] / max(1, passes[k]),
                "mean_pass_ms": 1e3 * busy_time[k] / max(1, passes[k]),
                "busy": busy_time[k] / makespan if makespan else 0.0,
                "items_ms": {n: 1e3 * v / max(1, passes[k]) for n, v in items[k].items()},
            }
        )
    one = sum(cost.pass_s(k, [Unit(0, w.width, w.context or w.prompt, False)]) for k in range(S))
    one += sum(cost.hop_out_s(k, [Unit(0, w.width, 0, False)]) for k in range(S)) if S > 1 else 0.0
    return SimResult(
        w.streams,
        sum(per) / len(per) if per else math.nan,
        aggregate,
        sum(t_first) / w.streams if all(t is not None for t in t_first) else math.nan,
        1e3 * one,
        stages,
    )
