"""Speculative decoding through a local ring: what a pass costs by width, what speculation gains.

    python tools/bench_spec.py [--nodes 4] [--tokens 32] [--sessions 1,16] [--quick]

Part 1: the cost of one ring pass when every session sends 1 + k tokens (k = 0, 1, 3, 7: widths 1, 2, 4, 8
per session), with 1 and 16 concurrent sessions (drafts that are always rejected, so every pass settles
one token and includes its rollback): ms per pass = wall time / passes.
Part 2: greedy generation with speculation off / ngram / suffix (adaptive draft length, at most 8) on
code-editing-like, summarisation-like (the continuation repeats the prompt) and open-chat-like prompts
with the embedded model, at 1 and 16 concurrent sessions: mean tokens per pass, acceptance, tokens/s,
the drafting time per pass, and whether the output equals plain decoding (it must).

Daemons run in this process (one asyncio loop, authenticated TCP over loopback, each stage in its own
worker thread), like tests/test_ring.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pk3.engine.reference import default_model_dir  # noqa: E402
from p2pk3.model.config import K3Config  # noqa: E402
from p2pk3.node.client import Client  # noqa: E402
from p2pk3.node.daemon import NodeDaemon  # noqa: E402
from p2pk3.node.local import free_ports  # noqa: E402
from p2pk3.node.options import NodeOptions  # noqa: E402
from p2pk3.params import SamplingParams  # noqa: E402
from p2pk3.topology import even_split  # noqa: E402

CODE = '''def parse_args(argv):
    parser = argparse.ArgumentParser(description="Process some files.")
    parser.add_argument("paths", nargs="+", help="files to read")
    parser.add_argument("--verbose", action="store_true", help="print more")
    return parser.parse_args(argv)

# The same function, with the help texts changed:
def parse_args(argv):
    parser = argparse.ArgumentParser(description="'''
SUMMARY = (
    "The with statement is used to wrap the execution of a block with methods defined by a context "
    "manager. This allows common try except finally usage patterns to be encapsulated for convenient "
    "reuse.\n\nIn short: the with statement is used to wrap the execution of a block"
)
CHAT = "How do I read a file line by line in Python?"


class LocalRing:
    def __init__(self, model_dir, n):
        cfg = K3Config.from_pretrained(model_dir)
        ports = free_ports(n)
        self.topo = even_split(cfg, n, host="127.0.0.1", base_port=ports[0], model_path=str(model_dir))
        for s, p in zip(self.topo.slots, ports):
            s.port = p
        self.model_dir, self.secret, self.daemons = model_dir, secrets.token_bytes(32), []

    async def __aenter__(self):
        for s in self.topo.active:
            d = NodeDaemon(
                self.topo,
                s.id,
                model_dir=self.model_dir,
                secret=self.secret,
                options=NodeOptions(prefill_chunk=64, max_sessions=40),
            )
            await d.start()
            self.daemons.append(d)
        deadline = time.monotonic() + 60  # until the entry's failure detector has seen every slot up
        while self.daemons[0].coordinator.health() is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self

    async def __aexit__(self, *exc):
        for d in self.daemons:
            await d.stop()

    @property
    def entry(self):
        return self.daemons[0].entry

    async def run(self, prompts, params):
        async def one(p, sp):
            c = await Client.connect("127.0.0.1", self.daemons[0].port, self.secret)
            try:
                return await c.generate(p, sp)
            finally:
                c.close()

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
        return outs, time.perf_counter() - t0


class Reject:
    """Always proposes k tokens that the target will not produce (token -1 mod vocab... a fixed odd id)."""

    def propose(self, history, k):
        return [(history[-1] * 7 + 3 + i) % 1000 for i in range(k)]


async def pass_cost(ring, prompt, tokens, sessions_list):
    rows = []
    entry = ring.entry
    entry.draft_policy = "fixed"
    entry.proposer_factories["ngram"] = Reject
    for b in sessions_list:
        for k in (0, 1, 3, 7):
            p = SamplingParams(max_tokens=tokens, speculate="ngram" if k else "off", draft_tokens=max(k, 1))
            await ring.run([prompt] * b, [p] * b)  # warm-up (prefill shapes)
            outs, wall = await ring.run([prompt] * b, [p] * b)
            passes = statistics.mean(o.stats.get("passes") or len(o.tokens) for o in outs)
            decode = statistics.mean(
                (o.stats["total_s"] - o.stats["ttft_s"]) / max(1, (o.stats.get("passes") or len(o.tokens)) - 1)
                for o in outs
            )
            rows.append(
                {
                    "sessions": b,
                    "width_per_session": 1 + k,
                    "ms_per_pass": round(1000 * decode, 2),
                    "batch_tokens": b * (1 + k),
                    "passes": passes,
                }
            )
            print(f"  sessions {b:2d}  width {1 + k}  {1000 * decode:8.2f} ms/pass", flush=True)
    entry.draft_policy = "adaptive"
    from p2pk3.spec.proposers import NgramProposer

    entry.proposer_factories["ngram"] = NgramProposer
    return rows


async def gains(ring, tok, tokens, sessions_list):
    cases = {
        "code-edit": [tok.bos_id] + tok.encode(CODE) if tok.bos_id is not None else tok.encode(CODE),
        "summarise": ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(SUMMARY),
        "open-chat": tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True),
    }
    rows = []
    for name, prompt in cases.items():
        for b in sessions_list:
            base = None
            for method in ("off", "ngram", "suffix"):
                p = SamplingParams(max_tokens=tokens, speculate=method, draft_tokens=8)
                ring.entry.suffix_index.__init__()  # each run starts with an empty cluster index
                outs, wall = await ring.run([prompt] * b, [p] * b)
                n = sum(len(o.tokens) for o in outs)
                st = [o.stats for o in outs]
                tpp = statistics.mean(s.get("tokens_per_pass") or 1.0 for s in st)
                prop = sum(s.get("proposed", 0) for s in st)
                acc = sum(s.get("accepted", 0) for s in st)
                dus = [s["draft_us"] for s in st if s.get("draft_us")]
                decode = statistics.mean(
                    max(1, len(o.tokens) - 1) / max(1e-9, o.stats["total_s"] - o.stats["ttft_s"]) for o in outs
                )
                same = base is None or [o.tokens for o in outs] == base
                if base is None:
                    base = [o.tokens for o in outs]
                r = {
                    "prompt": name,
                    "sessions": b,
                    "speculate": method,
                    "tokens_per_pass": round(tpp, 2),
                    "acceptance": round(acc / prop, 3) if prop else None,
                    "proposed": prop,
                    "accepted": acc,
                    "aggregate_tok_s": round(n / wall, 1),
                    "decode_tok_s_per_session": round(decode, 1),
                    "draft_us_per_pass": round(statistics.mean(dus), 1) if dus else None,
                    "same_as_plain": same,
                }
                rows.append(r)
                print(
                    f"  {name:9s} sessions {b:2d} {method:6s} tok/pass {tpp:5.2f}  acc "
                    f"{(acc / prop if prop else 0):5.2f}  {n / wall:7.1f} tok/s aggregate  {decode:6.1f} tok/s/session"
                    f"  draft {r['draft_us_per_pass']} us  same={same}",
                    flush=True,
                )
    return rows


async def main(args):
    from p2pk3.tokenizer import load_tokenizer

    mdir = default_model_dir()
    tok = load_tokenizer(mdir)
    sessions = [int(x) for x in args.sessions.split(",")]
    out = {}
    async with LocalRing(mdir, args.nodes) as ring:
        prompt = tok.encode(SUMMARY)
        print("ring pass cost by width per session:", flush=True)
        out["pass_cost"] = await pass_cost(ring, prompt, args.cost_tokens, sessions)
        print("speculation gains (greedy, adaptive k <= 8):", flush=True)
        out["gains"] = await gains(ring, tok, args.tokens, sessions)
        out["stage_status"] = [d.public_stats().get("spec") for d in ring.daemons]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48, help="generated tokens per session (part 2)")
    ap.add_argument("--cost-tokens", type=int, default=12, help="generated tokens per session (part 1)")
    ap.add_argument("--sessions", default="1,16")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.cost_tokens = 24, 8
    import torch

    torch.set_num_threads(1)
    asyncio.run(main(a))
