"""Prometheus metrics of the API server (prometheus-client), in a registry of its own per app, served at
`/metrics`: requests by route and status, time to first token, inter-token latency, tokens."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)


class ApiMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "p2pk3_api_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.in_flight = Gauge("p2pk3_api_requests_in_flight", "generation requests being served", registry=r)
        self.ttft = Histogram(
            "p2pk3_api_time_to_first_token_seconds",
            "from the request's arrival to its first generated token",
            ["route"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "p2pk3_api_inter_token_latency_seconds",
            "time between consecutive generated tokens",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generated = Counter("p2pk3_api_generated_tokens", "completion tokens generated", ["route"], registry=r)
        self.prompt = Counter("p2pk3_api_prompt_tokens", "prompt tokens received", ["route"], registry=r)
        # the entry's admission queue (node/admission.py), read from its status at scrape time
        self.queued = Gauge("p2pk3_entry_queued_requests", "requests waiting in the entry's queue", registry=r)
        self.queue_max = Gauge("p2pk3_entry_queue_capacity", "most requests the entry's queue holds", registry=r)
        self.queue_refused = Gauge(
            "p2pk3_entry_queue_refused", "requests the entry refused since it started (queue full)", registry=r
        )

    def observe_entry(self, status: dict | None) -> None:
        """The entry's status (None: no answer): its queue's gauges."""
        adm = (status or {}).get("admission")
        if adm:
            self.queued.set(adm["queued"])
            self.queue_max.set(adm["max_queue"])
            self.queue_refused.set(adm["refused"])

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
