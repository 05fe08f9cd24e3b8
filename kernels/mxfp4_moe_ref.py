"""Routed experts from MXFP4 weights, torch reference (spec 5.1 steps 5-6, 5.3, 6.2).

u[n] = sum_j topk_weights[n, j] * W2_e (act(W1_e z[n], W3_e z[n])),  e = topk_ids[n, j]
with W{1,3} [I, W] and W2 [W, I] in the compressed-tensors layout (packed uint8 [out, in/2], low nibble
= even element; E8M0 scales [out, in/32]) stacked over the local experts. Ids < 0 are experts this
stage does not hold (skipped: another stage adds them).

Two orders of the same arithmetic: a few tokens (decode) gather the weights of their N*k chosen experts
and run three batched matmuls (a fixed handful of ops, no host sync, no loop: the hot path, capturable by
torch.compile); many tokens (prefill) loop over the experts they touch, dequantizing each once. Both give
the same values up to the order of the fp32 sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


# byte -> its two E2M1 values (low nibble first), and E8M0 byte -> 2^(s - 127) (0xFF -> NaN): two table
# lookups instead of a dozen elementwise ops per dequantization (the same values: exp2 of an integer is exact)
_BYTE_PAIRS = torch.stack([E2M1[torch.arange(256) & 0xF], E2M1[torch.arange(256) >> 4]], -1)  # [256, 2]
_E8M0 = torch.where(torch.arange(256) == 255, torch.tensor(float("nan")), torch.exp2(torch.arange(256.0) - 127.0))
_LUTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _luts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device not in _LUTS:
        _LUTS[device] = (_BYTE_PAIRS.to(device), _E8M0.to(device))
    return _LUTS[device]


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., out, in/2] u8 + [..., out, in/32] u8 -> [..., out, in] fp32 (scale 0xFF -> NaN)."""
    pairs, e8m0 = _luts(packed.device)
    vals = pairs.index_select(0, packed.reshape(-1).int())  # [out * in/2, 2] (index_select: ~4x `pairs[idx]` on CPU)
    s = e8m0.index_select(0, scale.reshape(-1).int()).view(scale.shape)  # [..., out, in/32]
    return (vals.view(*scale.shape, -1) * s.unsqueeze(-1)).view(*packed.shape[:-1], -1)


GATHER_MAX_ELEMS = 1 << 24  # weight elements gathered per call (N*k chosen experts x 3 matrices) up to which
#                             the batched order runs; beyond it (prefill) the loop over experts reads less
GATHER_MANY_ELEMS = 1 << 20  # the same bound when the choices outnumber the experts (the loop then copies less;
#                              measured on the CPU: small-k3 at batch 8 runs 2x faster looping)


def batched_order(topk_ids: torch.Tensor, experts: int, rows: int, cols: int) -> bool:
    """Whether the gathered (batched, loop-free) order runs for these choices: always under torch.compile (the
    loop's host sync would break the graph), else while the gathered weights stay small."""
    n = topk_ids.numel() * 3 * rows * cols
    if torch.compiler.is_compiling():
        return True
    return n <= (GATHER_MANY_ELEMS if topk_ids.numel() >= experts else GATHER_MAX_ELEMS)


def glu_act(g: torch.Tensor, u: torch.Tensor, activation: str, beta1: float, beta2: float) -> torch.Tensor:
    """SiTU-GLU (K3) or SiLU-GLU (Kimi Linear), fp32."""
    g, u = g.float(), u.float()
    if activation == "situ":
        return (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
    return F.silu(g) * u


def mxfp4_moe(
    z: torch.Tensor,
    w1_packed,
    w1_scale,
    w3_packed,
    w3_scale,
    w2_packed,
    w2_scale,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str = "situ",
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """z [N, W]; w1/w3 packed [E, I, W/2] scale [E, I, W/32]; w2 packed [E, W, I/2] scale [E, W, I/32];
    topk_ids [N, k] local expert index or -1; topk_weights [N, k]. Returns u [N, W] fp32."""
    N, W = z.shape
    if batched_order(topk_ids, w1_packed.shape[0], w1_packed.shape[1], W):
        ids = topk_ids.clamp(min=0)
        once = ids.numel() >= w1_packed.shape[0]  # as many choices as experts: dequantize each once, then gather
        w1, w3, w2 = (
            (dequant_mxfp4(p, s)[ids] if once else dequant_mxfp4(p[ids], s[ids]))
            for p, s in ((w1_packed, w1_scale), (w3_packed, w3_scale), (w2_packed, w2_scale))
        )
        return _gathered(z.float(), w1, w3, w2, topk_ids, topk_weights, activation, beta1, beta2)
    out = torch.zeros(N, W, dtype=torch.float32, device=z.device)
    zf = z.float()
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        x = zf[rows]
        h = glu_act(
            x @ dequant_mxfp4(w1_packed[e], w1_scale[e]).T,
            x @ dequant_mxfp4(w3_packed[e], w3_scale[e]).T,
            activation,
            beta1,
            beta2,
        )
        y = h @ dequant_mxfp4(w2_packed[e], w2_scale[e]).T
        out.index_add_(0, rows, y * topk_weights[rows, cols].float().unsqueeze(-1))
    return out


def dequantized_moe(
    z: torch.Tensor,
    w13,
    w2,
    topk_ids,
    topk_weights,
    activation: str = "situ",
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """mxfp4_moe over experts dequantized once (at load), in fp32: w13 [E, 2I, W] (W1 over W3), w2 [E, W, I],
    holding the MXFP4 values exactly. The same fp32 arithmetic as mxfp4_moe without the per-step
    dequantization: the expert-major order (`expert_major`, no weight copied) whenever the choices fill the
    experts' rows well enough, else the gathered order (a token or two) or the loop over experts (many
    tokens on a few experts); returns u [N, W] fp32."""
    zf = z.float()
    if not torch.compiler.is_compiling():
        out = expert_major(zf, w13, w2, topk_ids, topk_weights, activation, beta1, beta2)
        if out is not None:
            return out
    I = w2.shape[2]
    if batched_order(topk_ids, w13.shape[0], I, z.shape[1]):  # each token's chosen experts gathered
        ids = topk_ids.clamp(min=0)
        h = (w13[ids] @ zf.unsqueeze(1).unsqueeze(-1)).squeeze(-1)  # [N, k, 2I]: W1 and W3 in one matmul
        a = glu_act(h[..., :I], h[..., I:], activation, beta1, beta2)
        y = (w2[ids] @ a.unsqueeze(-1)).squeeze(-1)  # [N, k, W]
        y = torch.where((topk_ids >= 0).unsqueeze(-1), y * topk_weights.float().unsqueeze(-1), 0.0)
        return y.sum(1)
    out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
    for e in torch.unique(topk_ids).tolist():  # many tokens on a few experts: each expert once
        if e < 0:
            continue
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        h = zf[rows] @ w13[e].T
        a = glu_act(h[:, :I], h[:, I:], activation, beta1, beta2)
        out.index_add_(0, rows, (a @ w2[e].T) * topk_weights[rows, cols].float().unsqueeze(-1))
    return out


PAD_WASTE = 4  # expert-major grid: at most this many rows (experts x the most choices of one expert) per
PAD_ROWS = 16  # choice, or at most this many rows per expert; and only with more than experts / GATHER_BELOW
GATHER_BELOW = 4  # choices (fewer: gathering their few experts is cheaper than a pass over all of them).
#                   Measured on the CPU, 16 experts of 128 x 128: one token 190 us gathered vs 350 us
#                   expert-major; 8 tokens 1,130 vs 350 (2 per expert) and 1,030 vs 610 (8 on one expert)


def expert_major(x, w13, w2, topk_ids, topk_weights, activation, beta1, beta2) -> torch.Tensor | None:
    """The expert-major order: the N*k choices sorted by expert into an [E, C] grid of rows (C = the most
    choices any one expert got; empty rows are zero), two batched matmuls against every held expert's
    weights in place (nothing gathered), the rows weighed and added back to their tokens. A fixed ~25 ops
    for any N (the loop over experts costs ~15 per expert touched; the gathered order copies N*k expert
    matrices). None for very few choices, or a grid past PAD_WASTE / PAD_ROWS (a skewed prefill: the
    loop). Reads the counts on the host, so never under torch.compile."""
    if GATHER_BELOW * topk_ids.numel() <= w13.shape[0]:
        return None
    E, W, I = w13.shape[0], x.shape[1], w2.shape[2]
    flat = topk_ids.reshape(-1)
    sel = (flat >= 0).nonzero().squeeze(1)  # the choices held here
    if sel.numel() == 0:
        return torch.zeros(x.shape[0], W, dtype=torch.float32, device=x.device)
    e = flat[sel]
    cnt = torch.bincount(e, minlength=E)
    C = int(cnt.max())
    if E * C > max(PAD_WASTE * sel.numel(), PAD_ROWS * E):
        return None
    order = torch.argsort(e, stable=True)
    es, choice = e[order], sel[order]
    slot = torch.arange(es.numel(), device=x.device) - (torch.cumsum(cnt, 0) - cnt)[es]
    dst = es * C + slot  # each choice's row in the grid
    tok = torch.div(choice, topk_ids.shape[1], rounding_mode="floor")
    grid = x.new_zeros(E * C, W)
    grid[dst] = x[tok]
    h = torch.bmm(grid.view(E, C, W), w13.transpose(1, 2))  # [E, C, 2I]
    a = glu_act(h[..., :I], h[..., I:], activation, beta1, beta2)
    y = torch.bmm(a, w2.transpose(1, 2)).view(E * C, W)[dst]  # [choices, W]
    out = torch.zeros(x.shape[0], W, dtype=torch.float32, device=x.device)
    return out.index_add_(0, tok, y * topk_weights.reshape(-1)[choice].float().unsqueeze(-1))


def dense_moe(
    z: torch.Tensor,
    w1,
    w3,
    w2,
    topk_ids,
    topk_weights,
    activation: str = "silu",
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """Same as mxfp4_moe for unquantized experts (Kimi Linear): w1/w3 [E, I, W], w2 [E, W, I]."""
    N, W = z.shape
    if batched_order(topk_ids, w1.shape[0], w1.shape[1], W):
        ids = topk_ids.clamp(min=0)
        return _gathered(
            z,
            w1[ids].to(z.dtype),
            w3[ids].to(z.dtype),
            w2[ids].to(z.dtype),
            topk_ids,
            topk_weights,
            activation,
            beta1,
            beta2,
        )
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


def _gathered(x, w1, w3, w2, topk_ids, topk_weights, activation, beta1, beta2) -> torch.Tensor:
    """The batched order: x [N, W]; w1/w3 [N, k, I, W], w2 [N, k, W, I] (each token's chosen experts, in x's
    dtype). Choices with id < 0 contribute exactly nothing. Returns [N, W] fp32."""
    xe = x.unsqueeze(1).unsqueeze(-1)  # [N, 1, W, 1]
    h = glu_act((w1 @ xe).squeeze(-1), (w3 @ xe).squeeze(-1), activation, beta1, beta2).to(x.dtype)  # [N, k, I]
    y = (w2 @ h.unsqueeze(-1)).squeeze(-1).float()  # [N, k, W]
    y = torch.where((topk_ids >= 0).unsqueeze(-1), y * topk_weights.float().unsqueeze(-1), 0.0)
    return y.sum(1)
