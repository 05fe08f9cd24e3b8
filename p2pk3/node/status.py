"""A daemon's status: what the `status` request, the pongs, the dashboard and `/metrics` read
(docs/protocol.md lists every field). Built from the daemon's parts; it changes nothing."""

from __future__ import annotations

import time

from .metrics import memory_usage
from .prefix_setup import prefix_status


def node_status(d) -> dict:
    """The status map of daemon `d` (a NodeDaemon)."""
    w = d.worker.stats if d.worker else None
    st = {
        "slot": d.slot_id,
        "standby": d.role == "standby",
        "role": d.role,
        "node": d.node_id,
        "epoch": d.claim.epoch if d.claim else None,
        "address": [d.advertised_host, d.port],
        "batches": w.batches if w else 0,
        "tokens": w.tokens if w else 0,
        "busy_s": round(w.busy_s, 4) if w else 0.0,
        "held_s": round(d.worker.held_s(), 4) if d.worker else 0.0,
        "last_batch_ms": round(w.last_batch_ms, 3) if w else 0.0,
        "busy": round(d.worker.busy_fraction(), 3) if d.worker else 0.0,
        "queue": d.worker.depth if d.worker else 0,
        "sessions": d.runner.sessions if d.runner else 0,
        "errors": d.stats["errors"] + (w.errors if w else 0),
        "uptime_s": round(time.time() - d.stats["started"], 1),
        "memory": memory_usage(d.opts.device),
    }
    if d.runner is not None:  # what the planner's table sizes (p2pk3.topology.sizing)
        st["memory"] |= {"weights": d.runner.weight_bytes, "cache": d.runner.cache.bytes()}
    if d.role in ("entry", "stage") and hasattr(d, "plan"):
        st["layers"] = [d.plan.layers[0].layer, d.plan.last_layer] if d.plan.layers else None
    try:
        st["entry"] = list(d.routes.address(d.topo.active[0].id))
    except ConnectionError:
        st["entry"] = None
    prefix_status(st, d.runner, d.entry)  # the prefix cache: this stage's, the entry's hits
    if d.runner is not None:  # speculative decoding: passes by width, rollbacks (stage_runner.py)
        st["spec"] = d.runner.spec_stats() | (d.entry.spec_stats() if d.entry is not None else {})
    if d.entry is not None:
        st["live_sessions"] = len(d.entry.live())
        st["paused"] = d.entry.paused
        st["finished"], st["failed"], st["cancelled"] = d.entry.finished, d.entry.failed, d.entry.cancelled
        st["schedule"] = d.entry.schedule_stats()
    if d.clients is not None:
        st["admission"] = d.clients.admission.stats()
    if d.coordinator is not None:
        st["unavailable"] = d.coordinator.unavailable
        st["down"] = sorted(d.coordinator.down)
        st["events"] = d.coordinator.events[-20:]
        st["spares"] = d.spares.rows(d.monitor.state if d.monitor else lambda k: None)
        if d.coordinator.degraded is not None:  # slow stages (node/degraded.py)
            st["degraded"] = d.coordinator.degraded.report()
    return st
