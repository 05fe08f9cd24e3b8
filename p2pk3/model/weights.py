"""The checkpoint's tensor inventory: every weight name, shape and dtype (spec 1.2 and 8).

Names are canonical: `model.layers.N...`, `model.embed_tokens.weight`, `lm_head.weight`, without the
multimodal wrapper's `language_model.` prefix (the loader strips and the tiny-checkpoint writer adds it).
`K3Stage.load_weights` takes exactly these names; module paths equal them except the AttnRes pairs
(`...mlp_res_norm.weight` is the module `...mlp_res.norm.weight`, see kimi_k3.checkpoint_to_module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .config import K3Config

# the checkpoint's dtypes by their safetensors names: this module needs no torch (the planner, topology
# checks and deploy commands size slots without importing it); `TensorSpec.dtype` gives the torch dtype
BF16, FP32, U8 = "BF16", "F32", "U8"
ITEMSIZE = {BF16: 2, FP32: 4, U8: 1}
NAMES = {BF16: "bfloat16", FP32: "float32", U8: "uint8"}  # torch's names


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stored: str  # the dtype the published checkpoint stores (safetensors name: BF16, F32, U8)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.stored]

    @property
    def dtype_name(self) -> str:
        return NAMES[self.stored]

    @property
    def dtype(self):
        """The stored dtype as a torch.dtype."""
        import torch

        return getattr(torch, NAMES[self.stored])


def layer_tensors(
    cfg: K3Config, i: int, experts: Iterable[int] | None = None, parts: tuple[str, ...] = ("attn", "mlp")
) -> dict[str, TensorSpec]:
    """Tensors of decoder layer `i`. `experts`: routed experts to include (None = all).
    `parts`: which halves ("attn": everything up to the attention output, "mlp": the MLP/MoE half);
    a layer split over several ring slots needs the attention half on one slot only."""
    D = cfg.hidden_size
    p = f"model.layers.{i}."
    t: dict[str, TensorSpec] = {}
    if "attn" in parts:
        t[p + "input_layernorm.weight"] = TensorSpec((D,), BF16)
        if cfg.uses_attn_res:
            t[p + "self_attention_res_norm.weight"] = TensorSpec((D,), BF16)
            t[p + "self_attention_res_proj.weight"] = TensorSpec((1, D), BF16)
        a = p + "self_attn."
        if cfg.layer_types[i] == "kda":
            H, K = cfg.kda_num_heads, cfg.kda_head_dim
            for n in "qkv":
                t[a + f"{n}_proj.weight"] = TensorSpec((H * K, D), BF16)
                t[a + f"{n}_conv1d.weight"] = TensorSpec((H * K, 1, cfg.kda_conv_size), FP32)
            t[a + "f_a_proj.weight"] = TensorSpec((cfg.kda_gate_low_rank, D), BF16)
            t[a + "f_b_proj.weight"] = TensorSpec((H * K, cfg.kda_gate_low_rank), BF16)
            t[a + "A_log"] = TensorSpec((cfg.kda_a_log_len,), FP32)
            t[a + "dt_bias"] = TensorSpec((H * K,), FP32)
            t[a + "b_proj.weight"] = TensorSpec((H, D), BF16)
            t[a + "o_norm.weight"] = TensorSpec((K,), FP32)
            if cfg.kda_full_rank_gate:
                t[a + "g_proj.weight"] = TensorSpec((H * K, D), BF16)
            else:
                t[a + "g_a_proj.weight"] = TensorSpec((cfg.kda_gate_low_rank, D), BF16)
                t[a + "g_b_proj.weight"] = TensorSpec((H * K, cfg.kda_gate_low_rank), BF16)
            t[a + "o_proj.weight"] = TensorSpec((D, H * K), BF16)
        else:
            H = cfg.num_attention_heads
            if cfg.q_lora_rank:
                t[a + "q_a_proj.weight"] = TensorSpec((cfg.q_lora_rank, D), BF16)
                t[a + "q_a_layernorm.weight"] = TensorSpec((cfg.q_lora_rank,), BF16)
                t[a + "q_b_proj.weight"] = TensorSpec((H * cfg.q_head_dim, cfg.q_lora_rank), BF16)
            else:
                t[a + "q_proj.weight"] = TensorSpec((H * cfg.q_head_dim, D), BF16)
            t[a + "kv_a_proj_with_mqa.weight"] = TensorSpec((cfg.mla_cache_width, D), BF16)
            t[a + "kv_a_layernorm.weight"] = TensorSpec((cfg.kv_lora_rank,), BF16)
            t[a + "kv_b_proj.weight"] = TensorSpec(
                (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), BF16
            )
            if cfg.mla_use_output_gate:
                t[a + "g_proj.weight"] = TensorSpec((H * cfg.v_head_dim, D), BF16)
            t[a + "o_proj.weight"] = TensorSpec((D, H * cfg.v_head_dim), BF16)
    if "mlp" in parts:
        t[p + "post_attention_layernorm.weight"] = TensorSpec((D,), BF16)
        if cfg.uses_attn_res:
            t[p + "mlp_res_norm.weight"] = TensorSpec((D,), BF16)
            t[p + "mlp_res_proj.weight"] = TensorSpec((1, D), BF16)
        if not cfg.is_moe_layer(i):
            I = cfg.intermediate_size
            t[p + "mlp.gate_proj.weight"] = TensorSpec((I, D), BF16)
            t[p + "mlp.up_proj.weight"] = TensorSpec((I, D), BF16)
            t[p + "mlp.down_proj.weight"] = TensorSpec((D, I), BF16)
        else:
            m = p + "block_sparse_moe."
            E, W, I = cfg.num_experts, cfg.expert_width, cfg.moe_intermediate_size
            t[m + "gate.weight"] = TensorSpec((E, D), BF16)
            t[m + "gate.e_score_correction_bias"] = TensorSpec((E,), FP32)
            if cfg.routed_expert_hidden_size:
                t[m + "routed_expert_down_proj.weight"] = TensorSpec((W, D), BF16)
                t[m + "routed_expert_up_proj.weight"] = TensorSpec((D, W), BF16)
                if cfg.latent_moe_use_norm:
                    t[m + "routed_expert_norm.weight"] = TensorSpec((W,), BF16)
            if cfg.num_shared_experts:
                S = cfg.num_shared_experts * I
                t[m + "shared_experts.gate_proj.weight"] = TensorSpec((S, D), BF16)
                t[m + "shared_experts.up_proj.weight"] = TensorSpec((S, D), BF16)
                t[m + "shared_experts.down_proj.weight"] = TensorSpec((D, S), BF16)
            for e in range(E) if experts is None else experts:
                for w, (o, n) in (("w1", (I, W)), ("w3", (I, W)), ("w2", (W, I))):
                    q = m + f"experts.{e}.{w}."
                    if cfg.quant is not None:
                        g = cfg.quant.group_size
                        t[q + "weight_packed"] = TensorSpec((o, n // 2), U8)
                        t[q + "weight_scale"] = TensorSpec((o, n // g), U8)
                    else:
                        t[q + "weight"] = TensorSpec((o, n), BF16)
    return t


def embed_tensors(cfg: K3Config) -> dict[str, TensorSpec]:
    return {"model.embed_tokens.weight": TensorSpec((cfg.vocab_size, cfg.hidden_size), BF16)}


def head_tensors(cfg: K3Config) -> dict[str, TensorSpec]:
    D = cfg.hidden_size
    t = {"model.norm.weight": TensorSpec((D,), BF16)}
    if cfg.uses_attn_res:
        t["model.output_attn_res_norm.weight"] = TensorSpec((D,), BF16)
        t["model.output_attn_res_proj.weight"] = TensorSpec((1, D), BF16)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = TensorSpec((cfg.vocab_size, D), BF16)
    return t


def all_tensors(cfg: K3Config) -> dict[str, TensorSpec]:
    t = embed_tensors(cfg)
    for i in range(cfg.num_hidden_layers):
        t.update(layer_tensors(cfg, i))
    t.update(head_tensors(cfg))
    return t


def mlp_tensors(
    cfg: K3Config, i: int, experts: Iterable[int] | None = None, *, finish: bool = True
) -> dict[str, TensorSpec]:
    """The MLP half of layer `i` as one ring slot holds it. `experts`: routed experts (None = all).
    `finish`: the slot finishes the layer; when a MoE layer is split by experts over several slots, only
    the finishing one holds the shared experts and the latent up-projection (the others hold the norms,
    the router, the latent down-projection and their experts)."""
    t = layer_tensors(cfg, i, experts=experts, parts=("mlp",))
    if finish:
        return t
    return {k: v for k, v in t.items() if ".shared_experts." not in k and ".routed_expert_up_proj." not in k}
