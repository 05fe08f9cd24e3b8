"""Write a checkpoint in the exact published layout (tiny random models for tests, or a trained export).

Layout (spec 1.2, 6.2, 8): `config.json` (`cfg.to_hf_dict()`), shards `model-0000k-of-0000n.safetensors`
plus `model.safetensors.index.json` (`metadata.total_size`, `weight_map`), or a single `model.safetensors`
when shards == 1 (what HF writes for one shard); `language_model.` prefix for kimi_k3 (none for
kimi_linear); a few fake `vision_tower.*` / `mm_projector.*` tensors for kimi_k3; routed experts as
MXFP4 (`weight_packed` / `weight_scale` uint8) when the config is quantized; `A_log` zero-padded.
Everything is bf16 on disk except the fp32 / uint8 tensors that `p2pk3.model.weights` lists.

    python tools/make_tiny_checkpoint.py --preset tiny-k3 --out /tmp/tiny --seed 0 --shards 3
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import save_file

from p2pk3.model.config import K3Config, preset  # noqa: E402
from p2pk3.model.weights import TensorSpec, all_tensors  # noqa: E402
from p2pk3.quant.mxfp4 import quantize_mxfp4  # noqa: E402

__all__ = ["write_checkpoint", "random_state_dict", "default_prefix", "main"]

_EXPERT_RE = re.compile(r"^(.*\.experts\.\d+\.w[123]\.)(weight_packed|weight_scale)$")


def default_prefix(cfg: K3Config) -> str:
    return "language_model." if cfg.model_type == "kimi_k3" else ""


def _init_tensor(name: str, spec: TensorSpec, cfg: K3Config, g: torch.Generator) -> torch.Tensor:
    """Random value for one (non-expert-packed) tensor, in float32 before the cast to spec dtype."""
    shape = spec.shape
    if name.endswith("A_log"):
        H = cfg.kda_num_heads
        t = torch.zeros(shape)
        t[:H] = torch.log(torch.empty(H).uniform_(1.0, 16.0, generator=g))
        return t
    if name.endswith("dt_bias"):
        return torch.randn(shape, generator=g) * 0.1
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=g) * 0.01
    if "conv1d" in name:
        return torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    if len(shape) == 1:  # every 1-D weight left is a norm weight (RMSNorm / o_norm)
        return torch.ones(shape)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    if name.endswith("_res_proj.weight"):  # AttnRes pseudo-queries: small so that the first mixes are near-uniform
        return torch.randn(shape, generator=g) * 0.02
    # projections [out, in]: variance-preserving 1/sqrt(fan_in)
    return torch.randn(shape, generator=g) / math.sqrt(shape[-1])


def random_state_dict(cfg: K3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor for every tensor of `all_tensors(cfg)`, in the on-disk dtypes; routed
    experts of a quantized config are MXFP4-quantized from random float weights."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, spec in all_tensors(cfg).items():
        m = _EXPERT_RE.match(name)
        if m:
            if m.group(2) == "weight_packed":
                o, half = spec.shape
                w = torch.randn((o, half * 2), generator=g) / math.sqrt(half * 2)
                out[m.group(1) + "weight_packed"], out[m.group(1) + "weight_scale"] = quantize_mxfp4(w)
            continue
        out[name] = _init_tensor(name, spec, cfg, g).to(spec.dtype)
    return {n: out[n] for n in all_tensors(cfg)}


def _from_state_dict(cfg: K3Config, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Validate / convert a user state dict (canonical names) into the on-disk tensors."""
    specs = all_tensors(cfg)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for name, spec in specs.items():
        m = _EXPERT_RE.match(name)
        if m and name in sd:
            t = sd[name]
            used.add(name)
            if t.dtype != torch.uint8:
                raise ValueError(f"state_dict[{name!r}]: MXFP4 tensors must be uint8, got {t.dtype}")
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"state_dict[{name!r}]: shape {list(t.shape)}, expected {list(spec.shape)}")
            out[name] = t.detach().cpu().contiguous()
            continue
        if m:
            fname = m.group(1) + "weight"
            if fname not in sd:
                missing.append(name)
                continue
            used.add(fname)
            if m.group(2) == "weight_scale":
                continue  # produced together with weight_packed below
            w = sd[fname].detach().cpu()
            o, half = spec.shape
            if tuple(w.shape) != (o, half * 2):
                raise ValueError(f"state_dict[{fname!r}]: shape {list(w.shape)}, expected {[o, half * 2]}")
            p, s = quantize_mxfp4(w.float())
            out[m.group(1) + "weight_packed"], out[m.group(1) + "weight_scale"] = p, s
            continue
        if name not in sd:
            missing.append(name)
            continue
        used.add(name)
        t = sd[name].detach().cpu()
        if name.endswith("A_log"):
            t = t.reshape(-1)
            if t.numel() < cfg.kda_num_heads or t.numel() > spec.shape[0]:
                raise ValueError(
                    f"state_dict[{name!r}]: {t.numel()} entries, expected {cfg.kda_num_heads}..{spec.shape[0]}"
                )
            pad = torch.zeros(spec.shape, dtype=torch.float32)
            pad[: cfg.kda_num_heads] = t[: cfg.kda_num_heads].float()
            if t.numel() > cfg.kda_num_heads and bool((t[cfg.kda_num_heads :] != 0).any()):
                raise ValueError(f"state_dict[{name!r}]: entries past the {cfg.kda_num_heads} real heads must be zero")
            t = pad
        elif tuple(t.shape) != spec.shape:
            raise ValueError(f"state_dict[{name!r}]: shape {list(t.shape)}, expected {list(spec.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"state_dict[{name!r}]: expected a float tensor, got {t.dtype}")
        out[name] = t.to(spec.dtype).contiguous()
    if missing:
        raise ValueError(f"state_dict lacks {len(missing)} tensors, e.g. {missing[:5]}")
    extra = sorted(set(sd) - used)
    if extra:
        raise ValueError(f"state_dict has {len(extra)} tensors the config does not list, e.g. {extra[:5]}")
    return {n: out[n] for n in specs}


def _fake_multimodal(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "vision_tower.encoder.blocks.0.attn.qkv.weight": (torch.randn((24, 8), generator=g) * 0.02).to(torch.bfloat16),
        "vision_tower.patch_embed.proj.bias": torch.zeros(8, dtype=torch.bfloat16),
        "mm_projector.proj.0.weight": (torch.randn((16, 8), generator=g) * 0.02).to(torch.bfloat16),
        "mm_projector.pre_norm.weight": torch.ones(8, dtype=torch.bfloat16),
    }


def write_checkpoint(
    out_dir: str | Path,
    cfg: K3Config,
    seed: int = 0,
    shards: int = 3,
    prefix: str | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write `cfg`'s full checkpoint to `out_dir` and return the directory.

    prefix: prepended to every text-tower name (default `language_model.` for kimi_k3, none for kimi_linear).
    state_dict: canonical name -> tensor to write instead of random values; routed experts may be given
    packed (`weight_packed`/`weight_scale` uint8) or as float `experts.E.wK.weight` (then MXFP4-quantized).
    Every tensor of `all_tensors(cfg)` must be present and nothing else."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pre = default_prefix(cfg) if prefix is None else prefix
    tensors = random_state_dict(cfg, seed) if state_dict is None else _from_state_dict(cfg, state_dict)
    stored: dict[str, torch.Tensor] = {pre + n: t for n, t in tensors.items()}
    if cfg.model_type == "kimi_k3":
        stored.update(_fake_multimodal(torch.Generator().manual_seed(seed + 1)))

    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")

    names = list(stored)
    nbytes = {n: stored[n].numel() * stored[n].element_size() for n in names}
    total = sum(nbytes.values())
    shards = min(shards, len(names))
    if shards == 1:
        save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    # contiguous split into `shards` non-empty groups of roughly equal bytes (in canonical order, like HF)
    groups: list[list[str]] = [[]]
    acc = 0
    for k, n in enumerate(names):
        shards_left = shards - len(groups)
        if groups[-1] and shards_left > 0 and (acc * shards >= total * len(groups) or len(names) - k <= shards_left):
            groups.append([])
        groups[-1].append(n)
        acc += nbytes[n]
    weight_map: dict[str, str] = {}
    for k, grp in enumerate(groups):
        fn = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: stored[n] for n in grp}, str(out / fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in grp})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny-k3", choices=["tiny-k3", "tiny-kimi-linear"])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (keeps the K3 cadence)")
    a = ap.parse_args(argv)
    cfg = preset(a.preset)
    if a.layers is not None:
        L = a.layers
        if cfg.model_type == "kimi_k3":
            full = tuple(sorted({i for i in range(3, L, 4)} | {L - 1}))
        else:
            full = tuple(i for i in cfg.full_attn_layers if i < L - 1) + (L - 1,)
        cfg = cfg.replace(num_hidden_layers=L, full_attn_layers=full)
    p = write_checkpoint(a.out, cfg, seed=a.seed, shards=a.shards)
    n = sum(f.stat().st_size for f in p.glob("*.safetensors"))
    print(f"wrote {p} ({cfg.model_type}, {cfg.num_hidden_layers} layers, {n} bytes of safetensors)")
    return 0
