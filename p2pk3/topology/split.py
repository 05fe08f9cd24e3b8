"""Builders: a new topology from a model config and a number of slots.

`even_split` gives each slot whole layers, cut exactly as the in-process pipeline cuts its stages
(`p2pk3.model.split.even_layer_ranges`); `balanced_split` gives each slot (nearly) the same weight
bytes, splitting MoE layers by experts where a cut falls inside one."""
from __future__ import annotations

import bisect

from p2pk3.model.config import K3Config
from p2pk3.model.split import even_layer_ranges
from p2pk3.model.weights import embed_tensors, head_tensors, layer_tensors

from .sizing import nbytes, part_bytes
from .specs import DEFAULT_BASE_PORT, DEFAULT_BEACON_PORT, ClusterSpec, MemorySpec, ModelSpec, Slot, TopologyError
from .topology import Topology


def even_split(cfg: K3Config, n_nodes: int, host: str | None = "127.0.0.1", base_port: int = DEFAULT_BASE_PORT, *,
               gpu_memory_gb: float = 24.0, name: str = "local", preset: str | None = None,
               model_path: str | None = None, secret_file: str | None = None,
               beacon_port: int = DEFAULT_BEACON_PORT, n_standby: int = 0, ids: list[str] | None = None) -> Topology:
    """n_nodes slots with (nearly) equal numbers of whole layers, in order; ports base_port + i.
    Raises TopologyError when n_nodes exceeds the number of layers."""
    L = cfg.num_hidden_layers
    if n_nodes < 1:
        raise TopologyError(f"need at least one node, got {n_nodes}")
    if n_nodes > L:
        raise TopologyError(f"{n_nodes} nodes but only {L} layers: with whole layers every node needs at least "
                            f"one; to split layers by experts over more nodes use `p2pk3 topology init --split experts`")
    ids = ids or [f"s{i}" for i in range(n_nodes + n_standby)]
    slots = [Slot(ids[i], (r.start, r.stop - 1), gpu_memory_gb, host, base_port + i if host else None)
             for i, r in enumerate(even_layer_ranges(L, n_nodes))]
    for j in range(n_standby):
        i = n_nodes + j
        slots.append(Slot(ids[i], None, gpu_memory_gb, host, base_port + i if host else None, standby=True))
    return Topology(ClusterSpec(name, secret_file, beacon_port), ModelSpec(path=model_path, preset=preset), slots)


def balanced_split(cfg: K3Config, n_slots: int, *, gpu_memory_gb: float, name: str = "cluster",
                   ids: list[str] | None = None, host: str | None = None, base_port: int | None = None,
                   n_standby: int = 0, standby_ids: list[str] | None = None, preset: str | None = None,
                   model_path: str | None = None, repo: str | None = None, revision: str | None = None,
                   secret_file: str | None = None, beacon_port: int = DEFAULT_BEACON_PORT,
                   memory: MemorySpec | None = None, snap_fraction: float = 0.05) -> Topology:
    """n_slots slots with (nearly) equal weight bytes; MoE layers are split by experts where a cut falls
    inside one (each piece keeps at least one expert); a cut within snap_fraction of a slot's share from a
    layer boundary moves to that boundary. Validate the result for the memory check."""
    if n_slots < 1:
        raise TopologyError(f"need at least one slot, got {n_slots}")
    L, E = cfg.num_hidden_layers, cfg.num_experts
    # units: (layer, expert or -1 for the layer's non-expert part), with their sizes
    unit_layer: list[int] = []
    unit_exp: list[int] = []
    size: list[int] = []
    for l in range(L):
        if cfg.is_moe_layer(l):
            base = part_bytes(cfg, l, "attn", True) + part_bytes(cfg, l, "mlp", True)
            one = part_bytes(cfg, l, "expert", True)
            unit_layer += [l] * (E + 1)
            unit_exp += [-1] + list(range(E))
            size += [base] + [one] * E
        else:
            unit_layer.append(l)
            unit_exp.append(-1)
            size.append(nbytes(layer_tensors(cfg, l)))
    size[0] += nbytes(embed_tensors(cfg))
    size[-1] += nbytes(head_tensors(cfg))
    cum = [0]
    for x in size:
        cum.append(cum[-1] + x)
    total = cum[-1]
    # allowed cut k (before unit k): a layer start, or inside a MoE layer after its first expert
    allowed = [k for k in range(1, len(size)) if unit_exp[k] == -1 or unit_exp[k] >= 1]
    if len(allowed) < n_slots - 1:
        raise TopologyError(f"cannot cut the model into {n_slots} slots: it has only {len(allowed) + 1} pieces "
                            f"(layers, and single experts of MoE layers)")
    allowed_index = {k: i for i, k in enumerate(allowed)}
    layer_cuts = [k for k in allowed if unit_exp[k] == -1]
    snap = snap_fraction * total / n_slots
    cuts = [0]
    pos = 0  # index into allowed
    for m in range(1, n_slots):
        target = total * m / n_slots
        j = bisect.bisect_left(cum, target)
        # nearest allowed cut to unit j, strictly after the previous cut, leaving room for the rest
        p = bisect.bisect_left(allowed, j, lo=pos)
        cands = [q for q in (p - 1, p) if pos <= q < len(allowed) - (n_slots - 1 - m)]
        if not cands:
            cands = [max(pos, min(p, len(allowed) - (n_slots - m)))]
        q = min(cands, key=lambda q: abs(cum[allowed[q]] - target))
        # prefer a layer boundary when one is close: a split costs a duplicated router/latent projection
        # and a partial latent on the wire
        lb = bisect.bisect_left(layer_cuts, j)
        for r in (lb - 1, lb):
            if 0 <= r < len(layer_cuts):
                qb = allowed_index[layer_cuts[r]]
                if pos <= qb < len(allowed) - (n_slots - 1 - m) and abs(cum[layer_cuts[r]] - target) <= snap:
                    q = qb
                    break
        cuts.append(allowed[q])
        pos = q + 1
    cuts.append(len(size))
    ids = ids or [f"s{i}" for i in range(n_slots)]
    slots = []
    for m in range(n_slots):
        u0, u1 = cuts[m], cuts[m + 1] - 1
        a, b = unit_layer[u0], unit_layer[u1]
        experts: dict[int, tuple[int, ...]] = {}
        for l in {a, b}:
            if not cfg.is_moe_layer(l):
                continue
            es = [unit_exp[k] for k in range(u0, u1 + 1) if unit_layer[k] == l and unit_exp[k] >= 0]
            if len(es) != E:
                experts[l] = tuple(es)
        slots.append(Slot(ids[m], (a, b), gpu_memory_gb, host, (base_port + m) if (host and base_port) else None,
                          experts))
    sids = standby_ids or [f"spare{j}" for j in range(n_standby)]
    for j in range(n_standby):
        slots.append(Slot(sids[j], None, gpu_memory_gb, host,
                          (base_port + n_slots + j) if (host and base_port) else None, standby=True))
    return Topology(ClusterSpec(name, secret_file, beacon_port),
                    ModelSpec(path=model_path, repo=repo, revision=revision, preset=preset), slots,
                    memory or MemorySpec())
