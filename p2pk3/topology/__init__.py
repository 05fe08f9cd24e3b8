"""The topology file: which ring slot runs which layers (and which experts of a split layer).

Format, semantics and an example: docs/topology.md. In short (TOML)::

    [cluster]                 name, secret_file (the nodes need it), beacon_port, beacon_addrs (optional)
    [model]                   path | repo (+ revision), preset (optional)
    [memory]                  optional sizing of caches/workspace for the memory check
    [[slots]]                 in ring order: id, host/port (optional when discovered), gpu_memory_gb,
                              layers = [first, last] (inclusive, 0-indexed), experts = {"<layer>" = "0-447,500"},
                              standby = false

A MoE layer may be split by experts over CONSECUTIVE active slots: the first of them runs the layer's
attention, each adds the contribution of its experts to the partial latent-MoE sum that travels with
the hop, the last one finishes the layer (shared experts, latent up-projection, residual). Standby slots
(hot spares) hold no layers.

Modules: specs (the tables as dataclasses, TopologyError), ranges ("0-447,500"), format (the TOML in and
out), topology (`Topology`: the tables, queries, plans and checks of one file), plans (`SlotPlan`: what one
slot runs), sizing (bytes a slot needs: weights in formats, caches, workspace), checks (validation rules),
split (`even_split`; splits by experts are the planner's, p2pk3.plan).
"""

from .checks import check
from .plans import LayerPlan, SlotPlan, slot_plan
from .ranges import format_ranges, parse_ranges
from .sizing import estimate_slot_bytes, runtime_bytes, slot_tensors, weight_bytes
from .specs import (
    BROADCAST,
    DEFAULT_BASE_PORT,
    DEFAULT_BEACON_PORT,
    GiB,
    ClusterSpec,
    MemorySpec,
    ModelSpec,
    Slot,
    TopologyError,
)
from .split import even_split
from .topology import Topology, generate_secret

__all__ = [
    "TopologyError",
    "ClusterSpec",
    "ModelSpec",
    "MemorySpec",
    "Slot",
    "LayerPlan",
    "SlotPlan",
    "Topology",
    "slot_plan",
    "check",
    "parse_ranges",
    "format_ranges",
    "slot_tensors",
    "weight_bytes",
    "runtime_bytes",
    "estimate_slot_bytes",
    "even_split",
    "generate_secret",
    "GiB",
    "BROADCAST",
    "DEFAULT_BEACON_PORT",
    "DEFAULT_BASE_PORT",
]
