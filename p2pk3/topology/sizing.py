"""Memory sizing of a slot: the checkpoint tensors its plan loads, their bytes, and an estimate of the
caches and workspace on top (docs/topology.md, "Memory check")."""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping

from p2pk3.model.config import K3Config
from p2pk3.model.weights import embed_tensors, head_tensors, layer_tensors, mlp_tensors

from .plans import SlotPlan
from .specs import GiB, MemorySpec


def nbytes(specs: Mapping[str, Any]) -> int:
    """Bytes of a tensor inventory (name -> TensorSpec) as the checkpoint stores it."""
    return sum(math.prod(s.shape) * s.itemsize for s in specs.values())


def slot_tensors(cfg: K3Config, plan: SlotPlan) -> dict[str, Any]:
    """The checkpoint tensors (name -> TensorSpec) a slot loads for its plan."""
    t: dict[str, Any] = {}
    if plan.embed:
        t.update(embed_tensors(cfg))
    for lp in plan.layers:
        if lp.attn:
            t.update(layer_tensors(cfg, lp.layer, experts=(), parts=("attn",)))
        t.update(mlp_tensors(cfg, lp.layer, None if lp.all_experts else lp.experts, finish=lp.finish))
    if plan.head:
        t.update(head_tensors(cfg))
        if cfg.tie_word_embeddings:
            t.update(embed_tensors(cfg))
    return t


@functools.lru_cache(maxsize=4096)
def part_bytes(cfg: K3Config, layer: int, part: str, finish: bool) -> int:
    """Bytes of one layer's attention half ("attn"), MLP half without routed experts ("mlp"), or ONE
    routed expert ("expert"). A pure function of the (frozen) config, hence the cache."""
    if part == "attn":
        return nbytes(layer_tensors(cfg, layer, experts=(), parts=("attn",)))
    if part == "expert":
        return nbytes(mlp_tensors(cfg, layer, (0,))) - nbytes(mlp_tensors(cfg, layer, ()))
    if part == "mlp":
        return nbytes(mlp_tensors(cfg, layer, (), finish=finish))
    raise ValueError(f"unknown part {part!r} (expected 'attn', 'mlp' or 'expert')")


def weight_bytes(cfg: K3Config, plan: SlotPlan) -> int:
    """Bytes of `slot_tensors(cfg, plan)`, computed without listing every expert tensor."""
    n = nbytes(embed_tensors(cfg)) if plan.embed else 0
    for lp in plan.layers:
        if lp.attn:
            n += part_bytes(cfg, lp.layer, "attn", True)
        n += part_bytes(cfg, lp.layer, "mlp", lp.finish)
        if lp.moe:
            n += len(lp.experts) * part_bytes(cfg, lp.layer, "expert", True)
    if plan.head:
        n += nbytes(head_tensors(cfg))
        if cfg.tie_word_embeddings and not plan.embed:
            n += nbytes(embed_tensors(cfg))
    return n


def runtime_bytes(cfg: K3Config, plan: SlotPlan, memory: MemorySpec | None = None) -> int:
    """Caches and workspace on top of the weights (an estimate, see docs/topology.md)."""
    m = memory or MemorySpec()
    cache = 0
    for lp in plan.layers:
        if not lp.attn:
            continue
        if lp.kind == "kda":
            hk = cfg.kda_num_heads * cfg.kda_head_dim
            cache += m.sessions * (cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4 + 3 * hk * (cfg.kda_conv_size - 1) * 2)
        else:
            cache += m.sessions * m.context * cfg.mla_cache_width * 2
    rows = cfg.max_bank_rows + 1
    work = m.prefill_chunk * cfg.hidden_size * 2 * (2 * rows + 16) if plan.layers else 0
    if plan.head:
        work += m.sessions * cfg.vocab_size * 4 * 2  # fp32 logits of the sampled rows (+ sampling scratch)
    return cache + work + int(m.overhead_gb * GiB)


def estimate_slot_bytes(cfg: K3Config, plan: SlotPlan, memory: MemorySpec | None = None) -> int:
    """Device memory a slot needs for `plan`: its weights (checkpoint sizes: MXFP4 experts stay packed;
    the first slot adds the embedding, the last the final norm + lm_head) plus caches and workspace
    (`memory`, default `MemorySpec()`). 0 for a plan without layers (a standby slot)."""
    if not plan.layers:
        return 0
    return weight_bytes(cfg, plan) + runtime_bytes(cfg, plan, memory)
