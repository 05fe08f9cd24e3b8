"""The fault matrix: a 4-stage loopback ring of `p2pk3 node` processes with one standby, 8 concurrent
greedy sessions of different lengths started at different times, and one failure per case. Every
session must complete with exactly the tokens of an undisturbed run (the in-process reference), and
nothing may wait without a deadline. Detection and recovery times come from the entry's failure log
and are printed (pytest -s shows them)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from p2pk3.engine.reference import Pipeline
from p2pk3.node.client import RequestError
from p2pk3.node.local import LocalRing, probe
from p2pk3.params import SamplingParams

pytestmark = pytest.mark.slow  # every case runs a 4-node ring of processes through a failure

PROMPTS = [[(7 * i + 13 * j) % 500 + 3 for j in range(4 + 3 * i)] for i in range(8)]
LENGTHS = [60, 44, 52, 36, 48, 40, 56, 30]
DEADLINE = 180  # nothing in a case may take longer


@pytest.fixture(scope="module")
def want(ckpt):
    ref = Pipeline.load(ckpt, 1, max_sessions=8, max_tokens=4096)
    return [ref.generate([p], SamplingParams(max_tokens=n))[0] for p, n in zip(PROMPTS, LENGTHS)]


async def _sessions(ring, fault, *, after_tokens=8, every_session=False, at_fault=None):
    """Run the 8 sessions (staggered starts); call `fault()` once session 0 has streamed `after_tokens` (with
    `every_session`: once every session has streamed one, so every client is connected). `at_fault`, a list,
    receives each session's token count at the fault."""
    started = asyncio.Event()
    counts = [0] * len(PROMPTS)

    def on_token(i):
        def f(_t):
            counts[i] += 1
            if every_session and all(counts):
                started.set()
            elif not every_session and i == 0 and counts[0] == after_tokens:
                started.set()

        return f

    async def one(i):
        await asyncio.sleep(0.15 * i)
        c = await ring.client()
        try:
            r = await c.generate(PROMPTS[i], SamplingParams(max_tokens=LENGTHS[i]), on_token=on_token(i))
            return r.tokens
        except RequestError as e:
            return e
        finally:
            c.close()

    tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
    await asyncio.wait_for(started.wait(), 60)
    t_fault = time.time()
    if at_fault is not None:
        at_fault[:] = counts
    await fault()
    outs = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE)
    return outs, t_fault


async def _entry_status(ring):
    """The status of whichever node holds the entry role now."""
    for sid in ring.procs:
        st = await probe(ring.address(sid), ring.secret)
        if st and st.get("role") == "entry":
            return st
    return None


def _report(name, t_fault, st):
    ev = {e["event"]: e for e in (st or {}).get("events", [])}
    down, rec = ev.get("down"), ev.get("recovered")
    detect = f"{down['t'] - t_fault:.2f} s" if down else "n/a"
    recover = f"{rec['t'] - t_fault:.2f} s" if rec else "n/a"
    print(f"\n[fault matrix] {name}: detected after {detect}, ring serving again after {recover}")


def _ring(ckpt, standby=1):
    return LocalRing(ckpt, 4, standby=standby)


@pytest.mark.parametrize(
    "victim,sig",
    [("s1", signal.SIGKILL), ("s3", signal.SIGKILL), ("s2", signal.SIGSTOP)],
    ids=["kill-middle", "kill-last", "stop-middle"],
)
def test_stage_failure_is_taken_over_and_replayed(ckpt, want, victim, sig):
    with _ring(ckpt) as ring:

        async def go():
            async def fault():
                ring.signal(victim, sig)

            outs, t = await _sessions(ring, fault)
            st = await _entry_status(ring)
            return outs, t, st, await ring.state()

        outs, t_fault, st, state = asyncio.run(go())
        _report(f"{sig.name} {victim}", t_fault, st)
        assert outs == want
        holder = [n for n in state["nodes"] if n["slot"] == victim and n["role"] in ("stage", "entry")]
        assert holder and holder[0]["started_on"] == "s4", state  # the standby (slot s4) serves it now
        events = [e["event"] for e in st["events"]]
        assert "takeover" in events and "recovered" in events, events
        down = next(e for e in st["events"] if e["event"] == "down")
        assert down["t"] - t_fault < 5.0  # detection bound: heartbeat 0.5 s + dead-after 2.5 s (+ load noise)


def test_entry_failure_standby_takes_the_entry_and_clients_resume(ckpt, want):
    with _ring(ckpt) as ring:

        async def go():
            async def fault():
                # the standby must have heard the entry once (its detector takes over only a slot that
                # was up; its first heartbeats may have gone out before the entry listened): its log says
                # so. Kill at once then, while the sessions still stream (they take ~2 s on this host)
                log = ring.log_dir / "node-s4.log"
                deadline = time.monotonic() + 10.0
                while "slot s0 is up" not in (log.read_text() if log.exists() else ""):
                    assert time.monotonic() < deadline, "the standby never heard the entry"
                    await asyncio.sleep(0.05)
                ring.signal("s0", signal.SIGKILL)

            outs, t = await _sessions(ring, fault)
            return outs, t, await ring.state()

        outs, t_fault, state = asyncio.run(go())
        print(
            f"\n[fault matrix] SIGKILL s0 (entry): every client resumed, {time.time() - t_fault:.2f} s after the kill"
        )
        assert outs == want
        entry = [n for n in state["nodes"] if n["role"] == "entry"]
        assert entry and entry[0]["slot"] == "s0" and entry[0]["started_on"] == "s4", state


def test_entry_never_heard_by_the_standby_is_taken_over_after_the_startup_grace(ckpt, want):
    """The entry dies before the standby ever heard it (the spare is started after the kill): the standby
    takes the entry once its start-up grace is over (NodeOptions.startup_grace_s, counted from its own
    start), and every client resumes there."""
    ring = _ring(ckpt)
    try:
        ring.start(standbys=False)

        async def go():
            async def fault():
                # every client is connected (a new one would wait only 10 s for an entry) and streaming
                ring.signal("s0", signal.SIGKILL)
                ring.spawn("s4")

            outs, t = await _sessions(ring, fault, every_session=True, at_fault=at_fault)
            return outs, t, await ring.state()

        at_fault: list[int] = []
        outs, t_fault, state = asyncio.run(go())
        print(
            f"\n[fault matrix] SIGKILL s0 (entry) before the standby started: every client resumed, "
            f"{time.time() - t_fault:.2f} s after the kill"
        )
        assert outs == want
        assert any(c < n for c, n in zip(at_fault, LENGTHS)), at_fault  # some session resumed on the standby
        entry = [n for n in state["nodes"] if n["role"] == "entry"]
        assert entry and entry[0]["slot"] == "s0" and entry[0]["started_on"] == "s4", state
        assert "has not answered since this standby started" in ring.log_path("s4").read_text()
    finally:
        ring.stop()


def test_killed_standby_changes_nothing_and_restarted_node_does_not_take_its_slot_back(ckpt, want):
    with _ring(ckpt) as ring:

        async def go():
            async def fault():
                ring.signal("s4", signal.SIGKILL)  # the standby itself

            outs1, _ = await _sessions(ring, fault)
            st = await _entry_status(ring)
            return outs1, st

        outs1, st = asyncio.run(go())
        assert outs1 == want
        assert st["down"] == [] and st["unavailable"] is None
        # now kill a middle stage with no standby left... (covered below); here: restart the standby,
        # kill s2, let the standby take it, then restart s2's old process: it must not get s2 back
        entry_log = ring.log_path("s0")
        ups = entry_log.read_text().count("slot s4 is up")
        ring.spawn("s4")
        ring.wait_up(["s4"], 60)

        async def go2():
            # the entry counts the restarted standby once its detector hears it again (its log says so)
            deadline = time.monotonic() + 30.0
            while entry_log.read_text().count("slot s4 is up") <= ups:
                assert time.monotonic() < deadline, "the entry never saw the restarted standby"
                await asyncio.sleep(0.1)

            async def fault():
                ring.signal("s2", signal.SIGKILL)

            outs, _ = await _sessions(ring, fault)
            return outs

        assert asyncio.run(go2()) == want
        p = ring.spawn("s2")
        assert p.wait(60) == 1
        log = ring.log_path("s2").read_text()
        assert "cannot claim slot s2: slot s2 is held by node s4@" in log, log[-2000:]


def test_no_standby_gives_clear_errors_then_recovers_when_a_spare_starts(ckpt, want):
    ring = _ring(ckpt)
    try:
        ring.start(standbys=False)

        async def go():
            async def fault():
                ring.signal("s2", signal.SIGKILL)

            outs, _ = await _sessions(ring, fault)
            c = await ring.client()
            try:
                with pytest.raises(RequestError) as refused:
                    await c.generate(PROMPTS[0], SamplingParams(max_tokens=4))
            finally:
                c.close()
            return outs, refused.value

        outs, refused = asyncio.run(go())
        errors = [o for o in outs if isinstance(o, RequestError)]
        assert errors, "sessions in flight must end with an error when no standby can take the slot"
        for e in errors:  # by the failure detector, or by s1's link to s2 failing first: both name the slot
            assert e.code == "unavailable" and (
                "slot s2 is down" in e.message or "slot s2 is unreachable from slot s1" in e.message
            ), e
        assert refused.code == "unavailable" and "slot s2 is down" in refused.message
        for o, w in zip(outs, want):  # sessions that finished before the kill are intact
            if not isinstance(o, RequestError):
                assert o == w
        ring.spawn("s4")  # a spare arrives: service resumes without restarting anything

        async def after():
            deadline = time.time() + 60
            while time.time() < deadline:
                c = await ring.client()
                try:
                    return (await c.generate(PROMPTS[1], SamplingParams(max_tokens=LENGTHS[1]))).tokens
                except RequestError as e:
                    assert e.code == "unavailable", e
                    await asyncio.sleep(0.5)
                finally:
                    c.close()
            raise AssertionError("the ring did not recover within 60 s of the spare starting")

        assert asyncio.run(after()) == want[1]
    finally:
        ring.stop()


def test_a_slot_missing_at_start_up_is_a_clear_error_not_a_hang(ckpt):
    """The last slot (the sampler) never started: requests end with an error naming it, within a bound."""
    ring = LocalRing(ckpt, 4)
    try:
        for sid in ("s0", "s1", "s2"):
            ring.spawn(sid)
        ring.wait_up(["s0", "s1", "s2"], 120)

        async def go():
            out = []
            for _ in range(2):
                t0 = time.time()
                c = await ring.client(resume=False)
                try:
                    with pytest.raises(RequestError) as e:
                        await asyncio.wait_for(c.generate(PROMPTS[0], SamplingParams(max_tokens=4)), 60)
                finally:
                    c.close()
                out.append((e.value, time.time() - t0))
            return out

        (first, t1), (second, t2) = asyncio.run(go())
        print(f"\n[fault matrix] missing last slot: first request failed after {t1:.1f} s, the next after {t2:.1f} s")
        for e in (first, second):
            assert e.code == "unavailable" and "s3" in e.message, e
        assert t2 < 2.0  # once the detector knows, requests are refused at once
    finally:
        ring.stop()
