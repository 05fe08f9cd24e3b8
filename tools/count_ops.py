"""Count the aten operations of one decode pass, per layer kind (KDA, MLA, MoE, dense), with torch's profiler.

    PYTHONPATH=. python tools/count_ops.py                          # torch path, tiny K3, batch 1
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/count_ops.py --kernels triton
    PYTHONPATH=. python tools/count_ops.py --model DIR --batch 8 --json out.json

Each layer part (the attention half of a KDA or MLA layer, the MLP half of a MoE or dense layer) runs on
its own under the profiler, inside one decode step of the whole stage, so the counts are per layer per
pass. Three counts per part:
  all      every aten event the profiler records (nested ones too: `aten::linear` and its `aten::mm`);
  compute  leaf events that are neither views (reshape, slice, transpose, ...), allocations (empty,
           empty_strided, ...) nor no-op casts (`aten::to` to the same dtype; a real cast counts its
           `aten::copy_`): on a GPU each is one kernel launch, the figure the simulator prices
           (p2pk3.sim.overhead);
  casts    `aten::to` / `aten::_to_copy` events (dtype round trips on the hot path).
"stage" is the whole pass (embedding, every layer, head, the batch's index tensors).
On the Triton path each kernel launch counts as one compute op, and the aten ops issued inside a launch
are left out (under TRITON_INTERPRET=1 the interpreter copies every tensor argument to the host and back:
those copies do not exist on a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VIEWS = {
    "view",
    "reshape",
    "_reshape_alias",
    "as_strided",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "expand",
    "transpose",
    "t",
    "permute",
    "alias",
    "detach",
    "unflatten",
    "flatten",
    "split",
    "split_with_sizes",
    "chunk",
    "narrow",
    "unbind",
    "_unsafe_view",
    "lift_fresh",
    "view_as",
    "expand_as",
    "numpy_T",
    "contiguous",
    "result_type",
    "is_nonzero",
    "resolve_conj",
    "resolve_neg",
    "_local_scalar_dense_view",
    "diagonal",
    "movedim",
    "unfold",
    "index_select_view",
}
ALLOCS = {"empty", "empty_strided", "empty_like", "zeros_like_alloc", "resize_", "set_", "_empty_affine_quantized"}
CASTS = {"to", "_to_copy"}
LAUNCH = "triton::launch"


def mark_triton_launches() -> None:
    """Wrap every Triton kernel launch (compiled or interpreted) in a profiler range named LAUNCH."""
    from torch.profiler import record_function
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    for cls in classes:
        if getattr(cls.run, "_counted", False):
            continue
        run = cls.run

        def counted(self, *a, _run=run, **k):
            with record_function(LAUNCH):
                return _run(self, *a, **k)

        counted._counted = True
        cls.run = counted


def _in_launch(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name == LAUNCH:
            return True
        p = p.cpu_parent
    return False


def classify(events) -> dict[str, int]:
    """aten events -> {"all", "compute", "casts"} counts (see the module docstring)."""
    launches = sum(1 for e in events if e.name == LAUNCH)
    ev = [e for e in events if e.name.startswith("aten::") and not _in_launch(e)]
    out = {"all": len(ev) + launches, "compute": launches, "casts": 0}
    for e in ev:
        name = e.name[len("aten::") :]
        if name in CASTS:
            out["casts"] += 1
        leaf = not any(c.name.startswith("aten::") for c in e.cpu_children)
        if leaf and name not in VIEWS and name not in ALLOCS and name not in CASTS:  # a cast that copies has a child
            out["compute"] += 1
    return out


def _profiled(fn) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return classify(prof.events())


def count(model: str, batch: int = 1, prompt: int = 8) -> dict:
    """{"stage": counts, "per_kind": {kind: counts per layer (mean)}, "layers": n of each kind}."""
    from p2pk3.engine.reference import Pipeline
    from p2pk3.model.batch import Batch
    from p2pk3.model.cache import Span
    from p2pk3.model.kimi_k3 import Hop

    pipe = Pipeline.load(model, 1, max_sessions=batch, max_tokens=batch * (prompt + 8), dequant_experts=False)
    stage, cache, cfg = pipe.stages[0], pipe.caches[0], pipe.cfg
    ids = [f"s{i}" for i in range(batch)]
    for s in ids:
        pipe.open(s)
    g = torch.Generator().manual_seed(0)
    pipe.forward([Span(s, 0, prompt) for s in ids], torch.randint(0, cfg.vocab_size, (batch * prompt,), generator=g))
    tok = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
    pos = prompt
    pipe.forward([Span(s, pos, 1) for s in ids], tok)  # warm-up (lazy imports, first-call paths)
    pos += 1
    with torch.inference_mode():
        total = _profiled(lambda: pipe.forward([Span(s, pos, 1) for s in ids], tok))
        pos += 1
        # the same pass again, one layer part at a time under the profiler
        spans = [Span(s, pos, 1) for s in ids]
        cache.reserve(spans)
        b = Batch(spans, cache, stage.device)
        x = stage.model.embed_tokens(tok)
        hop = Hop(prefix=x, bank=x.new_zeros(0, *x.shape))
        per = defaultdict(list)
        for i in stage.plan.layers:
            layer = stage.model.layers[str(i)]
            per[cfg.layer_types[i].upper()].append(_profiled(lambda layer=layer: layer.attn_part(hop, b)))
            kind = "MoE" if cfg.is_moe_layer(i) else "dense"
            per[kind].append(_profiled(lambda layer=layer: layer.mlp_part(hop, b, True)))
        cache.commit(spans)
    for s in ids:
        pipe.close(s)
    mean = {k: {c: sum(d[c] for d in v) / len(v) for c in v[0]} for k, v in per.items()}
    return {"stage": total, "per_kind": mean, "layers": {k: len(v) for k, v in per.items()}}


def print_counts(label: str, r: dict) -> None:
    st = r["stage"]
    print(f"{label}: whole pass  all {st['all']:6d}  compute {st['compute']:6d}  casts {st['casts']:5d}")
    for k in ("KDA", "MLA", "MoE", "dense"):
        if k in r["per_kind"]:
            c = r["per_kind"][k]
            print(
                f"  {k:5s} x{r['layers'][k]}  per layer: all {c['all']:7.0f}  compute {c['compute']:6.0f}  "
                f"casts {c['casts']:4.0f}"
            )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: a tiny K3, seed 0)")
    ap.add_argument(
        "--kernels",
        choices=("torch", "triton"),
        default="torch",
        help="triton on the CPU needs TRITON_INTERPRET=1 in the environment",
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", help="write the counts here")
    a = ap.parse_args(argv)
    from p2pk3_kernels import ops

    ops.force(a.kernels)
    if a.kernels == "triton":
        mark_triton_launches()
    tmp = None
    model = a.model
    if model is None:
        from p2pk3.checkpoint.tiny import write_checkpoint
        from p2pk3.model.config import TINY_K3

        tmp = tempfile.TemporaryDirectory()
        write_checkpoint(tmp.name, TINY_K3, seed=0)
        model = tmp.name
    r = count(model, a.batch)
    print_counts(f"{a.kernels} path, batch {a.batch}", r)
    if a.json:
        Path(a.json).write_text(json.dumps({"kernels": a.kernels, "batch": a.batch, **r}, indent=1))
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
