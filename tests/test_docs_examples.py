"""The README's commands, run as a user types them (bash, with only the port and the state file's path
substituted so the test does not collide with a real ring). Every command the README names has a
working --help; the two set-up commands are the ones .ci/run and the main-command test run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def test_the_two_set_up_commands():
    setup = README.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    cmds = [b.strip() for b in _blocks(setup)]
    assert len(cmds) == 2, cmds
    main_cmd, test_cmd = cmds
    assert main_cmd == "pip install torch==2.13.0 -e . && p2pk3 local --nodes 4 --chat"  # run by test_cli.py
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_every_command_named_in_the_readme_has_help():
    names = README.split("Commands (`p2pk3 COMMAND --help` for each):", 1)[1].split("Errors are", 1)[0]
    cmds = [c.strip("` .,\n") for c in re.findall(r"`[^`]+`", names)]
    assert len(cmds) >= 12, cmds
    for c in cmds:
        words = c.split()
        for w in words[-1].split("|") if "|" in words[-1] else [None]:
            argv = words[:-1] + [w] if w else words
            r = subprocess.run(
                [sys.executable, "-m", "p2pk3.cli", *argv, "--help"], capture_output=True, text=True, timeout=120
            )
            assert r.returncode == 0, (argv, r.stderr[-1500:])
            assert "Usage:" in r.stdout


def _sh(cmd: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout, **kw)


def _code(section: str, pattern: str) -> str:
    """The inline command of the section that matches `pattern` (a regex of the text between backticks)."""
    return re.search(r"`(" + pattern + r")`", section).group(1)


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("jq") is None or shutil.which("curl") is None,
    reason="the README's examples use jq and curl (apt-get install jq curl)",
)
def test_talk_to_a_running_ring_section_as_written(tmp_path):
    """Every command of the section in the order a user runs them: start and wait, chat, curl, the
    client, the dashboard's one JSON document, a kill survived (said in the ring's log), the stop."""
    section = README.split("## Talk to a running ring", 1)[1].split("\n## ", 1)[0]
    port = str(18000 + int(time.time()) % 1000)
    state, log = str(tmp_path / "ring.json"), str(tmp_path / "ring.log")

    def sub(c):
        return (
            c.replace("/tmp/ring.json", state)
            .replace("/tmp/ring.log", log)
            .replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        )

    start = sub(_blocks(section)[0].strip())
    assert start.splitlines()[0].endswith("&") and "until" in start
    r = _sh(start, timeout=300)  # returns once the ring is up (the ring runs on in the background)
    try:
        assert r.returncode == 0, r.stderr + Path(log).read_text()[-3000:]
        doc = json.loads(Path(state).read_text())
        assert "ring up" in Path(log).read_text()
        assert [n["role"] for n in doc["nodes"]] == ["entry", "stage", "stage", "stage", "standby"], doc
        curl = textwrap.dedent(sub(_blocks(section)[1])).strip()
        deadline = time.time() + 60  # the API starts just after the state file is written
        while time.time() < deadline and not json.loads(Path(state).read_text()).get("api"):
            time.sleep(0.5)
        r = _sh(curl)
        assert r.returncode == 0 and json.loads(r.stdout)["choices"][0]["message"]["content"], r.stdout + r.stderr
        client = textwrap.dedent(sub(_blocks(section)[2]))
        r = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
        anthropic_client = textwrap.dedent(sub(_blocks(section)[3]))  # the Messages API, Anthropic's client
        r = subprocess.run([sys.executable, "-c", anthropic_client], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
        r = _sh(sub(_code(section, r'echo "What is a tuple\?" \| p2pk3 chat --state /tmp/ring\.json')))
        assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
        r = _sh(sub(_code(section, r"p2pk3 dashboard --state /tmp/ring\.json --json")), timeout=60)  # ends
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stderr[-2000:]
        assert json.loads(r.stdout)["totals"]["up"] == 5
        kill = sub(_code(section, r"kill -9 \$\(jq [^`]+\)"))
        victim = [n for n in doc["nodes"] if n["role"] == "stage" and n["started_on"] == n["slot"]][0]
        assert _sh(kill).returncode == 0
        deadline = time.time() + 90
        while time.time() < deadline and "recovered:" not in Path(log).read_text():
            time.sleep(0.5)
        text = Path(log).read_text()
        assert f"node down: slot {victim['slot']}" in text and "taken over: standby" in text, text[-3000:]
        nodes = json.loads(_sh(sub(_code(section, r"jq \.nodes /tmp/ring\.json"))).stdout)
        holder = [n for n in nodes if n["slot"] == victim["slot"] and n["role"] == "stage"]
        assert holder and holder[0]["started_on"] != victim["slot"], nodes
        r = _sh(curl)  # the ring still answers, through the repaired ring
        assert r.returncode == 0 and json.loads(r.stdout)["choices"][0]["message"]["content"], r.stdout + r.stderr
        stop = sub(_code(section, r"kill \$\(jq \.pid /tmp/ring\.json\)"))
        assert _sh(stop).returncode == 0
        deadline = time.time() + 60
        while time.time() < deadline and Path(state).exists():
            time.sleep(0.5)
        assert not Path(state).exists(), "the state file outlived the ring"
    finally:
        if Path(state).exists():  # a failed test must not leave the ring running
            doc = json.loads(Path(state).read_text())
            for pid in [doc["pid"], *(n["pid"] for n in doc["nodes"])]:
                subprocess.run(["kill", "-9", str(pid)], capture_output=True)


# ------------------------------------------------------------------------- docs/deploy.md
DEPLOY = (ROOT / "docs" / "deploy.md").read_text()


def _deploy_commands() -> list[str]:
    """The shell commands of docs/deploy.md in order (not the TOML, nor the sudo/journalctl lines that
    `p2pk3 systemd` prints as an example)."""
    out = []
    for lang, block in re.findall(r"```([a-z]*)\n(.*?)```", DEPLOY, flags=re.S):
        if lang == "toml":
            continue
        out += [
            ln.strip() for ln in block.splitlines() if ln.strip() and not ln.startswith(("sudo ", "#", "journalctl"))
        ]
    return out


def test_the_readme_deploy_section_has_the_deploy_docs_steps_and_commands():
    section = README.split("## Deploy on a rack", 1)[1].split("\n## ", 1)[0]
    readme = [c for c in re.findall(r"`([^`]+)`", section) if c.split()[0] in ("p2pk3", "pip", "scp")]
    doc = _deploy_commands()
    assert doc == [c for c in readme if c in doc], (doc, readme)  # every command of the doc, in the same order
    assert all(
        c in doc or c.split()[:2] in (["p2pk3", "topology"], ["p2pk3", "secret"], ["p2pk3", "serve"]) for c in readme
    ), readme  # the README's others are the alternatives the doc names in prose
    for alt in ("p2pk3 topology init", "p2pk3 secret --out /etc/p2pk3/cluster.key"):
        assert alt in DEPLOY and alt in section
    titles = re.findall(r"^## \d\. (.+)$", DEPLOY, flags=re.M)
    steps = re.findall(r"^\d\. \*\*(\w+)\*\*", section, flags=re.M)
    assert [t.split()[0].rstrip(":") for t in titles] == steps, (titles, steps)
    assert "cluster.key" in DEPLOY and 'secret"' not in DEPLOY  # one secret file name


@pytest.mark.slow
def test_deploy_doc_commands_run_on_loopback(tmp_path):
    """docs/deploy.md as written, on this host: its NODES.toml with the hosts on loopback (one card each),
    the embedded model's config for K3's, a local stand-in of the hub serving the embedded model as
    moonshotai/Kimi-K3; then the nodes as the systemd unit starts them, the dashboard and a chat."""
    from hub_standin import HubStandIn
    from p2pk3.node.local import free_ports

    model = ROOT / "p2pk3" / "assets" / "k3-docs"
    hub_root = tmp_path / "hub"
    shutil.copytree(model, hub_root, ignore=shutil.ignore_patterns("p2pk3-manifest.json"))
    etc, models = tmp_path / "etc", tmp_path / "models" / "kimi-k3"
    etc.mkdir()
    nodes_toml = re.findall(r"```toml\n(.*?)```", DEPLOY, flags=re.S)[0]
    ports = iter(free_ports(8))
    nodes_toml = re.sub(r'host = "10\.0\.0\.\d+"', 'host = "127.0.0.1"', nodes_toml)
    nodes_toml = re.sub(r"port = 47920", lambda m: f"port = {next(ports)}", nodes_toml).replace(
        "count = 8", "count = 1"
    )
    (etc / "NODES.toml").write_text(nodes_toml)

    def sub(c: str) -> str:
        c = (
            c.replace("/etc/p2pk3", str(etc))
            .replace("/models/kimi-k3", str(models))
            .replace("--model kimi-k3", f"--model {model}")
        )
        if c.startswith("p2pk3 topology check"):  # K3's topology names its preset; the embedded model has none,
            c += f" --model {model}"  # and its config is not in [model] path before the download
        return c

    with HubStandIn(hub_root, repo="moonshotai/Kimi-K3") as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT)}
        ran = []
        for c in _deploy_commands():
            if c.startswith(("pip ", "scp ")) or c.split()[:2] in (["p2pk3", "dashboard"], ["p2pk3", "chat"]):
                continue  # installed already; one host; the ring's commands run once it is up
            r = _sh(sub(c).replace("p2pk3 ", f"{sys.executable} -m p2pk3.cli ", 1), timeout=300, env=env, cwd=tmp_path)
            assert r.returncode == 0, (c, r.stdout[-2000:], r.stderr[-2000:])
            ran.append((c.split()[1], r.stdout + r.stderr))
    assert [w for w, _ in ran] == ["plan", "topology", "download", "systemd"], ran
    from p2pk3.topology import Topology

    topo = Topology.load(etc / "topology.toml")
    assert topo.cluster.secret_file == "cluster.key" and (etc / "cluster.key").is_file()  # plan created it
    assert topo.model.repo == "moonshotai/Kimi-K3" and Path(topo.model.path) == models
    assert (models / "p2pk3-manifest.json").is_file() and len(list(models.glob("*.safetensors"))) == 2
    unit = (tmp_path / "p2pk3-systemd" / "p2pk3-node@.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, flags=re.M).group(1)
    procs = []
    try:
        for s in topo.active:  # as systemd starts them: the unit's command, the slot's env file's extra flags
            cmd = exec_start.replace("%i", s.id).replace("$P2PK3_NODE_ARGS", "--no-discovery")
            procs.append(
                subprocess.Popen(
                    ["bash", "-c", cmd],
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        dash = sub(next(c for c in _deploy_commands() if c.startswith("p2pk3 dashboard")))
        deadline = time.monotonic() + 120
        while True:
            r = _sh(dash.replace("p2pk3 ", f"{sys.executable} -m p2pk3.cli ", 1) + " --json", env=env)
            states = {row["slot"]: row["state"] for row in json.loads(r.stdout)["slots"]} if r.returncode == 0 else {}
            if all(states.get(s.id) == "up" for s in topo.active):  # the doc's dashboard says every slot serves
                break
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                r.stdout[-1500:],
                r.stderr[-1500:],
                [p.stderr.read() for p in procs if p.poll() is not None],
            )
            time.sleep(1)
        chat = sub(next(c for c in _deploy_commands() if c.startswith("p2pk3 chat")))
        r = _sh(
            "echo 'What is a tuple?' | " + chat.replace("p2pk3 ", f"{sys.executable} -m p2pk3.cli ", 1),
            env=env,
            timeout=180,
        )
        assert r.returncode == 0 and r.stdout.strip(), (r.stdout[-1500:], r.stderr[-1500:])
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
