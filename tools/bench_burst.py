"""Bursts against `p2pk3 serve` in front of a 2-node ring with the default admission settings (issue 25):
every request of a burst is sent at once; each must be answered 200, or, once the entry's queue is full,
429 with a Retry-After header; the processes' memory must stay bounded.

    python tools/bench_burst.py [--nodes 2] [--bursts 64 400] [--tokens 16]

The baseline, measured in the same run: a burst of exactly the session capacity (no request waits). For
each burst it prints the answers by status, whether every 429 carried Retry-After, the wall time, the
median and p99 latency, the aggregate tokens/s as a ratio to the baseline's, and the peak resident memory
of the entry, the other node and the API server as a ratio to their idle memory before the first burst.
Requests are non-streaming chat completions of a fixed length (`ignore_eos`), greedy."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections import Counter

import aiohttp

from p2pk3.api import start_api_in_background
from p2pk3.engine.reference import default_model_dir
from p2pk3.node.local import LocalRing, free_ports, probe
from p2pk3.node.options import DEFAULT_SESSIONS

MODEL = default_model_dir().name
QUESTIONS = ["What does the with statement do?", "How do I open a file?", "What is a generator?", "What is a dict?"]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """Samples the resident memory of some processes every 50 ms (a thread) and keeps each one's peak."""

    def __init__(self, pids: dict[str, int]):
        self.pids, self.peak = pids, {k: rss(p) for k, p in pids.items()}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.05):
            for k, p in self.pids.items():
                try:
                    self.peak[k] = max(self.peak[k], rss(p))
                except OSError:
                    pass

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(2)


async def burst(url: str, n: int, tokens: int) -> dict:
    """n chat completions at once; their statuses, Retry-After headers, latencies and tokens."""

    async def one(s, i):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": tokens,
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        async with s.post(url + "/chat/completions", json=body) as r:
            doc = await r.json()
            done = time.perf_counter() - t0
            n_tok = doc["usage"]["completion_tokens"] if r.status == 200 else 0
            if r.status not in (200, 429):
                errors[f"{r.status}: {doc.get('error', {}).get('message', doc)}"[:200]] += 1
            return r.status, r.headers.get("Retry-After"), done, n_tok

    errors: Counter = Counter()
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(s, i) for i in range(n)))
        wall = time.perf_counter() - t0
    ok = sorted(d for st, _, d, _ in res if st == 200)
    return {
        "n": n,
        "status": Counter(st for st, *_ in res),
        "retry_after_missing": sum(1 for st, ra, *_ in res if st == 429 and not ra),
        "retry_after": sorted({int(ra) for st, ra, *_ in res if st == 429 and ra}),
        "wall_s": wall,
        "p50_s": statistics.median(ok) if ok else None,
        "p99_s": ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else None,
        "tokens": sum(t for *_, t in res),
        "errors": errors,
    }


async def wait_idle(ring, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sts = await asyncio.gather(*(probe(ring.address(s.id), ring.secret) for s in ring.topo.active))
        if all(st and st.get("sessions") == 0 and not (st.get("admission") or {}).get("queued") for st in sts):
            return sts[0]
        await asyncio.sleep(0.1)
    raise TimeoutError("the ring still holds sessions")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--bursts", type=int, nargs="+", default=[64, 400])
    ap.add_argument("--tokens", type=int, default=16, help="generated tokens per request")
    a = ap.parse_args()
    mdir = default_model_dir()
    with LocalRing(mdir, a.nodes) as ring:  # the defaults: 32 sessions, a queue of 4 x 32, 600 s
        api = start_api_in_background(ring.topology, "127.0.0.1", free_ports(1)[0])
        try:
            pids = {"entry": ring.procs["s0"].pid, "node s1": ring.procs["s1"].pid, "api": api.proc.pid}

            async def bench():
                await burst(api.url, 2, 4)  # warm-up
                st = await wait_idle(ring)
                adm = st["admission"]
                idle = {k: rss(p) for k, p in pids.items()}
                rows = []
                for n in [adm["capacity"], *a.bursts]:
                    await wait_idle(ring)
                    with PeakRss(pids) as mem:
                        r = await burst(api.url, n, a.tokens)
                    r["peak"] = dict(mem.peak)
                    rows.append(r)
                st = await wait_idle(ring)
                return adm, idle, rows, st["admission"]

            adm, idle, rows, after = asyncio.run(bench())
        finally:
            api.stop()
    base = rows[0]["tokens"] / rows[0]["wall_s"]
    print(
        f"`p2pk3 serve` + {a.nodes}-node ring, embedded model, defaults: {adm['capacity']} sessions "
        f"(DEFAULT_SESSIONS {DEFAULT_SESSIONS}), queue {adm['max_queue']}, queue timeout {adm['timeout_s']:g} s; "
        f"{a.tokens} tokens per request; baseline: a burst of {rows[0]['n']} (the capacity)"
    )
    print(
        f"{'burst':>5} | {'200':>4} {'429':>4} {'other':>5} {'429 w/o Retry-After':>19} {'Retry-After s':>13} | "
        f"{'wall s':>7} {'p50 s':>6} {'p99 s':>6} {'tok/s vs base':>13} | "
        + " ".join(f"{k + ' RSS peak/idle':>22}" for k in idle)
    )
    bad = 0
    for r in rows:
        st = r["status"]
        other = sum(v for k, v in st.items() if k not in (200, 429))
        ra = f"{r['retry_after'][0]}..{r['retry_after'][-1]}" if r["retry_after"] else "-"
        mem = " ".join(
            f"{r['peak'][k] / 2**20:>8.0f} MiB {r['peak'][k] / idle[k]:>5.2f}x      " for k in idle
        )
        print(
            f"{r['n']:>5} | {st.get(200, 0):>4} {st.get(429, 0):>4} {other:>5} "
            f"{r['retry_after_missing']:>19} {ra:>13} | "
            f"{r['wall_s']:>7.1f} {r['p50_s'] or 0:>6.1f} {r['p99_s'] or 0:>6.1f} "
            f"{(r['tokens'] / r['wall_s']) / base:>13.2f} | {mem}"
        )
        for msg, k in r["errors"].most_common(3):
            print(f"      {k} x {msg}")
        expect_ok = min(r["n"], adm["capacity"] + adm["max_queue"])
        bad += other + r["retry_after_missing"] + (st.get(200, 0) < expect_ok)
    print(
        f"entry's queue afterwards: admitted {after['admitted']}, waited {after['waited']}, refused "
        f"{after['refused']}, timed out {after['timed_out']}, longest wait {after['max_wait_s']:.1f} s"
    )
    if bad:
        print("FAILED: a request was answered other than 200 / 429 with Retry-After, or fewer were served than fit")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
