"""The small K3 of the embedded models: its config, its initialisation for training (float master experts,
MXFP4 quantization-aware), and the trained weights under canonical checkpoint names."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch

from p2pk3.model.config import TINY_K3, K3Config, _k3_full_attn
from p2pk3.model.kimi_k3 import KimiDeltaAttention, LatentMoE, module_to_checkpoint
from p2pk3.model.stage import K3Stage


def tiny_config(
    vocab_size: int,
    bos: int,
    eos: int,
    pad: int,
    *,
    hidden: int = 128,
    layers: int = 9,
    kda_heads: int = 2,
    kda_dim: int = 32,
    experts: int = 16,
    topk: int = 2,
    moe_inter: int = 64,
) -> K3Config:
    """A small K3. `layers` = 9 keeps K3's pattern exactly: 1-indexed MLA layers 4, 8 and 9 (every 4th plus
    the last, so the last two are MLA, as 92 and 93 in K3); dense layer 0; MoE elsewhere."""
    return TINY_K3.replace(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        full_attn_layers=_k3_full_attn(layers),
        kda_num_heads=kda_heads,
        kda_head_dim=kda_dim,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=4 * hidden,
        num_experts=experts,
        num_experts_per_token=topk,
        num_shared_experts=1,
        moe_intermediate_size=moe_inter,
        routed_expert_hidden_size=hidden // 2,
        attn_res_block_size=3,
    )


def config_from_args(tok, a) -> K3Config:
    """`tiny_config` for a tokenizer and a training script's size options (--hidden, --layers, ...)."""
    return tiny_config(
        tok.vocab_size,
        tok.bos_id,
        tok.im_end_id,
        tok.pad_id,
        hidden=a.hidden,
        layers=a.layers,
        kda_heads=a.kda_heads,
        kda_dim=a.kda_dim,
        experts=a.experts,
        topk=a.topk,
        moe_inter=a.moe_inter,
    )


def _set_decay(m: KimiDeltaAttention, A: torch.Tensor, lb: float, lo: float, hi: float, g: torch.Generator) -> None:
    """One KDA layer's dt_bias such that its initial per-token decay exp(g) is log-uniform in [exp(-hi),
    exp(-lo)] per channel: g = lb * sigmoid(A * (a + dt_bias)), with a ~ 0 at the start."""
    tgt = torch.exp(torch.empty(m.H, m.K).uniform_(math.log(lo), math.log(hi), generator=g))
    s = (tgt / -lb).clamp(1e-6, 1 - 1e-6)
    m.dt_bias.copy_((torch.log(s / (1 - s)) / A[:, None]).reshape(-1))


def _kda_decay(stage: K3Stage, lo: float, hi: float, g: torch.Generator) -> None:
    """Every KDA layer's decay drawn anew in [exp(-hi), exp(-lo)] (init_stage draws it in [exp(-1), exp(-0.01)])."""
    for m in stage.modules():
        if isinstance(m, KimiDeltaAttention):
            _set_decay(m, m.A_log[: m.H].exp(), stage.cfg.kda_gate_lower_bound, lo, hi, g)


def _fan_in(stage: K3Stage, names: tuple[str, ...], g: torch.Generator) -> None:
    """The matrices whose parameter name ends with one of `names` drawn N(0, 1/fan_in) instead of N(0, 0.02):
    a unit-variance output for a unit-variance input (the MLA up-projections read a normed latent, so their
    queries and keys, and the attention scores, are then of order one at the start)."""
    for n, p in stage.named_parameters():
        if p.dim() == 2 and n.endswith(names):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


MLA_QK = ("q_b_proj.weight", "kv_b_proj.weight")
KDA_QK = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")

# init_stage's variants: the start above, then one change (`tools/copy_probe.py --learn --init NAME` measures
# how fast each learns to copy; `tools/train_docs.py --fresh-init NAME` trains from it; docs/quality.md)
INIT_VARIANTS: dict[str, Callable[[K3Stage, torch.Generator], None]] = {
    "train": lambda stage, g: None,
    "kda-slow": lambda stage, g: _kda_decay(stage, 0.001, 0.1, g),  # a longer memory: decay 0.90-0.999 a token
    "mla-fanin": lambda stage, g: _fan_in(stage, MLA_QK, g),  # MLA query and key/value up-projections
    "mla-q-fanin": lambda stage, g: _fan_in(stage, MLA_QK[:1], g),  # the query's alone
    "mla-kv-fanin": lambda stage, g: _fan_in(stage, MLA_QK[1:], g),  # the key/value's alone
    "qk-fanin": lambda stage, g: _fan_in(stage, MLA_QK + KDA_QK, g),  # MLA's, and KDA's q and k projections
}


@torch.no_grad()
def redraw(stage: K3Stage, variant: str, seed: int) -> list[str]:
    """A warm start's tensors that `INIT_VARIANTS[variant]` sets, drawn afresh (the rest keeps what it learnt:
    `tools/train_docs.py --redraw`); returns the names of the tensors it changed."""
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    INIT_VARIANTS[variant](stage, torch.Generator().manual_seed(seed + 1))
    return [k for k, v in stage.state_dict().items() if not torch.equal(v, before[k])]


@torch.no_grad()
def init_stage(stage: K3Stage, seed: int, variant: str = "train") -> None:
    """Random start. Projections N(0, 0.02) (output projections / 1/sqrt(2L), GPT-2 style), norms 1, KDA
    A_log = log U(1, 16) on the real heads (zero padding), dt_bias set so that the initial per-channel decay
    exp(g) spans exp(-0.01)..exp(-1) (log-uniform, like Mamba's dt init), short convs N(0,1)/sqrt(kernel),
    AttnRes pseudo-queries 0 (uniform mix at start, as in the AttnRes paper), router bias 0, routed experts
    as float masters N(0, 0.02) (QAT). Then `INIT_VARIANTS[variant]` (from a generator of its own: the
    start before it is the same for every variant)."""
    if variant not in INIT_VARIANTS:
        raise ValueError(f"unknown init variant {variant!r}; one of {', '.join(INIT_VARIANTS)}")
    g = torch.Generator().manual_seed(seed)
    cfg = stage.cfg
    L = cfg.num_hidden_layers
    for name, p in stage.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.zero_()
            p.requires_grad_(False)  # moved by the balancing rule, not by gradients
        elif module_to_checkpoint(name).endswith("_res_proj.weight"):
            p.zero_()
        elif "conv1d" in name:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        elif name.endswith("A_log") or name.endswith("dt_bias"):
            pass  # below, per module
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            std = 0.02 / math.sqrt(2 * L) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * std)
    for m in stage.modules():
        if isinstance(m, KimiDeltaAttention):
            H = m.H
            A = torch.empty(H).uniform_(1.0, 16.0, generator=g)
            m.A_log.zero_()
            m.A_log[:H] = A.log()
            _set_decay(m, A, cfg.kda_gate_lower_bound, 0.01, 1.0, g)  # a target g in [-1, -0.01]
    for m in stage.modules():
        if isinstance(m, LatentMoE):
            E, W, I = len(m.held), cfg.expert_width, cfg.moe_intermediate_size
            m.enable_master_experts(
                {
                    "w1": torch.randn((E, I, W), generator=g) * 0.02,
                    "w3": torch.randn((E, I, W), generator=g) * 0.02,
                    "w2": torch.randn((E, W, I), generator=g) * 0.02 / math.sqrt(2 * L),
                }
            )
            for b in ("w1_packed", "w1_scale", "w2_packed", "w2_scale", "w3_packed", "w3_scale"):
                delattr(m, b)  # the packed buffers are unused in training; keep them out of state_dict()
    INIT_VARIANTS[variant](stage, torch.Generator().manual_seed(seed + 1))


def moe_layers(stage: K3Stage) -> dict[int, LatentMoE]:
    return {m.layer_idx: m for m in stage.modules() if isinstance(m, LatentMoE)}


def canonical_state_dict(stage: K3Stage) -> dict[str, torch.Tensor]:
    """Canonical checkpoint names -> fp32 tensors; routed experts as float `experts.E.wK.weight`."""
    sd: dict[str, torch.Tensor] = {}
    for n, p in stage.named_parameters():
        if re.search(r"\.w[123]_master$", n):
            pre, w = n.rsplit(".", 1)
            for e in range(p.shape[0]):
                sd[f"{pre}.experts.{e}.{w[:2]}.weight"] = p[e].detach().clone()
        else:
            sd[module_to_checkpoint(n)] = p.detach().clone()
    return sd
