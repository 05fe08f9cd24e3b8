"""Benchmark of the prefix cache: a 4-node ring on loopback (`p2pk3 node` processes, the embedded model),
every workload run with the cache off and on in the same run, ratios printed (the host may be shared: the
absolute times are noise, the ratios are the figures). docs/benchmarks.md, "Prefix cache", records them.

    python tools/bench_prefix.py [--nodes 4] [--turns 8] [--system 1500] [--only chat,shared,tiers,k,cold]

* chat: an 8-turn chat with a 1,500-token system prompt (the chat template, each turn's reply appended to
  the history): median time to first token of turns 2..8, cache on / off (target <= 0.25).
* shared: 32 requests sharing a 1,024-token prefix with distinct 32-token suffixes, sent at once after one
  request of the prefix alone: aggregate tokens per second, on / off (target >= 2).
* tiers: 4 conversations of a 1,024-token system prompt each, 4 turns round robin; the device budget a
  quarter of the working set the unbounded run held, the host tier on: hit rate against the unbounded
  run's (target >= 0.9), TTFT against no cache (target <= 0.5), and each node's resident memory against
  the cache-off ring's plus the budgets.
* k: the snapshot spacing (--snapshot-every) against the shared workload: bytes held and TTFT.
* cold: prompts that share nothing, on / off (what the cache costs a miss).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from p2pk3.engine.reference import default_model_dir
from p2pk3.node.client import Client
from p2pk3.node.local import LocalRing
from p2pk3.params import SamplingParams
from p2pk3.tokenizer import ChatTokenizer

GB = 1 << 30
WORDS = (
    "the ring of nodes serves one model in stages and every stage keeps its own layers cache state tokens "
    "prompt answer careful short clear tool call result file line error retry budget memory block"
).split()


def text_of(tok, n_tokens: int, seed: int) -> str:
    """Words whose encoding is about `n_tokens` tokens."""
    rng = random.Random(seed)
    words = []
    while len(tok.encode(" ".join(words))) < n_tokens:
        words.extend(rng.choice(WORDS) for _ in range(32))
    while len(tok.encode(" ".join(words))) > n_tokens:
        words.pop()
    return " ".join(words)


class Ring:
    """A LocalRing with the prefix cache options given, and a client on its entry."""

    def __init__(self, nodes: int, cache_args: list[str]):
        self.ring = LocalRing(default_model_dir(), nodes, extra_args=list(cache_args))

    async def __aenter__(self):
        await asyncio.to_thread(self.ring.start)  # it runs event loops of its own
        h, p = self.ring.entry_addr
        self.client = await Client.connect(h, p, self.ring.secret)
        return self

    async def __aexit__(self, *exc):
        self.client.close()
        await asyncio.to_thread(self.ring.stop)

    async def generate(self, ids, max_tokens: int):
        """(tokens, seconds to the first token, cached tokens) of one greedy request on its own connection."""
        h, p = self.ring.entry_addr
        c = await Client.connect(h, p, self.ring.secret)
        try:
            t0 = time.perf_counter()
            first = []
            r = await c.generate(
                ids,
                SamplingParams(max_tokens=max_tokens, stop_ids=()),
                on_token=lambda t: first or first.append(time.perf_counter()),
            )
            return r.tokens, first[0] - t0, r.stats.get("cached_tokens", 0)
        finally:
            c.close()

    async def statuses(self):
        return await self.ring.statuses()


async def chat(nodes, cache_args, tok, turns, system_tokens, seed=0, reply=16):
    system = text_of(tok, system_tokens, seed)
    msgs = [{"role": "system", "content": system}]
    ttft, cached = [], []
    async with Ring(nodes, cache_args) as r:
        for t in range(turns):
            msgs.append({"role": "user", "content": f"question {t}: " + text_of(tok, 20, seed * 100 + t)})
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
            out, dt, c = await r.generate(ids, reply)
            ttft.append(dt)
            cached.append(c)
            msgs.append({"role": "assistant", "content": tok.decode(out)})
        return ttft, cached, len(ids)


async def shared(nodes, cache_args, n=32, prefix=1024, suffix=32, gen=8, seed=1, warm=1):
    """One request of the shared prefix and `warm` more tokens first (both runs), then the n at once."""
    rng = random.Random(seed)
    head = [rng.randrange(10, 4000) for _ in range(prefix)]
    prompts = [head + [rng.randrange(10, 4000) for _ in range(suffix)] for _ in range(n)]
    async with Ring(nodes, cache_args) as r:
        await r.generate(head + [rng.randrange(10, 4000) for _ in range(warm)], 1)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(r.generate(p, gen) for p in prompts))
        wall = time.perf_counter() - t0
        st = await r.statuses()
    tokens = sum(len(p) + gen for p in prompts)
    held = max((s or {}).get("prefix", {}).get("device_bytes", 0) for s in st.values())
    return tokens / wall, statistics.median(t for _, t, _ in res), sum(c for *_, c in res), held


async def tiers(nodes, cache_args, tok, convs=4, turns=4, system_tokens=1024, reply=8):
    """(hit rate, median TTFT of turns after the first, max device bytes, max host bytes, RSS by slot)."""
    chats = [[{"role": "system", "content": text_of(tok, system_tokens, 50 + i)}] for i in range(convs)]
    ttft, hit, total = [], 0, 0
    async with Ring(nodes, cache_args) as r:
        for t in range(turns):
            for i, msgs in enumerate(chats):
                msgs.append({"role": "user", "content": f"turn {t}: " + text_of(tok, 16, 1000 * i + t)})
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
                out, dt, c = await r.generate(ids, reply)
                msgs.append({"role": "assistant", "content": tok.decode(out)})
                hit, total = hit + c, total + len(ids)
                if t:
                    ttft.append(dt)
        st = await r.statuses()
    pre = [(s or {}).get("prefix", {}) for s in st.values()]
    rss = {k: (s or {}).get("memory", {}).get("used") for k, s in st.items()}
    return (
        hit / total,
        statistics.median(ttft),
        max(p.get("device_bytes", 0) for p in pre),
        max(p.get("host_bytes", 0) for p in pre),
        rss,
    )


async def cold(nodes, cache_args, n=4, tokens=1500, seed=7):
    """Median TTFT of `n` prompts that share nothing (what the cache costs a miss: snapshot cuts, copies)."""
    rng = random.Random(seed)
    async with Ring(nodes, cache_args) as r:
        await r.generate([rng.randrange(10, 4000) for _ in range(64)], 1)  # warm the processes
        return statistics.median([(await r.generate([rng.randrange(10, 4000) for _ in range(tokens)], 1))[1] for _ in range(n)])


def gb(x: float) -> str:
    return f"{x / GB:.6f}"


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system", type=int, default=1500)
    ap.add_argument("--only", default="chat,shared,tiers,k,cold")
    a = ap.parse_args()
    only = set(a.only.split(","))
    tok = ChatTokenizer.from_pretrained(default_model_dir())
    off, on = ["--prefix-cache-gb", "0"], ["--prefix-cache-gb", "1"]
    ok = True
    print("host shared with other work: ratios are measured in this run, each against the cache-off ring")
    if "chat" in only:
        t_off, _, n = await chat(a.nodes, off, tok, a.turns, a.system)
        t_on, cached, _ = await chat(a.nodes, on, tok, a.turns, a.system)
        m_off, m_on = statistics.median(t_off[1:]), statistics.median(t_on[1:])
        r = m_on / m_off
        ok &= r <= 0.25
        print(f"\nchat: {a.turns} turns, {a.system}-token system prompt (last prompt {n} tokens)")
        print("  TTFT by turn, off: " + " ".join(f"{t:.2f}" for t in t_off))
        print("  TTFT by turn, on:  " + " ".join(f"{t:.2f}" for t in t_on))
        print(f"  cached tokens by turn: {cached}")
        print(f"  median TTFT turns 2..{a.turns}: off {m_off:.3f} s, on {m_on:.3f} s: on/off = {r:.3f} (target <= 0.25)")
    if "shared" in only:
        tp_off, tt_off, _, _ = await shared(a.nodes, off)
        tp_on, tt_on, cached, held = await shared(a.nodes, on)
        r = tp_on / tp_off
        ok &= r >= 2
        print("\nshared: 32 requests, a 1,024-token prefix, distinct 32-token suffixes, 8 tokens each")
        print(f"  aggregate tokens/s: off {tp_off:.0f}, on {tp_on:.0f}: on/off = {r:.2f} (target >= 2)")
        print(f"  median TTFT: off {tt_off:.2f} s, on {tt_on:.2f} s; cached tokens {cached}; held {held} bytes")
    if "tiers" in only:
        h_off, t_off, _, _, rss_off = await tiers(a.nodes, off, tok)
        h_inf, t_inf, dev_inf, _, _ = await tiers(a.nodes, on, tok)
        budget = max(dev_inf // 4, 1)
        host = 4 * dev_inf
        h_q, t_q, dev_q, host_q, rss_q = await tiers(
            a.nodes, ["--prefix-cache-gb", gb(budget), "--host-cache-gb", gb(host)], tok
        )
        rh, rt = h_q / h_inf if h_inf else 0.0, t_q / t_off
        ok &= rh >= 0.9 and rt <= 0.5
        print("\ntiers: 4 conversations x 4 turns, 1,024-token system prompts, round robin")
        print(f"  unbounded: hit rate {h_inf:.3f}, device bytes held (max stage) {dev_inf}")
        print(
            f"  device budget {budget} bytes (a quarter), host tier {host}: hit rate {h_q:.3f} = {rh:.3f} of "
            f"unbounded (target >= 0.9); device {dev_q}, host {host_q} bytes held"
        )
        print(f"  median TTFT turns 2..4: off {t_off:.3f} s, quarter+host {t_q:.3f} s: {rt:.3f} (target <= 0.5)")
        for slot in rss_q:
            extra = (rss_q[slot] or 0) - (rss_off.get(slot) or 0)
            print(f"  {slot}: RSS {rss_q[slot]} vs cache off {rss_off.get(slot)}: +{extra} (budgets {budget + host})")
    if "k" in only:
        print(
            "\nk (--snapshot-every): 16 requests diverging at token 1,000 from a 1,200-token one seen before "
            "(a hit at the last k-th boundary below 1,000): bytes held by the largest stage, cached tokens, TTFT"
        )
        for k in (1, 2, 4, 8, 16):
            tp, tt, cached, held = await shared(a.nodes, [*on, "--snapshot-every", str(k)], n=16, prefix=1000, warm=200)
            print(f"  k={k:2d}: {held:>9d} bytes, {cached // 16:4d} cached tokens a request, median TTFT {tt:.2f} s")
    if "cold" in only:
        c_off, c_on = await cold(a.nodes, off), await cold(a.nodes, on)
        print(
            f"\ncold: 4 unrelated 1,500-token prompts, median TTFT: off {c_off:.2f} s, on {c_on:.2f} s: "
            f"on/off = {c_on / c_off:.2f} (what a miss costs)"
        )
    print("\nall targets met" if ok else "\nsome target missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
