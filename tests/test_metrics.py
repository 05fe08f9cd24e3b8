"""Prometheus metrics of a daemon (`p2pk3 node --metrics-port`): scraped from a live 1-node ring."""

import asyncio
import socket
import urllib.request

import pytest
from conftest import local_ring

from p2pk3.node.local import free_ports
from p2pk3.node.metrics import memory_usage, start_metrics
from p2pk3.params import SamplingParams

parser = pytest.importorskip("prometheus_client.parser")


def scrape(port: int) -> dict[str, float]:
    """sample name{labels} -> value (labels without slot/role, which are the same for every sample)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("slot", "role")}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            out[key] = s.value
    return out


@pytest.fixture(scope="module")
def ring():
    port = free_ports(1)[0]
    with local_ring(nodes=1, extra_args=["--metrics-port", str(port)]) as r:
        r.metrics_port = port
        yield r


@pytest.mark.slow
def test_counters_move_with_a_request(ring):
    before = scrape(ring.metrics_port)
    assert before["p2pk3_tokens_total"] == 0 and before["p2pk3_batch_seconds_count"] == 0
    assert before["p2pk3_live_sessions"] == 0 and before["p2pk3_errors_total{kind=batch}"] == 0
    assert before["p2pk3_memory_used_bytes"] > 0 and before["p2pk3_memory_total_bytes"] > 0

    async def go():
        c = await ring.client()
        try:
            return await c.generate([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=5))
        finally:
            c.close()

    reply = asyncio.run(go())
    after = scrape(ring.metrics_port)
    assert after["p2pk3_tokens_total"] == 6 + len(reply.tokens) - 1  # the prompt, then one token per decode step
    assert after["p2pk3_batches_total"] >= len(reply.tokens)
    assert after["p2pk3_batch_seconds_count"] == after["p2pk3_batches_total"]
    assert after["p2pk3_batch_seconds_sum"] > 0 and after["p2pk3_busy_seconds_total"] > 0
    assert 0 < after["p2pk3_busy_fraction"] <= 1  # computed within the last 5 s
    assert after["p2pk3_requests_finished_total"] == before["p2pk3_requests_finished_total"] + 1
    assert after["p2pk3_sessions"] == 0 and after["p2pk3_queue_depth"] == 0


@pytest.mark.slow
def test_prefix_cache_hits_misses_and_bytes_per_tier(ring):
    before = scrape(ring.metrics_port)
    prompt = [9, 8, 7, 6, 5, 4, 3]

    async def go():
        c = await ring.client()
        try:
            return [await c.generate(prompt, SamplingParams(max_tokens=3)) for _ in range(2)]
        finally:
            c.close()

    first, second = asyncio.run(go())
    after = scrape(ring.metrics_port)
    assert first.stats["cached_tokens"] == 0 and second.stats["cached_tokens"] == len(prompt) - 1
    hit = after["p2pk3_prefix_hit_tokens_total"] - before.get("p2pk3_prefix_hit_tokens_total", 0)
    miss = after["p2pk3_prefix_miss_tokens_total"] - before.get("p2pk3_prefix_miss_tokens_total", 0)
    assert (hit, miss) == (len(prompt) - 1, len(prompt) + 1)
    assert after["p2pk3_prefix_cache_bytes{tier=device}"] > 0 and after["p2pk3_prefix_cache_bytes{tier=host}"] == 0
    assert after["p2pk3_prefix_cache_budget_bytes{tier=device}"] > 0
    assert after["p2pk3_prefix_evictions_total"] == 0 and after["p2pk3_prefix_stage_hits_total"] >= 1


def test_memory_usage_on_cpu():
    m = memory_usage("cpu")
    assert m["kind"] == "cpu" and 0 < m["used"] < m["total"]


def test_a_taken_port_is_an_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:

        async def go():
            class Idle:  # a daemon that has not loaded a stage yet
                worker = None

            start_metrics(Idle(), s.getsockname()[1], host="127.0.0.1")

        with pytest.raises(OSError):
            asyncio.run(go())
    finally:
        s.close()
