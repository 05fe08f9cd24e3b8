"""The discrete-event ring.

Streams start together. The entry (stage 0) schedules, like p2pk3/node/entry.py, decode steps first and
then prefill chunks of at most `prefill_chunk` tokens; a stage that is free takes everything queued (up to
`max_batch_tokens`) as one packed batch (continuous batching), runs it for `CostModel.pass_s`, and sends it
on after the hop; the last stage returns results to the entry, which queues each stream's next unit. With
speculation every decode pass of a stream is (k + 1) tokens wide and yields `accept` tokens on average.
Stages on a shared CPU (`cpu.cores` > 0) run under processor sharing: with n passes running and b
runnable processes of others, each pass advances at min(1, cores / (n + b)). Optionally (`sleep_gap_s`, off
by default: on this host it did not hold from one run to the next) a pass whose stage waited longer than
that for its input is treated as a woken sleeper and shares the cores only with our own passes."""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from .model import CostModel, Unit


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
    max_batch_streams: int = 0  # units per stage pass (0: no limit): micro-batches that fill the pipeline


@dataclass
class SimResult:
    streams: int
    per_stream_tps: float  # decode tokens/s of one stream, first token to last (mean over streams)
    aggregate_tps: float  # the sum of the streams' decode speeds (tokens/s of the ring while they all decode)
    ttft_s: float  # mean time to first token
    token_ms_1: float  # one stream alone: ms per decode pass (analytic sum, for the breakdown)
    stages: list[dict] = field(default_factory=list)  # per stage: mean batch, pass ms, busy fraction, items
    meta: dict = field(default_factory=dict)


def run(cost: CostModel, w: Workload, cores: int = 0, background: float = 0.0, sleep_gap_s: float = math.inf) -> SimResult:
    S = len(cost.stages)
    queues: list[list[Unit]] = [[] for _ in range(S)]
    busy = [False] * S
    busy_time = [0.0] * S
    passes = [0] * S
    tok_in = [0] * S
    items: list[dict] = [dict() for _ in range(S)]
    ev: list = []
    seq = 0
    now = 0.0
    # processor sharing state (cores > 0): running job -> remaining work
    running: dict[int, list] = {}  # stage -> [remaining work s, units, start]
    version = 0
    last = 0.0

    def push(t, kind, data):
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (t, seq, kind, data))

    done_prompt = [0] * w.streams
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

    def next_unit(i: int) -> Unit | None:
        if done_prompt[i] < w.prompt:
            n = min(w.prefill_chunk, w.prompt - done_prompt[i])
            return Unit(i, n, done_prompt[i] + n, True)
        if made[i] >= w.new_tokens:
            return None
        ctx = w.context if w.context else w.prompt + int(made[i])
        return Unit(i, w.width, ctx, False)

    def try_start(k: int):
        if busy[k] or not queues[k]:
            return
        q = queues[k]
        q.sort(key=lambda u: u.prefill)  # decode steps first, then prefill chunks
        take, n = [], 0
        while q and (not take or n + q[0].n_tokens <= w.max_batch_tokens) and \
                (not w.max_batch_streams or len(take) < w.max_batch_streams):
            u = q.pop(0)
            take.append(u)
            n += u.n_tokens
        busy[k] = True
        d = cost.pass_s(k, take)
        for name, v in cost.stages[k].breakdown.items():
            items[k][name] = items[k].get(name, 0.0) + v
        passes[k] += 1
        tok_in[k] += n
        if cores > 0:
            advance(now)
            running[k] = [d, take, now, now - idle_since[k] < sleep_gap_s]
            reschedule()
        else:
            busy_time[k] += d
            push(now + d, "done", (k, take))

    def finish(k: int, take: list[Unit]):
        busy[k] = False
        hop = cost.hop_out_s(k, take) if S > 1 else 0.0
        push(now + hop, "arrive", ((k + 1) % S, take, k == S - 1))
        try_start(k)

    for i in range(w.streams):
        queues[0].append(next_unit(i))
    try_start(0)
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
            k, take, result = data
            if result:  # back at the entry: next unit of each stream
                for u in take:
                    i = u.stream
                    if u.prefill:
                        done_prompt[i] += u.n_tokens
                        if done_prompt[i] >= w.prompt:
                            made[i] += 1  # the prefill's last position samples the first token
                            t_first[i] = now
                            t_last[i] = now
                    else:
                        made[i] = min(w.new_tokens, made[i] + w.accept)
                        t_last[i] = now
                    nu = next_unit(i)
                    if nu is not None:
                        queues[0].append(nu)
                try_start(0)
            else:
                queues[k].extend(take)
                try_start(k)
    makespan = max(t_last) if w.streams else 0.0

    per = [(w.new_tokens - 1) / (t_last[i] - t_first[i]) for i in range(w.streams) if t_last[i] > t_first[i]]
    aggregate = sum(per) if per else math.nan  # concurrent streams: the sum of their decode speeds
    stages = []
    for k, s in enumerate(cost.stages):
        stages.append({"stage": s.slot, "passes": passes[k], "mean_batch_tokens": tok_in[k] / max(1, passes[k]),
                       "mean_pass_ms": 1e3 * busy_time[k] / max(1, passes[k]),
                       "busy": busy_time[k] / makespan if makespan else 0.0,
                       "items_ms": {n: 1e3 * v / max(1, passes[k]) for n, v in items[k].items()}})
    one = sum(cost.pass_s(k, [Unit(0, w.width, w.context or w.prompt, False)]) for k in range(S))
    one += sum(cost.hop_out_s(k, [Unit(0, w.width, 0, False)]) for k in range(S)) if S > 1 else 0.0
    return SimResult(w.streams, sum(per) / len(per) if per else math.nan,
                     aggregate,
                     sum(t_first) / w.streams if all(t is not None for t in t_first) else math.nan,
                     1e3 * one, stages)
