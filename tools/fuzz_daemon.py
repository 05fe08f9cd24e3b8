"""Fuzz a LIVE ring of `p2pk3 node` processes with hostile frames while sessions generate.

    python tools/fuzz_daemon.py --frames 100000 --nodes 2

Half of the frames (--auth-share) come from an AUTHENTICATED peer (a connection with the ring's secret,
frames of every kind the daemons handle, mutated), the rest are raw TCP bytes sent BEFORE the handshake.
Generators: tests/fuzzing.py. Meanwhile `--lanes` greedy sessions generate one after the other through the
entry and every result is compared with the single-process reference.

Connections are reused while the daemon keeps them open: after a frame that the in-process oracle
(`fuzzing.judge`) accepts, the next one follows on the same connection; after one it rejects, a `ping`
follows and the fuzzer waits for the daemon to close the connection (or to answer: then the oracle was
wrong, counted as `oracle_mismatch`) and reconnects. Frames cut off in the middle are followed by closing
the connection. Valid frames that change the ring's state by design (see fuzzing.judge) are withheld.

Printed at the end: frames sent by category, daemon crashes (processes that exited), the daemons' RSS
(VmRSS) before and after (after a pause), sessions checked against the reference, unexpected exceptions
in the daemon logs, and whether every daemon still serves a new request. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fuzzing  # noqa: E402  (tests/fuzzing.py)

from p2pk3.transport.codec import ProtocolError  # noqa: E402
from p2pk3.transport.connection import ConnectionClosed, TransportError, open_connection  # noqa: E402
from p2pk3.transport.messages import ping_frame  # noqa: E402

PROMPTS = [[5, 17, 300, 42, 42, 7, 99], [123, 511, 0, 1, 2, 3, 250, 260, 270, 280, 14], [9, 8, 7, 6]]
SESSION_TOKENS = 12
# daemon log lines that mean a bug (an exception a handler did not turn into a ProtocolError, a crash)
BAD_LOG = re.compile(
    r"handler failed|Task exception was never retrieved|Exception in callback|"
    r"Fatal error|MemoryError|crashed|Traceback"
)
# ... except the one traceback that is logged by design: a well-formed hop the stage cannot compute
EXPECTED_TB = re.compile(r"unexpected failure of a batch")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@dataclass
class Stats:
    sent: collections.Counter = field(default_factory=collections.Counter)  # by category
    auth: int = 0
    raw: int = 0
    withheld: collections.Counter = field(default_factory=collections.Counter)
    rejected_by_daemon: int = 0  # the daemon closed the connection after the frame
    reasons: collections.Counter = field(default_factory=collections.Counter)  # bad_frame reasons (first words)
    oracle_mismatch: collections.Counter = field(default_factory=collections.Counter)
    reconnects: int = 0
    transient_connect: int = 0  # connect / handshake attempts that failed once (retried)
    ghost_frees: int = 0  # free frames sent for sessions a well-formed fuzz hop opened
    rss_samples: list = field(default_factory=list)
    write_on_closed: int = 0  # the daemon had closed the connection before the next frame (resent on a new one)
    pings: int = 0
    sessions_ok: int = 0
    sessions_bad: list = field(default_factory=list)
    crashes: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # harness-side failures (a daemon not answering in time)

    @property
    def total(self) -> int:
        return self.auth + self.raw


def _segments(f):
    from p2pk3.transport.messages import parse_forward

    try:
        return parse_forward(f).segments
    except Exception:  # noqa: BLE001
        return []


class Budget:
    def __init__(self, n: int):
        self.left = n

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def _cat(c: str) -> str:
    return re.sub(r"ext type -?[0-9]+", "ext type (each code)", c)


def _merge(c) -> dict:
    out = collections.Counter()
    for k, v in c.items():
        out[_cat(k)] += v
    return out


def _reason_key(msg: str) -> str:
    return re.sub(r"[0-9]+", "N", msg)[:70]


async def _drain(conn, sink: list) -> None:
    """Read what the daemon sends on a fuzz connection (pongs, errors, replies) until it closes it."""
    try:
        while True:
            f = await conn.recv()
            sink.append(f)
    except Exception:
        pass


class AuthPeer:
    """An authenticated fuzz connection to one daemon."""

    def __init__(self, addr, secret, name, stats: Stats):
        self.addr, self.secret, self.name, self.stats = addr, secret, name, stats
        self.conn = None
        self.inbox: list = []
        self.reader: asyncio.Task | None = None
        self.used = 0
        self.ping_id = 0
        self.dead = False

    async def connect(self) -> None:
        await self.close()
        self.conn = await open_connection(*self.addr, self.secret, self.name, timeout=10, handshake_timeout=10)
        self.inbox = []
        self.reader = asyncio.create_task(_drain(self.conn, self.inbox))
        self.used = 0
        self.stats.reconnects += 1

    async def connect_retrying(self, tries: int = 5) -> bool:
        """Connect; a daemon that refuses `tries` times in a row (2 s apart) is dead (a finding)."""
        for i in range(tries):
            try:
                await self.connect()
                return True
            except (OSError, asyncio.TimeoutError, ConnectionError, TransportError, ProtocolError) as e:
                self.stats.transient_connect += 1
                last = f"{type(e).__name__}: {e}"
                await asyncio.sleep(2.0 if i else 0.05)
        self.stats.errors.append(f"cannot connect to {self.addr}: {last}")
        self.dead = True
        return False

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.close("fuzz peer done", abort=True)
        if self.reader is not None:
            try:
                await asyncio.wait_for(self.reader, 5)
            except asyncio.TimeoutError:
                self.reader.cancel()
        self.conn = self.reader = None

    async def write(self, data: bytes) -> None:
        c = self.conn
        n = c._write_now([data])  # the connection's own write path: ordered with its send()
        if n != len(data):
            await c._write_rest([data], n)

    async def sync(self, timeout: float = 15.0) -> bool:
        """Ping; True if the pong came (connection open), False if the daemon closed the connection."""
        self.ping_id += 1
        pid = self.ping_id
        self.stats.pings += 1
        try:
            await self.conn.send(ping_frame(pid, time.monotonic_ns()))
        except (ConnectionClosed, ConnectionError, OSError):
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(f.kind == "pong" and f.header.get("id") == pid for f in self.inbox):
                self.inbox.clear()
                return True
            if self.reader.done():
                return False
            await asyncio.sleep(0.001)
        raise TimeoutError(f"daemon at {self.addr} neither answered a ping nor closed the connection in {timeout}s")

    def reasons(self) -> list[str]:
        return [str(f.header.get("message")) for f in self.inbox if f.kind == "error"]


async def auth_worker(wid, addrs, secret, fz: fuzzing.FrameFuzzer, target, budget: Budget, stats: Stats):
    peers = [AuthPeer(a, secret, f"fuzz-{wid}-{i}", stats) for i, a in enumerate(addrs)]
    try:
        while budget.take():
            p = peers[stats.auth % len(peers)]
            item = fz.auth_frame()
            try:
                v = fuzzing.judge(item.data, target)
            except Exception as e:  # noqa: BLE001 - a parser bug found in-process: a finding, send it anyway
                stats.errors.append(f"in-process parser raised {type(e).__name__}: {str(e)[:200]} ({item.category})")
                v = fuzzing.Verdict(True, "parser bug")
            if v.withhold:
                stats.withheld[v.withhold] += 1
                budget.left += 1
                continue
            if p.dead:
                live = [q for q in peers if not q.dead]
                if not live:
                    stats.errors.append("no daemon accepts connections any more")
                    return
                p = live[stats.auth % len(live)]
            if p.conn is None or p.conn.closed or p.used >= 64:
                if not await p.connect_retrying():
                    budget.left += 1
                    continue
            try:
                await p.write(item.data)
            except (ConnectionClosed, ConnectionError, OSError):  # closed by the daemon after an earlier frame
                stats.write_on_closed += 1
                await p.close()
                budget.left += 1
                continue
            p.used += 1
            stats.auth += 1
            stats.sent[
                item.category.split(":")[0]
                if not item.category.startswith(("bomb", "prefix", "truncated"))
                else item.category
            ] += 1
            opened = [
                (s.session, s.epoch)
                for f in v.frames
                if f.kind == "forward" and not v.rejected
                for s in _segments(f)
                if s.start_pos == 0
            ]
            if opened:
                # a well-formed hop at position 0 opens its (made-up) session on the stage, which never
                # expires there (see the report): free it, as the entry would (frees queue behind the work)
                from p2pk3.transport.messages import free_frame

                try:
                    await p.sync()  # the daemon has taken the frame (and queued its work) first
                    if p.conn is None or p.conn.closed:
                        await p.connect_retrying()
                    await p.conn.send(free_frame(opened, origin="fuzzer"))
                    stats.ghost_frees += 1
                except (ConnectionClosed, ConnectionError, OSError, AttributeError, TimeoutError):
                    stats.errors.append(f"could not free ghost sessions {opened}")
            if item.truncated:
                if not v.rejected:  # a complete frame after all: let the daemon act on it before closing
                    try:
                        await p.sync()
                    except TimeoutError as e:
                        stats.errors.append(str(e))
                await p.close()
                continue
            if v.rejected or p.used % 16 == 0:
                try:
                    alive = await p.sync()
                except TimeoutError as e:
                    stats.errors.append(str(e))
                    await p.close()
                    continue
                if alive and v.rejected:
                    stats.oracle_mismatch[f"kept open after: {v.reason[:60]}"] += 1
                if not alive:
                    stats.rejected_by_daemon += 1
                    for r in p.reasons():
                        stats.reasons[_reason_key(r)] += 1
                    if not v.rejected:
                        stats.oracle_mismatch[f"closed after accepted {v.kind}: {(p.reasons() or ['?'])[0][:80]}"] += 1
                    await p.close()
    finally:
        for p in peers:
            await p.close()


async def raw_worker(addrs, fz: fuzzing.FrameFuzzer, budget: Budget, stats: Stats):
    i = 0
    fails: dict = {}
    while budget.take():
        item = fz.raw_frame()
        addr = addrs[i % len(addrs)]
        i += 1
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(*addr), 10)
        except (OSError, asyncio.TimeoutError) as e:
            stats.transient_connect += 1
            fails[addr] = fails.get(addr, 0) + 1
            if fails[addr] >= 5:
                stats.errors.append(f"cannot connect to {addr}: {type(e).__name__}: {e}")
                addrs = [x for x in addrs if x != addr]
                if not addrs:
                    return
            await asyncio.sleep(1.0)
            budget.left += 1
            continue
        fails[addr] = 0
        try:
            w.write(item.data)
            await w.drain()
            if w.can_write_eof():
                w.write_eof()
            stats.raw += 1
            stats.sent[
                item.category
                if item.category.startswith("raw_bomb") or item.category.startswith("raw_prefix")
                else item.category.split(":")[0]
            ] += 1
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the server closes (handshake failed / EOF) within its 5 s timeout
                try:
                    chunk = await asyncio.wait_for(r.read(65536), max(0.01, deadline - time.monotonic()))
                except (ConnectionError, OSError):
                    break
                if not chunk:
                    break
            else:
                stats.errors.append(f"raw connection to {addr} not closed by the daemon after 10 s ({item.category})")
        except (ConnectionError, OSError):  # the daemon closed first (it rejected the first bytes): sent
            stats.raw += 1
            stats.sent[item.category.split(":")[0]] += 1
        finally:
            w.close()


async def session_lane(lane, ring, reference: dict, stop: asyncio.Event, stats: Stats):
    from p2pk3.params import SamplingParams

    c = await ring.client()
    try:
        k = lane
        while not stop.is_set():
            prompt = PROMPTS[k % len(PROMPTS)]
            k += 1
            try:
                r = await asyncio.wait_for(c.generate(prompt, SamplingParams(max_tokens=SESSION_TOKENS)), 120)
                got = r.tokens
            except Exception as e:  # noqa: BLE001 - any failure of a session is a finding
                got = f"{type(e).__name__}: {e}"
            if got == reference[tuple(prompt)]:
                stats.sessions_ok += 1
            else:
                stats.sessions_bad.append({"prompt": prompt, "got": got, "want": reference[tuple(prompt)]})
                c.close()
                c = await ring.client()
    finally:
        c.close()


async def watch(ring, stop: asyncio.Event, stats: Stats):
    while not stop.is_set():
        for sid, p in ring.procs.items():
            if p.poll() is not None and sid not in [c["slot"] for c in stats.crashes]:
                stats.crashes.append({"slot": sid, "returncode": p.returncode})
        await asyncio.sleep(0.5)


def reference_tokens(model_dir) -> dict:
    from p2pk3.engine.reference import Pipeline
    from p2pk3.params import SamplingParams

    pipe = Pipeline.load(model_dir, 1, max_sessions=8, max_tokens=4096)
    return {tuple(p): pipe.generate([p], SamplingParams(max_tokens=SESSION_TOKENS))[0] for p in PROMPTS}


def scan_logs(ring) -> dict:
    """Lines in the daemon logs that mean a bug, and the size of the logs."""
    out = {"bad_lines": collections.Counter(), "log_bytes": 0, "warnings": 0}
    for sid in ring.procs:
        path = ring.log_path(sid)
        if not path.exists():
            continue
        out["log_bytes"] += path.stat().st_size
        prev = ""
        with open(path, errors="replace") as fh:
            for line in fh:
                if " WARNING " in line or "WARNING" in line[:40]:
                    out["warnings"] += 1
                if BAD_LOG.search(line) and not (line.startswith("Traceback") and EXPECTED_TB.search(prev)):
                    out["bad_lines"][f"{sid}: {line.strip()[:160]}"] += 1
                if re.match(r"\d{4}-\d\d-\d\d ", line):  # a log record (not a traceback's lines)
                    prev = line
    return out


async def still_serving(ring, reference) -> dict:
    """Each daemon answers a status request; the entry serves a new session with the reference tokens;
    no stage holds a leftover session."""
    from p2pk3.node.local import probe
    from p2pk3.params import SamplingParams

    st = await ring.statuses()
    c = await ring.client()
    try:
        p = PROMPTS[0]
        r = await asyncio.wait_for(c.generate(p, SamplingParams(max_tokens=SESSION_TOKENS)), 120)
    finally:
        c.close()
    await asyncio.sleep(0.5)
    st2 = {s: await probe(ring.address(s), ring.secret, 2.0) for s in ring.procs}
    return {
        "status": {s: (v or {}).get("role") for s, v in st.items()},
        "new_session_ok": r.tokens == reference[tuple(p)],
        "sessions_held": {s: (v or {}).get("sessions") for s, v in st2.items()},
    }


async def fuzz_ring(
    ring,
    reference: dict,
    frames: int,
    *,
    auth_share: float = 0.5,
    seed: int = 0,
    auth_workers: int = 3,
    raw_workers: int = 3,
    lanes: int = 2,
    warmup: int = 2000,
    pause_s: float = 3.0,
    progress: bool = False,
    on_baseline=None,
) -> dict:
    """The whole run against a started LocalRing. Returns the report (see main)."""
    from p2pk3.model.config import K3Config

    cfg = K3Config.from_pretrained(ring.model_dir)
    target = fuzzing.Target.for_topology(ring.topo, cfg)
    addrs = [ring.address(s.id) for s in ring.topo.active]
    stats = Stats()
    stop = asyncio.Event()
    pids = {sid: p.pid for sid, p in ring.procs.items()}

    async def blast(n, st, sd):
        na = round(n * auth_share)
        ba, br = Budget(na), Budget(n - na)
        fzs = [fuzzing.FrameFuzzer(target, sd * 1000 + i) for i in range(auth_workers + raw_workers)]
        tasks = [auth_worker(i, addrs, ring.secret, fzs[i], target, ba, st) for i in range(auth_workers)]
        tasks += [raw_worker(addrs, fzs[auth_workers + i], br, st) for i in range(raw_workers)]
        await asyncio.gather(*tasks)

    # warm up (sessions and every code path once), then the baseline
    await blast(warmup, Stats(), seed + 99991)
    c = await ring.client()
    from p2pk3.params import SamplingParams

    for p in PROMPTS:
        await c.generate(p, SamplingParams(max_tokens=SESSION_TOKENS))
    c.close()
    await asyncio.sleep(pause_s)
    rss_before = {sid: rss_kb(pid) for sid, pid in pids.items()}
    if on_baseline is not None:
        on_baseline()

    t0 = time.time()
    lane_tasks = [asyncio.create_task(session_lane(i, ring, reference, stop, stats)) for i in range(lanes)]
    watcher = asyncio.create_task(watch(ring, stop, stats))
    prog = None
    if progress:

        async def report():
            while not stop.is_set():
                await asyncio.sleep(15)
                stats.rss_samples.append([round(time.time() - t0), [rss_kb(p) for p in pids.values()]])
                print(
                    f"[{time.time() - t0:6.0f}s] frames {stats.total} (auth {stats.auth}, raw {stats.raw}) "
                    f"sessions ok {stats.sessions_ok} bad {len(stats.sessions_bad)} crashes {len(stats.crashes)} "
                    f"rss {[rss_kb(p) for p in pids.values()]}",
                    flush=True,
                )

        prog = asyncio.create_task(report())
    try:
        await blast(frames, stats, seed)
    finally:
        stop.set()
        await asyncio.gather(*lane_tasks, return_exceptions=True)
        watcher.cancel()
        if prog:
            prog.cancel()
    elapsed = time.time() - t0
    await asyncio.sleep(pause_s)
    rss_after = {sid: rss_kb(pid) if ring.procs[sid].poll() is None else 0 for sid, pid in pids.items()}
    serving = await still_serving(ring, reference) if not stats.crashes else {"new_session_ok": False}
    logs = scan_logs(ring)
    return {
        "frames": stats.total,
        "auth_frames": stats.auth,
        "raw_frames": stats.raw,
        "elapsed_s": round(elapsed, 1),
        "by_category": dict(sorted(_merge(stats.sent).items())),
        "withheld": dict(stats.withheld),
        "closed_by_daemon": stats.rejected_by_daemon,
        "reconnects": stats.reconnects,
        "transient_connect_failures": stats.transient_connect,
        "ghost_frees": stats.ghost_frees,
        "rss_kb_samples": stats.rss_samples,
        "write_on_closed": stats.write_on_closed,
        "sync_pings": stats.pings,
        "top_reasons": dict(stats.reasons.most_common(12)),
        "oracle_mismatch": dict(stats.oracle_mismatch),
        "crashes": stats.crashes,
        "harness_errors": stats.errors[:10],
        "rss_kb_before": rss_before,
        "rss_kb_after": rss_after,
        "sessions_ok": stats.sessions_ok,
        "sessions_bad": stats.sessions_bad[:5],
        "n_sessions_bad": len(stats.sessions_bad),
        "serving_after": serving,
        "unexpected_log_lines": dict(logs["bad_lines"].most_common(10)),
        "n_unexpected_log_lines": sum(logs["bad_lines"].values()),
        "log_bytes": logs["log_bytes"],
        "log_warnings": logs["warnings"],
    }


async def _exchange(addr, secret, frames, *, name="fuzz-directed", until=None, timeout=20.0):
    """Send `frames` on one authenticated connection and collect replies until `until(replies)` is true,
    the daemon closes the connection, or `timeout`."""
    conn = await open_connection(*addr, secret, name, timeout=10, handshake_timeout=10)
    got: list = []
    reader = asyncio.create_task(_drain(conn, got))
    try:
        for f in frames:
            await conn.send(f)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not reader.done() and not (until and until(got)):
            await asyncio.sleep(0.01)
        return got, reader.done()
    finally:
        conn.close("done", abort=True)
        reader.cancel()


async def _big_prompt(ring, entry, session_ok, errs) -> dict:
    from p2pk3.params import SamplingParams
    from p2pk3.transport.messages import GenerateRequest

    big = GenerateRequest(1, [1] * 1_000_000, SamplingParams(max_tokens=1)).frame()
    t0 = time.monotonic()
    normal = asyncio.create_task(session_ok())
    got, closed = await _exchange(
        entry, ring.secret, [big], until=lambda g: any(f.kind in ("error", "done") for f in g), timeout=120
    )
    return {
        "reply": errs(got) or [f.kind for f in got][-1:],
        "closed": closed,
        "reply_s": round(time.monotonic() - t0, 2),
        "concurrent_session_ok": await normal,
        "session_ok_after": await session_ok(),
    }


async def directed(ring, reference, big_prompt: bool = True) -> dict:
    """Hostile requests an authenticated peer can make, each followed by a check that the ring still
    serves a session correctly. Returns what each one got (and `ok` per check)."""
    from p2pk3.transport.messages import takeover_frame
    from p2pk3.params import SamplingParams
    from p2pk3.transport.codec import Frame
    from p2pk3.transport.messages import GenerateRequest

    out: dict = {}
    entry, stage = ring.address(ring.topo.active[0].id), ring.address(ring.topo.active[-1].id)
    want = reference[tuple(PROMPTS[1])]

    async def session_ok():
        c = await ring.client()
        try:
            return (
                await asyncio.wait_for(c.generate(PROMPTS[1], SamplingParams(max_tokens=SESSION_TOKENS)), 120)
            ).tokens == want
        finally:
            c.close()

    def errs(got):
        return [f"{f.header.get('code')}: {str(f.header.get('message'))[:100]}" for f in got if f.kind == "error"]

    # 1. a 1,000,000-token prompt, while a normal session runs
    if big_prompt:
        out["prompt_1M"] = await _big_prompt(ring, entry, session_ok, errs)

    # 2. 65 concurrent requests on one connection (MAX_REQUESTS_PER_CONNECTION = 64; max_sessions 32)
    reqs = [GenerateRequest(i + 1, [3, 4, 5], SamplingParams(max_tokens=2000)).frame() for i in range(65)]
    got, closed = await _exchange(
        entry, ring.secret, reqs, until=lambda g: sum(f.kind == "error" for f in g) >= 30, timeout=30
    )
    await asyncio.sleep(1.0)  # the connection is closed: its requests are cancelled
    st = await ring.statuses()
    e = collections.Counter(x.split(":")[0] for x in errs(got))
    out["requests_65"] = {
        "errors": dict(e),
        "closed_by_daemon": closed,
        "live_after_close": st[ring.topo.active[0].id].get("live_sessions"),
        "session_ok_after": await session_ok(),
    }
    dup = [GenerateRequest(7, [3, 4], SamplingParams(max_tokens=500)).frame()] * 2
    got, closed = await _exchange(entry, ring.secret, dup, timeout=5)
    out["duplicate_request_id"] = {"errors": errs(got), "closed": closed}
    # 3. takeover sent to active (non-standby) slots: refused
    res = {}
    for sid in [s.id for s in ring.topo.active]:
        got, closed = await _exchange(
            ring.address(sid),
            ring.secret,
            [takeover_frame(ring.topo.active[0].id, ("x", 1))],
            until=lambda g: bool(g),
            timeout=10,
        )
        res[sid] = {"reply": errs(got) or [f.kind for f in got], "closed": closed}
    out["takeover_to_active"] = res
    # 4. hostile claim / route / retain / takeover contents: each rejected, nothing crashes
    hostile = {
        "claim since=str (real slot, own id)": Frame.make(
            "claim", slot="s1", node="fuzz-directed", epoch=1, op="commit", since="x"
        ),
        "claim request after it": Frame.make("claim", slot="s1", node="fuzz-directed", epoch=3, op="request"),
        "claim epoch bool": Frame.make("claim", slot="s1", node="fuzz-directed", epoch=True),
        "claim for another node": Frame.make("claim", slot="s1", node="someone-else", epoch=9, op="commit"),
        "claim unknown slot": Frame.make("claim", slot="zz" * 5000, node="fuzz-directed", epoch=9, op="commit"),
        "route unknown slot": Frame.make("route", slot="zz-1", node="n", host="h" * 100000, port=1, epoch=1),
        "route port 0": Frame.make("route", slot="s1", node="n", host="127.0.0.1", port=0, epoch=1),
        "route epoch -1": Frame.make("route", slot="s1", node="n", host="127.0.0.1", port=5, epoch=-1),
        "retain not pairs": Frame.make("retain", sessions=[["a", 1, 2]]),
        "retain dict": Frame.make("retain", sessions={"a": 1}),
        "takeover slot int": Frame.make("takeover", slot=5),
        "takeover replaces junk": Frame.make("takeover", slot="s1", replaces=[1, 2]),
        "ping 1 MB id": Frame.make("ping", id="i" * 1_000_000, t_ns=1),
        "result uint32 logits to a stage": Frame.make(
            "result",
            [("logits", ("uint32", (1, 4), bytes(16)))],
            results=[{"session": "g", "epoch": 0, "pos": 1, "token": 1, "rows": 1}],
        ),
        "generate temperature nan": GenerateRequest(1, [3, 4], SamplingParams(max_tokens=2)).frame(),
        "generate temperature 1e-300": GenerateRequest(1, [3, 4], SamplingParams(max_tokens=2)).frame(),
    }
    hostile["generate temperature nan"].header["params"]["temperature"] = float("nan")
    hostile["generate temperature 1e-300"].header["params"]["temperature"] = 1e-300
    res = {}
    for name, f in hostile.items():
        addr = entry if name.startswith("generate") else stage
        got, closed = await _exchange(
            addr,
            ring.secret,
            [f, ping_frame(99, 0)],
            until=lambda g, name=name: (
                any(x.kind in ("pong", "done") for x in g)
                and (not name.startswith("generate") or any(x.kind in ("done", "error") for x in g))
            ),
            timeout=10,
        )
        res[name] = {"reply": (errs(got) or [x.kind for x in got])[:2], "closed": closed}
    res["session_ok_after"] = await session_ok()
    out["hostile_contents"] = res
    out["all_alive"] = not ring.exited()
    return out


def verdict(rep: dict, rss_margin_kb: int) -> list[str]:
    bad = []
    if rep["crashes"]:
        bad.append(f"daemon crashes: {rep['crashes']}")
    if rep["n_sessions_bad"] or not rep["sessions_ok"]:
        bad.append(f"{rep['n_sessions_bad']} sessions differ from the reference ({rep['sessions_ok']} ok)")
    sv = rep["serving_after"]
    if not sv.get("new_session_ok") or any(v is None for v in sv.get("status", {None: None}).values()):
        bad.append(f"not serving afterwards: {sv}")
    if any(v for v in sv.get("sessions_held", {}).values()):
        bad.append(f"stages still hold sessions: {sv.get('sessions_held')}")
    for sid, b in rep["rss_kb_before"].items():
        a = rep["rss_kb_after"].get(sid, 0)
        if a - b > max(rss_margin_kb, b // 10):
            bad.append(f"slot {sid}: RSS grew from {b} kB to {a} kB")
    if rep["n_unexpected_log_lines"]:
        bad.append(f"{rep['n_unexpected_log_lines']} unexpected exception lines in the daemon logs")
    if rep["harness_errors"]:
        bad.append(f"harness errors: {rep['harness_errors']}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100000)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--model", help="checkpoint folder (default: a random tiny K3 written to the work folder)")
    ap.add_argument("--auth-share", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lanes", type=int, default=2, help="sessions generating concurrently throughout")
    ap.add_argument("--workdir", help="where the ring's topology, secret and logs go (kept)")
    ap.add_argument("--rss-margin-mb", type=float, default=16.0)
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--directed", action="store_true", help="then run the directed hostile requests (directed())")
    a = ap.parse_args(argv)
    from p2pk3.node.local import LocalRing

    work = Path(a.workdir or tempfile.mkdtemp(prefix="p2pk3-fuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model
    if model is None:
        from p2pk3.checkpoint.tiny import write_checkpoint
        from p2pk3.model.config import TINY_K3

        model = work / "tiny-k3"
        if not (model / "config.json").exists():
            write_checkpoint(model, TINY_K3, seed=0, shards=3)
    print(f"reference tokens ({len(PROMPTS)} prompts) ...", flush=True)
    ref = reference_tokens(model)
    (work / "ring").mkdir(exist_ok=True)
    ring = LocalRing(model, a.nodes, workdir=work / "ring")
    ring.start()
    try:
        print(
            f"ring up: {a.nodes} daemons, pids {[p.pid for p in ring.procs.values()]}, logs in {ring.log_dir}",
            flush=True,
        )
        rep = asyncio.run(
            fuzz_ring(ring, ref, a.frames, auth_share=a.auth_share, seed=a.seed, lanes=a.lanes, progress=True)
        )
        if a.directed:
            rep["directed"] = asyncio.run(directed(ring, ref))
            print(json.dumps(rep["directed"], indent=2, default=str), flush=True)
    finally:
        ring.stop()
    bad = verdict(rep, int(a.rss_margin_mb * 1024))
    rep["failures"] = bad
    print(json.dumps(rep, indent=2, default=str))
    print(
        f"\nframes sent: {rep['frames']} ({rep['auth_frames']} authenticated, {rep['raw_frames']} before the "
        f"handshake) in {rep['elapsed_s']} s; daemon crashes: {len(rep['crashes'])}; sessions ok "
        f"{rep['sessions_ok']}, differing {rep['n_sessions_bad']}"
    )
    for sid in rep["rss_kb_before"]:
        print(f"slot {sid}: VmRSS before {rep['rss_kb_before'][sid]} kB, after {rep['rss_kb_after'][sid]} kB")
    print("RESULT:", "PASS" if not bad else "FAIL\n  " + "\n  ".join(bad))
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=2, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
