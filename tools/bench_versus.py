"""This checkout's ring against another checkout's, in one run: decode tokens/s of 16 sessions.

The rings are all started first and stay up; each round gives every ring the same 16 fresh prompts, one
ring after the other (the order reversed every other round), so a host whose speed drifts during the run
(a shared machine does, by 2x within an hour) shifts every ring alike and the per-round ratios stay
readable. Each ring's daemons run the code of its checkout (`PYTHONPATH` points at it; `p2pk3 node` runs
with -P, so nothing else shadows it; the other checkout must accept the flags this one's LocalRing passes).
Figures per ring: tokens/s over the whole request ("total") and while all 16 sessions decode ("steady":
from the last session's second token to the first session's last), and the median per-round ratio against
the first ring.

    git worktree add /tmp/base <commit>
    python tools/bench_versus.py --other /tmp/base --nodes 4 [--also-nodes 1] [--rounds 6] [--tokens 48]

Rings: `base<N>` (the --other checkout) and `new<N>` (this one) for each of --nodes; --also-nodes adds
rings of this checkout only (the 1-node baseline of issue 21's figures)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.bench_ring import _default_model, _timed  # noqa: E402


def _measure(ring, prompts, new_tokens: int) -> tuple[float, float]:
    from p2pk3.params import SamplingParams

    t0, t1, replies, stamps = asyncio.run(_timed(ring, prompts, SamplingParams(max_tokens=new_tokens)))
    total = sum(len(r.tokens) for r in replies) / (t1 - t0)
    a, b = max(s[1] for s in stamps), min(s[-1] for s in stamps)  # every session decoding
    steady = sum(1 for s in stamps for x in s if a <= x <= b) / (b - a) if b > a else float("nan")
    return total, steady


def versus(model: str, other: str | None, nodes: list[int], also: list[int], rounds: int, new_tokens: int) -> dict:
    from p2pk3.node.local import LocalRing
    from p2pk3.params import SamplingParams

    rings = [(f"new{n}", n, None) for n in also]
    for n in nodes:
        rings += ([(f"base{n}", n, other)] if other else []) + [(f"new{n}", n, None)]
    rng = np.random.default_rng(7)
    res: dict = {label: {"total": [], "steady": []} for label, _, _ in rings}
    with contextlib.ExitStack() as stack:
        up = []
        for _label, n, tree in rings:
            env = dict(os.environ)
            if tree:
                os.environ["PYTHONPATH"] = str(Path(tree).resolve())
            try:
                up.append(stack.enter_context(LocalRing(model, n)))
            finally:
                os.environ.clear()
                os.environ.update(env)
        for ring in up:

            async def warm(ring=ring):
                c = await ring.client()
                await c.generate([5, 6, 7], SamplingParams(max_tokens=4))
                c.close()

            asyncio.run(warm())
        for k in range(rounds):
            prompts = [[int(t) for t in rng.integers(3, 2000, 16)] for _ in range(16)]
            order = range(len(up)) if k % 2 == 0 else reversed(range(len(up)))
            for i in order:
                total, steady = _measure(up[i], prompts, new_tokens)
                res[rings[i][0]]["total"].append(total)
                res[rings[i][0]]["steady"].append(steady)
            print(
                f"   round {k}: "
                + "  ".join(f"{lb} {r['total'][-1]:.0f}/{r['steady'][-1]:.0f}" for lb, r in res.items()),
                flush=True,
            )
    first = rings[0][0]
    for label, r in res.items():
        for key in ("total", "steady"):
            r[f"{key}_median"] = statistics.median(r[key])
            r[f"{key}_ratio"] = statistics.median(x / y for x, y in zip(r[key], res[first][key]))
        print(
            f"   {label}: total {r['total_median']:.1f} tok/s, steady {r['steady_median']:.1f} tok/s; "
            f"per-round ratio vs {first}: total {r['total_ratio']:.3f}x, steady {r['steady_ratio']:.3f}x"
        )
    res["load"] = os.getloadavg()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", help="the other checkout (a git worktree); without it only this checkout's rings")
    ap.add_argument("--nodes", default="4", help="ring sizes run from both checkouts")
    ap.add_argument("--also-nodes", default="1", help="ring sizes from this checkout only ('' for none)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per session")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.other and not (Path(a.other) / "p2pk3" / "__init__.py").is_file():
        sys.exit(f"--other {a.other}: not a p2pk3 checkout (no p2pk3/__init__.py); make one with git worktree add")
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    print(f"versus: {a.other or '(this checkout only)'}; load average {os.getloadavg()}")
    res = versus(a.model or _default_model(), a.other, ints(a.nodes), ints(a.also_nodes), a.rounds, a.tokens)
    if a.json:
        import json

        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
