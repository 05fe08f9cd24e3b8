"""Slot claims: refusal of a second claimant, epochs, returning nodes, races (in memory and over TCP)."""

from __future__ import annotations

import asyncio
import random

import pytest

from p2pk3.node.claims import ClaimRefused, ClaimTable, connection_asker, handle_claim, negotiate_claim
from p2pk3.transport.messages import claim_frame, parse_claim
from p2pk3.transport.server import serve
from conftest import run as _run  # the one deadline-guarded runner

SECRET = b"claims-secret-0123456789abcdef!!"


class Clock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def run(coro):
    return _run(coro, 20.0)


class Net:
    """In-memory claim messages between tables, with random delays (and optional unreachable nodes)."""

    def __init__(self, tables: dict[str, ClaimTable], seed: int = 0, max_delay: float = 0.01):
        self.t = tables
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.down: set[str] = set()

    def asker(self, me: str):
        async def ask(peer, frame):
            await asyncio.sleep(self.rng.uniform(0, self.max_delay))
            if peer in self.down:
                raise ConnectionRefusedError(f"{peer} is down")
            reply = handle_claim(self.t[peer], parse_claim(frame), peer_id=me)
            await asyncio.sleep(self.rng.uniform(0, self.max_delay))
            return reply

        return ask

    def notifier(self, me: str):
        async def notify(peer, frame):
            await asyncio.sleep(self.rng.uniform(0, self.max_delay))
            if peer not in self.down:
                handle_claim(self.t[peer], parse_claim(frame), peer_id=me)

        return notify

    async def claim(self, me: str, slot: str):
        peers = [p for p in self.t if p != me]
        return await negotiate_claim(self.t[me], slot, peers, self.asker(me), notify=self.notifier(me), timeout=1)


def test_second_claimant_is_refused_with_a_clear_message():
    clk = Clock()
    a, b = ClaimTable("A", clock=clk), ClaimTable("B", clock=clk)
    net = Net({"A": a, "B": b})
    c = run(net.claim("A", "s2"))
    assert (c.slot, c.node, c.epoch) == ("s2", "A", 1)
    assert b.holder("s2").node == "A"  # via the commit notification
    with pytest.raises(ClaimRefused, match=r"slot s2 is held by node A \(epoch 1\) since 2023-11-14 22:13:20 UTC"):
        run(net.claim("B", "s2"))
    # the same answer from the holder itself, when B's own view is empty
    b2 = ClaimTable("B", clock=clk)
    net2 = Net({"A": a, "B": b2})
    with pytest.raises(ClaimRefused, match=r"slot s2 is held by node A \(epoch 1\).*\(refused by A\)"):
        run(net2.claim("B", "s2"))
    # claiming the slot one already holds is a no-op
    assert run(net.claim("A", "s2")).epoch == 1


def test_handover_and_returning_node_with_old_epoch():
    clk = Clock()
    lost = []
    a = ClaimTable("A", clock=clk, lease_s=10, on_lost=lambda mine, by: lost.append((mine.epoch, by.node, by.epoch)))
    b, c = ClaimTable("B", clock=clk, lease_s=10), ClaimTable("C", clock=clk, lease_s=10)
    net = Net({"A": a, "B": b, "C": c})
    assert run(net.claim("A", "s1")).epoch == 1
    # A keeps beaconing; then it falls silent (crash / partition) for longer than the lease
    clk.t += 5
    for t in (b, c):
        assert t.observe("A", "s1", 1) == "refresh"
    clk.t += 11
    assert b.holder("s1") is None and b.max_epoch("s1") == 1
    net.down.add("A")
    cl = run(net.claim("B", "s1"))
    assert (cl.node, cl.epoch) == ("B", 2)
    assert c.holder("s1").node == "B"
    # A comes back still announcing epoch 1: everybody ignores it ...
    net.down.clear()
    assert c.observe("A", "s1", 1) == "stale" and b.observe("A", "s1", 1) == "stale"
    assert c.holder("s1").node == "B"
    # ... and A, hearing B's beacon, learns that it lost the slot
    assert a.observe("B", "s1", 2) == "superseded"
    assert a.mine is None and lost == [(1, "B", 2)]
    # A cannot take it back while B is alive: not with its old epoch, not with a new one
    with pytest.raises(ClaimRefused, match=r"slot s1 is held by node B \(epoch 2\)"):
        run(net.claim("A", "s1"))
    d = c.decide("s1", "A", 1)
    assert not d.granted and d.code == "held"
    # once B is gone (it released the slot and said bye), an old-epoch claim is stale; a fresh one goes above 2
    b.release()
    for t in (a, c):
        t.forget("B")
    d = c.decide("s1", "A", 2)
    assert not d.granted and d.code == "stale"
    assert "slot s1 was handed over to node B at epoch 2; a claim at epoch 2 is stale" in d.reason
    assert run(net.claim("A", "s1")).epoch == 3


def test_restarted_node_remembering_its_epoch():
    clk = Clock()
    b = ClaimTable("B", clock=clk)
    b.observe("X", "s5", 4)  # B has seen X's beacon: X holds s5 at epoch 4
    a = ClaimTable("A", clock=clk)
    a.restore("s5", 2)  # A held s5 at epoch 2 before it restarted; it does not hold it now
    assert a.mine is None and a.holder("s5") is None
    x = ClaimTable("X", clock=clk)
    net = Net({"A": a, "B": b, "X": x})
    x.begin("s5", epoch=4)  # X took the slot at epoch 4 (its earlier hand-overs are not modelled here)
    x.commit("s5", 4)
    with pytest.raises(ClaimRefused, match=r"slot s5 is held by node X \(epoch 4\)"):
        run(net.claim("A", "s5"))
    # A now knows the holder from the refusal
    assert a.holder("s5").node == "X"


def test_stale_epoch_is_retried_above_the_record():
    clk = Clock()
    a, b = ClaimTable("A", clock=clk), ClaimTable("B", clock=clk)
    b.observe("Z", "s0", 7)
    b.forget("Z")  # Z left: the slot is free at epoch 7, which A does not know
    net = Net({"A": a, "B": b})
    c = run(net.claim("A", "s0"))
    assert c.epoch == 8


@pytest.mark.parametrize("seed", range(25))
def test_race_exactly_one_winner(seed):
    async def main():
        clk = Clock()
        tables = {n: ClaimTable(n, clock=clk) for n in ("A", "B", "C", "D")}
        net = Net(tables, seed=seed)
        rng = random.Random(seed)

        async def go(n):
            await asyncio.sleep(rng.uniform(0, 0.01))
            try:
                return await net.claim(n, "s9")
            except ClaimRefused as e:
                return e

        res = await asyncio.gather(*(go(n) for n in ("B", "C", "D")))
        winner = next(r.node for r in res if not isinstance(r, Exception))
        deadline = asyncio.get_running_loop().time() + 5
        while any(
            t.node_id != winner and (t.holder("s9") is None or t.holder("s9").node != winner) for t in tables.values()
        ):  # the commit notifications are on their way
            assert asyncio.get_running_loop().time() < deadline, "commit notifications never arrived"
            await asyncio.sleep(0.01)
        return tables, res

    tables, res = run(main())
    winners = [r for r in res if not isinstance(r, Exception)]
    assert len(winners) == 1, res
    w = winners[0].node
    for t in tables.values():
        if t.node_id != w:
            assert t.holder("s9").node == w
    assert all(("s9" in str(r)) for r in res if isinstance(r, Exception))


def test_simultaneous_claims_resolve_deterministically():
    """Both claimants start before any message is delivered: the smaller node id wins, in any order."""
    for order in (("B", "C"), ("C", "B")):

        async def main(order=order):
            clk = Clock()
            tables = {n: ClaimTable(n, clock=clk) for n in ("A", "B", "C")}
            net = Net(tables, max_delay=0.005)
            res = await asyncio.gather(*(net.claim(n, "s1") for n in order), return_exceptions=True)
            return dict(zip(order, res))

        res = run(main())
        assert not isinstance(res["B"], Exception) and res["B"].node == "B"
        assert isinstance(res["C"], ClaimRefused)
        assert (
            "node B is claiming slot s1 at epoch 1, which wins over node C's claim at epoch 1" in str(res["C"])
            or "slot s1 is held by node B" in str(res["C"])
            or "slot s1 is being claimed by node B" in str(res["C"])
        )


def test_observation_order_and_claims_for_others():
    clk = Clock()
    t = ClaimTable("me", clock=clk)
    assert t.observe("B", "s0", 1) == "new"
    assert t.observe("A", "s0", 1) == "new"  # same epoch, smaller id: A's claim beats B's
    assert t.observe("B", "s0", 1) == "stale"
    assert t.observe("C", "s0", 2) == "new"  # a higher epoch beats
    assert t.observe("C", "s1", 1) == "new"  # C moved: it released s0 ...
    assert t.holder("s0") is None and t.max_epoch("s0") == 2  # ... whose epoch stays
    assert t.observe("C", None, 1) == "released" and t.holder("s1") is None
    reply = handle_claim(t, parse_claim(claim_frame("s0", "X", 3)), peer_id="Y")
    assert reply.header["granted"] is False and reply.header["code"] == "forbidden"
    reply = handle_claim(t, parse_claim(claim_frame("s0", "Y", 3)), peer_id="Y")
    assert reply.header["granted"] is True


def test_race_over_authenticated_connections():
    async def main():
        names = ["A", "B", "C"]
        tables = {n: ClaimTable(n) for n in names}
        servers = {}
        for n in names:

            async def handler(conn, n=n):
                async for f in conn:
                    r = handle_claim(tables[n], parse_claim(f), peer_id=conn.peer_id)
                    if r is not None:
                        await conn.send(r)

            servers[n] = await serve("127.0.0.1", 0, SECRET, n, handler)
        addrs = {n: ("127.0.0.1", s.port) for n, s in servers.items()}
        try:

            async def claim(n):
                ask = connection_asker(addrs, SECRET, n)
                try:
                    return await negotiate_claim(tables[n], "s4", [p for p in names if p != n], ask, notify=ask)
                except ClaimRefused as e:
                    return e

            res = await asyncio.gather(claim("C"), claim("B"))
            await asyncio.sleep(0.2)
            return tables, res
        finally:
            for s in servers.values():
                s.close()
                await s.wait_closed()

    tables, res = run(main())
    winners = [r for r in res if not isinstance(r, Exception)]
    assert len(winners) == 1, res
    w = winners[0].node
    assert tables["A"].holder("s4").node == w
    loser = [r for r in res if isinstance(r, Exception)][0]
    assert "s4" in str(loser)
