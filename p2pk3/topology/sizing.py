"""Memory sizing of a slot: the checkpoint tensors its plan loads, their bytes once loaded in the
topology's weight formats, and the caches and workspace on top (docs/topology.md, "Memory check").

The one place bytes are counted: the topology memory check (`estimate_slot_bytes`) and the planner's
itemised table (p2pk3/plan/memory.py) both add up `weight_items` and `runtime_items`. A matrix converted by
a weight format costs what `MXLinear` holds (p2pk3.quant.formats.packed_bytes); the KDA state and the MLA
pages cost what `StageCache` allocates (p2pk3.model.cache.kda_session_bytes / mla_pool_bytes)."""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping


from p2pk3.model.cache_sizes import BF16, DEFAULT_BLOCK_SIZE, kda_session_bytes, mla_pool_bytes
from p2pk3.model.config import K3Config
from p2pk3.model.weights import embed_tensors, head_tensors, layer_tensors, mlp_tensors
from p2pk3.quant.formats import class_of, packed_bytes, parse_formats

from .plans import SlotPlan
from .specs import GiB, MemorySpec

CACHE_DTYPE = BF16  # the MLA pages on a card (the stage's activation dtype)
Items = dict[tuple[str, str], int]  # (tensor class, stored as) -> bytes


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


# ----------------------------------------------------------------------------- weights
def weight_class(name: str, shape: tuple[int, ...]) -> str:
    """The memory-table row of a checkpoint tensor: a convertible class of p2pk3.quant.formats (attention,
    shared_experts, dense, lm_head, latent) or one that is always loaded as shipped (routed_experts,
    embedding, router, norms: norms, gate vectors, biases, conv taps)."""
    if ".experts." in name:
        return "routed_experts"
    if name == "model.embed_tokens.weight":
        return "embedding"
    cls = class_of(name)
    if cls is not None and len(shape) == 2 and min(shape) > 1:
        return cls
    if name.endswith("block_sparse_moe.gate.weight"):
        return "router"
    return "norms"


_LABEL = {"bfloat16": "bf16", "float32": "fp32", "uint8": "mxfp4"}  # uint8: the packed experts


def tensor_bytes(name: str, spec: Any, formats: Mapping[str, str]) -> tuple[str, str, int]:
    """(class, stored as, bytes) of one checkpoint tensor loaded with `formats` (class -> format)."""
    cls = weight_class(name, spec.shape)
    fmt = formats.get(cls, "bf16")
    if fmt != "bf16" and len(spec.shape) == 2:
        return cls, fmt, packed_bytes(spec.shape[0], spec.shape[1], fmt)
    return cls, _LABEL.get(spec.dtype_name, spec.dtype_name), math.prod(spec.shape) * spec.itemsize


def formats_key(formats: Mapping[str, str] | str | None) -> tuple:
    """A hashable formats map, through `parse_formats` (any spelling it accepts; FormatError otherwise)."""
    return tuple(sorted(parse_formats(formats).items()))


@functools.lru_cache(maxsize=8192)
def part_items(cfg: K3Config, layer: int, part: str, finish: bool, fkey: tuple = ()) -> tuple:
    """((class, stored as), bytes) of one layer's attention half ("attn"), MLP half without routed experts
    ("mlp", `finish`: with the shared experts and latent up-projection), ONE routed expert ("expert"), the
    embedding ("embed") or the head ("head": final norms and lm_head), in formats `fkey` (`formats_key`).
    A pure function of the (frozen) config, hence the cache."""
    if part == "attn":
        specs = layer_tensors(cfg, layer, experts=(), parts=("attn",))
    elif part == "mlp":
        specs = mlp_tensors(cfg, layer, (), finish=finish)
    elif part == "expert":
        specs = {k: v for k, v in mlp_tensors(cfg, layer, (0,)).items() if ".experts." in k}
    elif part == "embed":
        specs = embed_tensors(cfg)
    elif part == "head":
        specs = head_tensors(cfg)
    else:
        raise ValueError(f"unknown part {part!r} (expected 'attn', 'mlp', 'expert', 'embed' or 'head')")
    formats = dict(fkey)
    out: Items = {}
    for name, s in specs.items():
        cls, label, b = tensor_bytes(name, s, formats)
        out[(cls, label)] = out.get((cls, label), 0) + b
    return tuple(sorted(out.items()))


def part_bytes(
    cfg: K3Config, layer: int, part: str, finish: bool = True, formats: Mapping[str, str] | None = None
) -> int:
    return sum(b for _, b in part_items(cfg, layer, part, finish, formats_key(formats)))


def weight_items(cfg: K3Config, plan: SlotPlan, formats: Mapping[str, str] | None = None) -> Items:
    """The weights of `slot_tensors(cfg, plan)` by (class, stored as), without listing every expert tensor."""
    fk = formats_key(formats)
    out: Items = {}

    def add(items, times: int = 1) -> None:
        for k, b in items:
            out[k] = out.get(k, 0) + b * times

    if plan.embed:
        add(part_items(cfg, 0, "embed", True, fk))
    for lp in plan.layers:
        if lp.attn:
            add(part_items(cfg, lp.layer, "attn", True, fk))
        add(part_items(cfg, lp.layer, "mlp", lp.finish, fk))
        if lp.moe and lp.experts:
            add(part_items(cfg, lp.layer, "expert", True, fk), len(lp.experts))
    if plan.head:
        add(part_items(cfg, 0, "head", True, fk))
        if cfg.tie_word_embeddings and not plan.embed:
            add(part_items(cfg, 0, "embed", True, fk))
    return out


def weight_bytes(cfg: K3Config, plan: SlotPlan, formats: Mapping[str, str] | None = None) -> int:
    """Bytes of `slot_tensors(cfg, plan)` as loaded with `formats` (checkpoint sizes when none)."""
    return sum(weight_items(cfg, plan, formats).values())


def loaded_weight_bytes(stage) -> int:
    """What a loaded stage holds in weights: its parameters and persistent buffers, each storage once
    (the figure `weight_bytes` estimates; a node reports it in its status as memory.weights)."""
    seen: dict[tuple[int, int], int] = {}
    for t in stage.state_dict().values():
        seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.nbytes
    return sum(seen.values())


# ----------------------------------------------------------------------------- caches and workspace
def kda_state_bytes(cfg: K3Config) -> int:
    """One session's KDA state in one layer (recurrent state + short-conv history), as StageCache allocates it."""
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    return kda_session_bytes(cfg.kda_num_heads, cfg.kda_head_dim, 3 * hk, cfg.kda_conv_size)


def mla_token_bytes(cfg: K3Config, dtype=CACHE_DTYPE) -> int:
    """One token of the MLA latent cache in one layer ([kv_lora_rank + rope] in `dtype`): what a decode step
    reads per token of context."""
    return cfg.mla_cache_width * dtype.itemsize


def mla_cache_bytes(
    cfg: K3Config, sessions: int, context: int, dtype=CACHE_DTYPE, block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """One MLA layer's paged cache for `sessions` x `context` tokens, as StageCache allocates it."""
    return mla_pool_bytes(sessions * context, sessions, cfg.mla_cache_width, dtype, block_size)


def workspace_bytes(cfg: K3Config, prefill_chunk: int) -> int:
    """Activations of one prefill chunk: prefix + AttnRes bank (in and out) + 16 hidden-wide temporaries (bf16)."""
    return prefill_chunk * cfg.hidden_size * 2 * (2 * (cfg.max_bank_rows + 1) + 16)


def logits_bytes(cfg: K3Config, sessions: int) -> int:
    """fp32 logits of the sampled rows plus sampling scratch, on the head slot."""
    return sessions * cfg.vocab_size * 4 * 2


def runtime_items(
    cfg: K3Config, plan: SlotPlan, memory: MemorySpec | None = None, dtype=CACHE_DTYPE
) -> list[tuple[str, str, int]]:
    """(item, detail, bytes) on top of the weights: KDA state and MLA cache of the attention held here,
    the prefill workspace, the logits on the head slot, the CUDA reserve (an estimate beyond the caches)."""
    m = memory or MemorySpec()
    n_kda = sum(1 for lp in plan.layers if lp.attn and lp.kind == "kda")
    n_mla = sum(1 for lp in plan.layers if lp.attn and lp.kind == "mla")
    rows = []
    if n_kda:
        rows.append(("KDA state", f"{m.sessions} sessions x {n_kda} layers", m.sessions * n_kda * kda_state_bytes(cfg)))
    if n_mla:
        rows.append(
            (
                "MLA latent cache",
                f"{m.sessions} x {m.context} tok x {n_mla} layers",
                n_mla * mla_cache_bytes(cfg, m.sessions, m.context, dtype),
            )
        )
    if plan.layers:
        rows.append(
            ("activations + workspace", f"prefill chunk {m.prefill_chunk} tok", workspace_bytes(cfg, m.prefill_chunk))
        )
    if plan.head:
        rows.append(
            ("logits + sampling", f"{m.sessions} rows x vocab {cfg.vocab_size} fp32 x2", logits_bytes(cfg, m.sessions))
        )
    rows.append(("CUDA context + allocator reserve", "overhead_gb", int(m.overhead_gb * GiB)))
    return rows


def runtime_bytes(cfg: K3Config, plan: SlotPlan, memory: MemorySpec | None = None, dtype=CACHE_DTYPE) -> int:
    """Caches and workspace on top of the weights (see `runtime_items`)."""
    return sum(b for _, _, b in runtime_items(cfg, plan, memory, dtype))


def estimate_slot_bytes(
    cfg: K3Config, plan: SlotPlan, memory: MemorySpec | None = None, formats: Mapping[str, str] | None = None
) -> int:
    """Device memory a slot needs for `plan`: its weights in `formats` (as shipped when none: MXFP4 experts
    stay packed; the first slot adds the embedding, the last the final norm + lm_head) plus caches and
    workspace (`memory`, default `MemorySpec()`). 0 for a plan without layers (a standby slot)."""
    if not plan.layers:
        return 0
    return weight_bytes(cfg, plan, formats) + runtime_bytes(cfg, plan, memory)
