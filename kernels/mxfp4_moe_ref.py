"""Routed experts from MXFP4 weights, torch reference (spec 5.1 steps 5-6, 5.3, 6.2).

u[n] = sum_j topk_weights[n, j] * W2_e (act(W1_e z[n], W3_e z[n])),  e = topk_ids[n, j]
with W{1,3} [I, W] and W2 [W, I] in the compressed-tensors layout (packed uint8 [out, in/2], low nibble
= even element; E8M0 scales [out, in/32]) stacked over the local experts. Ids < 0 are experts this
stage does not hold (skipped: another stage adds them). The reference dequantizes one expert at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in/2] u8 + [out, in/32] u8 -> [out, in] fp32 (scale 0xFF -> NaN)."""
    lut = E2M1.to(packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    vals = lut[codes.long()]
    s = torch.exp2(scale.float() - 127.0)
    s = torch.where(scale == 255, torch.full_like(s, float("nan")), s)
    return (vals.view(*scale.shape, -1) * s.unsqueeze(-1)).reshape(vals.shape)


def glu_act(g: torch.Tensor, u: torch.Tensor, activation: str, beta1: float, beta2: float) -> torch.Tensor:
    """SiTU-GLU (K3) or SiLU-GLU (Kimi Linear), fp32."""
    g, u = g.float(), u.float()
    if activation == "situ":
        return (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
    return F.silu(g) * u


def mxfp4_moe(z: torch.Tensor, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str = "situ",
              beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """z [N, W]; w1/w3 packed [E, I, W/2] scale [E, I, W/32]; w2 packed [E, W, I/2] scale [E, W, I/32];
    topk_ids [N, k] local expert index or -1; topk_weights [N, k]. Returns u [N, W] fp32."""
    N, W = z.shape
    out = torch.zeros(N, W, dtype=torch.float32, device=z.device)
    zf = z.float()
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        x = zf[rows]
        h = glu_act(x @ dequant_mxfp4(w1_packed[e], w1_scale[e]).T, x @ dequant_mxfp4(w3_packed[e], w3_scale[e]).T,
                    activation, beta1, beta2)
        y = h @ dequant_mxfp4(w2_packed[e], w2_scale[e]).T
        out.index_add_(0, rows, y * topk_weights[rows, cols].float().unsqueeze(-1))
    return out


def dense_moe(z: torch.Tensor, w1, w3, w2, topk_ids, topk_weights, activation: str = "silu",
              beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """Same as mxfp4_moe for unquantized experts (Kimi Linear): w1/w3 [E, I, W], w2 [E, W, I]."""
    N, W = z.shape
    out = torch.zeros(N, W, dtype=torch.float32, device=z.device)
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        x = z[rows]
        h = glu_act(x @ w1[e].to(x.dtype).T, x @ w3[e].to(x.dtype).T, activation, beta1, beta2)
        y = h.to(x.dtype) @ w2[e].to(x.dtype).T
        out.index_add_(0, rows, y.float() * topk_weights[rows, cols].float().unsqueeze(-1))
    return out
