"""Planning a ring from a list of hosts: NODES.toml (nodes.py), the itemised per-card memory table
(memory.py), and the planner that cuts the model into stages balanced by predicted time (planner.py).
Weight formats are parsed by p2pk3.quant.formats and bytes counted by p2pk3.topology.sizing.
docs/rack.md shows it on K3 over 80 RTX 5090."""

from .memory import MemoryTable, memory_table, stage_traffic
from .nodes import Card, NodesError, load_nodes, parse_nodes
from .planner import Plan, PlanError, balanced_split, plan_ring

__all__ = [
    "MemoryTable",
    "memory_table",
    "stage_traffic",
    "Card",
    "NodesError",
    "load_nodes",
    "parse_nodes",
    "Plan",
    "PlanError",
    "balanced_split",
    "plan_ring",
]
