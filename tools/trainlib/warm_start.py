"""Start a training stage from a published checkpoint (`train_docs.py --init-from DIR`).

    cfg = export_config(model_dir)                  # the checkpoint's K3Config
    stage = K3Stage(cfg, StagePlan.whole(cfg)); init_stage(stage, 0)
    load_export(stage, model_dir)                   # every parameter and buffer from the checkpoint

The inverse of `export`: non-expert tensors (BF16 in the checkpoint) become the fp32 parameters of the
same module path (`checkpoint_to_module`), and each MXFP4 routed expert (`experts.E.wK.weight_packed` /
`weight_scale`) is dequantized exactly into row E of the float master `wK_master` [E, out, in]. The QAT
forward fake-quantizes the masters with the quantizer that wrote the checkpoint, and MXFP4 values are its
fixed points, so the warm-started stage computes what the checkpoint computes (up to the BF16 rounding of
the other matrices, which the checkpoint has too). Optimizer state is not in a checkpoint: training
re-warms the learning rate.

A training run's folder (its `ckpt.pt`, no `config.json`) is a start too, for a curriculum of runs each with
its own options (`run_checkpoint`): its fp32 stage exactly, its tokenizer, and the runs before it plus its
own steps so far in the lineage (`lineage.runs_through`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from p2pk3.checkpoint.tiny import default_prefix
from p2pk3.model.config import K3Config
from p2pk3.model.kimi_k3 import checkpoint_to_module
from p2pk3.model.stage import K3Stage
from p2pk3.quant.convert import dequantize_weight

_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(w[123])\.weight_packed$")


def run_checkpoint(path: str | Path) -> Path | None:
    """`path`'s `ckpt.pt` where `path` is a training run's folder (no exported `config.json`), else None."""
    path = Path(path)
    ck = path / "ckpt.pt"
    return ck if ck.exists() and not (path / "config.json").exists() else None


def export_config(model_dir: str | Path) -> K3Config:
    ck = run_checkpoint(model_dir)
    if ck is not None:
        return K3Config.from_hf_dict(torch.load(ck, map_location="cpu", weights_only=False)["config"])
    return K3Config.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text()))


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"--init-from {model_dir}: no *.safetensors there")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


@torch.no_grad()
def load_export(stage: K3Stage, model_dir: str | Path) -> int:
    """Copy the checkpoint in `model_dir` into the training `stage` (module doc); returns the number of
    tensors read. Raises SystemExit naming the first tensor that has no place or no value."""
    model_dir = Path(model_dir)
    ck = run_checkpoint(model_dir)
    if ck is not None:  # a training run: its fp32 parameters and buffers as they are
        sd = torch.load(ck, map_location="cpu", weights_only=False)["stage"]
        stage.load_state_dict(sd)
        return len(sd)
    pre = default_prefix(stage.cfg)
    sd = _tensors(model_dir)
    params = dict(stage.named_parameters()) | dict(stage.named_buffers())
    filled: set[str] = set()
    for name, t in sd.items():
        if not name.startswith(pre):
            continue  # multimodal stand-ins and other towers: not part of the language model
        key = name[len(pre) :]
        m = _EXPERT.match(key)
        if m:
            layer, e, w = m.group(1), int(m.group(2)), m.group(3)
            dst = params.get(f"{layer}.{w}_master")
            if dst is None:
                raise SystemExit(f"--init-from: {name} has no master expert {layer}.{w}_master in this stage")
            scale = sd[name[: -len("weight_packed")] + "weight_scale"]
            dst[e].copy_(dequantize_weight(t, scale, "mxfp4", in_features=dst.shape[-1]))
            filled.add(f"{layer}.{w}_master")
            continue
        if key.endswith("weight_scale") and ".experts." in key:
            continue
        path = checkpoint_to_module(key)
        if path not in params:
            continue  # tensors the training stage does not hold (e.g. packed expert buffers)
        dst = params[path]
        if tuple(dst.shape) != tuple(t.shape):
            raise SystemExit(f"--init-from: {name} is {tuple(t.shape)}, the stage's {path} is {tuple(dst.shape)}")
        dst.copy_(t.to(dst.dtype))
        filled.add(path)
    missing = [n for n, p in stage.named_parameters() if n not in filled]
    if missing:
        raise SystemExit(f"--init-from {model_dir}: no value for {missing[:3]} ({len(missing)} parameters)")
    return len(filled)


def upgrade_tokenizer(src: str | Path, dst: str | Path) -> Path:
    """The tokenizer of checkpoint `src` in `dst`, its special slots named and its chat template set as
    `p2pk3.tokenizer.bpe` names and writes them today (a slot the checkpoint left `<|reserved_token_i|>` that
    is now a tool-call or thinking marker gets that name; ids and merges are unchanged, so the embedding rows
    keep their meaning)."""
    from p2pk3.tokenizer.bpe import CHAT_TEMPLATE, special_tokens

    src, dst = Path(src), Path(dst)
    if run_checkpoint(src) is not None:
        src = src / "tokenizer"
    dst.mkdir(parents=True, exist_ok=True)
    tc = json.loads((src / "tokenizer_config.json").read_text())
    names = dict(special_tokens(tc["num_base_tokens"]))
    tj = json.loads((src / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        t["content"] = names.get(t["id"], t["content"])
    for i, t in tc["added_tokens_decoder"].items():
        t["content"] = names.get(int(i), t["content"])
    tc["chat_template"] = CHAT_TEMPLATE
    (dst / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    (dst / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    return dst
