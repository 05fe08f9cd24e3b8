"""The README's commands, run as a user types them (bash, with only the port and the state file's path
substituted so the test does not collide with a real ring). Every command the README names has a
working --help; the two set-up commands are the ones .ci/run and the main-command test run."""
from __future__ import annotations

import json
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


def test_every_command_named_in_the_readme_has_help():
    names = README.split("Commands (`p2pk3 COMMAND --help` for each):", 1)[1].split("Errors are", 1)[0]
    cmds = [c.strip("` .,\n") for c in re.findall(r"`[^`]+`", names)]
    assert len(cmds) >= 12, cmds
    for c in cmds:
        words = c.split()
        for w in words[-1].split("|") if "|" in words[-1] else [None]:
            argv = words[:-1] + [w] if w else words
            r = subprocess.run([sys.executable, "-m", "p2pk3.cli", *argv, "--help"], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, (argv, r.stderr[-1500:])
            assert "Usage:" in r.stdout


def _sh(cmd: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout, **kw)


def _code(section: str, pattern: str) -> str:
    """The inline command of the section that matches `pattern` (a regex of the text between backticks)."""
    return re.search(r"`(" + pattern + r")`", section).group(1)


@pytest.mark.skipif(shutil.which("jq") is None or shutil.which("curl") is None,
                    reason="the README's examples use jq and curl (apt-get install jq curl)")
def test_talk_to_a_running_ring_section_as_written(tmp_path):
    """Every command of the section in the order a user runs them: start and wait, chat, curl, the
    client, the dashboard's one JSON document, a kill survived (said in the ring's log), the stop."""
    section = README.split("## Talk to a running ring", 1)[1].split("\n## ", 1)[0]
    port = str(18000 + int(time.time()) % 1000)
    state, log = str(tmp_path / "ring.json"), str(tmp_path / "ring.log")
    sub = lambda c: (c.replace("/tmp/ring.json", state).replace("/tmp/ring.log", log)  # noqa: E731
                     .replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
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
