"""The commands as a user runs them: one clear line and a non-zero exit for every ordinary mistake, no
traceback (without --verbose), and the flags meaning the same everywhere. Most cases run in-process with
click's runner (the same `main` the `p2pk3` script calls); the ones that need a real process (signals,
the working directory, a daemon) run `python -m p2pk3.cli` as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from p2pk3.cli import main
from p2pk3.engine.reference import default_model_dir

MODEL = default_model_dir()
LAYERS = json.loads((MODEL / "config.json").read_text())["text_config"]["num_hidden_layers"]


def cli(*args, input=None):
    r = CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"p2pk3 {' '.join(map(str, args))} raised {r.exception!r}:\n{r.output}")
    return r


def refused(*args, match: str, code: int | None = None):
    r = cli(*args)
    assert r.exit_code != 0, r.output
    if code is not None:
        assert r.exit_code == code, (r.exit_code, r.output)
    assert "Traceback" not in r.output, r.output
    assert match in r.output, r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) <= 3, r.output  # usage line + hint + the error at most
    return r.output


# ------------------------------------------------------------------------------ option validation
@pytest.mark.parametrize(
    "args,match",
    [
        (["generate", "--prompt", "hi", "--max-tokens", "-1"], "--max-tokens"),
        (["generate", "--prompt", "hi", "--temperature", "-0.5"], "--temperature"),
        (["generate", "--prompt", "hi", "--temperature", "100"], "0<=x<=2"),  # the API's range
        (["local", "--prompt", "hi", "--temperature", "2.5"], "0<=x<=2"),
        (["generate", "--prompt", "hi", "--top-k", "-2"], "--top-k"),
        (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p"),
        (["generate", "--prompt", "hi", "--top-p", "1.5"], "--top-p"),
        (["generate", "--prompt", "", "--raw"], "the prompt is empty"),
        (["generate", "--prompt", "   "], "the prompt is empty"),
        (["generate", "--prompt", "hi", "--model", "/nonexistent/model"], "no such directory"),
        (["local", "--nodes", "0"], "--nodes"),
        (["local", "--nodes", str(LAYERS + 1)], f"the model has only {LAYERS} layers"),
        (["score", "--tokens", "1,2,3", "--stages", "20"], f"the model has only {LAYERS} layers"),
        (["score", "--tokens", "1,2,3", "--stages", "0"], "--stages"),
        (["score", "--tokens", "1,x"], "comma-separated integers"),
        (["score", "--tokens", "1,2,99999999"], "outside the vocabulary"),
        (["score", "--tokens", "1,2,3", "--dump-logits", "/nonexistent/dir/l.npy"], "does not exist"),
        (["score", "--tokens", "1,2,3", "--device", "cuda"], "CUDA is not available"),
        (["bench", "reference", "--batch", "0"], "--batch"),
        (["bench", "reference", "--steps", "0"], "--steps"),
        (["bench", "reference", "--prompt-len", "0"], "--prompt-len"),
        (["bench", "reference", "--model", "/nonexistent"], "no such directory"),
        (["topology", "init", "--nodes", "2", "--base-port", "70000"], "--base-port"),
        (["topology", "init", "--nodes", "2", "--base-port", "65535"], "65536"),
        (["topology", "init", "--nodes", str(LAYERS + 3)], "--split experts"),
        (["topology", "init", "--nodes", "2", "--out", "/nonexistent/dir/t.toml"], "does not exist"),
    ],
)
def test_usage_errors_are_one_line(args, match):
    refused(*args, match=match)


def test_max_tokens_zero_means_zero_tokens_in_process():
    r = cli("generate", "--prompt", "hi", "--max-tokens", "0")
    assert r.exit_code == 0 and r.output.strip() == "", r.output


# ------------------------------------------------------------------------------------- topologies
def test_topology_init_defaults_and_secret_next_to_it(tmp_path):
    out = tmp_path / "sub" / "t.toml"
    out.parent.mkdir()
    r = cli("topology", "init", "--nodes", "3", "--out", out)
    assert r.exit_code == 0, r.output
    from p2pk3.topology import DEFAULT_BASE_PORT, Topology

    t = Topology.load(out)
    assert [s.port for s in t.slots] == [DEFAULT_BASE_PORT + i for i in range(3)]
    assert t.cluster.beacon_addrs == ["127.0.0.1"]  # loopback hosts: loopback beacons, not broadcast
    assert Path(t.resolve(t.model.path)) == MODEL.resolve()  # default model: the embedded one
    secret = out.parent / "cluster.key"
    assert secret.exists() and oct(secret.stat().st_mode & 0o777) == "0o600"
    assert t.secret() == secret.read_bytes().strip()  # the node finds it where it was written
    assert str(secret) in r.output


def _bad_topology(tmp_path, **slot1):
    from p2pk3.topology import Topology

    t = Topology.load(Path(__file__).resolve().parents[1] / "topology" / "embedded-4.toml")
    d = t.to_dict()
    d["model"]["path"] = str(MODEL)
    d["cluster"]["secret_file"] = str(tmp_path / "secret")
    d["slots"][1].update(slot1)
    (tmp_path / "secret").write_text("x" * 64)
    import tomli_w

    p = tmp_path / "bad.toml"
    p.write_text(tomli_w.dumps(d))
    return p


@pytest.mark.parametrize(
    "change,match",
    [
        ({"layers": [2, 5]}, "overlap"),
        ({"layers": [5, 7]}, "layer 4 is not assigned to any slot"),
        ({"layers": [3, 50]}, "50"),
        ({"port": 47920}, "both use 127.0.0.1:47920"),
    ],
)
def test_node_with_a_broken_topology_says_what_is_wrong(tmp_path, change, match):
    p = _bad_topology(tmp_path, **change)
    out = refused("node", "--topology", p, "--slot", "s0", match=match)
    assert "TopologyError" not in out


def test_secret_file_that_is_a_folder(tmp_path):
    p = _bad_topology(tmp_path)
    text = p.read_text().replace(str(tmp_path / "secret"), str(tmp_path))
    p.write_text(text)
    refused("node", "--topology", p, "--slot", "s0", match="is a folder")


def test_unknown_slot_and_secret_command(tmp_path):
    p = _bad_topology(tmp_path)
    refused("node", "--topology", p, "--slot", "nope", match="unknown slot 'nope'")
    s = tmp_path / "k"
    assert cli("secret", "--out", s).exit_code == 0
    assert len(s.read_text().strip()) == 64 and oct(s.stat().st_mode & 0o777) == "0o600"
    refused("secret", "--out", s, match="exists")
    assert len(cli("secret").output.strip()) == 64


# ---------------------------------------------------------------------------------- real processes
def _run(args, cwd=None, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-m", "p2pk3.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        **kw,
    )


@pytest.mark.slow
def test_generate_through_a_ring_equals_in_process_with_every_flag():
    """--nodes must not drop --raw / --top-k / --top-p / --temperature / --seed: one code path."""
    flags = [
        "--prompt",
        "The with statement",
        "--raw",
        "--max-tokens",
        "12",
        "--temperature",
        "1.3",
        "--top-k",
        "1",
        "--top-p",
        "0.9",
        "--seed",
        "7",
    ]
    local = cli("generate", *flags)
    assert local.exit_code == 0, local.output
    ring = _run(["generate", *flags, "--nodes", "2"])
    assert ring.returncode == 0, ring.stderr[-2000:]
    assert ring.stdout == local.output
    greedy = cli("generate", "--prompt", "The with statement", "--raw", "--max-tokens", "12").output
    assert local.output == greedy  # top-k 1 is greedy whatever the temperature


@pytest.mark.slow
def test_node_with_a_port_in_use_names_slot_and_port(tmp_path):
    import socket

    p = _bad_topology(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 47920))
        s.listen()
        r = _run(["node", "--topology", p, "--slot", "s0", "--no-discovery"], timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "slot s0: port 47920 on 127.0.0.1 is already in use" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_node_with_a_wrong_secret_exits_instead_of_pretending(tmp_path, ckpt):
    from p2pk3.node.local import LocalRing

    with LocalRing(ckpt, 2) as ring:
        (tmp_path / "wrong").write_text("w" * 64)
        text = ring.topology.read_text().replace('secret_file = "secret"', f'secret_file = "{tmp_path / "wrong"}"')
        bad = tmp_path / "t.toml"
        bad.write_text(text)
        r = _run(["node", "--topology", bad, "--slot", "s1", "--no-discovery", "--port", "0"])
    assert r.returncode == 1, r.stderr[-3000:]
    assert "refused this node's proof: the cluster secret" in r.stderr, r.stderr[-2000:]
    assert "took slot" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_local_owns_its_daemons_on_sigterm_and_cannot_be_shadowed(tmp_path):
    """SIGTERM ends every daemon of `p2pk3 local` and removes its folder; started from a folder that
    holds a directory named p2pk3 (as the parent of a clone does) the daemons still import the package."""
    (tmp_path / "p2pk3").mkdir()
    (tmp_path / "p2pk3" / "__init__.py").write_text("raise ImportError('shadowed!')\n")
    state = tmp_path / "ring.json"
    p = subprocess.Popen(
        [sys.executable, "-P", "-m", "p2pk3.cli", "local", "--nodes", "2", "--state", str(state)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not state.exists() and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert state.exists(), p.stdout.read() if p.poll() is not None else "no state file"
        doc = json.loads(state.read_text())
        pids = [n["pid"] for n in doc["nodes"]]
        assert [n["role"] for n in doc["nodes"]] == ["entry", "stage"] and doc["entry"]
        workdir = Path(doc["topology"]).parent
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
    for pid in pids:
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"daemon {pid} outlived `p2pk3 local`")
    assert not workdir.exists()


@pytest.mark.slow
def test_readme_main_command_opens_the_chat_on_a_terminal_and_scripts_without_one():
    """`p2pk3 local --nodes 4 --chat`: on a terminal the REPL (a question, a streamed answer, /quit);
    without one, a single scripted exchange with the ring's statistics."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "p2pk3.cli", "local", "--nodes", "2", "--chat"],
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 160),
    )
    try:
        child.expect("on the ring: /help for commands, /quit or Ctrl-D to leave")
        child.expect(r"> ")
        child.sendline("What does the with statement do?")
        child.expect(r"tok/s")  # the answer's footer
        child.expect(r"> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    r = _run(["local", "--nodes", "2", "--chat"], stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "> What does the with statement do?" in r.stdout and "[ring of 2 nodes:" in r.stdout
