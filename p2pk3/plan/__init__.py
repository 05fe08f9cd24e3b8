"""Planning a ring from a list of hosts: NODES.toml (nodes.py), the itemised per-card memory table
(memory.py), and the planner that cuts the model into stages balanced by predicted time (planner.py).
docs/rack.md shows it on K3 over 80 RTX 5090."""
from .memory import FORMATS, MemoryTable, Formats, memory_table, parse_formats, stage_traffic
from .nodes import Card, NodesError, load_nodes, parse_nodes
from .planner import Plan, PlanError, plan_ring

__all__ = ["FORMATS", "Formats", "MemoryTable", "memory_table", "parse_formats", "stage_traffic", "Card",
           "NodesError", "load_nodes", "parse_nodes", "Plan", "PlanError", "plan_ring"]
