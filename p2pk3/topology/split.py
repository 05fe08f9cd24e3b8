"""A new topology of whole layers: `even_split` gives each slot (nearly) the same number of layers, cut
exactly as the in-process pipeline cuts its stages (`p2pk3.model.split.even_layer_ranges`). Splits inside
MoE layers, by experts, are the planner's (p2pk3.plan: `plan_ring`, and `balanced_split` for N equal slots)."""

from __future__ import annotations

from p2pk3.model.config import K3Config
from p2pk3.model.split import even_layer_ranges

from .specs import DEFAULT_BASE_PORT, DEFAULT_BEACON_PORT, ClusterSpec, ModelSpec, Slot, TopologyError
from .topology import Topology


def even_split(
    cfg: K3Config,
    n_nodes: int,
    host: str | None = "127.0.0.1",
    base_port: int = DEFAULT_BASE_PORT,
    *,
    gpu_memory_gb: float = 24.0,
    name: str = "local",
    preset: str | None = None,
    model_path: str | None = None,
    secret_file: str | None = None,
    beacon_port: int = DEFAULT_BEACON_PORT,
    n_standby: int = 0,
    ids: list[str] | None = None,
) -> Topology:
    """n_nodes slots with (nearly) equal numbers of whole layers, in order; ports base_port + i.
    Raises TopologyError when n_nodes exceeds the number of layers."""
    L = cfg.num_hidden_layers
    if n_nodes < 1:
        raise TopologyError(f"need at least one node, got {n_nodes}")
    if n_nodes > L:
        raise TopologyError(
            f"{n_nodes} nodes but only {L} layers: with whole layers every node needs at least "
            f"one; to split layers by experts over more nodes use `p2pk3 topology init --split experts`"
        )
    ids = ids or [f"s{i}" for i in range(n_nodes + n_standby)]
    slots = [
        Slot(ids[i], (r.start, r.stop - 1), gpu_memory_gb, host, base_port + i if host else None)
        for i, r in enumerate(even_layer_ranges(L, n_nodes))
    ]
    for j in range(n_standby):
        i = n_nodes + j
        slots.append(Slot(ids[i], None, gpu_memory_gb, host, base_port + i if host else None, standby=True))
    return Topology(ClusterSpec(name, secret_file, beacon_port), ModelSpec(path=model_path, preset=preset), slots)
