"""The spare pool (p2pk3/node/spares.py): standbys beyond the topology's standby slots. The pool's own
bookkeeping; the `join` frame; then an in-process ring whose topology has no standby slot at all: a spare
started on any free port joins, the entry counts it at once, and the next failure uses it."""

from __future__ import annotations

import asyncio
import time

import pytest

from p2pk3.engine.reference import Pipeline
from p2pk3.node.spares import POOL_SLOT, SparePool, spare_key, with_pool_slot
from p2pk3.params import SamplingParams
from p2pk3.transport.codec import ProtocolError
from p2pk3.transport.messages import join_frame, joined_frame, parse_join, parse_joined

from conftest import run
from ring_helpers import InProcessRing, loopback_topology


class _PS:
    def __init__(self, state, role):
        self.state, self.info = state, {"role": role}


def test_pool_joins_forgets_and_hands_out_spares_oldest_first():
    now = [100.0]
    pool = SparePool(forget_after_s=30, clock=lambda: now[0])
    assert pool.join("a", ("10.0.0.5", 4000)) and not pool.join("a", ("10.0.0.5", 4000))
    now[0] += 1
    assert pool.join("b", ("10.0.0.6", 4001))
    assert pool.keys() == [spare_key("a"), spare_key("b")] and pool.address(spare_key("b")) == ("10.0.0.6", 4001)
    states = {spare_key("a"): _PS("up", "standby"), spare_key("b"): _PS("up", "loading")}
    rows = pool.rows(states.get)
    assert [(r["node"], r["ready"]) for r in rows] == [("a", True), ("b", False)]
    pool.taken(spare_key("a"))
    assert pool.keys() == [spare_key("b")]
    now[0] += 31  # b stopped joining
    assert pool.keys() == []


def test_discovery_beacons_of_standbys_without_a_slot_join_the_pool():
    from p2pk3.node.discovery import PeerInfo

    pool = SparePool()
    pool.heard(
        {
            "x": PeerInfo("x", "10.0.0.7", 4100, None, standby=True),
            "y": PeerInfo("y", "10.0.0.8", 4101, "s4", standby=True),  # a topology standby slot: watched as such
            "z": PeerInfo("z", "10.0.0.9", 4102, "s1"),
        }
    )
    assert pool.keys() == [spare_key("x")]


def test_join_frames_round_trip_and_reject_bad_ports():
    assert parse_join(join_frame("spare@h:1", "10.0.0.5", 4000)) == ("spare@h:1", "10.0.0.5", 4000)
    assert parse_joined(joined_frame("s0@h:2", 3)) == ("s0@h:2", 3)
    with pytest.raises(ProtocolError, match="port"):
        parse_join(join_frame("spare@h:1", "10.0.0.5", 4000).__class__.make("join", node="n", host="h", port=0))


def test_a_pool_spare_sees_one_more_standby_slot_without_an_address(ckpt):
    topo = loopback_topology(ckpt, 2)
    t = with_pool_slot(topo)
    assert [s.id for s in t.standby] == [POOL_SLOT] and POOL_SLOT not in t.static_addresses()
    assert [s.id for s in topo.slots] == ["s0", "s1"]  # the ring's own topology is unchanged


def test_a_spare_on_any_port_joins_and_takes_the_next_failure_without_a_standby_slot(ckpt):
    prompt, n = [11, 12, 13, 14, 15], 24
    want = Pipeline.load(ckpt, 1, max_sessions=2, max_tokens=256).generate([prompt], SamplingParams(max_tokens=n))[0]

    async def go():
        topo = loopback_topology(ckpt, 3)  # no standby slot
        async with InProcessRing(topo, ckpt, heartbeat_s=0.2, dead_after_s=1.0) as ring:
            await ring.wait_healthy()
            spare = await ring.start(None, port=0)  # `p2pk3 node --standby` without --slot
            assert spare.role == "standby" and spare.pool and spare.claim is None
            entry = ring.entry
            deadline = time.monotonic() + 20
            while not any(r["ready"] for r in entry.public_stats()["spares"]):
                assert time.monotonic() < deadline, entry.public_stats()["spares"]
                await asyncio.sleep(0.05)
            assert entry.public_stats()["spares"][0]["address"] == ["127.0.0.1", spare.port]
            victim = ring.daemons[1]
            c = await ring.client()
            got: list[int] = []
            task = asyncio.create_task(c.generate(prompt, SamplingParams(max_tokens=n), on_token=got.append))
            while len(got) < 4:
                if task.done():  # refused or failed before its fourth token: say why instead of waiting
                    raise AssertionError(f"the request ended after {len(got)} tokens: {task.result()!r}")
                await asyncio.sleep(0.01)
            await victim.stop("killed by the test")
            r = await asyncio.wait_for(task, 90)
            c.close()
            assert spare.role == "stage" and spare.slot_id == "s1"
            events = [e["event"] for e in entry.coordinator.events]
            assert "spare_joined" in events and "takeover" in events and "unavailable" not in events, events
            assert entry.public_stats()["spares"] == []  # it serves a slot now
            return r.tokens

    assert run(go(), timeout=150) == want


@pytest.mark.slow
def test_after_an_entry_takeover_a_pool_spare_finds_the_new_entry(ckpt):
    """A pool spare gets no `route` frames: when the entry slot moves, its joins at the old address fail,
    and it finds the new entry through the other slots (their `not_entry` answer says where it is)."""
    from p2pk3.model.config import K3Config
    from p2pk3.node.local import free_ports
    from p2pk3.topology import even_split

    async def go():
        ports = free_ports(3)
        topo = even_split(K3Config.from_pretrained(ckpt), 2, host="127.0.0.1", base_port=ports[0],
                          model_path=str(ckpt), n_standby=1)
        for s, p in zip(topo.slots, ports):
            s.port = p
        async with InProcessRing(topo, ckpt, slots=["s0", "s1", "s2"], heartbeat_s=0.2, dead_after_s=1.0) as ring:
            old, standby = ring.daemons[0], ring.daemons[2]
            spare = await ring.start(None, port=0)
            deadline = time.monotonic() + 30
            while not old.public_stats()["spares"] or not standby.monitor.state("s0").ever_up:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await old.stop("killed by the test")
            while standby.role != "entry" or not any(r["ready"] for r in standby.public_stats()["spares"]):
                assert time.monotonic() < deadline + 60, (standby.role, standby.public_stats().get("spares"))
                await asyncio.sleep(0.1)
            assert standby.public_stats()["spares"][0]["node"] == spare.node_id

    run(go(), timeout=150)


def test_node_cli_says_what_a_spare_needs(ckpt, tmp_path):
    from click.testing import CliRunner

    from p2pk3.cli import main
    from p2pk3.node.local import write_local_topology

    t = str(write_local_topology(ckpt, 2, tmp_path))
    r = CliRunner().invoke(main, ["node", "--topology", t])
    assert r.exit_code == 2 and "give --slot ID, or --standby to run as a spare" in r.output
    r = CliRunner().invoke(main, ["node", "--topology", t, "--standby", "--rejoin-as-standby"])
    assert r.exit_code == 2 and "--rejoin-as-standby is for a node started with --slot ID" in r.output
    r = CliRunner().invoke(main, ["node", "--topology", t, "--slot", "s1", "--standby"])
    assert r.exit_code == 2 and "slot s1 is not a standby slot" in r.output
    r = CliRunner().invoke(main, ["node", "--help"])
    assert "--max-queue" in r.output and "--queue-timeout" in r.output and "spare pool" in r.output
