"""Chaos run (not a test): `--sessions` concurrent streaming requests over the OpenAI API of a loopback
ring of `p2pk3 node` processes with spares, while a random stage (never the entry) is, in turn, killed
(SIGKILL), stopped (SIGSTOP for `--stop-s`, then SIGCONT), slowed (a SIGSTOP/SIGCONT duty cycle running
`--slow-duty` of the time, for `--slow-s`) and partitioned (`--fault-signals`: every frame it sends is
black-holed for `--cut-s`; p2pk3/transport/faults.py). After each fault, once the ring serves again, a
spare is started on every standby slot whose process is gone (the pool stays full).

    python tools/chaos.py --minutes 10 [--sessions 64] [--nodes 3] [--spares 3] [--model DIR]

First an undisturbed pass (every prompt once, greedy): its texts are the reference; then `--base-s` of
the same load as the chaos without faults: its inter-token gaps are the baseline. Then the chaos: every
reply must equal the reference (a lost or repeated token changes it), every request must succeed, and
the p99 inter-token gap outside the fault windows (a fault's start until the ring serves again and the
replay is done: at most a quarter of the sessions prefilling, plus `--settle-s`; a gap that overlaps a window is in it) is
compared with the undisturbed p99. Prints the figures and
exits 1 when a token was lost, a request failed, or the p99 ratio is above `--max-p99-ratio` (1.5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time

import aiohttp

from p2pk3.api import start_api_in_background
from p2pk3.engine.reference import default_model_dir
from p2pk3.node.local import LocalRing, free_ports, probe

FAULTS = ("kill", "stop", "slow", "partition")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Run:
    def __init__(self, a, ring: LocalRing, url: str, model: str):
        self.a, self.ring, self.url, self.model = a, ring, url, model
        rng = random.Random(0)
        self.prompts = [f"Question {i}: {rng.choice(WORDS)} {rng.choice(WORDS)}?" for i in range(a.sessions)]
        self.want: dict[int, str] = {}
        self.gaps: list[tuple[float, float]] = []  # (time, gap since the previous chunk of that request)
        self.done = self.wrong = 0
        self.failed: list[str] = []
        self.windows: list[list[float]] = []  # [start, end] of each fault until the ring served again
        self.log: list[str] = []

    def say(self, msg: str) -> None:
        line = f"  t={time.time() - self.t0:5.0f}s  {msg}"
        self.log.append(line)
        print(line, flush=True)

    async def one(self, s: aiohttp.ClientSession, i: int, gaps: list | None) -> str:
        body = {
            "model": self.model,
            "prompt": self.prompts[i],
            "max_tokens": self.a.tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text, last = [], None
        async with s.post(self.url + "/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    raise RuntimeError(f"stream error: {d['error']}")
                now = time.perf_counter()
                if gaps is not None and last is not None:  # between tokens (the first one's wait is TTFT)
                    gaps.append((time.time(), now - last))
                last = now
                text.extend(c.get("text", "") for c in d.get("choices", []))
        return "".join(text)

    async def worker(self, s, w: int, end: float | None, gaps: list) -> None:
        """Requests until `end`, or with None until `self.end` (the chaos, which `--faults` may cut short)."""
        i = w
        while time.time() < (self.end if end is None else end):
            try:
                got = await self.one(s, i, gaps)
                self.done += 1
                self.wrong += got != self.want[i]
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                self.failed.append(f"request {i}: {e}")
                self.say(f"request failed: {e}")
                await asyncio.sleep(1.0)
            i = (i + self.a.sessions // 2 + 1) % self.a.sessions

    async def entry_status(self) -> dict | None:
        for sid in list(self.ring.procs):
            st = await probe(self.ring.address(sid), self.ring.secret)
            if st and st.get("role") == "entry":
                return st
        return None

    async def victim(self):
        """(slot, process) of a random stage that is not the entry, one that came from the spare pool where
        there is one: when it goes, its standby slot takes a fresh spare, so the pool stays full."""
        doc = await self.ring.state()
        stages = [n for n in doc["nodes"] if n["role"] == "stage"]
        if not stages:
            return None, None
        spares = [n for n in stages if self.ring.topo.slot(n["started_on"]).standby]
        n = random.choice(spares or stages)
        return n["slot"], self.ring.procs[n["started_on"]]

    async def serving(self, timeout: float = 120.0) -> bool:
        """Until the entry serves with every slot up (not paused, nothing down, not unavailable)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = await self.entry_status()
            if st and not st.get("paused") and not st.get("down") and not st.get("unavailable"):
                return True
            await asyncio.sleep(0.5)
        return False

    async def caught_up(self, timeout: float = 240.0) -> bool:
        """Until the replay is done: a repair re-prefills every live session, while in steady state only
        the few new requests are prefilling (at most a quarter of the sessions)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = await self.entry_status() or {}
            prefilling = (st.get("schedule") or {}).get("prefilling")
            if prefilling is not None and prefilling <= max(2, self.a.sessions // 4) and not st.get("paused"):
                return True
            await asyncio.sleep(0.5)
        return False

    async def noticed(self, t: float, timeout: float = 10.0) -> None:
        """Until the entry logged something about the fault begun at `t` (a slot down, degraded, taken
        over), or `timeout` passed (a fault it rode out)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = await self.entry_status() or {}
            if any(e.get("t", 0) >= t for e in st.get("events", [])):
                return
            await asyncio.sleep(0.25)

    def refill(self) -> None:
        """A spare on every standby slot whose process is gone."""
        for s in self.ring.topo.standby:
            p = self.ring.procs.get(s.id)
            if p is not None and p.poll() is not None:
                self.ring.spawn(s.id)
                self.say(f"spare started on standby slot {s.id}")

    async def fault(self, kind: str) -> None:
        slot, p = await self.victim()
        if p is None:
            self.say(f"{kind}: no stage to hit")
            return
        a, t = self.a, time.time()
        self.windows.append([t, t])
        try:
            if kind == "kill":
                self.say(f"SIGKILL slot {slot} (pid {p.pid})")
                p.kill()
            elif kind == "stop":
                self.say(f"SIGSTOP slot {slot} for {a.stop_s:.0f} s")
                p.send_signal(signal.SIGSTOP)
                await asyncio.sleep(a.stop_s)
                p.send_signal(signal.SIGCONT)
            elif kind == "slow":
                self.say(f"slow slot {slot}: running {a.slow_duty:.0%} of every 0.3 s for {a.slow_s:.0f} s")
                end = time.time() + a.slow_s
                while time.time() < end and p.poll() is None:
                    p.send_signal(signal.SIGSTOP)
                    await asyncio.sleep(0.3 * (1 - a.slow_duty))
                    p.send_signal(signal.SIGCONT)
                    await asyncio.sleep(0.3 * a.slow_duty)
            else:
                self.say(f"partition slot {slot} for {a.cut_s:.0f} s (it sends nothing)")
                p.send_signal(signal.SIGUSR1)
                await asyncio.sleep(a.cut_s)
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR2)
        finally:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        await self.noticed(t)
        ok = await self.serving() and await self.caught_up()
        st = await self.entry_status() or {}
        took = [e for e in st.get("events", []) if e.get("event") in ("takeover", "degraded") and e["t"] >= t]
        self.say(
            f"{kind} of {slot}: {'serving again' if ok else 'NOT serving'} after {time.time() - t:.1f} s; "
            + (", ".join(f"{e['event']} of {e['slot']}" for e in took) or "no takeover")
        )
        await asyncio.sleep(self.a.settle_s)
        self.windows[-1][1] = time.time()
        self.refill()

    async def main(self) -> int:
        a = self.a
        self.t0 = time.time()
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
            base_gaps: list = []
            texts = await asyncio.gather(*(self.one(s, i, None) for i in range(a.sessions)))
            self.want = dict(enumerate(texts))
            t1 = time.time() + a.base_s  # the same load as below, without faults: the baseline
            await asyncio.gather(*(self.worker(s, w, t1, base_gaps) for w in range(a.sessions)))
            base_p99 = pct([g for _, g in base_gaps], 0.99)
            self.say(
                f"undisturbed {a.base_s:.0f} s: {self.done} requests, {len(base_gaps)} gaps, "
                f"p99 inter-token {1000 * base_p99:.0f} ms"
            )
            base_bad = bool(self.wrong or self.failed)
            if base_bad:
                self.say("the undisturbed run itself differed from the reference or failed")
            self.done = self.wrong = 0
            self.t0 = time.time()
            self.end = self.t0 + 60 * a.minutes
            workers = [asyncio.create_task(self.worker(s, w, None, self.gaps)) for w in range(a.sessions)]
            rng, k = random.Random(a.seed), 0
            await asyncio.sleep(a.quiet_s)
            while time.time() < self.end - a.quiet_s and (a.faults is None or k < a.faults):
                await self.fault(FAULTS[k % len(FAULTS)])
                k += 1
                await asyncio.sleep(rng.uniform(0.5, 1.5) * a.quiet_s)
            if a.faults is not None and k == a.faults:  # the last fault's quiet period was the run's end
                self.end = min(self.end, time.time())
            await asyncio.wait_for(asyncio.gather(*workers), 600)
        # a gap is outside the windows when it neither ends nor began in one (nor spans one)
        calm = [g for t, g in self.gaps if not any(t - g <= w1 and t >= w0 for w0, w1 in self.windows)]
        p99 = pct(calm, 0.99)
        ratio = p99 / base_p99
        print(
            f"\nchaos: {a.minutes:g} min, {a.sessions} sessions over the API, {a.nodes} nodes + {a.spares} spares, "
            f"{k} faults ({', '.join(FAULTS[i % len(FAULTS)] for i in range(k))})"
        )
        print(f"requests completed: {self.done}   failed: {len(self.failed)}   with other tokens: {self.wrong}")
        print(
            f"p99 inter-token outside the fault windows: {1000 * p99:.0f} ms vs {1000 * base_p99:.0f} ms "
            f"undisturbed ({ratio:.2f}x; {len(calm)} of {len(self.gaps)} gaps outside the windows)"
        )
        bad = base_bad or self.wrong or self.failed or ratio > a.max_p99_ratio
        return 1 if bad else 0


WORDS = "ring slot stage token cache expert router layer spare entry epoch claim route heartbeat".split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=24, help="tokens per request")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--spares", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--base-s", type=float, default=40.0, help="seconds of the undisturbed baseline")
    ap.add_argument("--quiet-s", type=float, default=25.0, help="seconds between two faults (on average)")
    ap.add_argument("--settle-s", type=float, default=5.0, help="a fault's window lasts this long after recovery")
    ap.add_argument("--stop-s", type=float, default=8.0)
    ap.add_argument("--slow-s", type=float, default=30.0)
    ap.add_argument("--slow-duty", type=float, default=0.25, help="share of the time the slowed stage runs")
    ap.add_argument("--cut-s", type=float, default=10.0)
    ap.add_argument("--max-p99-ratio", type=float, default=1.5)
    ap.add_argument(
        "--faults",
        type=int,
        default=None,
        help="end the run a quiet period after this many faults, --minutes being then the most it may take "
        "(default: faults until --minutes are over)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--node-arg", action="append", default=[], help="extra `p2pk3 node` argument (repeatable)")
    a = ap.parse_args()
    random.seed(a.seed)
    model = a.model or str(default_model_dir())
    extra = ["--fault-signals", "--max-sessions", str(a.sessions + 16), *a.node_arg]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with LocalRing(model, a.nodes, standby=a.spares, extra_args=extra) as ring:
        api = start_api_in_background(ring.topology, "127.0.0.1", free_ports(1)[0])
        try:
            return asyncio.run(Run(a, ring, api.url, os.path.basename(os.path.normpath(model))).main())
        finally:
            api.stop()


if __name__ == "__main__":
    sys.exit(main())
