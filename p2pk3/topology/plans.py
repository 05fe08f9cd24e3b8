"""The per-slot plan: which layers (and halves of layers, and experts) one ring slot runs.

There is one way to compute it, `slot_plan(cfg, ring, slot)`, from the ring's active slots as they are
at the time of the call (nothing is cached, so a slot added to or moved in `Topology.slots` later gets
the plan of where it is now). The model's own `p2pk3.model.stage.StagePlan` is what a slot's plan is
turned into to build the torch stage (`p2pk3.node.stage_runner.model_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from p2pk3.model.config import K3Config

from .ranges import format_ranges
from .specs import Slot


@dataclass
class LayerPlan:
    """What one slot does for one layer.

    attn:    runs the attention half (AttnRes mix, norm, KDA/MLA, output added to the prefix);
             False when the slot continues a layer whose attention ran on the previous slot
    moe:     the layer has routed experts (False: dense MLP)
    experts: routed experts run here (all of them when the layer is not split)
    finish:  finishes the MLP half: for a split MoE layer the slot that adds the shared experts,
             projects the latent sum back up and adds the layer output to the prefix
    enters_mid_moe / exits_mid_moe: the hop arriving before / leaving after this layer carries the
             partial latent-MoE sum of this layer (docs/protocol.md, forward frames)
    Every slot of a split layer recomputes the MoE input (mlp AttnRes mix, post-attention norm, router,
    latent down-projection) from the prefix and bank it receives: routing costs no bytes on the wire."""

    layer: int
    kind: str  # "kda" | "mla"
    moe: bool
    attn: bool
    experts: tuple[int, ...]
    all_experts: bool
    finish: bool
    enters_mid_moe: bool
    exits_mid_moe: bool

    @property
    def parts(self) -> tuple[str, ...]:
        return ("attn", "mlp") if self.attn else ("mlp",)


@dataclass
class SlotPlan:
    slot: str
    index: int | None  # position among the active slots (None: standby / no layers)
    layers: list[LayerPlan]
    embed: bool  # holds embed_tokens and turns token ids into the first hop
    head: bool  # holds the output AttnRes, final norm and lm_head, and samples
    prev_slot: str | None = None
    next_slot: str | None = None

    @property
    def last_layer(self) -> int | None:
        return self.layers[-1].layer if self.layers else None

    @property
    def enters_mid_moe(self) -> bool:
        return bool(self.layers) and self.layers[0].enters_mid_moe

    @property
    def exits_mid_moe(self) -> bool:
        return bool(self.layers) and self.layers[-1].exits_mid_moe

    def bank_rows_in(self, cfg: K3Config) -> int:
        """AttnRes snapshots in the hop this slot receives (0 for the embedding slot: it gets token ids)."""
        if self.embed or not self.layers:
            return 0
        l = self.layers[0].layer
        return cfg.bank_rows_before(l + 1 if self.enters_mid_moe else l)

    def bank_rows_out(self, cfg: K3Config) -> int:
        if self.head or not self.layers:
            return 0
        l = self.layers[-1].layer
        return cfg.bank_rows_before(l + 1)

    def hop_bytes_per_token_out(self, cfg: K3Config, itemsize: int = 2) -> int:
        """Bytes per token of the forward frame this slot sends (prefix + bank + partial latent)."""
        if self.head or not self.layers:
            return 0
        n = (1 + self.bank_rows_out(cfg)) * cfg.hidden_size * itemsize
        if self.exits_mid_moe:
            n += cfg.expert_width * 4  # the partial latent sum travels in fp32 (docs/protocol.md)
        return n

    def describe(self) -> str:
        parts = []
        for lp in self.layers:
            s = f"L{lp.layer}({lp.kind}"
            if not lp.attn:
                s += ", cont."
            if lp.moe and not lp.all_experts:
                s += f", experts {format_ranges(lp.experts)}"
            parts.append(s + ")")
        pre = "embed + " if self.embed else ""
        post = " + head" if self.head else ""
        return f"{self.slot}: {pre}{' '.join(parts)}{post}"


def slot_plan(cfg: K3Config, ring: Sequence[Slot], slot: Slot) -> SlotPlan:
    """The plan of `slot` in `ring` (the active slots in ring order; `slot` must be one of them, compared
    by identity). A standby slot or one without layers gets an empty plan.

    A layer held by several slots of the ring is split by experts: the first of its slots runs the
    attention half, the last finishes it. A slot on its own is `slot_plan(cfg, [slot], slot)`."""
    if slot.standby or not slot.layers:
        return SlotPlan(slot.id, None, [], False, False)
    idx = next((i for i, x in enumerate(ring) if x is slot), None)
    if idx is None:
        raise ValueError(
            f"slot {slot.id} is not one of the active slots {', '.join(s.id for s in ring) or '(none)'}; "
            f"add it to the topology's slots before asking for its plan"
        )
    lps = []
    for l in slot.layer_range:
        moe = cfg.is_moe_layer(l)
        exps = slot.experts_for(l, cfg)
        owners = [i for i, x in enumerate(ring) if x.holds(l)]
        if len(owners) > 1:  # split by experts over consecutive slots
            attn, finish = owners[0] == idx, owners[-1] == idx
            lps.append(
                LayerPlan(
                    l,
                    cfg.layer_types[l],
                    moe,
                    attn,
                    exps,
                    False,
                    finish,
                    enters_mid_moe=not attn,
                    exits_mid_moe=not finish,
                )
            )
        else:
            whole = not moe or len(exps) == cfg.num_experts
            lps.append(LayerPlan(l, cfg.layer_types[l], moe, True, exps, whole, True, False, False))
    embed = lps[0].layer == 0 and lps[0].attn
    head = lps[-1].layer == cfg.num_hidden_layers - 1 and lps[-1].finish
    return SlotPlan(
        slot.id,
        idx,
        lps,
        embed,
        head,
        prev_slot=ring[idx - 1].id if idx > 0 else None,
        next_slot=ring[idx + 1].id if idx + 1 < len(ring) else None,
    )
