"""`p2pk3 systemd`: the units pass `systemd-analyze verify`, and the node unit's ExecStart (with %i and the
slot's env file substituted) really starts a node that stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from p2pk3.checkpoint.tiny import write_checkpoint
from p2pk3.cli import main
from p2pk3.deploy.systemd import BACKOFF_SYSTEMD, local_systemd_version
from p2pk3.model.config import TINY_K3
from p2pk3.node.local import free_ports


@pytest.fixture
def rack(tmp_path):
    model = write_checkpoint(tmp_path / "model", TINY_K3, seed=0, shards=2)
    port, spare_port, bport = free_ports(3)
    (tmp_path / "secret").write_text("q" * 32)
    t = tmp_path / "topo.toml"
    t.write_text(
        f'[cluster]\nname = "rack"\nsecret_file = "secret"\nbeacon_port = {bport}\n'
        f'beacon_addrs = ["127.255.255.255"]\n[model]\npath = "{model}"\n'
        f'[[slots]]\nid = "s0"\nhost = "127.0.0.1"\nport = {port}\ngpu_memory_gb = 2\nlayers = [0, 5]\n'
        f'[[slots]]\nid = "spare"\nhost = "127.0.0.1"\nport = {spare_port}\ngpu_memory_gb = 2\nstandby = true\n'
    )
    out = tmp_path / "units"
    r = CliRunner().invoke(main, ["systemd", "--topology", str(t), "--out", str(out), "--user", "root"])
    assert r.exit_code == 0, r.output
    return t, out, r.output


def test_files_and_commands(rack):
    t, out, text = rack
    node = (out / "p2pk3-node@.service").read_text()
    for line in [
        "EnvironmentFile=/etc/p2pk3/%i.env",
        "Restart=on-failure",
        "RestartSec=5s",
        "After=network-online.target",
        "Wants=network-online.target",
        "LimitMEMLOCK=infinity",
        "LimitNOFILE=1048576",
        "TimeoutStopSec=60s",
        "StandardOutput=journal",
        "User=root",
    ]:
        assert line in node.splitlines()
    v = local_systemd_version()
    assert ("RestartSteps=8" in node.splitlines()) == ((v or BACKOFF_SYSTEMD) >= BACKOFF_SYSTEMD)
    assert f"--topology {t.resolve()}" in node and "--slot %i --rejoin-as-standby $P2PK3_NODE_ARGS" in node
    assert "p2pk3 serve --topology" in (out / "p2pk3-api.service").read_text().replace(".cli serve", " serve")
    assert "P2PK3_NODE_ARGS=--standby" in (out / "env" / "spare.env").read_text()
    assert "sudo systemctl enable --now p2pk3-node@s0.service p2pk3-node@spare.service" in text
    assert f"sudo install -m 0644 {out.resolve()}/p2pk3-node@.service" in text
    r = CliRunner().invoke(main, ["systemd", "--topology", str(t), "--slot", "nope", "--out", str(out)])
    assert r.exit_code == 2 and "unknown slot 'nope'" in r.output


def _analyze() -> str | None:
    exe = shutil.which("systemd-analyze")
    if exe is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "systemd"], capture_output=True, timeout=180)
        exe = shutil.which("systemd-analyze")
    return exe


def test_systemd_analyze_verify(rack, tmp_path):
    exe = _analyze()
    if exe is None:
        pytest.skip("systemd-analyze is not installed")
    _, out, _ = rack
    inst = tmp_path / "verify"
    inst.mkdir()
    shutil.copy(out / "p2pk3-node@.service", inst / "p2pk3-node@s0.service")  # an instance of the template
    shutil.copy(out / "p2pk3-api.service", inst / "p2pk3-api.service")
    for unit in [out / "p2pk3-node@.service", inst / "p2pk3-node@s0.service", inst / "p2pk3-api.service"]:
        r = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "Unknown key" not in r.stderr and "Invalid" not in r.stderr, r.stderr


def _exec_start(unit: str, slot: str, env: dict[str, str]) -> list[str]:
    line = next(l for l in unit.splitlines() if l.startswith("ExecStart="))[len("ExecStart=") :]
    line = line.replace("%i", slot)
    line = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), line)  # systemd: $VAR splits into words
    return shlex.split(line)


def _env_file(p: Path) -> dict[str, str]:
    return dict(l.split("=", 1) for l in p.read_text().splitlines() if l and not l.startswith("#"))


@pytest.mark.slow
def test_the_node_units_exec_start_runs_and_stops_on_sigterm(rack, tmp_path):
    t, out, _ = rack
    env = _env_file(out / "env" / "s0.env")
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    cmd = _exec_start((out / "p2pk3-node@.service").read_text(), "s0", env)
    assert Path(cmd[0]).is_absolute()
    log = tmp_path / "node.log"
    with open(log, "w") as f:
        p = subprocess.Popen(
            cmd + ["--device", "cpu"],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, "CUDA_VISIBLE_DEVICES": ""},
        )
    try:
        deadline = time.monotonic() + 90
        while "slot s0 up on" not in log.read_text():
            assert p.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "node did not come up: " + log.read_text()[-2000:]
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0, log.read_text()[-2000:]
        assert "stopped (signal)" in log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    api = _exec_start((out / "p2pk3-api.service").read_text(), "", _env_file(out / "env" / "api.env"))
    r = subprocess.run(api + ["--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "OpenAI" in r.stdout


@pytest.mark.slow
def test_a_restarted_node_whose_slot_was_taken_over_rejoins_as_a_spare_instead_of_failing(rack, tmp_path):
    """What systemd does after a takeover: the spare's unit took s0 over while s0's node was dead; s0's unit
    restarts it with the same ExecStart. Its claim is refused (a live holder), and with the unit's
    --rejoin-as-standby it joins the spare pool and stays up (no restart loop every RestartSec)."""
    t, out, _ = rack
    unit = (out / "p2pk3-node@.service").read_text()
    procs = {}

    def start(slot):
        env = _env_file(out / "env" / f"{slot}.env")
        log = tmp_path / f"{slot}-{len(procs)}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(
                _exec_start(unit, slot, env) + ["--device", "cpu"],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, "CUDA_VISIBLE_DEVICES": ""},
            )
        procs[log] = p
        return p, log

    def wait_for(log, text, p, timeout=120):
        deadline = time.monotonic() + timeout
        while text not in log.read_text():
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {text!r} in: " + log.read_text()[-3000:]
            time.sleep(0.2)

    try:
        s0, s0_log = start("s0")
        wait_for(s0_log, "slot s0 up on", s0)
        spare, spare_log = start("spare")
        wait_for(spare_log, "slot spare up on", spare)
        time.sleep(3)  # the spare hears the entry before it dies (it takes over a slot that was up)
        s0.kill()
        s0.wait(10)
        wait_for(spare_log, "took over slot s0", spare)
        again, again_log = start("s0")  # systemd restarts the unit
        wait_for(again_log, "joining the spare pool instead", again)
        wait_for(again_log, "spare pool up on", again)
        wait_for(again_log, "joined the spare pool of entry", again)
        time.sleep(2)
        assert again.poll() is None  # it stays up: no claim retried every RestartSec
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=30) == 0, again_log.read_text()[-2000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
