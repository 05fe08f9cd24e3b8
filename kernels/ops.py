"""The one place that chooses Triton or torch for every op.

Default: Triton when the tensors are on CUDA and triton imports, torch otherwise. `P2PK3_KERNELS=torch`
forces the torch references; `P2PK3_KERNELS=triton` forces the Triton kernels (on the CPU this needs
`TRITON_INTERPRET=1` set before triton is first imported). Callers (the model, the daemon) never know
which ran. `force(path)` overrides the environment for the current process (tests, benchmarks).
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

from . import attnres_ref, kda_ref, mla_decode_ref, mx_linear_ref, mxfp4_moe_ref

_forced: str | None = None
_triton_ok: bool | None = None


def force(path: str | None) -> None:
    """'triton', 'torch' or None (back to the environment / automatic choice)."""
    global _forced
    if path not in (None, "triton", "torch", "auto"):
        raise ValueError(f"kernel path must be triton, torch or auto, not {path!r}")
    _forced = path


def mode() -> str:
    m = _forced or os.environ.get("P2PK3_KERNELS", "auto")
    if m not in ("auto", "triton", "torch"):
        raise ValueError(f"P2PK3_KERNELS={m!r}: expected triton, torch or auto")
    return m


def triton_available() -> bool:
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401

            _triton_ok = True
        except Exception:
            _triton_ok = False
    return _triton_ok


def use_triton(t: torch.Tensor) -> bool:
    m = mode()
    if m == "torch":
        return False
    if m == "triton":
        if not triton_available():
            raise RuntimeError("P2PK3_KERNELS=triton but triton is not installed")
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "P2PK3_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)"
            )
        return True
    return t.is_cuda and triton_available()


def _pick(module: str, name: str, ref: Callable, probe_arg: int = 0) -> Callable:
    def op(*args, **kwargs):
        if use_triton(args[probe_arg]):
            return getattr(importlib.import_module(f"{__package__}.{module}"), name)(*args, **kwargs)
        return ref(*args, **kwargs)

    op.__name__ = name
    op.__doc__ = ref.__doc__
    return op


attnres_mix = _pick("attnres", "attnres_mix", attnres_ref.attnres_mix, probe_arg=1)
kda_decode = _pick("kda", "kda_decode", kda_ref.kda_decode)
kda_prefill = _pick("kda", "kda_prefill", kda_ref.kda_prefill)
mla_decode = _pick("mla_decode", "mla_decode", mla_decode_ref.mla_decode)
mxfp4_moe = _pick("mxfp4_moe", "mxfp4_moe", mxfp4_moe_ref.mxfp4_moe)
mx_linear = _pick(
    "mx_linear", "mx_linear", mx_linear_ref.mx_linear
)  # MXFP8 / MXFP4 dense weights (p2pk3.quant.formats)
dense_moe = mxfp4_moe_ref.dense_moe
dequantized_moe = mxfp4_moe_ref.dequantized_moe  # MXFP4 experts dequantized at load (CPU option, LatentMoE.dequantize_experts)  # unquantized experts (Kimi Linear): torch matmuls are already the fast path
