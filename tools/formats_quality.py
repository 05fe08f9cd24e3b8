"""What each weight format of the non-expert matrices costs in quality (p2pk3.quant.formats); prints the
tables of docs/quality.md ("Weight formats of the non-expert matrices").

1. The embedded model (p2pk3/assets/tiny-k3-pydoc): held-out perplexity measured exactly as docs/quality.md
   does (tools/trainlib/pydoc_topics.py: the 7 hash-held-out pydoc topics, paragraph-deduplicated, `[BOS] text [EOS]` per
   topic, non-overlapping 128-token windows with fresh context, fp32 compute), the checkpoint loaded through
   `load_stage` with `formats=...` (the loader's conversion, the model's MXLinear path).
2. Random K3-shaped matrices (the KIMI_K3 preset): relative output error ||y_fmt - y|| / ||y|| of one
   projection (and one whole shared expert) on random inputs, against the BF16 weight as shipped. Weights are
   drawn N(0, 1/in) (and Student-t with 4 degrees of freedom, scaled alike, for heavier tails), rounded to
   BF16, then re-quantized. Output rows are i.i.d., so only `--rows` of them are kept (the full input dim
   is used): the expected relative error does not depend on the number of rows.
3. Bytes per parameter of each format and the non-expert bytes a K3 token reads per class.

    python -m tools.formats_quality [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from p2pk3.quant.convert import quantize_weight  # noqa: E402
from p2pk3.quant.formats import BYTES_PER_PARAM, TENSOR_CLASSES, class_of, format_spec  # noqa: E402

TINY_CONFIGS: list[tuple[str, dict[str, str]]] = [("as shipped (BF16)", {})]
for _c in TENSOR_CLASSES:
    for _f in ("mxfp8", "mxfp4"):
        TINY_CONFIGS.append((f"{_c}={_f}", {_c: _f}))
TINY_CONFIGS += [
    ("issue example: attention=mxfp8, shared_experts=mxfp4", {"attention": "mxfp8", "shared_experts": "mxfp4"}),
    ("all five classes MXFP8", {c: "mxfp8" for c in TENSOR_CLASSES}),
    ("all five classes MXFP4", {c: "mxfp4" for c in TENSOR_CLASSES}),
    ("all MXFP4 but lm_head MXFP8", {**{c: "mxfp4" for c in TENSOR_CLASSES}, "lm_head": "mxfp8"}),
]


# ------------------------------------------------------------------------------------------ K3 bytes
def k3_class_params() -> dict[str, int]:
    """Non-expert parameters of K3 per tensor class (+ "other": router, norms, AttnRes, conv...; embeddings
    are a gather and are not counted as read)."""
    from p2pk3.model.config import KIMI_K3 as cfg
    from p2pk3.model.weights import head_tensors, layer_tensors

    out = {c: 0 for c in TENSOR_CLASSES}
    out["other"] = 0
    specs = dict(head_tensors(cfg))
    for i in range(cfg.num_hidden_layers):
        specs.update(layer_tensors(cfg, i, experts=[]))
    for name, sp in specs.items():
        out[class_of(name) or "other"] += math.prod(sp.shape)
    return out


def k3_token_gb(params: dict[str, int], formats: dict[str, str]) -> float:
    """GB of non-expert weights one K3 token reads (the "other" tensors at 2 bytes)."""
    b = params["other"] * 2.0
    for c in TENSOR_CLASSES:
        b += params[c] * BYTES_PER_PARAM[formats.get(c, "bf16")]
    return b / 1e9


# ------------------------------------------------------------------------------------------ tiny model
def tiny_perplexities(model_dir: Path, configs, T: int = 128) -> list[dict]:
    from p2pk3.checkpoint.stage import load_stage
    from p2pk3.model.config import K3Config
    from p2pk3.model.stage import StagePlan
    from p2pk3.tokenizer import load_tokenizer
    from tools.trainlib.evaluate import nll_windows
    from tools.trainlib.pydoc_topics import encode_documents, split_topics

    cfg = K3Config.from_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    held = encode_documents(tok, split_topics()["heldout"])
    rows = []
    base = None
    for label, fm in configs:
        t0 = time.perf_counter()
        stage = load_stage(model_dir, StagePlan.whole(cfg), "float32", "cpu", cfg, fm)
        tot, cnt = nll_windows(stage, held, T)
        ppl = math.exp(tot / cnt)
        base = ppl if base is None else base
        rows.append(
            {
                "config": label,
                "formats": format_spec(fm),
                "ppl": ppl,
                "vs_shipped": ppl / base - 1,
                "tokens": cnt,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"  {label:<55} ppl {ppl:8.3f} ({100 * (ppl / base - 1):+.2f}%)  [{cnt} tokens, "
            f"{time.perf_counter() - t0:.1f} s]",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------------------------ random K3 layers
def k3_matrices() -> list[tuple[str, str, int, int]]:
    """(class, name, in, out) of representative K3 matrices (KIMI_K3 preset)."""
    from p2pk3.model.config import KIMI_K3 as c

    D, HK = c.hidden_size, c.kda_num_heads * c.kda_head_dim
    H = c.num_attention_heads
    return [
        ("attention", "KDA q_proj (k, v, g alike)", D, HK),
        ("attention", "KDA o_proj", HK, D),
        ("attention", "MLA q_a_proj", D, c.q_lora_rank),
        ("attention", "MLA q_b_proj", c.q_lora_rank, H * c.q_head_dim),
        ("attention", "MLA kv_a_proj_with_mqa", D, c.mla_cache_width),
        ("attention", "MLA kv_b_proj", c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim)),
        ("shared_experts", "shared gate_proj / up_proj", D, c.num_shared_experts * c.moe_intermediate_size),
        ("shared_experts", "shared down_proj", c.num_shared_experts * c.moe_intermediate_size, D),
        ("dense", "layer-0 gate_proj / up_proj", D, c.intermediate_size),
        ("dense", "layer-0 down_proj", c.intermediate_size, D),
        ("latent", "routed_expert_down_proj", D, c.routed_expert_hidden_size),
        ("latent", "routed_expert_up_proj", c.routed_expert_hidden_size, D),
        ("lm_head", "lm_head", D, c.vocab_size),
    ]


def _weights(out_f: int, in_f: int, dist: str, gen: torch.Generator) -> torch.Tensor:
    if dist == "gauss":
        w = torch.randn(out_f, in_f, generator=gen)
    else:  # Student-t, 4 dof, unit variance: z / sqrt(chi2_4 / 4) * sqrt(1/2)
        z = torch.randn(out_f, in_f, generator=gen)
        chi = torch.randn(4, out_f, in_f, generator=gen).pow(2).sum(0)
        w = z / torch.sqrt(chi / 4) * math.sqrt(0.5)
    return (w / math.sqrt(in_f)).to(torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _mx_matmul(x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
    from p2pk3_kernels import ops

    d, s = quantize_weight(w, fmt)
    return ops.mx_linear(x, d, s, fmt)


def random_layer_errors(rows: int, tokens: int, seed: int = 0, dists=("gauss", "t4")) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for cls, name, k, n in k3_matrices():
        r = {"class": cls, "matrix": name, "in": k, "out": n, "rows_kept": min(rows, n)}
        x = torch.randn(tokens, k, generator=gen)
        for dist in dists:
            w = _weights(min(rows, n), k, dist, gen)
            ref = x @ w.float().T
            for fmt in ("mxfp8", "mxfp4"):
                r[f"{fmt}_{dist}"] = _rel(_mx_matmul(x, w, fmt), ref)
        out.append(r)
        print(
            f"  {name:<30} {k:>6} -> {n:<6} "
            + "  ".join(f"{kk} {100 * v:.2f}%" for kk, v in r.items() if kk.startswith("mx")),
            flush=True,
        )
    # one whole shared expert: down(SiTU-GLU(gate x, up x)), the down rows capped
    from p2pk3.model.config import KIMI_K3 as c
    from p2pk3_kernels.mxfp4_moe_ref import glu_act

    D, S = c.hidden_size, c.num_shared_experts * c.moe_intermediate_size
    r = {
        "class": "shared_experts",
        "matrix": "whole shared expert (SiTU-GLU)",
        "in": D,
        "out": D,
        "rows_kept": min(rows, D),
    }
    x = torch.randn(tokens, D, generator=gen)
    for dist in dists:
        wg, wu, wd = _weights(S, D, dist, gen), _weights(S, D, dist, gen), _weights(min(rows, D), S, dist, gen)
        # SiTU's tanh(u / 25) needs pre-activations of a trained scale: inputs are scaled so that gate/up
        # outputs have unit variance (x ~ N(0, 1), w ~ N(0, 1/D))
        act = lambda g, u: glu_act(g, u, c.hidden_act, c.situ_beta, c.situ_linear_beta)  # noqa: E731
        ref = act(x @ wg.float().T, x @ wu.float().T) @ wd.float().T
        for fmt in ("mxfp8", "mxfp4"):
            h = act(_mx_matmul(x, wg, fmt), _mx_matmul(x, wu, fmt))
            r[f"{fmt}_{dist}"] = _rel(_mx_matmul(h, wd, fmt), ref)
    out.append(r)
    print(
        f"  {r['matrix']:<30} " + "  ".join(f"{kk} {100 * v:.2f}%" for kk, v in r.items() if kk.startswith("mx")),
        flush=True,
    )
    return out


# ------------------------------------------------------------------------------------------ tables
def markdown(tiny: list[dict], layers: list[dict], params: dict[str, int]) -> str:
    lines = ["| format | bytes / param | vs BF16 |", "|---|---|---|"]
    for f in ("bf16", "mxfp8", "mxfp4"):
        lines.append(f"| {f} | {BYTES_PER_PARAM[f]:.5f} | {BYTES_PER_PARAM[f] / 2:.3f}x |")
    lines += ["", "| K3 tensor class | parameters | GB / token in BF16 | MXFP8 | MXFP4 |", "|---|---|---|---|---|"]
    for c in (*TENSOR_CLASSES, "other"):
        p = params[c]
        fm = ("bf16",) if c == "other" else ("bf16", "mxfp8", "mxfp4")
        vals = [f"{p * BYTES_PER_PARAM[f] / 1e9:.2f}" for f in fm] + ([] if c != "other" else ["(stays)", "(stays)"])
        lines.append(f"| {c} | {p / 1e9:.2f} B | " + " | ".join(vals) + " |")
    if tiny:
        lines += [
            "",
            "| formats (tiny-k3-pydoc, fp32 compute) | held-out perplexity | vs as shipped | "
            "K3 non-expert GB / token |",
            "|---|---|---|---|",
        ]
        for r in tiny:
            fm = dict(kv.split("=") for kv in r["formats"].split(",")) if r["formats"] else {}
            lines.append(
                f"| {r['config']} | {r['ppl']:.2f} | {100 * r['vs_shipped']:+.2f}% | {k3_token_gb(params, fm):.1f} |"
            )
    if layers:
        lines += [
            "",
            "| class | K3 matrix | in -> out | MXFP8 (Gaussian) | MXFP4 (Gaussian) | MXFP8 (t, 4 dof) | "
            "MXFP4 (t, 4 dof) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in layers:
            cells = " | ".join(
                f"{100 * r.get(k, float('nan')):.2f}%" for k in ("mxfp8_gauss", "mxfp4_gauss", "mxfp8_t4", "mxfp4_t4")
            )
            lines.append(f"| {r['class']} | {r['matrix']} | {r['in']} -> {r['out']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded tiny-k3-pydoc)")
    ap.add_argument("--quick", action="store_true", help="fewer configurations and rows (a smoke run)")
    ap.add_argument("--rows", type=int, default=1024, help="output rows kept per random matrix")
    ap.add_argument("--tokens", type=int, default=16, help="random input rows")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--json", help="write the numbers as JSON")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from p2pk3.engine.reference import default_model_dir

    model_dir = Path(a.model) if a.model else default_model_dir()
    params = k3_class_params()
    tiny, layers = [], []
    if not a.skip_tiny:
        print(f"held-out perplexity of {model_dir.name}:", flush=True)
        cfgs = TINY_CONFIGS if not a.quick else [TINY_CONFIGS[0], TINY_CONFIGS[-3], TINY_CONFIGS[-2]]
        tiny = tiny_perplexities(model_dir, cfgs)
    if not a.skip_layers:
        print("relative output error of random K3-shaped matrices:", flush=True)
        layers = random_layer_errors(
            64 if a.quick else a.rows, a.tokens, dists=("gauss",) if a.quick else ("gauss", "t4")
        )
    print()
    print(markdown(tiny, layers, params))
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"tiny": tiny, "layers": layers, "k3_params": params, "bytes_per_param": BYTES_PER_PARAM}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
