"""Soak benchmark (not a test): many concurrent greedy sessions through a local ring with standbys for a
fixed time, with one SIGKILL of a middle stage and one restart in the middle. Every finished session is
checked against the in-process reference, so "tokens lost" counts sessions whose tokens differ.

    python tools/soak.py --minutes 10 --sessions 64 [--model DIR] [--nodes 4]

Prints: sessions completed, tokens lost (must be 0), daemon RSS over time (MB, per minute), p50 / p99
inter-token latency, and the longest stall the kill caused (the largest gap between two tokens of any
session around the kill) against the p99 gap of the minute before it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import time
from pathlib import Path


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def soak(args) -> None:
    from p2pk3.engine.reference import Pipeline, default_model_dir
    from p2pk3.node.client import RequestError
    from p2pk3.node.local import LocalRing
    from p2pk3.params import SamplingParams

    model = Path(args.model) if args.model else default_model_dir()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))] for _ in range(32)]
    lengths = [rng.randrange(16, 64) for _ in prompts]
    ref = Pipeline.load(model, 1, max_sessions=4, max_tokens=8192)
    want = [ref.generate([p], SamplingParams(max_tokens=n))[0] for p, n in zip(prompts, lengths)]
    del ref
    ring = LocalRing(model, args.nodes, standby=2, extra_args=["--max-sessions", str(max(64, args.sessions + 8))])
    await asyncio.to_thread(ring.start)  # (LocalRing.start runs its own event loop for the probes)
    t0 = time.time()
    end = t0 + 60 * args.minutes
    kill_at, restart_at = t0 + 60 * args.minutes * 0.4, t0 + 60 * args.minutes * 0.6
    gaps: list[tuple[float, float]] = []  # (time, gap since the session's previous token)
    done = lost = failed = 0
    rss: list[tuple[float, float]] = []
    victim = ring.topo.active[len(ring.topo.active) // 2].id

    async def worker(w: int) -> None:
        nonlocal done, lost, failed
        c = await ring.client()
        try:
            while time.time() < end:
                i = rng.randrange(len(prompts))
                last = [time.perf_counter()]

                def on_token(_t, last=last):
                    now = time.perf_counter()
                    gaps.append((time.time(), now - last[0]))
                    last[0] = now

                try:
                    r = await c.generate(prompts[i], SamplingParams(max_tokens=lengths[i]), on_token=on_token)
                except RequestError as e:
                    failed += 1
                    print(f"  session failed: {e}")
                    continue
                done += 1
                if r.tokens != want[i]:
                    lost += 1
        finally:
            c.close()

    async def chaos() -> None:
        killed = restarted = False
        while time.time() < end:
            now = time.time()
            if not killed and now >= kill_at:
                print(f"  t={now - t0:.0f}s: SIGKILL slot {victim}")
                ring.signal(victim, signal.SIGKILL)
                killed = True
            if killed and not restarted and now >= restart_at:
                print(f"  t={now - t0:.0f}s: restarting the killed process as a standby-slot spare")
                ring.procs.pop(victim, None)
                spare = ring.topo.standby[-1].id
                if spare in ring.procs and ring.procs[spare].poll() is None:
                    ring.procs[spare].kill()
                ring.spawn(spare)
                restarted = True
            rss.append((now - t0, sum(rss_mb(p.pid) for p in ring.procs.values() if p.poll() is None)))
            await asyncio.sleep(5)

    try:
        await asyncio.gather(chaos(), *(worker(w) for w in range(args.sessions)))
    finally:
        ring.stop()
    tokens = len(gaps)
    g = sorted(x for _, x in gaps)
    before = sorted(x for t, x in gaps if kill_at - 60 <= t < kill_at) or [0.0]
    around = [x for t, x in gaps if kill_at <= t < kill_at + 30] or [0.0]
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    print(f"\nsoak: {args.minutes} min, {args.sessions} concurrent sessions, {args.nodes} nodes + 2 standbys")
    print(f"sessions completed: {done}   failed: {failed}   tokens lost (sessions with other tokens): {lost}")
    print(f"tokens streamed: {tokens}  ({tokens / (60 * args.minutes):.1f} tok/s aggregate)")
    print(f"inter-token latency: p50 {1000 * statistics.median(g):.1f} ms   p99 {1000 * pct(g, 0.99):.1f} ms")
    print(
        f"stall caused by the kill: longest gap {max(around):.2f} s vs p99 {1000 * pct(before, 0.99):.0f} ms "
        f"in the minute before"
    )
    print("daemon RSS (sum over processes, MB): " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in rss[::12]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--model", default=None)
    asyncio.run(soak(ap.parse_args()))


if __name__ == "__main__":
    main()
