"""Converting a loaded stage's non-expert matrices into the weight formats of a formats map, once at load
(the formats, their classes and their sizes: p2pk3/quant/formats.py).

``apply_formats(stage, {"attention": "mxfp8", ...})`` swaps the chosen ``nn.Linear`` modules of a
loaded stage for `MXLinear` (packed weights, the matmul through ``p2pk3_kernels.ops.mx_linear``, Triton
or torch). With every class at ``bf16`` (the default) nothing is touched: outputs stay bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Mapping

import torch
import torch.nn as nn

from .formats import FormatError, class_of, format_spec, parse_formats
from .mxfp4 import (
    E4M3_EMAX,
    E4M3_MAX,
    MX_BLOCK,
    MXFP4Error,
    _E8M0_VALUES,
    _floor_log2,
    dequantize_mxfp4,
    e8m0_to_float,
    quantize_mxfp4,
)

__all__ = [
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "quantize_weight",
    "dequantize_weight",
    "MXLinear",
    "apply_formats",
    "ApplyStats",
    "source_fingerprint",
]


# ------------------------------------------------------------------------------------------- MXFP8
def _padded(w: torch.Tensor) -> torch.Tensor:
    pad = (-w.shape[-1]) % MX_BLOCK
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., out, in] -> (E4M3 bytes uint8 [..., out, Kp], E8M0 scales uint8 [..., out, Kp/32]), Kp = in
    rounded up to 32 (zero columns). OCP MX v1.0 rule (as `mxfp8_e4m3_fake_quant`): shared_exp =
    floor(log2(max|block|)) - 8 clamped at -127; elements V / 2^shared_exp rounded to nearest-even E4M3 and
    saturated to +-448. An all-zero block gets scale byte 0. Non-finite input raises MXFP4Error."""
    if not w.dtype.is_floating_point:
        raise MXFP4Error(f"quantize_mxfp8 needs a floating tensor, got {w.dtype}")
    x = _padded(w.float())
    if not torch.isfinite(x).all():
        raise MXFP4Error(f"cannot quantize non-finite values ({int((~torch.isfinite(x)).sum())} of {x.numel()})")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exp = torch.where(
        amax > 0,
        _floor_log2(torch.where(amax > 0, amax, torch.ones_like(amax))) - E4M3_EMAX,
        torch.full_like(amax, -127, dtype=torch.int32),
    ).clamp(min=-127)
    inv = _E8M0_VALUES.to(x.device)[(127 - exp).clamp(max=254).long()].unsqueeze(-1)
    q = (blocks * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).reshape(x.shape), (exp + 127).to(torch.uint8)


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E4M3 bytes [..., out, Kp] + E8M0 scales [..., out, Kp/32] -> [..., out, Kp] in `dtype` (exact in fp32)."""
    if q.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise MXFP4Error(f"MXFP8 data and scales must be uint8, got {q.dtype} and {scale.dtype}")
    if q.shape[:-1] != scale.shape[:-1] or scale.shape[-1] * MX_BLOCK != q.shape[-1]:
        raise MXFP4Error(
            f"MXFP8 shape mismatch: data {tuple(q.shape)} needs scales "
            f"{tuple(q.shape[:-1]) + (q.shape[-1] // MX_BLOCK,)}, got {tuple(scale.shape)}"
        )
    v = q.view(torch.float8_e4m3fn).float().view(*scale.shape, MX_BLOCK) * e8m0_to_float(scale).unsqueeze(-1)
    return v.view(q.shape).to(dtype)


def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (packed data, E8M0 scales) in `fmt` ("mxfp8" or "mxfp4"), in dim zero-padded to 32."""
    if fmt == "mxfp8":
        return quantize_mxfp8(w)
    if fmt == "mxfp4":
        return quantize_mxfp4(_padded(w.float()))
    raise FormatError(f"cannot quantize to {fmt!r} (quantized formats: mxfp8, mxfp4)")


def dequantize_weight(
    data: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    in_features: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize_weight` (exact): [out, in_features] (the padding cut off) in `dtype`."""
    w = dequantize_mxfp8(data, scale) if fmt == "mxfp8" else dequantize_mxfp4(data, scale)
    return (w if in_features is None else w[..., :in_features]).to(dtype)


# ------------------------------------------------------------------------------------------ module
class MXLinear(nn.Module):
    """A bias-free linear layer whose weight [out, in] is held as MXFP8 or MXFP4 (`data` u8 [out, Kp] or
    [out, Kp/2], `scale` u8 [out, Kp/32]); y = x W^T through ``ops.mx_linear`` (Triton with in-kernel
    dequant, or the torch reference), fp32 accumulation, output in the activation dtype."""

    def __init__(self, in_features: int, out_features: int, fmt: str, data: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if fmt not in ("mxfp8", "mxfp4"):
            raise FormatError(f"MXLinear holds mxfp8 or mxfp4, not {fmt!r}")
        kp = -(-in_features // MX_BLOCK) * MX_BLOCK
        want = (out_features, kp if fmt == "mxfp8" else kp // 2)
        if tuple(data.shape) != want or tuple(scale.shape) != (out_features, kp // MX_BLOCK):
            raise FormatError(
                f"MXLinear {fmt} [{out_features}, {in_features}]: data {tuple(data.shape)} / scale "
                f"{tuple(scale.shape)}, expected {want} / {(out_features, kp // MX_BLOCK)}"
            )
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.register_buffer("data", data.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.act_dtype = torch.float32  # dtype of `weight` (the dequantized view); set by from_linear

    @classmethod
    def from_linear(cls, lin: nn.Linear, fmt: str) -> "MXLinear":
        if lin.bias is not None:
            raise FormatError("MXLinear has no bias")
        w = lin.weight.detach()
        data, scale = quantize_weight(w, fmt)
        m = cls(lin.in_features, lin.out_features, fmt, data, scale)
        m.act_dtype = w.dtype
        return m

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] in the activation dtype (made on every access: for code that uses
        the matrix itself, e.g. the absorbed MLA's kv_b_proj)."""
        return dequantize_weight(self.data, self.scale, self.fmt, self.in_features, self.act_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from p2pk3_kernels import ops

        lead = x.shape[:-1]
        y = ops.mx_linear(x.reshape(-1, x.shape[-1]), self.data, self.scale, self.fmt)
        return y.reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}"


# ------------------------------------------------------------------------------------------- apply
class ApplyStats(dict):
    """Per class: {"modules": n, "params": n, "bytes_before": n, "bytes_after": n}; plus "cached": bool."""


def _cache_key(stage: nn.Module, formats: Mapping[str, str], source: str | None) -> str:
    names = sorted(n for n, m in stage.named_modules() if isinstance(m, nn.Linear))
    blob = json.dumps(
        {"formats": format_spec(formats), "linears": names, "source": source or "", "v": 1}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def source_fingerprint(model_dir: str | os.PathLike) -> str:
    """Names, sizes and mtimes of a checkpoint's shards: a converted cache is reused only for the same shards."""
    d = Path(model_dir)
    parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(d.glob("*.safetensors"))]
    return ";".join(parts)


def apply_formats(
    stage: nn.Module,
    formats: Mapping[str, str] | str | None,
    *,
    cache: str | os.PathLike | None = None,
    source: str | None = None,
) -> ApplyStats:
    """Re-quantize the chosen tensor classes of a loaded stage in place (each chosen nn.Linear becomes an
    MXLinear). `cache`: a .safetensors file for the converted tensors: read when it exists and was written for
    the same formats, modules and `source` (see `source_fingerprint`), written otherwise. Returns ApplyStats."""
    fm = parse_formats(formats)
    stats = ApplyStats(cached=False)
    if "expert_inputs" in fm:  # the activation entry: an instance attribute of each LatentMoE
        for mod in stage.modules():
            if hasattr(mod, "mxfp8_activations"):
                mod.mxfp8_activations = fm["expert_inputs"] == "mxfp8"
    todo = []
    for name, mod in stage.named_modules():
        for cname, child in mod.named_children():
            path = f"{name}.{cname}" if name else cname
            if not isinstance(child, nn.Linear):
                continue
            cls = class_of(path)
            if cls is None or fm.get(cls, "bf16") == "bf16":
                continue
            todo.append((mod, cname, path, cls, child))
    if (
        "lm_head" in fm
        and fm["lm_head"] != "bf16"
        and getattr(getattr(stage, "cfg", None), "tie_word_embeddings", False)
    ):
        raise FormatError(
            "lm_head is tied to the embeddings (tie_word_embeddings): it is a gather table and "
            "cannot be re-quantized; drop lm_head from formats"
        )
    if not todo:
        return stats
    key = _cache_key(stage, fm, source)
    loaded: dict[str, torch.Tensor] = {}
    if cache is not None and Path(cache).exists():
        from safetensors import safe_open

        with safe_open(str(cache), framework="pt") as f:
            if (f.metadata() or {}).get("p2pk3_formats_key") == key:
                loaded = {k: f.get_tensor(k) for k in f.keys()}
    stats["cached"] = bool(loaded)
    out: dict[str, torch.Tensor] = {}
    for mod, cname, path, cls, lin in todo:
        fmt = fm[cls]
        if loaded:
            m = MXLinear(lin.in_features, lin.out_features, fmt, loaded[path + ".data"], loaded[path + ".scale"])
            m.act_dtype = lin.weight.dtype
            m = m.to(lin.weight.device)
        else:
            m = MXLinear.from_linear(lin, fmt)
        setattr(mod, cname, m)
        out[path + ".data"], out[path + ".scale"] = m.data, m.scale
        s = stats.setdefault(cls, {"format": fmt, "modules": 0, "params": 0, "bytes_before": 0, "bytes_after": 0})
        s["modules"] += 1
        s["params"] += lin.weight.numel()
        s["bytes_before"] += lin.weight.numel() * lin.weight.element_size()
        s["bytes_after"] += m.nbytes()
    if cache is not None and not loaded:
        from safetensors.torch import save_file

        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(cache) + ".tmp")
        save_file(
            {k: v.contiguous().cpu() for k, v in out.items()},
            str(tmp),
            metadata={"p2pk3_formats_key": key, "formats": format_spec(fm)},
        )
        os.replace(tmp, cache)
    return stats
