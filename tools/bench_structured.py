"""Structured outputs through a live ring (issue 24): decode speed with json_schema against without, and
constrained requests at the embedded model's worst, parsed and validated.

    python tools/bench_structured.py [--nodes 3] [--sessions 1 16] [--tokens 48] [--requests 200]

A ring of `p2pk3 node` processes on the embedded model (the ring's own `Client`, no HTTP):

1. Decode tok/s with and without a json_schema, at each `--sessions` count: every session samples at
   temperature 1.0 (seeded) for at most `--tokens` tokens with no stop ids (so both sides generate the same
   number of tokens: after its stop token a finished grammar no longer masks); the figure is generated
   tokens / wall time of the batch (its short prompts' prefill included, the same on both sides), best of
   `--rounds`, the two sides alternating so drifting host load hits both alike. Printed with the ratio
   (schema / plain).
2. `--requests` constrained requests over the 10 schemas of tests/data/json_schemas.json (nested objects,
   arrays, enums, required fields) at temperature 1.5, 16 at a time: how many end with a stop token,
   parse and validate (jsonschema), and their token counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import jsonschema

from p2pk3.engine.reference import default_model_dir
from p2pk3.node.client import RequestError
from p2pk3.node.local import LocalRing
from p2pk3.params import SamplingParams
from p2pk3.tokenizer import ChatTokenizer

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = json.loads((ROOT / "tests/data/json_schemas.json").read_text())
SPEED_SCHEMA = {
    "type": "object",
    "required": ["title", "items"],
    "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
    },
}


def rf(schema, name="s"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def batch(ring, prompt, params_list) -> tuple[float, int]:
    """(generated tokens per second of wall time, tokens) of one concurrent batch (connections made first)."""
    clients = [await ring.client() for _ in params_list]
    counts = [0] * len(params_list)

    async def one(i, p):
        def on_token(_t):
            counts[i] += 1

        await clients[i].generate(prompt, p, on_token=on_token)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(params_list)))
    finally:
        for c in clients:
            c.close()
    return sum(counts) / (time.perf_counter() - t0), sum(counts)


async def speed(ring, prompt, sessions: int, tokens: int, rounds: int) -> dict:
    def params(grammar):
        return [
            SamplingParams(temperature=1.0, seed=i + 1, max_tokens=tokens, grammar=grammar) for i in range(sessions)
        ]

    best = {"plain": 0.0, "json_schema": 0.0}
    for _ in range(rounds):
        for name, g in (("plain", None), ("json_schema", rf(SPEED_SCHEMA))):
            tps, _ = await batch(ring, prompt, params(g))
            best[name] = max(best[name], tps)
    return best


async def constrained(ring, tok, prompt, n: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(16)
    stops = tok.stop_ids

    async def one(j):
        k = j % len(SCHEMAS)
        p = SamplingParams(temperature=1.5, seed=j + 1, max_tokens=max_tokens, stop_ids=stops, grammar=rf(SCHEMAS[k]))
        async with sem:
            c = await ring.client()
            try:
                r = await c.generate(prompt, p)
            except RequestError as e:  # a request the ring failed: counted apart, said at the end
                return None, str(e), 0
            finally:
                c.close()
        ended = bool(r.tokens) and r.tokens[-1] in stops
        text = tok.decode([t for t in r.tokens if t not in stops], skip_special=True)
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[k])
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        return ended, valid, len(r.tokens)

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(j) for j in range(n)))
    outs = [x for x in got if x[0] is not None]
    lens = [x[2] for x in outs]
    return {
        "requests": n,
        "failed": [x[1] for x in got if x[0] is None],
        "ended_with_stop": sum(x[0] for x in outs),
        "parse_and_validate": sum(x[1] for x in outs),
        "tokens_mean": statistics.mean(lens),
        "tokens_max": max(lens),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--sessions", type=int, nargs="*", default=[1, 16], help="none: skip the speed part")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=1500, help="per constrained request")
    a = ap.parse_args()
    model = default_model_dir()
    tok = ChatTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Answer in JSON."}], add_generation_prompt=True)
    with LocalRing(model, a.nodes, extra_args=["--max-sessions", str(max(16, *a.sessions, 0))]) as ring:

        async def go():
            await batch(ring, prompt, [SamplingParams(max_tokens=4, grammar={"type": "json_object"})])  # warm-up
            for n in a.sessions:
                s = await speed(ring, prompt, n, a.tokens, a.rounds)
                print(
                    f"decode, {n:>2} session(s): plain {s['plain']:.1f} tok/s, json_schema {s['json_schema']:.1f} "
                    f"tok/s, ratio {s['json_schema'] / s['plain']:.3f}",
                    flush=True,
                )
            if a.requests:
                c = await constrained(ring, tok, prompt, a.requests, a.max_tokens)
                print(
                    f"constrained, temperature 1.5, {len(SCHEMAS)} schemas: {c['parse_and_validate']}/{c['requests']} "
                    f"parse and validate, {c['ended_with_stop']} ended with a stop token; tokens mean "
                    f"{c['tokens_mean']:.0f}, max {c['tokens_max']}; {c['wall_s']:.0f} s; "
                    f"{len(c['failed'])} failed in the ring{': ' + '; '.join(c['failed'][:3]) if c['failed'] else ''}",
                    flush=True,
                )

        asyncio.run(go())


if __name__ == "__main__":
    main()
