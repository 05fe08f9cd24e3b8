"""`p2pk3 dashboard`: the cluster view against a live 2-node ring, also with one node stopped (SIGSTOP)."""

import asyncio
import json
import signal
import subprocess
import sys

import pytest
from rich.console import Console

from p2pk3.cli.dashboard import render
from p2pk3.frontends.cluster_view import ClusterView
from conftest import local_ring
from p2pk3.params import SamplingParams

pytestmark = pytest.mark.slow  # every test shares a ring of `p2pk3 node` processes


@pytest.fixture(scope="module")
def ring():
    with local_ring(nodes=2) as r:
        yield r


def dashboard_json(ring) -> dict:
    r = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "p2pk3.cli",
            "dashboard",
            "--topology",
            str(ring.topology),
            "--once",
            "--json",
            "--interval",
            "0.3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ring.workdir,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # unreachable nodes are shown, not logged
    return json.loads(r.stdout)


def test_once_json_shows_the_ring(ring):
    snap = dashboard_json(ring)
    rows = {r["slot"]: r for r in snap["slots"]}
    assert [r["slot"] for r in snap["slots"]] == ["s0", "s1"]
    for s in ring.topo.active:
        r = rows[s.id]
        assert r["state"] == "up" and r["node"].startswith(f"{s.id}@") and r["layers"] == list(s.layers)
        assert r["address"] == f"{s.host}:{s.port}" and r["hop_ms"] > 0 and r["queue"] == 0
        assert r["memory"]["kind"] == "cpu" and 0 < r["memory"]["used"] < r["memory"]["total"]
        assert r["tokens_per_s"] == 0.0  # idle: two polls, no work in between
    assert rows["s0"]["role"] == "entry" and rows["s1"]["role"] == "stage"
    assert snap["totals"]["up"] == 2 and snap["totals"]["live_sessions"] == 0
    assert snap["entry"] == "%s:%d" % ring.entry_addr


def test_rates_come_from_the_work_between_two_polls(ring):
    async def go():
        view = ClusterView(ring.topo, ring.secret)
        await view.poll()
        c = await ring.client()
        try:
            await c.generate([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=12))
        finally:
            c.close()
        return await view.poll()

    snap = asyncio.run(go())
    for r in snap["slots"]:
        assert r["tokens_per_s"] > 0 and r["batches_per_s"] > 0 and r["compute_ms"] > 0, r
        assert 0 < r["busy"] <= 1, r  # compute time / wall time over the last 5 s
    assert snap["totals"]["tokens_per_s"] == max(r["tokens_per_s"] for r in snap["slots"])
    assert snap["totals"]["finished"] >= 1
    # the prefix cache: each slot's hit rate and memory (the request above started cold: 0 %), the entry's
    # token hit rate in the title
    for r in snap["slots"]:
        assert r["prefix_hit_rate"] == 0.0 and r["prefix_bytes"]["device"] > 0 and r["prefix_bytes"]["host"] == 0, r
    assert snap["totals"]["prefix_hit_rate"] is not None
    console = Console(width=240, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "prefix hits" in text and " MiB" in text and "hit" in text


def test_a_stopped_node_turns_dead_the_others_stay_up(ring):
    ring.signal("s1", signal.SIGSTOP)
    try:
        snap = dashboard_json(ring)
    finally:
        ring.signal("s1", signal.SIGCONT)
    rows = {r["slot"]: r for r in snap["slots"]}
    assert rows["s1"]["state"] in ("dead", "unreachable") and rows["s1"]["tokens_per_s"] is None, rows["s1"]
    assert rows["s0"]["state"] == "up"
    assert snap["totals"]["up"] == snap["totals"]["serving"] == 1
    console = Console(width=200, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "1/2 slots serving" in text and rows["s1"]["state"] in text and "s0@" in text
