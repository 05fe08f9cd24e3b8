"""A stage from a checkpoint directory: the tensors its plan owns (loader.py), the stage module built
from them (model), and the weight formats applied once (quant.formats). The node daemon, the
in-process pipeline (engine/reference.py) and the tools load stages here."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from p2pk3_kernels import ops as kernel_ops

from p2pk3.model.config import K3Config
from p2pk3.model.dtypes import torch_dtype
from p2pk3.model.kimi_k3 import LatentMoE
from p2pk3.model.stage import K3Stage, StagePlan, build_stage

from .loader import load_stage_weights


DEQUANT_BYTES = 8  # fp32 bytes of a dequantized expert per packed byte (two 4-bit values a byte)
DEQUANT_RAM_SHARE = 0.25  # the dequantized copy may take at most this share of the host's available memory


def available_memory() -> int | None:
    """Bytes of memory the host can still give (Linux MemAvailable), or None where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_dequant_experts(moes: list[LatentMoE], device) -> bool:
    """Whether a stage holds its MXFP4 experts dequantized unless told (P2PK3_DEQUANT_EXPERTS=1/0 overrides):
    only where the experts run on the torch path (a CPU without forced Triton kernels), which otherwise
    dequantizes every expert it uses on every pass — holding them in fp32 makes CPU decode 1.2-3x faster
    (docs/benchmarks.md, "issue 22") — and only while the fp32 copy (DEQUANT_BYTES per packed byte) fits in
    DEQUANT_RAM_SHARE of the host's available memory; the Triton kernels read the packed bytes themselves."""
    env = os.environ.get("P2PK3_DEQUANT_EXPERTS")
    if env is not None:
        return env not in ("0", "", "false", "no")
    if torch.device(device).type != "cpu" or kernel_ops.mode() == "triton":
        return False
    packed = sum(b.numel() for m in moes for n, b in m.named_buffers() if n.endswith("_packed"))
    if not packed:
        return False
    free = available_memory()
    return free is not None and DEQUANT_BYTES * packed <= DEQUANT_RAM_SHARE * free


def load_stage(
    model_dir: str | Path,
    plan: StagePlan,
    dtype="float32",
    device="cpu",
    cfg: K3Config | None = None,
    formats=None,
    formats_cache: str | Path | None = None,
    compile: bool | None = None,
    dequant_experts: bool | None = None,
) -> K3Stage:
    """`formats`: per tensor class weight format (p2pk3.quant.formats; None / {} = BF16 as shipped), converted
    once here; `formats_cache`: a file for the converted tensors (reused while the shards are unchanged);
    `compile`: the compiled decode step (`K3Stage.compile_decode`; None: the device's default);
    `dequant_experts`: hold the MXFP4 experts dequantized (`LatentMoE.dequantize_experts`: faster on the
    CPU's torch path, 4x the expert bytes); None: `default_dequant_experts` decides."""
    cfg = cfg or K3Config.from_pretrained(model_dir)
    state = load_stage_weights(
        model_dir,
        cfg,
        layers=plan.layers,
        experts=plan.experts or None,
        embed=plan.embed,
        head=plan.head,
        layer_parts=plan.parts or None,
    )
    stage = build_stage(cfg, plan, state, torch_dtype(dtype), device)
    if formats:
        from p2pk3.quant.convert import apply_formats, source_fingerprint

        apply_formats(stage, formats, cache=formats_cache, source=source_fingerprint(model_dir))
    moes = [m for m in stage.modules() if isinstance(m, LatentMoE)]
    if dequant_experts is None:
        dequant_experts = default_dequant_experts(moes, device)
    if dequant_experts:
        for m in moes:
            m.dequantize_experts()
    stage.compile_decode(compile)
    return stage
