"""Benchmark of the OpenAI-compatible API's overhead: streaming throughput and time to first token with
1, 8 and 32 concurrent clients, through `p2pk3 serve` (HTTP + SSE) and, in the same run against the same
ring, through the ring's own `Client` (the baseline). Prints both and their ratio (API / ring).

    python tools/bench_api.py [--nodes 4] [--concurrency 1 8 32] [--tokens 32] [--rounds 2]

Every request is greedy with a fixed length (`ignore_eos` on the API, no stop ids on the ring client), so
both sides do the same work. The API's time to first token is the arrival of the first SSE event (the
server sends it once the first token is out of the ring). Each figure is the best of `--rounds` runs, the
two sides alternating so that drifting machine load hits both alike."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp

from p2pk3.api import start_api_in_background
from p2pk3.engine.reference import default_model_dir
from p2pk3.node.local import LocalRing, free_ports, probe
from p2pk3.params import SamplingParams
from p2pk3.tokenizer import ChatTokenizer

MODEL = default_model_dir().name  # the id the API serves it under
QUESTIONS = [
    "What does the with statement do?",
    "How do I open a file?",
    "What is a list comprehension?",
    "Explain the for statement.",
    "What is a generator?",
    "How does import work?",
    "What is a dictionary?",
    "What does the yield keyword do?",
]


async def ring_client_run(ring, prompts, tokens):
    """(total tokens, wall seconds, [ttft seconds]) with one ring Client per concurrent request."""

    async def one(ids):
        c = await ring.client()
        try:
            t0 = time.perf_counter()
            first = []
            r = await c.generate(
                ids, SamplingParams(max_tokens=tokens), on_token=lambda t: first or first.append(time.perf_counter())
            )
            return len(r.tokens), first[0] - t0
        finally:
            c.close()

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(p) for p in prompts))
    return sum(n for n, _ in res), time.perf_counter() - t0, [t for _, t in res]


async def api_run(url, questions, tokens):
    async def one(s, q):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": q}],
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        ttft, n = None, 0
        async with s.post(url + "/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    n = json.loads(line[6:])["usage"]["completion_tokens"]
        return n, ttft

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(s, q) for q in questions))
        wall = time.perf_counter() - t0
    return sum(n for n, _ in res), wall, [t for _, t in res]


async def wait_idle(ring, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sts = await asyncio.gather(*(probe(ring.address(s.id), ring.secret) for s in ring.topo.active))
        if all(st and st.get("sessions") == 0 for st in sts):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("the ring still holds sessions")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    mdir = default_model_dir()
    tok = ChatTokenizer.from_pretrained(mdir)
    with LocalRing(mdir, a.nodes, extra_args=["--max-sessions", str(max(32, max(a.concurrency)))]) as ring:
        api = start_api_in_background(ring.topology, "127.0.0.1", free_ports(1)[0])
        try:

            async def bench():
                rows = []
                await api_run(api.url, QUESTIONS[:2], 4)  # warm-up of both paths
                await ring_client_run(ring, [tok.apply_chat_template([{"role": "user", "content": "hi"}])], 4)
                for c in a.concurrency:
                    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(c)]
                    ids = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in qs]
                    best = {"ring": None, "api": None}
                    for _ in range(a.rounds):
                        for side in ("ring", "api"):
                            await wait_idle(ring)
                            n, wall, ttfts = (
                                (await ring_client_run(ring, ids, a.tokens))
                                if side == "ring"
                                else (await api_run(api.url, qs, a.tokens))
                            )
                            if n != c * a.tokens:
                                raise RuntimeError(f"{side}: {n} tokens, expected {c * a.tokens}")
                            fig = (n / wall, statistics.median(ttfts))
                            if best[side] is None or fig[0] > best[side][0]:
                                best[side] = fig
                    rows.append((c, *best["ring"], *best["api"]))
                return rows

            rows = asyncio.run(bench())
        finally:
            api.stop()
    print(f"ring of {a.nodes} nodes, embedded model, {a.tokens} tokens per request, best of {a.rounds} rounds")
    print(
        f"{'clients':>7} | {'ring tok/s':>10} {'ring TTFT ms':>12} | {'API tok/s':>10} {'API TTFT ms':>11} | "
        f"{'tok/s API/ring':>14} {'TTFT API/ring':>13}"
    )
    for c, rt, rf, at, af in rows:
        print(
            f"{c:>7} | {rt:>10.1f} {1000 * rf:>12.1f} | {at:>10.1f} {1000 * af:>11.1f} | {at / rt:>14.3f} "
            f"{af / rf:>13.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
