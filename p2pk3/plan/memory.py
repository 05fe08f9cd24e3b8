"""The itemised memory table of one card, and the bytes its stage reads per token.

Weights are grouped by tensor class; each class is stored in the checkpoint's dtype ("shipped") or in a
format chosen per class (`--formats attention=mxfp8,...`): bf16 2 B/param, mxfp8 1 B + one E8M0 scale per
32 values (1.03125 B), mxfp4 0.5 B + one scale per 32 (0.53125 B = 4.25 bit, the routed experts as
shipped). Only matrices change format; norms, biases, gates' vectors and conv taps stay as shipped.
Runtime items follow p2pk3/topology/sizing.py (the topology memory check) item by item."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from p2pk3.model.config import K3Config
from p2pk3.model.weights import embed_tensors, head_tensors, layer_tensors, mlp_tensors
from p2pk3.topology.plans import SlotPlan
from p2pk3.topology.specs import GiB, MemorySpec

# bytes per parameter of each weight format (None: as the checkpoint stores the tensor)
FORMATS: dict[str, float | None] = {"shipped": None, "bf16": 2.0, "mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32}
CLASSES = ("attention", "dense_mlp", "shared_experts", "router", "latent_proj", "routed_experts", "embedding",
           "lm_head", "norms")
# classes `--formats non-experts=F` sets (router and embedding stay: routing precision; the embedding reads one
# row per token)
NON_EXPERT = ("attention", "dense_mlp", "shared_experts", "latent_proj", "lm_head")
Formats = dict  # class -> format name


def parse_formats(text: str | None) -> dict[str, str]:
    """"attention=mxfp8,lm_head=bf16" or "non-experts=mxfp4" or "mxfp8" (= non-experts=mxfp8) -> class -> format."""
    out: dict[str, str] = {}
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        cls, _, fmt = part.rpartition("=")
        cls = cls.strip() or "non-experts"
        fmt = fmt.strip()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r} in --formats; known: {', '.join(FORMATS)}")
        targets = NON_EXPERT if cls in ("non-experts", "non_experts", "all") else (cls,)
        for c in targets:
            if c not in CLASSES:
                raise ValueError(f"unknown tensor class {c!r} in --formats; known: non-experts, {', '.join(CLASSES)}")
            if c == "routed_experts" and fmt not in ("shipped", "mxfp4"):
                raise ValueError("routed experts ship in MXFP4; --formats can only change the other tensor classes")
            out[c] = fmt
    return out


def tensor_class(name: str, shape: tuple[int, ...]) -> str:
    if ".experts." in name:
        return "routed_experts"
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if len(shape) < 2 or min(shape) == 1 or name.endswith("conv1d.weight"):
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".shared_experts." in name:
        return "shared_experts"
    if ".mlp." in name:
        return "dense_mlp"
    if name.endswith("block_sparse_moe.gate.weight"):
        return "router"
    if ".routed_expert_" in name:
        return "latent_proj"
    return "norms"


def _class_bytes(specs, formats: dict[str, str]) -> dict[tuple[str, str], int]:
    """(class, stored-as) -> bytes."""
    out: dict[tuple[str, str], int] = {}
    for name, s in specs.items():
        c = tensor_class(name, s.shape)
        n = math.prod(s.shape)
        fmt = formats.get(c, "shipped") if c != "norms" else "shipped"
        bpp = FORMATS[fmt]
        if bpp is None:
            label = "mxfp4" if c == "routed_experts" and s.itemsize == 1 else s.dtype_name
            label = {"bfloat16": "bf16", "float32": "fp32"}.get(label, label)
            b = n * s.itemsize
        else:
            label, b = fmt, int(round(n * bpp))
        out[(c, label)] = out.get((c, label), 0) + b
    return out


def _key(formats: dict[str, str]) -> tuple:
    return tuple(sorted(formats.items()))


@functools.lru_cache(maxsize=8192)
def _layer_parts(cfg: K3Config, layer: int, part: str, finish: bool, fkey: tuple) -> tuple:
    formats = dict(fkey)
    if part == "attn":
        specs = layer_tensors(cfg, layer, experts=(), parts=("attn",))
    elif part == "mlp":
        specs = mlp_tensors(cfg, layer, (), finish=finish)
    elif part == "expert":  # one routed expert
        specs = {k: v for k, v in mlp_tensors(cfg, layer, (0,)).items() if ".experts." in k}
    elif part == "embed":
        specs = embed_tensors(cfg)
    else:
        specs = head_tensors(cfg)
    return tuple(sorted(_class_bytes(specs, formats).items()))


@dataclass
class MemoryTable:
    """One card's memory, item by item (bytes)."""

    slot: str
    capacity: int
    weights: dict[tuple[str, str], int] = field(default_factory=dict)  # (class, format) -> bytes
    runtime: list[tuple[str, str, int]] = field(default_factory=list)  # (item, detail, bytes)

    @property
    def weight_total(self) -> int:
        return sum(self.weights.values())

    @property
    def runtime_total(self) -> int:
        return sum(b for _, _, b in self.runtime)

    @property
    def total(self) -> int:
        return self.weight_total + self.runtime_total

    @property
    def free(self) -> int:
        return self.capacity - self.total

    def rows(self) -> list[tuple[str, str, int]]:
        r = [(f"weights: {c}", f, b) for (c, f), b in sorted(self.weights.items(), key=lambda kv: -kv[1])]
        return r + self.runtime

    def render(self) -> str:
        lines = [f"{self.slot}: {self.total / GiB:.2f} GiB of {self.capacity / GiB:.2f} GiB "
                 f"({self.free / GiB:+.2f} GiB free)"]
        for item, detail, b in self.rows():
            lines.append(f"  {item:34s} {detail:34s} {b / GiB:9.3f} GiB")
        return "\n".join(lines)


def kda_state_bytes(cfg: K3Config) -> int:
    """One session's KDA state in one layer: fp32 recurrent state [H, K, K] + bf16 short-conv history."""
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    return cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4 + 3 * hk * (cfg.kda_conv_size - 1) * 2


def mla_token_bytes(cfg: K3Config) -> int:
    """One token of the MLA latent cache in one layer (bf16 [kv_lora_rank + rope])."""
    return cfg.mla_cache_width * 2


def workspace_bytes(cfg: K3Config, prefill_chunk: int) -> int:
    """Activations of one prefill chunk: prefix + AttnRes bank (in and out) + 16 hidden-wide temporaries."""
    return prefill_chunk * cfg.hidden_size * 2 * (2 * (cfg.max_bank_rows + 1) + 16)


def memory_table(cfg: K3Config, plan: SlotPlan, memory: MemorySpec, capacity_gib: float,
                 formats: dict[str, str] | None = None) -> MemoryTable:
    fkey = _key(formats or {})
    t = MemoryTable(plan.slot, int(capacity_gib * GiB))

    def add(items):
        for k, b in items:
            t.weights[k] = t.weights.get(k, 0) + b

    if plan.embed:
        add(_layer_parts(cfg, 0, "embed", True, fkey))
    n_kda = n_mla = 0
    for lp in plan.layers:
        if lp.attn:
            add(_layer_parts(cfg, lp.layer, "attn", True, fkey))
            n_kda += lp.kind == "kda"
            n_mla += lp.kind == "mla"
        add(_layer_parts(cfg, lp.layer, "mlp", lp.finish, fkey))
        if lp.moe and lp.experts:
            add(((k, b * len(lp.experts)) for k, b in _layer_parts(cfg, lp.layer, "expert", True, fkey)))
    if plan.head:
        add(_layer_parts(cfg, 0, "head", True, fkey))
    m = memory
    if n_kda:
        t.runtime.append(("KDA state", f"{m.sessions} sessions x {n_kda} layers", m.sessions * n_kda * kda_state_bytes(cfg)))
    if n_mla:
        t.runtime.append(("MLA latent cache", f"{m.sessions} x {m.context} tok x {n_mla} layers",
                          m.sessions * m.context * n_mla * mla_token_bytes(cfg)))
    if plan.layers:
        t.runtime.append(("activations + workspace", f"prefill chunk {m.prefill_chunk} tok",
                          workspace_bytes(cfg, m.prefill_chunk)))
    if plan.head:
        t.runtime.append(("logits + sampling", f"{m.sessions} rows x vocab {cfg.vocab_size} fp32 x2",
                          m.sessions * cfg.vocab_size * 4 * 2))
    t.runtime.append(("CUDA context + allocator reserve", "overhead_gb", int(m.overhead_gb * GiB)))
    return t


@dataclass
class StageTraffic:
    """What one stage reads from memory per pass, split so a simulator can price it.

    dense:   class -> bytes of non-expert weights read once per pass (all of them; the embedding: 0)
    experts: per MoE layer held here, (experts held, bytes of one expert, experts in the model, top-k)
    kda_state: bytes of KDA state read + written per stream per pass
    mla_per_ctx_token: bytes of MLA cache read per stream per pass, per token of context
    params_active: parameters multiplied per token (dense + top-k share of the held experts), for FLOPs"""

    dense: dict[str, int]
    experts: list[tuple[int, int, int, int]]
    kda_state: int
    mla_per_ctx_token: int
    params_active: float
    hop_bytes_per_token: int  # bf16 activations out (prefix + bank) + fp32 partial latent when mid-MoE
    hop_partial_bytes_per_token: int


def stage_traffic(cfg: K3Config, plan: SlotPlan, formats: dict[str, str] | None = None) -> StageTraffic:
    fkey = _key(formats or {})
    dense: dict[str, int] = {}
    experts = []
    n_kda = n_mla = 0
    params = 0.0

    def add(items):
        nonlocal params
        for (c, f), b in items:
            if c in ("embedding", "routed_experts"):
                continue
            dense[f] = dense.get(f, 0) + b
            params += b / _bpp(f)

    for lp in plan.layers:
        if lp.attn:
            add(_layer_parts(cfg, lp.layer, "attn", True, fkey))
            n_kda += lp.kind == "kda"
            n_mla += lp.kind == "mla"
        add(_layer_parts(cfg, lp.layer, "mlp", lp.finish, fkey))
        if lp.moe and lp.experts:
            one = sum(b for _, b in _layer_parts(cfg, lp.layer, "expert", True, fkey))
            experts.append((len(lp.experts), one, cfg.num_experts, cfg.num_experts_per_token))
            params += len(lp.experts) / cfg.num_experts * cfg.num_experts_per_token * one / 0.53125
    if plan.head:
        add(_layer_parts(cfg, 0, "head", True, fkey))
    hop = plan.hop_bytes_per_token_out(cfg, 2)
    partial = cfg.expert_width * 4 if plan.exits_mid_moe else 0
    return StageTraffic(dense, experts, n_kda * 2 * kda_state_bytes(cfg), n_mla * mla_token_bytes(cfg), params,
                        hop, partial)


def _bpp(label: str) -> float:
    return {"bf16": 2.0, "fp32": 4.0, "mxfp8": 1 + 1 / 32, "mxfp4": 0.53125, "uint8": 1.0}.get(label, 2.0)


def expected_distinct(n_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts touched by `tokens` tokens each routing top-k of n_experts (uniform routing):
    E * (1 - (1 - k/E)^n)."""
    if tokens <= 0:
        return 0.0
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)
