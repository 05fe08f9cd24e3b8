"""Quantization-aware training helpers: MXFP4 fake quantization with a straight-through estimator."""

from __future__ import annotations

import torch

from .mxfp4 import dequantize_mxfp4, quantize_mxfp4


class _FakeQuantMXFP4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:  # noqa: D401
        flat = w.detach().float().reshape(-1, w.shape[-1])
        packed, scale = quantize_mxfp4(flat)
        return dequantize_mxfp4(packed, scale).reshape(w.shape).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad  # straight-through: d(fakequant(w))/dw := identity


def fake_quant_mxfp4_ste(w: torch.Tensor) -> torch.Tensor:
    """Round `w` [..., in] to MXFP4 along the last (input) dim in the forward; identity gradient."""
    return _FakeQuantMXFP4.apply(w)
