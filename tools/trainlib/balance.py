"""Router balancing without an aux loss (spec section 7): the routers' scores of the last training forward
(`RouterTap`), K3's quantile balancing in a simple form (`qb_update`) or DeepSeek-V3's sign rule
(`sign_update`), applied to `e_score_correction_bias` after every step; `imbalance` measures the load."""

from __future__ import annotations

import torch

from p2pk3.model.stage import K3Stage

from .model import moe_layers


class RouterTap:
    """Forward hooks on every router: keep the fp32 sigmoid scores of the last training forward."""

    def __init__(self, stage: K3Stage):
        self.scores: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, moe in moe_layers(stage).items():
            self.handles.append(moe.gate.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def fn(mod, args, out):
            if mod.training:
                with torch.no_grad():
                    self.scores[i] = torch.sigmoid(args[0].detach().float() @ mod.weight.detach().float().T)

        return fn


@torch.no_grad()
def qb_update(bias: torch.Tensor, s: torch.Tensor, k: int, rate: float) -> None:
    """Quantile balancing, simple form (spec section 7). s [N, n] sigmoid scores, bias [n] (selection uses s + bias).

    For token t and expert e let c[t, e] be the k-th largest biased score among the OTHER experts (= the
    (k+1)-th largest overall if e is in t's top-k, else the k-th): e is admitted iff s[t, e] + b_e > c[t, e].
    With the other biases fixed, the bias that gives e exactly the target load m = N k / n is the m-th
    smallest d[t, e] = c[t, e] - s[t, e] (midpoint of the m-th and (m+1)-th). Blend towards it by `rate` (an EMA over
    steps) and subtract the mean (only differences matter for top-k)."""
    N, n = s.shape
    z = s + bias
    top = torch.topk(z, k + 1, dim=-1).values  # [N, k+1]
    chosen = torch.zeros_like(z, dtype=torch.bool).scatter_(1, torch.topk(z, k, dim=-1).indices, True)
    c = torch.where(chosen, top[:, k : k + 1], top[:, k - 1 : k])
    d = (c - s).sort(0).values  # [N, n] ascending per expert
    m = N * k // n
    tgt = 0.5 * (d[m - 1] + d[min(m, N - 1)])
    bias.mul_(1 - rate).add_(rate * tgt)
    bias.sub_(bias.mean())


@torch.no_grad()
def sign_update(bias: torch.Tensor, s: torch.Tensor, k: int, rate: float) -> None:
    """DeepSeek-V3 aux-loss-free rule: b_e += rate * sign(target - load_e)."""
    N, n = s.shape
    load = torch.bincount(torch.topk(s + bias, k, dim=-1).indices.flatten(), minlength=n).float()
    bias.add_(rate * torch.sign(N * k / n - load))
    bias.sub_(bias.mean())


def imbalance(ids: torch.Tensor, n: int) -> float:
    """max expert load / mean expert load (1.0 = perfectly balanced)."""
    load = torch.bincount(ids.flatten(), minlength=n).float()
    return float(load.max() / load.mean())
