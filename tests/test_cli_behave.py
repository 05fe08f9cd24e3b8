"""Issue 26 ("every command behaves, round two"): what a new user still hit, one test per item (the item
numbers are the issue's). In-process with click's runner where it can, subprocesses for start-up cost,
signals and rings."""

from __future__ import annotations

import pytest
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from p2pk3.cli import main
from p2pk3.engine.reference import default_model_dir

MODEL = default_model_dir()
ENV = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))


def cli(*args, input=None):
    r = CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"p2pk3 {' '.join(map(str, args))} raised {r.exception!r}:\n{r.output}")
    return r


def _free_base_port(n: int) -> int:
    """A port p with p .. p+n-1 free now (nothing of another test listens there)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base


def _topology(tmp_path, nodes: int = 2, **kw) -> Path:
    out = tmp_path / "topology.toml"
    kw.setdefault("base-port", _free_base_port(nodes + int(kw.get("standby", 0))))
    r = cli("topology", "init", "--nodes", nodes, "--out", out, *[a for k, v in kw.items() for a in (f"--{k}", v)])
    assert r.exit_code == 0, r.output
    return out


# ------------------------------------------------------------------------------ 10: lazy imports
def _imports_torch(args: list[str]) -> bool:
    code = (
        "import sys\nfrom p2pk3.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1] == "TORCH"


def test_commands_that_do_not_run_the_model_do_not_import_torch(tmp_path):
    topo = _topology(tmp_path)
    for args in (
        ["--help"],
        ["secret", "--out", str(tmp_path / "k")],
        ["topology", "init", "--nodes", "2"],
        ["topology", "check", str(topo)],
        ["systemd", "--topology", str(topo), "--out", str(tmp_path / "u")],
        ["local", "--help"],
        ["chat", "--help"],
    ):
        assert not _imports_torch(args), f"p2pk3 {' '.join(args)} imports torch"


# ------------------------------------------------------------------------------ 20: options that contradict
def test_contradicting_or_misplaced_options_are_refused(tmp_path):
    topo = _topology(tmp_path)
    r = cli("node", "--topology", topo, "--slot", "s0", "--heartbeat", "5", "--dead-after", "1")
    assert r.exit_code == 2 and "--dead-after" in r.output and "two heartbeats" in r.output, r.output
    key = tmp_path / "key"
    key.write_text("k" * 32)
    r = cli("local", "--api-key-file", key)
    assert r.exit_code == 2 and "give --api too" in r.output, r.output
    readme = Path(__file__).resolve().parent.parent / "README.md"
    r = cli("generate", "--prompt", "hi", "--model", readme)
    assert r.exit_code == 2 and "is a file; give the model's directory" in r.output, r.output


# ------------------------------------------------------------------------------ 12, 13: the dashboard
def test_dashboard_json_prints_one_document_unless_asked_to_follow(tmp_path):
    topo = _topology(tmp_path)  # nothing listens there: every slot is dead, the document says so
    base = [
        sys.executable,
        "-m",
        "p2pk3.cli",
        "dashboard",
        "--topology",
        str(topo),
        "--interval",
        "0.2",
        "--timeout",
        "0.2",
    ]
    r = subprocess.run(base + ["--json"], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    (doc,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert [s["state"] for s in doc["slots"]] == ["dead", "dead"] and doc["totals"]["up"] == 0
    p = subprocess.Popen(base + ["--json", "--follow"], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        lines = [json.loads(p.stdout.readline()) for _ in range(3)]  # JSON lines, one per poll
        assert all(d["slots"] for d in lines) and p.poll() is None
    finally:
        p.kill()
        p.wait(10)
    r = cli("dashboard", "--topology", topo, "--follow")
    assert r.exit_code == 2 and "--follow is for --json" in r.output


def test_dashboard_counts_a_healthy_standby_as_up(tmp_path, monkeypatch):
    from p2pk3.cli.dashboard import render
    from p2pk3.frontends import cluster_view
    from p2pk3.topology import Topology
    from rich.console import Console

    topo = Topology.load(_topology(tmp_path, nodes=2, standby=1))
    roles = {
        s.port: (s.id, "standby" if s.standby else "entry" if i == 0 else "stage") for i, s in enumerate(topo.slots)
    }

    async def fake_probe(addr, secret, timeout=1.0):
        slot, role = roles[addr[1]]
        return cluster_view.Probe(
            addr, {"slot": slot, "role": role, "node": f"{slot}@x", "epoch": 1, "address": list(addr)}, rtt_ms=0.1
        )

    monkeypatch.setattr(cluster_view, "probe", fake_probe)
    import asyncio

    snap = asyncio.run(cluster_view.ClusterView(topo, b"x" * 32).poll())
    assert [r["state"] for r in snap["slots"]] == ["up", "up", "standby"]
    assert snap["totals"]["up"] == 3 == snap["totals"]["nodes"]
    console = Console(width=200, record=True)
    console.print(render(snap))
    assert "2/2 slots serving + 1 standby" in console.export_text()


# ------------------------------------------------------------------------------ 16: words and shapes
def _help(*args) -> str:
    r = cli(*args, "--help")
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())  # unwrapped


def test_help_names_the_embedded_model_and_every_option_has_a_help_or_default():
    for cmd in (["generate"], ["local"], ["score"], ["chat"], ["topology", "init"]):
        text = _help(*cmd)
        assert "k3-docs" in text and "tiny K3" not in text, (cmd, text)
    assert "--port INTEGER RANGE listen port" in _help("node")
    plan = _help("plan")
    assert "--prefill-chunk INTEGER RANGE prompt tokens per prefill pass" in plan
    assert "--stage-overhead-us FLOAT RANGE fixed time per stage" in plan
    sim = _help("simulate")
    for opt, default in (
        ("--prompt", "rtx5090: 1024"),
        ("--new-tokens", "rtx5090: 256"),
        ("--context", "rtx5090: 32768"),
        ("--act", "rtx5090: bf16"),
        ("--hardware", "rtx5090.toml"),
    ):
        part = sim.split(opt + " ", 1)[1].split(" --", 1)[0]
        assert "[default:" in part and default in part, (opt, part)


def test_counts_take_the_right_plural_and_the_chats_share_one_banner():
    from p2pk3.cli.common import plural
    from p2pk3.frontends.repl import banner

    assert [plural(1, "daemon"), plural(2, "daemon"), plural(1, "standby", "standbys")] == [
        "1 daemon",
        "2 daemons",
        "1 standby",
    ]
    import inspect
    from p2pk3.cli import chat, ring

    for mod in (chat, ring):  # both chats greet through the one banner
        assert "banner(" in inspect.getsource(mod) and "to leave" not in inspect.getsource(mod)
    assert "/quit" in banner("k3-docs") and "Ctrl-D" in banner("k3-docs")


def test_usage_errors_and_long_errors_are_one_short_line():
    for args, match in (
        (["generate", "--prompt", "hi", "--max-tokens", "-1"], "--max-tokens"),
        (["generate", "--bogus"], "No such option"),
        (["topology", "init"], "--nodes"),
        (["generate", "--prompt", "hi", "--temperature", "x" * 2000], "--temperature"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "p2pk3.cli", *args], capture_output=True, text=True, env=ENV, timeout=120
        )
        assert r.returncode == 2 and r.stdout == "", r
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and match in lines[0] and len(lines[0]) <= 340, r.stderr
        assert lines[0].endswith(f"(p2pk3 {' '.join(a for a in args[:2] if not a.startswith('-'))} --help)"), lines


# ------------------------------------------------------------------------------ 18: a cancel is not a failure
def test_a_cancelled_request_is_no_failure_and_stats_show_the_stopped_answer():
    import io

    from p2pk3.frontends.prompt import PromptBuilder, SamplingOverrides
    from p2pk3.frontends.repl import Chat, stats_text
    from p2pk3.node.entry import Entry
    from p2pk3.params import SamplingParams

    entry = Entry(lambda work: None, lambda sessions: None)
    s = entry.submit([1, 2, 3], SamplingParams(max_tokens=8))
    entry.cancel(s.id, "cancelled by the client")  # what serving.py does on a cancel frame or a disconnect
    assert (entry.failed, entry.cancelled) == (0, 1)
    s = entry.submit([1, 2, 3], SamplingParams(max_tokens=8))
    entry.fail_all("slot s1 is down")
    assert (entry.failed, entry.cancelled) == (1, 1)

    chat = Chat(
        None,
        PromptBuilder.from_pretrained(MODEL),
        SamplingOverrides(),
        system=None,
        out=io.StringIO(),
        err=io.StringIO(),
        interactive=True,
    )
    chat.finish("first", [5, 6], {"ttft_s": 0.01, "decode_tokens_per_s": 50.0, "prompt_tokens": 9, "total_s": 0.2})
    assert "prompt 9 tokens" in stats_text(chat.conv)
    chat.finish("second", [7, 8, 9], None)  # Ctrl-C after three tokens
    text = stats_text(chat.conv, {"slot": "s0", "finished": 1, "cancelled": 1, "failed": 0})
    assert "last answer: stopped after 3 tokens" in text and "prompt 9 tokens" not in text, text
    assert "1 stopped by their client, 0 failed" in text, text


# ------------------------------------------------------------------------------ 7: no ring, wrong secret
def test_chat_says_at_once_which_address_refused_and_why(tmp_path):
    import asyncio
    import threading

    from p2pk3.topology import Topology
    from p2pk3.transport.server import serve

    topo_path = _topology(tmp_path, nodes=2)
    topo = Topology.load(topo_path)
    t0 = time.monotonic()
    r = cli("chat", "--topology", topo_path, "--no-history", input="hi\n")
    took = time.monotonic() - t0
    first = "%s:%d" % (topo.slots[0].host, topo.slots[0].port)
    assert r.exit_code == 1 and f"{first}: connection refused" in r.output and "is the node up?" in r.output, r.output
    assert took < 2.0 and len(r.output.strip().splitlines()) == 1, (took, r.output)

    loop = asyncio.new_event_loop()
    started = threading.Event()
    servers = []

    async def listen():  # every slot's address answers, with another cluster's secret
        for s in topo.slots:
            servers.append(await serve(s.host, s.port, b"another cluster's secret!", s.id, lambda conn: None))
        started.set()

    threading.Thread(target=lambda: (loop.run_until_complete(listen()), loop.run_forever()), daemon=True).start()
    try:
        assert started.wait(10)
        t0 = time.monotonic()
        r = cli("chat", "--topology", topo_path, "--no-history", input="hi\n")
        took = time.monotonic() - t0
    finally:
        for srv in servers:
            loop.call_soon_threadsafe(srv.close)
        loop.call_soon_threadsafe(loop.stop)
    assert (
        r.exit_code == 1
        and f"{first}: refused the handshake: authentication failed: wrong cluster secret" in r.output
        and len(r.output) < 340
    ), r.output
    assert took < 2.0, (took, r.output)


# ------------------------------------------------------------------------------ 8: local --prompt streams
def test_local_prompt_streams_and_ctrl_c_keeps_the_partial_answer(monkeypatch):
    import p2pk3.node.local as local
    from p2pk3.frontends.prompt import PromptBuilder

    tok = PromptBuilder.from_pretrained(MODEL).tok
    words = tok.encode(" with opens a context manager")

    class Interrupted:
        async def generate(self, ids, params, on_token=None, **kw):
            for t in words:
                on_token(t)
            raise KeyboardInterrupt  # Ctrl-C while the answer streams

        def close(self):
            pass

    class FakeRing:
        entry_addr, topology, log_dir, failed, procs = ("127.0.0.1", 1), "ring.toml", "/tmp", False, {}
        topo = type("T", (), {"slots": [], "active": []})()

        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def exited(self):
            return []

        async def client(self):
            return Interrupted()

    monkeypatch.setattr(local, "LocalRing", FakeRing)
    r = cli("local", "--nodes", 2, "--prompt", "What does with do?")
    assert "with opens a context manager" in r.output, r.output  # what came before Ctrl-C is on the terminal
    assert f"[stopped after {len(words)} tokens]" in r.output and "stopping ..." in r.output, r.output


# ------------------------------------------------------------------------------ 9: what happens to the ring
def test_ring_events_say_down_taken_over_recovered(tmp_path):
    from p2pk3.node.local import ring_events
    from p2pk3.topology import Topology

    topo = Topology.load(_topology(tmp_path, nodes=2, standby=1))

    def doc(*nodes):
        return {"entry": "127.0.0.1:1", "nodes": [dict(zip(("started_on", "slot", "role", "pid"), n)) for n in nodes]}

    up = doc(("s0", "s0", "entry", 10), ("s1", "s1", "stage", 11), ("s2", "s2", "standby", 12))
    down = doc(("s0", "s0", "entry", 10), ("s1", "s1", "dead", 11), ("s2", "s2", "standby", 12))
    over = doc(("s0", "s0", "entry", 10), ("s2", "s1", "stage", 12), ("s1", "s1", "dead", 11))
    assert ring_events(None, up, topo) == [] and ring_events(up, up, topo) == []
    assert ring_events(up, down, topo) == ["node down: slot s1 (pid 11) is dead"]
    assert ring_events(down, over, topo) == [
        "taken over: standby s2 (pid 12) serves slot s1 now",
        "recovered: every slot is served again (entry 127.0.0.1:1)",
    ]
    assert ring_events(over, over, topo) == []


# ------------------------------------------------------------------------------ 3: the API port and the state file
def test_local_refuses_a_busy_api_port_and_a_live_rings_state_file_before_starting(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = cli("local", "--nodes", 2, "--api", f"127.0.0.1:{port}")
        assert r.exit_code == 2 and f"port {port} on 127.0.0.1 is already in use" in r.output, r.output
        assert "starting" not in r.output and time.monotonic() - t0 < 10, r.output  # before any daemon
    state = tmp_path / "ring.json"
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        state.write_text(json.dumps({"topology": "x", "pid": owner.pid, "nodes": []}))
        r = cli("local", "--nodes", 2, "--state", state)
        assert r.exit_code == 2 and f"running ring (p2pk3 local, pid {owner.pid})" in r.output, r.output
        assert "starting" not in r.output and json.loads(state.read_text())["pid"] == owner.pid
    finally:
        owner.kill()
        owner.wait(10)
    from p2pk3.node.local import claim_state_file

    claim_state_file(state)  # its ring is gone: a stale file, removed so that waiting for it waits for the new one
    assert not state.exists()


def _wait_for(pred, timeout: float, what: str, proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended with {proc.returncode}")
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.mark.slow
def test_local_says_what_happens_and_cleans_up_after_itself(tmp_path):
    """A ring with a spare: a killed stage is said (down, taken over, recovered) on local's terminal; a
    second ring cannot take its state file; SIGTERM removes the state file and the work folder."""
    env = dict(ENV, TMPDIR=str(tmp_path))
    state = tmp_path / "ring.json"
    out = open(tmp_path / "local.out", "w+")
    p = subprocess.Popen(
        [sys.executable, "-m", "p2pk3.cli", "local", "--nodes", "2", "--standby", "1", "--state", str(state)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    pids = []
    try:
        _wait_for(lambda: state.exists() and state.stat().st_size, 180, "the state file", p)
        doc = json.loads(state.read_text())
        pids = [n["pid"] for n in doc["nodes"]]
        assert doc["pid"] == p.pid and [n["role"] for n in doc["nodes"]] == ["entry", "stage", "standby"], doc
        r = subprocess.run(
            [sys.executable, "-m", "p2pk3.cli", "local", "--nodes", "2", "--state", str(state)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert r.returncode == 2 and "running ring" in r.stderr, r.stderr
        victim = [n for n in doc["nodes"] if n["role"] == "stage" and n["started_on"] == n["slot"]][0]
        os.kill(victim["pid"], signal.SIGKILL)
        text = lambda: (tmp_path / "local.out").read_text()  # noqa: E731
        _wait_for(lambda: "recovered:" in text(), 90, "the recovery line", p)
        assert f"node down: slot {victim['slot']} (pid {victim['pid']}) is dead" in text(), text()
        assert f"taken over: standby s2 (pid {pids[2]}) serves slot {victim['slot']} now" in text(), text()
        workdir = Path(doc["topology"]).parent
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not state.exists(), "the state file outlived its ring"
    assert not workdir.exists() or not (workdir / "secret").exists()


def test_ctrl_c_while_local_starts_leaves_no_folder_with_the_secret(tmp_path):
    env = dict(ENV, TMPDIR=str(tmp_path))
    p = subprocess.Popen(
        [sys.executable, "-m", "p2pk3.cli", "local", "--nodes", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    try:
        assert p.stdout.readline().startswith("starting 2 daemons")
        _wait_for(lambda: list(tmp_path.glob("p2pk3-local-*/node-*.log")), 60, "the daemons' logs", p)
        p.send_signal(signal.SIGINT)  # the ring is not up yet
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    left = _processes_mentioning(str(tmp_path))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "daemons outlived `p2pk3 local` stopped while starting"
    assert not list(tmp_path.glob("p2pk3-local-*")), list(tmp_path.rglob("*"))


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (Linux /proc)."""
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                out.append(int(d.name))
        except OSError:
            continue
    return out


# ------------------------------------------------------------------------------ 22: each phrase once
def test_connection_errors_say_each_phrase_once():
    from p2pk3.node.client import why
    from p2pk3.transport.connection import AuthenticationError, ConnectionClosed

    lost = ConnectionClosed("connection lost: [Errno 104] Connection reset by peer")
    assert why(lost) == "[Errno 104] Connection reset by peer"
    assert why(ConnectionRefusedError(111, "Connection refused")).startswith("connection refused")
    auth = AuthenticationError(
        "node 's0' at 127.0.0.1:5 refused the connection: authentication failed: wrong cluster secret [auth_failed]"
    )
    assert why(auth) == (
        "refused the handshake: authentication failed: wrong cluster secret (is the topology's secret_file the ring's?)"
    )

    import asyncio

    from p2pk3.node.monitor import Monitor
    from p2pk3.transport.server import serve

    async def go():  # the failure detector's reason when a peer resets its heartbeat connection
        async def reset(conn):
            await conn.recv()
            conn.close("reset", abort=True)

        srv = await serve("127.0.0.1", 0, b"s" * 32, "s1", reset)
        m = Monitor(b"s" * 32, "s0", lambda: ["s1"], lambda slot: ("127.0.0.1", srv.port), heartbeat_s=0.05)
        m.start()
        try:
            for _ in range(200):
                ps = m.state("s1")
                if ps is not None and ps.state == "down" and ps.reason != "not probed yet":
                    return ps.reason
                await asyncio.sleep(0.02)
        finally:
            m.stop()
            srv.close()
        raise AssertionError(f"no down state: {m.state('s1')}")

    reason = asyncio.run(go())
    assert reason.startswith("closed by the peer (node 's1' at 127.0.0.1:"), reason  # not "connection lost: closed ..."
