"""CPU decode speed of p2pk3 against mlx-lm (the peer), on the same K3 checkpoints, in one invocation.

    PYTHONPATH=. python tools/bench_vs_mlx.py                      # tiny-k3 and small-k3, batch 1 and 8
    PYTHONPATH=. python tools/bench_vs_mlx.py --compile            # also p2pk3's compiled decode step
    PYTHONPATH=. python tools/bench_vs_mlx.py --ops                # also the aten ops per layer (tools/count_ops.py)

mlx-lm ships a K3 model and loads the published checkpoint layout (the one p2pk3.checkpoint.tiny writes);
it runs in a subprocess of its own environment, not one of the project's dependencies:
    python -m venv /work/venv-mlx && /work/venv-mlx/bin/pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2
(--mlx-python points elsewhere). Both decode greedily from the same random prompt, one process each,
after a warm-up step; the figure is tokens/s over `--steps` decode steps (batch x steps / seconds), the
best of `--repeats` runs (the host is shared: the best run is the least disturbed one). Both run in
`--dtype` (float32 by default: the CPU's fast path for torch; mlx casts its float weights the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MLX_PY = os.environ.get("MLX_PYTHON", "/work/venv-mlx/bin/python")

MLX_SCRIPT = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm.utils import load_model
from mlx_lm.models.cache import make_prompt_cache
a = json.loads(sys.argv[1])
model, _ = load_model(__import__("pathlib").Path(a["model"]))
if a["dtype"] == "float32":
    model.set_dtype(mx.float32)
elif a["dtype"] == "bfloat16":
    model.set_dtype(mx.bfloat16)
out = []
for b in a["batches"]:
    best = None
    for _ in range(a["repeats"]):
        mx.random.seed(0)
        prompt = mx.random.randint(0, a["vocab"], (b, a["prompt"]))
        cache = make_prompt_cache(model)
        lg = model(prompt, cache=cache)
        tok = mx.argmax(lg[:, -1, :], axis=-1)
        mx.eval(tok)
        lg = model(tok[:, None], cache=cache)  # warm-up step
        tok = mx.argmax(lg[:, -1, :], axis=-1)
        mx.eval(tok)
        t0 = time.perf_counter()
        for _ in range(a["steps"]):
            lg = model(tok[:, None], cache=cache)
            tok = mx.argmax(lg[:, -1, :], axis=-1)
            mx.eval(tok)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    out.append({"batch": b, "tokens_per_s": b * a["steps"] / best})
print("RESULT " + json.dumps(out))
"""


def mlx_decode(model: str, vocab: int, batches, steps, prompt, repeats, dtype, python=MLX_PY) -> list[dict]:
    if not Path(python).exists():
        raise SystemExit(
            f"{python}: no mlx-lm environment (python -m venv /work/venv-mlx && /work/venv-mlx/bin/pip "
            f"install 'mlx[cpu]==0.32.4' mlx-lm==0.32.2, or --mlx-python PATH)"
        )
    args = json.dumps(
        {
            "model": model,
            "vocab": vocab,
            "batches": batches,
            "steps": steps,
            "prompt": prompt,
            "repeats": repeats,
            "dtype": dtype,
        }
    )
    r = subprocess.run(
        [python, "-c", MLX_SCRIPT, args],
        capture_output=True,
        text=True,
        timeout=3600,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not line:
        raise SystemExit(f"mlx-lm run failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT ") :])


def p2pk3_decode(
    model: str, batches, steps, prompt, repeats, dtype, compile: bool, dequant: bool | None = None
) -> tuple[list[dict], float]:
    """Rows of tokens/s, and the seconds the first decode step of each batch size took (the compile)."""
    from p2pk3.engine.reference import Pipeline
    from p2pk3.model.cache import Span

    pipe = Pipeline.load(
        model,
        1,
        dtype=dtype,
        compile=compile,
        dequant_experts=dequant,
        max_sessions=max(batches),
        max_tokens=max(batches) * (prompt + steps + 8) * (repeats + 1),
    )
    vocab = pipe.cfg.vocab_size
    rows, first = [], 0.0
    for b in batches:
        best = None
        for rep in range(repeats):
            ids = [f"b{i}" for i in range(b)]
            for s in ids:
                pipe.open(s)
            g = torch.Generator().manual_seed(0)
            lg = pipe.forward([Span(s, 0, prompt) for s in ids], torch.randint(0, vocab, (b * prompt,), generator=g))
            tok = lg.argmax(-1)
            t0 = time.perf_counter()
            tok = pipe.forward([Span(s, prompt, 1) for s in ids], tok).argmax(-1)  # warm-up (compiles)
            if rep == 0:
                first += time.perf_counter() - t0
            t0 = time.perf_counter()
            for k in range(steps):
                tok = pipe.forward([Span(s, prompt + 1 + k, 1) for s in ids], tok).argmax(-1)
            dt = time.perf_counter() - t0
            for s in ids:
                pipe.close(s)
            best = dt if best is None else min(best, dt)
        rows.append({"batch": b, "tokens_per_s": b * steps / best})
    return rows, first


def checkpoints(tmp: Path, names: list[str]) -> dict[str, str]:
    from p2pk3.checkpoint.tiny import write_checkpoint
    from p2pk3.model.config import preset

    out = {}
    for n in names:
        d = tmp / n
        write_checkpoint(d, preset(n), seed=0)
        out[n] = str(d)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-k3,small-k3", help="presets (p2pk3.model.config) or checkpoint dirs")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--compile", action="store_true", help="also time p2pk3's compiled decode step")
    ap.add_argument("--ops", action="store_true", help="also count aten ops per layer (tools/count_ops.py)")
    ap.add_argument("--mlx-python", default=MLX_PY)
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",")]
    from p2pk3.model.config import K3Config

    tmp = tempfile.TemporaryDirectory()
    names = [m for m in a.models.split(",") if not Path(m).is_dir()]
    dirs = {**checkpoints(Path(tmp.name), names), **{m: m for m in a.models.split(",") if Path(m).is_dir()}}
    print(
        f"host: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}, torch {torch.__version__}, dtype {a.dtype}, "
        f"prompt {a.prompt}, {a.steps} steps, best of {a.repeats}"
    )
    report = {}
    for name, d in dirs.items():
        cfg = K3Config.from_pretrained(d)
        peer = mlx_decode(d, cfg.vocab_size, batches, a.steps, a.prompt, a.repeats, a.dtype, a.mlx_python)
        runs = {
            "eager, default (experts dequantized when they fit)": p2pk3_decode(
                d, batches, a.steps, a.prompt, a.repeats, a.dtype, compile=False
            )[0],
            "eager, experts packed": p2pk3_decode(
                d, batches, a.steps, a.prompt, a.repeats, a.dtype, compile=False, dequant=False
            )[0],
        }
        comp_first = 0.0
        if a.compile:
            runs["compiled, experts dequantized at load"], comp_first = p2pk3_decode(
                d, batches, a.steps, a.prompt, a.repeats, a.dtype, compile=True, dequant=True
            )
        report[name] = {"p2pk3": runs, "compile_s": comp_first, "mlx": peer}
        print(f"{name} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts):")
        for i, b in enumerate(batches):
            m = peer[i]["tokens_per_s"]
            print(f"  batch {b}: mlx-lm {m:8.1f} tok/s")
            for label, rows in runs.items():
                o = rows[i]["tokens_per_s"]
                print(f"           p2pk3 {o:8.1f} tok/s  ratio {o / m:5.2f}x  ({label})")
        if a.compile:
            print(f"  compile paid at the first decode step: {comp_first:.1f} s over {len(batches)} batch sizes")
        if a.ops:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from count_ops import count, print_counts

            r = count(d, 1)
            report[name]["ops"] = r
            print_counts("  aten ops, torch path, batch 1", r)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    tmp.cleanup()


if __name__ == "__main__":
    main()
