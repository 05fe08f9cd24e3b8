"""The itemised memory table of one card, and the bytes its stage reads per token.

Weights are grouped by tensor class; each class is stored as shipped or in the format the topology's
`[model] formats` choose (p2pk3.quant.formats: bf16 2 B/param, mxfp8 1 B + one E8M0 scale per 32 values,
mxfp4 0.5 B + one scale per 32, the routed experts as shipped). Every byte is counted by
p2pk3/topology/sizing.py (the topology memory check adds up the same items); this module lays them out as a
table and prices a stage's reads for the planner and the simulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from p2pk3.model.config import K3Config
from p2pk3.quant.formats import BYTES_PER_PARAM
from p2pk3.topology.plans import SlotPlan
from p2pk3.topology.sizing import formats_key, kda_state_bytes, mla_token_bytes, part_items, runtime_items, weight_items
from p2pk3.topology.specs import GiB, MemorySpec


@dataclass
class MemoryTable:
    """One card's memory, item by item (bytes)."""

    slot: str
    capacity: int
    weights: dict[tuple[str, str], int] = field(default_factory=dict)  # (class, format) -> bytes
    runtime: list[tuple[str, str, int]] = field(default_factory=list)  # (item, detail, bytes)
    # the prefix cache's device budget: taken from what the rest leaves free, so not in `total`
    prefix_cache: tuple[str, int] | None = None  # (detail, bytes)

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
        pc = [("prefix cache (device, of the free)", *self.prefix_cache)] if self.prefix_cache else []
        return r + self.runtime + pc

    def render(self) -> str:
        lines = [
            f"{self.slot}: {self.total / GiB:.2f} GiB of {self.capacity / GiB:.2f} GiB "
            f"({self.free / GiB:+.2f} GiB free)"
        ]
        for item, detail, b in self.rows():
            lines.append(f"  {item:34s} {detail:34s} {b / GiB:9.3f} GiB")
        return "\n".join(lines)


PREFIX_DEFAULT_SHARE = 0.25  # a node's default prefix-cache budget on a GPU (p2pk3/node/prefix_setup.py)


def memory_table(
    cfg: K3Config,
    plan: SlotPlan,
    memory: MemorySpec,
    capacity_gib: float,
    formats: Mapping[str, str] | None = None,
    prefix_cache_gb: float | None = None,
) -> MemoryTable:
    """The card's table: `sizing.weight_items` (weights by class and format) + `sizing.runtime_items`, and
    the prefix cache's device budget as its last line (`prefix_cache`, out of the free memory, not in the
    total): `prefix_cache_gb` (`p2pk3 node --prefix-cache-gb`), else the node's default, a quarter of the
    free memory."""
    t = MemoryTable(plan.slot, int(capacity_gib * GiB))
    t.weights = weight_items(cfg, plan, formats)
    t.runtime = runtime_items(cfg, plan, memory)
    if plan.layers:
        if prefix_cache_gb is None:
            t.prefix_cache = ("default: 1/4 of the free memory", int(PREFIX_DEFAULT_SHARE * max(0, t.free)))
        else:
            t.prefix_cache = ("--prefix-cache-gb", int(prefix_cache_gb * GiB))
    return t


@dataclass
class StageTraffic:
    """What one stage reads from memory per pass, split so a simulator can price it.

    dense:   stored-as format -> bytes of non-expert weights read once per pass (all of them; the embedding: 0)
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


def stage_traffic(cfg: K3Config, plan: SlotPlan, formats: Mapping[str, str] | None = None) -> StageTraffic:
    fkey = formats_key(formats)
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
            add(part_items(cfg, lp.layer, "attn", True, fkey))
            n_kda += lp.kind == "kda"
            n_mla += lp.kind == "mla"
        add(part_items(cfg, lp.layer, "mlp", lp.finish, fkey))
        if lp.moe and lp.experts:
            one_items = part_items(cfg, lp.layer, "expert", True, fkey)
            one = sum(b for _, b in one_items)
            experts.append((len(lp.experts), one, cfg.num_experts, cfg.num_experts_per_token))
            params += (
                len(lp.experts)
                / cfg.num_experts
                * cfg.num_experts_per_token
                * sum(b / _bpp(f) for (_, f), b in one_items)
            )
    if plan.head:
        add(part_items(cfg, 0, "head", True, fkey))
    hop = plan.hop_bytes_per_token_out(cfg, 2)
    partial = cfg.expert_width * 4 if plan.exits_mid_moe else 0
    return StageTraffic(
        dense, experts, n_kda * 2 * kda_state_bytes(cfg), n_mla * mla_token_bytes(cfg), params, hop, partial
    )


def _bpp(label: str) -> float:
    """Bytes per parameter of a stored-as label (`sizing.tensor_bytes`)."""
    return {**BYTES_PER_PARAM, "fp32": 4.0}.get(label, 2.0)


def expected_distinct(n_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts touched by `tokens` tokens each routing top-k of n_experts (uniform routing):
    E * (1 - (1 - k/E)^n)."""
    if tokens <= 0:
        return 0.0
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)
