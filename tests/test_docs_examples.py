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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("jq") is None or shutil.which("curl") is None,
                    reason="the README's examples use jq and curl (apt-get install jq curl)")
def test_talk_to_a_running_ring_section_as_written(tmp_path):
    section = README.split("## Talk to a running ring", 1)[1].split("\n## ", 1)[0]
    port = str(18000 + int(time.time()) % 1000)
    state = str(tmp_path / "ring.json")
    sub = lambda c: c.replace("/tmp/ring.json", state).replace("127.0.0.1:8000", f"127.0.0.1:{port}")  # noqa: E731
    start = sub(_blocks(section)[0].strip())
    assert start.endswith("&")
    ring = subprocess.Popen(["bash", "-c", start[:-1].strip()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if Path(state).exists() and json.loads(Path(state).read_text()).get("api"):
                break
            assert ring.poll() is None, ring.stdout.read()
            time.sleep(0.5)
        doc = json.loads(Path(state).read_text())
        assert [n["role"] for n in doc["nodes"]] == ["entry", "stage", "stage", "stage", "standby"], doc
        curl = textwrap.dedent(sub(_blocks(section)[1])).strip()
        r = _sh(curl)
        assert r.returncode == 0 and json.loads(r.stdout)["choices"][0]["message"]["content"], r.stdout + r.stderr
        client = textwrap.dedent(sub(_blocks(section)[2]))
        r = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
        chat = re.search(r'`(echo "What is a tuple\?" \| p2pk3 chat --topology \.\.\.)`', section).group(1)
        chat = chat.replace("--topology ...", f'--topology "$(jq -r .topology {state})"')
        r = _sh(chat)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
        dash = re.search(r'`(p2pk3 dashboard --topology "\$\(jq -r \.topology /tmp/ring\.json\)")`', section).group(1)
        r = _sh(sub(dash) + " --once --json")
        assert r.returncode == 0, r.stderr[-2000:]
        kill = sub(re.search(r"`(kill -9 \$\(jq '\.nodes\[1\]\.pid' /tmp/ring\.json\))`", section).group(1))
        victim = doc["nodes"][1]["slot"]
        assert _sh(kill).returncode == 0
        deadline = time.time() + 60
        while time.time() < deadline:
            nodes = json.loads(_sh(sub("jq .nodes /tmp/ring.json")).stdout)
            holder = [n for n in nodes if n["slot"] == victim and n["role"] == "stage"]
            if holder and holder[0]["started_on"] != victim:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the spare never took slot {victim} over: {nodes}")
        r = _sh(curl)  # the ring still answers, through the repaired ring
        assert r.returncode == 0 and json.loads(r.stdout)["choices"][0]["message"]["content"], r.stdout + r.stderr
    finally:
        ring.terminate()
        try:
            ring.wait(60)
        except subprocess.TimeoutExpired:
            ring.kill()
