"""Prometheus metrics of one daemon, served on `/metrics` (off unless `p2pk3 node --metrics-port P`).

    handle = start_metrics(daemon, port)      # in the daemon's event loop, after `await daemon.start()`
    handle.port, handle.close()

Each daemon has its own `CollectorRegistry`. Nothing is counted twice: at scrape time a custom collector
reads the same numbers the `status` request answers (`NodeDaemon.public_stats()`, read on the daemon's
event loop so they are consistent) plus the entry's heartbeat round trips to the other slots (hop
latency). The one thing a snapshot cannot give, the batch latency histogram, is observed per batch by
the worker's statistics object (`ObservedStats`, put in place of the worker's own at start; a task on the
daemon's loop does it again within 0.5 s when a takeover gives the daemon a new worker). The HTTP server
is prometheus-client's (a thread); `handle.close()` is called on the daemon's loop. `memory_usage` is used
by the daemon itself (its `status` carries it), so prometheus_client is imported only where it is used.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import asdict, dataclass

from .worker import WorkerStats

log = logging.getLogger("p2pk3.node")

BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def memory_usage(device: str = "cpu") -> dict:
    """{"kind", "used", "total"} in bytes: the GPU's (torch.cuda.mem_get_info) on CUDA, else this process's
    resident set and the machine's RAM (/proc). Missing numbers are None."""
    if str(device).startswith("cuda"):
        try:
            import torch

            free, total = torch.cuda.mem_get_info(torch.device(device))
            return {"kind": "cuda", "used": int(total - free), "total": int(total)}
        except Exception:  # noqa: BLE001 - no driver answer: say so, do not fail a status request
            return {"kind": "cuda", "used": None, "total": None}
    used = total = None
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return {"kind": "cpu", "used": used, "total": total}


@dataclass
class ObservedStats(WorkerStats):
    """WorkerStats that also feeds each batch's latency into a histogram (the worker sets last_batch_ms
    once per batch it emits)."""

    histogram: object = None

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name == "last_batch_ms" and self.histogram is not None:
            self.histogram.observe(value / 1000.0)


def _observe(worker, histogram) -> None:
    if worker is not None and not isinstance(worker.stats, ObservedStats):
        worker.stats = ObservedStats(**asdict(worker.stats), histogram=histogram)


class DaemonCollector:
    """Reads the daemon's statistics at scrape time (on its event loop)."""

    def __init__(self, daemon, loop: asyncio.AbstractEventLoop, histogram, timeout_s: float = 2.0):
        self.daemon, self.loop, self.histogram, self.timeout_s = daemon, loop, histogram, timeout_s

    def _snapshot(self) -> dict:
        d = self.daemon
        _observe(d.worker, self.histogram)  # a takeover may have made a new worker
        st = d.public_stats()
        peers = {}
        if d.monitor is not None:
            peers = {slot: ps.rtt_ms for slot, ps in d.monitor.peers.items() if ps.state == "up" and ps.rtt_ms}
        kinds = {"protocol": d.stats["errors"], "batch": d.worker.stats.errors if d.worker else 0}
        if d.entry is not None:
            kinds["request"] = d.entry.failed
        return {"st": st, "peers": peers, "errors": kinds}

    async def _async_snapshot(self) -> dict:
        return self._snapshot()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            snap = asyncio.run_coroutine_threadsafe(self._async_snapshot(), self.loop).result(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - loop closed or too busy: an empty scrape, not a crash
            log.warning("metrics: could not read the daemon's statistics: %s", e)
            return
        st = snap["st"]
        lab = ["slot", "role"]
        lv = [str(st.get("slot")), str(st.get("role"))]

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=lab)
            m.add_metric(lv, value)
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc, labels=lab)
            m.add_metric(lv, value)
            return m

        yield counter("p2pk3_tokens", "tokens this stage has computed (prefill and decode)", st.get("tokens", 0))
        yield counter("p2pk3_batches", "batches this stage has run", st.get("batches", 0))
        yield counter("p2pk3_busy_seconds", "seconds this stage spent computing", st.get("busy_s", 0.0))
        yield gauge(
            "p2pk3_busy_fraction", "compute time / wall time of this stage over the last 5 s", st.get("busy", 0.0)
        )
        yield gauge("p2pk3_last_batch_seconds", "compute time of the last batch", st.get("last_batch_ms", 0.0) / 1000)
        yield gauge("p2pk3_sessions", "sessions with state in this stage's cache", st.get("sessions", 0))
        yield gauge("p2pk3_queue_depth", "work items waiting for this stage", st.get("queue", 0))
        yield gauge("p2pk3_uptime_seconds", "seconds since the daemon started", st.get("uptime_s", 0.0))
        if st.get("epoch") is not None:
            yield gauge("p2pk3_epoch", "epoch of this node's claim on its slot", st["epoch"])
        mem = st.get("memory") or {}
        if mem.get("used") is not None:
            yield gauge("p2pk3_memory_used_bytes", f"memory in use ({mem.get('kind')})", mem["used"])
        if mem.get("total") is not None:
            yield gauge("p2pk3_memory_total_bytes", f"memory in all ({mem.get('kind')})", mem["total"])
        err = CounterMetricFamily(
            "p2pk3_errors",
            "errors by kind: protocol (bad frames), batch (failed stage "
            "batches), request (requests that ended in an error, entry only)",
            labels=[*lab, "kind"],
        )
        for kind, n in sorted(snap["errors"].items()):
            err.add_metric([*lv, kind], n)
        yield err
        if "live_sessions" in st:
            yield gauge("p2pk3_live_sessions", "requests the entry is serving now", st["live_sessions"])
            yield counter("p2pk3_requests_finished", "requests the entry finished", st.get("finished", 0))
            yield gauge("p2pk3_paused", "1 while the entry holds requests back (a repair)", int(bool(st.get("paused"))))
        adm = st.get("admission")
        if adm:  # the entry's admission queue (node/admission.py)
            yield gauge("p2pk3_queued_requests", "requests waiting in the entry's queue", adm["queued"])
            yield gauge("p2pk3_queue_capacity", "most requests the entry's queue holds (--max-queue)", adm["max_queue"])
            yield gauge("p2pk3_queue_oldest_wait_seconds", "how long the first request in the queue has waited",
                        adm["oldest_wait_s"])
            yield counter("p2pk3_queue_admitted", "requests admitted (at once or after waiting)", adm["admitted"])
            yield counter("p2pk3_queue_waited", "requests admitted after waiting in the queue", adm["waited"])
            yield counter("p2pk3_queue_refused", "requests refused: the queue was full (busy)", adm["refused"])
            yield counter("p2pk3_queue_timed_out", "requests that waited the whole queue timeout", adm["timed_out"])
            yield counter("p2pk3_queue_left", "requests that left the queue (client gone or cancelled)", adm["left"])
        spares = st.get("spares")
        if spares is not None:  # the entry's spare pool (node/spares.py)
            yield gauge("p2pk3_spares", "standbys ready to take a slot over", sum(1 for x in spares if x["ready"]))
        yield from _prefix_metrics(st, counter, gauge, lab, lv)
        if st.get("degraded"):  # the entry's verdicts on slow stages (node/degraded.py)
            slow = GaugeMetricFamily(
                "p2pk3_stage_slowdown",
                "a stage's time per token over its expected time (1: as expected; the entry judges)",
                labels=[*lab, "peer"],
            )
            deg = GaugeMetricFamily(
                "p2pk3_stage_degraded", "1 while the entry finds a stage degraded (slower than --degraded-factor)",
                labels=[*lab, "peer"],
            )
            for peer, d in sorted(st["degraded"].items()):
                if d.get("slowdown") is not None:
                    slow.add_metric([*lv, peer], d["slowdown"])
                deg.add_metric([*lv, peer], int(bool(d.get("degraded"))))
            yield slow
            yield deg
        if snap["peers"]:
            hop = GaugeMetricFamily(
                "p2pk3_hop_latency_seconds", "heartbeat round trip to a peer slot", labels=[*lab, "peer"]
            )
            for peer, ms in sorted(snap["peers"].items()):
                hop.add_metric([*lv, peer], ms / 1000)
            yield hop


def _prefix_metrics(st: dict, counter, gauge, lab, lv):
    """The prefix cache: prompt tokens hit and missed (entry), bytes per tier, evictions, hits and misses of
    this stage (p2pk3/model/prefix_cache.py)."""
    from prometheus_client.core import GaugeMetricFamily

    e = st.get("prefix_entry")
    if e:
        yield counter("p2pk3_prefix_hit_tokens", "prompt tokens started from the stages' prefix cache", e["hit_tokens"])
        yield counter("p2pk3_prefix_miss_tokens", "prompt tokens computed (not in the prefix cache)", e["miss_tokens"])
        yield counter("p2pk3_prefix_misses", "prefix_miss answers (a stage no longer held a named prefix)", e["misses"])
    p = st.get("prefix")
    if not p:
        return
    tier = GaugeMetricFamily("p2pk3_prefix_cache_bytes", "bytes the prefix cache holds, by tier", labels=[*lab, "tier"])
    tier.add_metric([*lv, "device"], p["device_bytes"])
    tier.add_metric([*lv, "host"], p["host_bytes"])
    yield tier
    budget = GaugeMetricFamily("p2pk3_prefix_cache_budget_bytes", "the prefix cache's budget, by tier", labels=[*lab, "tier"])
    budget.add_metric([*lv, "device"], p["budget_bytes"])
    budget.add_metric([*lv, "host"], p["host_budget_bytes"])
    yield budget
    yield counter("p2pk3_prefix_evictions", "points that left this stage's prefix cache", p["evictions"])
    yield counter("p2pk3_prefix_to_host", "points moved from the device tier to the host tier", p["to_host"])
    yield counter("p2pk3_prefix_from_host", "points brought back from the host tier on a hit", p["from_host"])
    yield counter("p2pk3_prefix_stage_hits", "sessions this stage started at a cached prefix", p["hits"])
    yield counter("p2pk3_prefix_stage_misses", "named prefixes this stage did not hold", p["misses"])


class MetricsHandle:
    def __init__(self, server, thread, registry, histogram, task: asyncio.Task):
        self.server, self.thread, self.registry, self.histogram = server, thread, registry, histogram
        self._task = task

    @property
    def port(self) -> int:
        return self.server.server_port

    def close(self) -> None:
        self._task.cancel()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def start_metrics(daemon, port: int, host: str = "0.0.0.0") -> MetricsHandle:
    """Serve `daemon`'s metrics on http://host:port/metrics (port 0: any free port, see `handle.port`).
    Call from the daemon's event loop. OSError when the port is taken."""
    from prometheus_client import CollectorRegistry, Histogram, start_http_server

    loop = asyncio.get_running_loop()
    registry = CollectorRegistry()
    histogram = Histogram(
        "p2pk3_batch_seconds", "compute time per stage batch", buckets=BATCH_BUCKETS, registry=registry
    )
    _observe(daemon.worker, histogram)
    registry.register(DaemonCollector(daemon, loop, histogram))
    server, thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)

    async def keep_observing():  # a takeover replaces the worker
        while True:
            await asyncio.sleep(0.5)
            _observe(daemon.worker, histogram)

    return MetricsHandle(server, thread, registry, histogram, loop.create_task(keep_observing(), name="metrics"))
