"""A stage from a checkpoint directory: the tensors its plan owns (loader.py), the stage module built
from them (model), and the weight formats applied once (quant.formats). The node daemon, the
in-process pipeline (engine/reference.py) and the tools load stages here."""

from __future__ import annotations

from pathlib import Path

from p2pk3.model.config import K3Config
from p2pk3.model.dtypes import torch_dtype
from p2pk3.model.stage import K3Stage, StagePlan, build_stage

from .loader import load_stage_weights


def load_stage(
    model_dir: str | Path,
    plan: StagePlan,
    dtype="float32",
    device="cpu",
    cfg: K3Config | None = None,
    formats=None,
    formats_cache: str | Path | None = None,
    compile: bool | None = None,
    dequant_experts: bool = False,
) -> K3Stage:
    """`formats`: per tensor class weight format (p2pk3.quant.formats; None / {} = BF16 as shipped), converted
    once here; `formats_cache`: a file for the converted tensors (reused while the shards are unchanged);
    `compile`: the compiled decode step (`K3Stage.compile_decode`; None: the device's default);
    `dequant_experts`: hold the MXFP4 experts dequantized (`LatentMoE.dequantize_experts`: faster on the
    CPU's torch path, 4x the expert bytes)."""
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
    if dequant_experts:
        from p2pk3.model.kimi_k3 import LatentMoE

        for m in stage.modules():
            if isinstance(m, LatentMoE):
                m.dequantize_experts()
    stage.compile_decode(compile)
    return stage
