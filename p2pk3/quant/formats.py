"""Weight formats of the non-expert matrices, chosen per tensor class and applied once at load.

The checkpoint ships every non-expert matrix in BF16 (attention projections, shared experts, the dense
layer 0, lm_head, the latent projections); at K3's size they are ~111 GB of the ~139 GB a token reads
(shared/research/performance.md section 6). They can be kept as shipped or re-quantized at load to

* ``mxfp8``: OCP MX v1.0 MXFP8, E4M3 elements + one E8M0 scale per 32 inputs (1 + 1/32 bytes/param);
* ``mxfp4``: OCP MX v1.0 MXFP4, E2M1 elements + one E8M0 scale per 32 inputs (0.5 + 1/32 bytes/param),
  the same layout and quantizer as the routed experts (`p2pk3.quant.mxfp4`).

Blocks run along the input dim of each ``nn.Linear`` weight [out, in]. An input dim that is not a
multiple of 32 is zero-padded to one (the padded columns quantize to 0 and the kernels mask x there).

Tensor classes (`class_of` maps a module path or checkpoint name to one):
  attention      every projection of a KDA or MLA block (q/k/v/g/f_a/f_b/b/o, q_a/q_b/kv_a/kv_b/g/o)
  shared_experts the fused shared experts of every MoE layer (gate/up/down)
  dense          the dense MLP of layer 0 (gate/up/down)
  lm_head        the output head (an untied lm_head only)
  latent         the latent-MoE projections (routed_expert_down_proj / routed_expert_up_proj)
Never converted: the embeddings (a gather), the router (fp32 routing), AttnRes pseudo-queries, norms.

One activation entry rides in the same map: ``expert_inputs = "mxfp8"`` fake-quantizes the routed experts'
input to MXFP8 (``LatentMoE.mxfp8_activations``; K3's QAT reportedly used MXFP8 activations, the checkpoint
declares none, so it is off by default). It costs no memory and is not part of ``non-experts``.

This module is the vocabulary (the one parser of a formats map, the tensor classes, the bytes a format
costs) and imports no torch, so the planner, `topology check` and the CLI can use it without loading the
model code. The conversion itself is p2pk3/quant/convert.py: ``apply_formats(stage, {"attention": "mxfp8",
...})`` swaps the chosen ``nn.Linear`` modules of a loaded stage for `MXLinear`.
"""

from __future__ import annotations

import difflib
import re
from typing import Mapping

MX_BLOCK = 32  # inputs per E8M0 scale (OCP MX v1.0; the same as p2pk3.quant.mxfp4.MX_BLOCK)

__all__ = [
    "FormatError",
    "FORMATS",
    "TENSOR_CLASSES",
    "BYTES_PER_PARAM",
    "parse_formats",
    "format_spec",
    "class_of",
    "packed_bytes",
    "GROUPS",
    "ACTIVATIONS",
    "MX_BLOCK",
]


class FormatError(ValueError):
    """An unknown tensor class or format in a formats map."""


FORMATS = ("bf16", "mxfp8", "mxfp4")
TENSOR_CLASSES = ("attention", "shared_experts", "dense", "lm_head", "latent")
ACTIVATIONS = {"expert_inputs": ("bf16", "mxfp8")}  # activation entries and the formats each takes
# Bytes per weight parameter of each format, scales included (what the rack simulator charges).
BYTES_PER_PARAM = {"bf16": 2.0, "mxfp8": 1.0 + 1.0 / MX_BLOCK, "mxfp4": 0.5 + 1.0 / MX_BLOCK}

# The one vocabulary of a formats map (CLI strings, the topology's [model] formats, the planner):
FORMAT_ALIASES = {"shipped": "bf16"}  # the non-expert matrices ship in BF16
CLASS_ALIASES = {"dense_mlp": "dense", "latent_proj": "latent"}  # the planner's older row names
GROUPS = {"non-experts": TENSOR_CLASSES, "non_experts": TENSOR_CLASSES, "all": TENSOR_CLASSES}
# named so that "router=shipped" reads as intended, but never converted: only these formats (a no-op) are allowed
KEPT = {"router": ("bf16",), "embedding": ("bf16",), "norms": ("bf16",), "routed_experts": ("mxfp4", "bf16")}
_KEPT_WHY = {
    "router": "the router stays as shipped (routing runs in fp32)",
    "embedding": "the embedding stays as shipped (a gather of one row per token)",
    "norms": "norms, gate vectors and conv taps stay as shipped",
    "routed_experts": "the routed experts ship in MXFP4 and are loaded as they are",
}


def _near(word: str, known) -> str:
    m = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {m[0]!r}?" if m else ""


def _format_name(cls: str, v, errs: list[str]) -> str | None:
    if isinstance(v, str) and (v in FORMATS or v in FORMAT_ALIASES):
        return FORMAT_ALIASES.get(v, v)
    known = (*FORMATS, *FORMAT_ALIASES)
    errs.append(
        f"{cls}: unknown format {v!r} (formats: {', '.join(known)})" + (_near(v, known) if isinstance(v, str) else "")
    )
    return None


def parse_formats(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """A formats map {class: format} over TENSOR_CLASSES from a dict (the topology's ``formats`` table) or a
    string (the CLI): ``"attention=mxfp8,shared_experts=mxfp4"``, ``"non-experts=mxfp8"`` (every class;
    ``non_experts`` and ``all`` too), ``"mxfp8"`` (= non-experts=mxfp8), ``"non-experts=mxfp8,lm_head=bf16"``
    (a class named on its own wins over a group, in any order). ``shipped`` means bf16; ``dense_mlp`` and
    ``latent_proj`` mean dense and latent; router / embedding / norms / routed_experts may be named only with
    the format they keep. Classes not named stay ``bf16``; the result names only the classes given.
    Raises FormatError naming every unknown class or format, with the nearest known name."""
    if spec is None:
        return {}
    errs: list[str] = []
    if isinstance(spec, str):
        pairs: list[tuple[str, str]] = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            if "=" not in part:
                if part in FORMATS or part in FORMAT_ALIASES:
                    pairs.append(("non-experts", part))
                else:
                    errs.append(f"{part!r} is not CLASS=FORMAT (e.g. attention=mxfp8, non-experts=mxfp8)")
                continue
            k, v = (x.strip() for x in part.split("=", 1))
            pairs.append((k, v))
    elif isinstance(spec, Mapping):
        pairs = list(spec.items())
    else:
        raise FormatError(f'formats must be a table like {{ attention = "mxfp8" }}, got {type(spec).__name__}')
    named: dict[str, str] = {}
    grouped: dict[str, str] = {}
    seen: set[str] = set()
    for k, v in pairs:
        if k in seen:
            errs.append(f"tensor class {k!r} given twice")
            continue
        seen.add(k)
        fmt = _format_name(k, v, errs)
        if k in GROUPS:
            if fmt is not None:
                grouped.update(dict.fromkeys(GROUPS[k], fmt))
        elif k in ACTIVATIONS:
            if fmt is not None and fmt not in ACTIVATIONS[k]:
                errs.append(f"{k} can be {' or '.join(ACTIVATIONS[k])}, not {fmt}")
            elif fmt is not None:
                named[k] = fmt
        elif k in KEPT:
            if fmt is not None and fmt not in KEPT[k]:
                errs.append(
                    f"{k} cannot be stored as {fmt}: {_KEPT_WHY[k]} (formats apply to {', '.join(TENSOR_CLASSES)})"
                )
        elif k in TENSOR_CLASSES or k in CLASS_ALIASES:
            c = CLASS_ALIASES.get(k, k)
            if c in named:
                errs.append(f"tensor class {c!r} given twice (as {k!r})")
            elif fmt is not None:
                named[c] = fmt
        else:
            known = (*TENSOR_CLASSES, *GROUPS, *CLASS_ALIASES, *KEPT, *ACTIVATIONS)
            errs.append(
                f"unknown tensor class {k!r} (classes: {', '.join(TENSOR_CLASSES)}; or non-experts for "
                f"all of them){_near(str(k), known)}"
            )
    if errs:
        raise FormatError("formats: " + "; ".join(errs))
    return {c: named.get(c, grouped.get(c)) for c in (*TENSOR_CLASSES, *ACTIVATIONS) if c in named or c in grouped}


def format_spec(formats: Mapping[str, str]) -> str:
    """The inverse of `parse_formats` for strings (non-bf16 classes in TENSOR_CLASSES order; "" = as shipped)."""
    return ",".join(f"{c}={formats[c]}" for c in (*TENSOR_CLASSES, *ACTIVATIONS) if formats.get(c, "bf16") != "bf16")


_ATTN = re.compile(r"(^|\.)layers\.\d+\.self_attn\.[a-z_]+_proj(_with_mqa)?(\.weight)?$")
_SHARED = re.compile(r"(^|\.)block_sparse_moe\.shared_experts\.(gate|up|down)_proj(\.weight)?$")
_DENSE = re.compile(r"(^|\.)layers\.\d+\.mlp\.(gate|up|down)_proj(\.weight)?$")
_LATENT = re.compile(r"(^|\.)block_sparse_moe\.routed_expert_(down|up)_proj(\.weight)?$")
_HEAD = re.compile(r"^lm_head(\.weight)?$")


def class_of(name: str) -> str | None:
    """Tensor class of a module path (``model.layers.3.self_attn.q_proj``) or checkpoint weight name
    (``...q_proj.weight``); None for everything that is never converted."""
    for cls, rx in (
        ("attention", _ATTN),
        ("shared_experts", _SHARED),
        ("dense", _DENSE),
        ("latent", _LATENT),
        ("lm_head", _HEAD),
    ):
        if rx.search(name):
            return cls
    return None


def packed_bytes(out_features: int, in_features: int, fmt: str) -> int:
    """Bytes of an [out, in] matrix held as `fmt` by MXLinear (data + E8M0 scales, the in dim padded to 32);
    bf16: 2 bytes per value. What the memory estimators charge for a converted matrix."""
    kp = -(-in_features // MX_BLOCK) * MX_BLOCK
    if fmt == "mxfp8":
        return out_features * (kp + kp // MX_BLOCK)
    if fmt == "mxfp4":
        return out_features * (kp // 2 + kp // MX_BLOCK)
    if fmt == "bf16":
        return out_features * in_features * 2
    raise FormatError(f"unknown format {fmt!r} (formats: {', '.join(FORMATS)})")
