"""Validation of a topology against the model: one small checker per rule, run in phases by `check`.

A checker takes (topology, cfg) and returns its error messages. The phases exist because later rules
read what earlier ones guarantee: the ring rules need every slot's layers to be well-formed, the memory
rules size each slot's plan and so run only on a ring whose layout has no error at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Callable, Protocol

from p2pk3.model.config import K3Config

from .plans import SlotPlan
from .ranges import format_ranges
from .sizing import estimate_slot_bytes, runtime_items, weight_bytes
from .specs import GiB, MemorySpec, ModelSpec, Slot


class Ring(Protocol):
    """What the checkers read of a topology (`Topology`, topology.py, is one; it runs `check` on itself)."""

    slots: list[Slot]
    model: ModelSpec
    memory: MemorySpec

    @property
    def active(self) -> list[Slot]: ...

    @property
    def standby(self) -> list[Slot]: ...

    def slot_plan(self, slot: Slot | str, cfg: K3Config) -> SlotPlan: ...


Checker = Callable[[Ring, K3Config], list[str]]
WeightBytesFn = Callable[[Slot], int]


def _plural(word: str, items: list[Any]) -> str:
    return word if len(items) == 1 else word + "s"


def _are(items: list[Any]) -> str:
    return "is" if len(items) == 1 else "are"


# ----------------------------------------------------------------------------- ids, addresses, standby
def duplicate_ids(topo: Ring, cfg: K3Config) -> list[str]:
    seen: dict[str, int] = {}
    for s in topo.slots:
        seen[s.id] = seen.get(s.id, 0) + 1
    return [f"duplicate slot id {sid!r} ({n} slots)" for sid, n in seen.items() if n > 1]


def duplicate_addresses(topo: Ring, cfg: K3Config) -> list[str]:
    errs, addrs = [], {}
    for s in topo.slots:
        if s.host and s.port:
            other = addrs.setdefault((s.host, s.port), s.id)
            if other != s.id:
                errs.append(f"slots {other} and {s.id} both use {s.host}:{s.port}")
    return errs


def standby_holds_nothing(topo: Ring, cfg: K3Config) -> list[str]:
    return [
        f"standby slot {s.id} must not hold layers or experts (hot spares take over a slot's work)"
        for s in topo.standby
        if s.layers is not None or s.experts
    ]


def has_active_slots(topo: Ring, cfg: K3Config) -> list[str]:
    return [] if topo.active else ["no active slots: every slot is standby"]


# ----------------------------------------------------------------------------- each active slot's fields
def slot_layers(topo: Ring, cfg: K3Config) -> list[str]:
    """Every active slot has layers [first, last], in order and inside the model."""
    errs, L = [], cfg.num_hidden_layers
    for s in topo.active:
        if s.layers is None:
            errs.append(f"slot {s.id} has no layers (set layers = [first, last], or standby = true)")
            continue
        a, b = s.layers
        if a > b:
            errs.append(f"slot {s.id}: layers [{a}, {b}] is reversed")
        elif a < 0 or b >= L:
            errs.append(f"slot {s.id}: layers [{a}, {b}] outside the model's layers 0..{L - 1}")
    return errs


def slot_gpu_memory(topo: Ring, cfg: K3Config) -> list[str]:
    return [
        f"slot {s.id} has no gpu_memory_gb" for s in topo.active if s.layers is not None and s.gpu_memory_gb is None
    ]


def slot_experts(topo: Ring, cfg: K3Config) -> list[str]:
    """Expert lists name layers of the slot that have routed experts, and experts that exist."""
    errs, E = [], cfg.num_experts
    for s in topo.active:
        if s.layers is None:
            continue
        a, b = s.layers
        for l, ex in sorted(s.experts.items()):
            if not a <= l <= b:
                errs.append(f"slot {s.id} lists experts for layer {l}, which is outside its layers [{a}, {b}]")
            elif not cfg.is_moe_layer(l):
                errs.append(f"slot {s.id} lists experts for layer {l}, which is a dense layer (no routed experts)")
            bad = [e for e in ex if e >= E]
            if bad:
                errs.append(
                    f"slot {s.id}: experts {format_ranges(bad)} of layer {l} do not exist "
                    f"(the model has experts 0..{E - 1})"
                )
            if not ex:
                errs.append(f"slot {s.id}: empty expert list for layer {l}")
    return errs


# ----------------------------------------------------------------------------- the ring's layout
def _owners(topo: Ring, cfg: K3Config) -> dict[int, list[int]]:
    """layer -> positions (among the active slots) of the slots holding it."""
    owners: dict[int, list[int]] = {l: [] for l in range(cfg.num_hidden_layers)}
    for i, s in enumerate(topo.active):
        for l in s.layer_range:
            owners[l].append(i)
    return owners


def _neighbour_overlap(x: Slot, y: Slot) -> list[int]:
    """Layers two neighbours in the ring share beyond what a split allows (only x's last layer)."""
    ov = list(range(max(x.layers[0], y.layers[0]), min(x.layers[1], y.layers[1]) + 1))
    return ov if len(ov) > 1 or (ov and ov[0] != x.layers[1]) else []


def layer_gaps(topo: Ring, cfg: K3Config) -> list[str]:
    owners = _owners(topo, cfg)
    gaps = [l for l, own in owners.items() if not own]
    if not gaps:
        return []
    return [f"{_plural('layer', gaps)} {format_ranges(gaps).replace(',', ', ')} {_are(gaps)} not assigned to any slot"]


def neighbour_overlaps(topo: Ring, cfg: K3Config) -> list[str]:
    errs, act = [], topo.active
    for x, y in pairwise(act):
        ov = _neighbour_overlap(x, y)
        if ov:
            errs.append(
                f"slots {x.id} {list(x.layers)} and {y.id} {list(y.layers)} overlap on "
                f"{_plural('layer', ov)} {format_ranges(ov).replace(',', ', ')}"
            )
    return errs


def ring_order(topo: Ring, cfg: K3Config) -> list[str]:
    """Each active slot starts where the previous one ended (a shared split layer) or right after it."""
    errs, act, owners = [], topo.active, _owners(topo, cfg)
    for x, y in pairwise(act):
        xb, ya = x.layers[1], y.layers[0]
        if _neighbour_overlap(x, y):
            continue  # reported by neighbour_overlaps
        if ya < xb or (ya > xb + 1 and all(owners[l] for l in range(xb + 1, ya))):
            errs.append(
                f"slot {y.id} starts at layer {ya} but the previous active slot {x.id} ends at layer {xb}: "
                f"slots must follow the layer order of the ring"
            )
    return errs


def unsplit_layer_experts(topo: Ring, cfg: K3Config) -> list[str]:
    """A layer only one slot holds runs all its experts there."""
    errs, act, E = [], topo.active, cfg.num_experts
    for l, own in _owners(topo, cfg).items():
        if len(own) == 1 and l in act[own[0]].experts and len(act[own[0]].experts[l]) != E:
            miss = sorted(set(range(E)) - set(act[own[0]].experts[l]))
            errs.append(f"{_plural('expert', miss)} {format_ranges(miss)} of layer {l} {_are(miss)} on no slot")
    return errs


def split_layers(topo: Ring, cfg: K3Config) -> list[str]:
    """A layer on several slots is a MoE layer split by experts over consecutive slots, each listing its
    experts, the lists disjoint and together covering all experts."""
    act = topo.active
    overlapping = {l for x, y in pairwise(act) for l in _neighbour_overlap(x, y)}  # already reported
    errs = []
    for l, own in _owners(topo, cfg).items():
        if len(own) > 1 and l not in overlapping:
            errs += _split_layer_problems(cfg, l, own, act)
    return errs


def _split_layer_problems(cfg: K3Config, l: int, own: list[int], act: list[Slot]) -> list[str]:
    names = " and ".join(act[i].id for i in own) if len(own) == 2 else ", ".join(act[i].id for i in own)
    if not cfg.is_moe_layer(l):
        return [f"layer {l} is on slots {names}: overlap (a dense layer cannot be split)"]
    whole = [act[i].id for i in own if l not in act[i].experts]
    if whole:
        return [
            f"layer {l} is on slots {names}: overlap ({', '.join(whole)} "
            f"{'holds' if len(whole) == 1 else 'hold'} all its experts; to split a layer, list "
            f'experts = {{"{l}" = "..."}} on each of its slots)'
        ]
    if own != list(range(own[0], own[0] + len(own))):
        between = [act[i].id for i in range(own[0], own[-1] + 1) if i not in own]
        return [
            f"layer {l} is split over slots {names}, which are not consecutive in the ring "
            f"({', '.join(between)} {_are(between)} between them)"
        ]
    where: dict[int, list[str]] = {}
    for i in own:
        for e in act[i].experts[l]:
            where.setdefault(e, []).append(act[i].id)
    dup: dict[tuple[str, ...], list[int]] = {}
    for e, ss in where.items():
        if len(ss) > 1:
            dup.setdefault(tuple(ss), []).append(e)
    errs = [
        f"{_plural('expert', es)} {format_ranges(es)} of layer {l} {_are(es)} on two slots: {' and '.join(ss)}"
        for ss, es in dup.items()
    ]
    miss = [e for e in range(cfg.num_experts) if e not in where]
    if miss:
        errs.append(
            f"{_plural('expert', miss)} {format_ranges(miss)} of layer {l} {_are(miss)} on no slot (split over {names})"
        )
    return errs


# ----------------------------------------------------------------------------- memory (valid layouts only)
def slot_needs(topo: Ring, cfg: K3Config, weight_bytes_fn: WeightBytesFn | None = None) -> dict[str, int]:
    """active slot id -> bytes it needs: `weight_bytes_fn(slot)` when given, else the estimate (weights in
    the file's own `[model] formats`)."""
    if weight_bytes_fn is not None:
        return {s.id: weight_bytes_fn(s) for s in topo.active}
    return {
        s.id: estimate_slot_bytes(cfg, topo.slot_plan(s, cfg), topo.memory, topo.model.formats) for s in topo.active
    }


def memory_fit(topo: Ring, cfg: K3Config, need: dict[str, int], estimated: bool = True) -> list[str]:
    errs = []
    for s in topo.active:
        n, cap = need[s.id], (s.gpu_memory_gb or 0) * GiB
        if n > cap:
            plan = topo.slot_plan(s, cfg)
            w = weight_bytes(cfg, plan, topo.model.formats) if estimated else n
            parts = {"weights": w, "caches": 0, "workspace": 0, "reserve": 0}
            if estimated:
                for item, _, b in runtime_items(cfg, plan, topo.memory):
                    key = (
                        "reserve"
                        if item.startswith("CUDA")
                        else "workspace"
                        if item.startswith("activations")
                        else "caches"
                    )
                    parts[key] += b
            errs.append(
                f"slot {s.id} needs about {n / GiB:.2f} GiB ({_itemised(parts)}) but has gpu_memory_gb = "
                f"{s.gpu_memory_gb:g}: {_shrink_advice(parts, n - cap, topo.memory)}"
            )
    return errs


def _itemised(parts: dict[str, int]) -> str:
    names = {"weights": "weights", "caches": "caches", "workspace": "prefill workspace", "reserve": "CUDA reserve"}
    return " + ".join(f"{names[k]} {b / GiB:.2f} GiB" for k, b in parts.items() if b or k == "weights")


def _shrink_advice(parts: dict[str, int], over: int, memory: MemorySpec) -> str:
    """What would free `over` bytes on one card, given what its memory holds (weights, caches, workspace,
    reserve in bytes): only the items big enough to make the difference alone."""
    opts = []
    if parts["weights"] >= over:
        opts.append("fewer layers/experts")
    if parts["caches"] >= over:
        opts.append("fewer [memory] sessions or a shorter context")
    if parts["workspace"] >= over:
        opts.append("a smaller [memory] prefill_chunk")
    if parts["reserve"] >= over:
        fits = int(max(0, parts["reserve"] - over) / GiB * 100) / 100
        opts.append(
            f"a CUDA reserve of at most {fits:g} GiB ([memory] overhead_gb, now {memory.overhead_gb:g}; "
            f"`p2pk3 plan --overhead-gb`)"
        )
    if not opts:
        return "a larger card, or less of several of these"
    return "it would fit with " + ", or ".join(opts)


def standby_capacity(topo: Ring, need: dict[str, int]) -> list[str]:
    """Warnings: a standby slot too small to take over any active slot."""
    if not need:
        return []
    smallest = min(need.values())
    return [
        f"standby slot {s.id} ({s.gpu_memory_gb:g} GiB) cannot take over any active slot "
        f"(the smallest needs {smallest / GiB:.1f} GiB)"
        for s in topo.standby
        if s.gpu_memory_gb is not None and s.gpu_memory_gb * GiB < smallest
    ]


# ----------------------------------------------------------------------------- running them
@dataclass(frozen=True)
class Rule:
    check: Checker
    blocking: bool = False  # a problem found here ends the check after its phase (later phases need it fixed)


PHASES: tuple[tuple[Rule, ...], ...] = (
    (Rule(duplicate_ids), Rule(duplicate_addresses), Rule(standby_holds_nothing), Rule(has_active_slots, True)),
    (Rule(slot_layers, True), Rule(slot_gpu_memory), Rule(slot_experts, True)),
    (Rule(layer_gaps), Rule(neighbour_overlaps), Rule(ring_order), Rule(unsplit_layer_experts), Rule(split_layers)),
)


def check(topo: Ring, cfg: K3Config, weight_bytes_fn: WeightBytesFn | None = None) -> tuple[list[str], list[str]]:
    """(errors, warnings) of `topo` against the model config. `weight_bytes_fn(slot) -> bytes` replaces
    the memory estimate."""
    errs: list[str] = []
    for phase in PHASES:
        blocked = False
        for rule in phase:
            found = rule.check(topo, cfg)
            errs += found
            blocked = blocked or (rule.blocking and bool(found))
        if blocked:
            return errs, []
    if errs:  # the memory rules size each slot's plan: only on a layout without errors
        return errs, []
    need = slot_needs(topo, cfg, weight_bytes_fn)
    return memory_fit(topo, cfg, need, estimated=weight_bytes_fn is None), standby_capacity(topo, need)
