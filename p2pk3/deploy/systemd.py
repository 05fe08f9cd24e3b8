"""systemd units for a rack: a template `p2pk3-node@.service` (instance = slot id), `p2pk3-api.service`
(`p2pk3 serve`), one environment file per slot, and the commands that install and enable them.

The node unit restarts on failure with a growing back-off (RestartSec, and RestartSteps /
RestartMaxDelaySec on systemd >= 254), waits for the network (network-online.target), raises the
open-files limit, allows pinned memory (LimitMEMLOCK=infinity), gives a stopping node TimeoutStopSec to
drain its sessions after SIGTERM, and logs to the journal (`journalctl -u p2pk3-node@s0`). A node whose
slot a spare has taken over meanwhile rejoins as a spare when it restarts (`--rejoin-as-standby`), so the
ring is back to full redundancy without anyone editing a unit.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from p2pk3.topology import Topology

NODE_UNIT = "p2pk3-node@.service"
API_UNIT = "p2pk3-api.service"
BACKOFF_SYSTEMD = 254  # first systemd with RestartSteps= / RestartMaxDelaySec=


def _doc() -> str:
    p = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
    return f"Documentation=file://{p}\n" if p.is_file() else ""


def local_systemd_version() -> int | None:
    exe = shutil.which("systemctl") or shutil.which("systemd-analyze")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"systemd (\d+)", out)
    return int(m.group(1)) if m else None


def p2pk3_command() -> list[str]:
    """The absolute command line of `p2pk3` in this installation (the script beside this Python, else -m)."""
    exe = Path(sys.executable)
    script = exe.parent / "p2pk3"
    if script.is_file():
        return [str(script)]
    return [str(exe), "-m", "p2pk3.cli"]


@dataclass
class Units:
    files: dict[str, str]  # relative path under --out -> content
    commands: list[str]  # what to run to install and enable them


def _q(args: list[str]) -> str:
    """Quote for a systemd command line (shell-like quoting is what systemd accepts)."""
    return " ".join(shlex.quote(a) for a in args)


def node_unit(
    topology: Path, *, user: str | None, env_dir: str, systemd_version: int | None, stop_timeout_s: int = 60
) -> str:
    # --rejoin-as-standby: a node restarted after a spare took its slot over joins the spare pool (it stays up)
    # instead of failing its claim, and systemd restarting it, forever
    cmd = _q(p2pk3_command() + ["node", "--topology", str(topology)])
    cmd += " --slot %i --rejoin-as-standby $P2PK3_NODE_ARGS"
    backoff = (
        "RestartSteps=8\nRestartMaxDelaySec=5min\n"
        if (systemd_version or BACKOFF_SYSTEMD) >= BACKOFF_SYSTEMD
        else "# RestartSteps=8 / RestartMaxDelaySec=5min: back-off needs systemd >= 254\n"
    )
    return f"""# p2pk3 node daemon; one instance per topology slot: systemctl enable --now p2pk3-node@SLOT
# Written by `p2pk3 systemd` for {topology}. Settings of the slot: {env_dir}/%i.env
[Unit]
Description=p2pk3 node, slot %i
{_doc()}Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=0

[Service]
Type=simple
{f"User={user}" + chr(10) if user else ""}EnvironmentFile={env_dir}/%i.env
ExecStart={cmd}
Restart=on-failure
RestartSec=5s
{backoff}KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec={stop_timeout_s}s
LimitNOFILE=1048576
LimitMEMLOCK=infinity
StandardOutput=journal
StandardError=journal
SyslogIdentifier=p2pk3-node-%i

[Install]
WantedBy=multi-user.target
"""


def api_unit(topology: Path, *, user: str | None, env_dir: str) -> str:
    cmd = _q(p2pk3_command() + ["serve", "--topology", str(topology)]) + " $P2PK3_API_ARGS"
    return f"""# p2pk3 OpenAI-compatible API in front of the ring (run it on one host, e.g. the entry's)
# Written by `p2pk3 systemd` for {topology}. Settings: {env_dir}/api.env
[Unit]
Description=p2pk3 OpenAI API
{_doc()}Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=0

[Service]
Type=simple
{f"User={user}" + chr(10) if user else ""}EnvironmentFile=-{env_dir}/api.env
ExecStart={cmd}
Restart=on-failure
RestartSec=5s
TimeoutStopSec=30s
LimitNOFILE=65536
StandardOutput=journal
StandardError=journal
SyslogIdentifier=p2pk3-api

[Install]
WantedBy=multi-user.target
"""


def slot_env(topo: Topology, slot, gpu_index: int | None) -> str:
    if slot.standby:
        what = "standby (hot spare)"
    else:
        what = f"layers {slot.layers[0]}-{slot.layers[1]}" if slot.layers else "no layers"
    lines = [
        f"# slot {slot.id} of cluster {topo.cluster.name}: {what}; host {slot.host or '(discovered)'}",
        "# extra `p2pk3 node` flags, e.g. --dtype bfloat16 --max-sessions 16 --advertise-host 10.0.0.5",
        "P2PK3_NODE_ARGS=" + ("--standby" if slot.standby else ""),
    ]
    if gpu_index is not None:
        lines += [
            "# the GPU of this slot on its host (slots of one host get 0, 1, ... in topology order)",
            f"CUDA_VISIBLE_DEVICES={gpu_index}",
        ]
    lines += [
        "# MB/s this node may spend serving checkpoint files to peers (p2pk3 download --from-peers)",
        "P2PK3_SHARE_MBPS=200",
    ]
    return "\n".join(lines) + "\n"


def build(
    topo: Topology,
    topology_path: Path,
    slot_ids: list[str] | None = None,
    *,
    user: str | None = None,
    env_dir: str = "/etc/p2pk3",
    out: Path = Path("p2pk3-systemd"),
    systemd_version: int | None = None,
) -> Units:
    slots = [topo.slot(s) for s in slot_ids] if slot_ids else list(topo.slots)
    gpu_of: dict[str, int] = {}
    per_host: dict[str, int] = {}
    for s in topo.slots:  # GPU index = order of the slot among the slots of its host
        if s.host:
            gpu_of[s.id] = per_host.get(s.host, 0)
            per_host[s.host] = gpu_of[s.id] + 1
    files = {
        NODE_UNIT: node_unit(topology_path, user=user, env_dir=env_dir, systemd_version=systemd_version),
        API_UNIT: api_unit(topology_path, user=user, env_dir=env_dir),
        "env/api.env": "# extra `p2pk3 serve` flags, e.g. --host 0.0.0.0 --port 8000 --api-key-file /etc/p2pk3/api.key\n"
        "P2PK3_API_ARGS=\n",
    }
    for s in slots:
        files[f"env/{s.id}.env"] = slot_env(topo, s, gpu_of.get(s.id))
    o = shlex.quote(str(out.resolve()))
    cmds = [
        f"# on every host: the units, and the topology + secret at {topology_path.parent}",
        f"sudo install -d -m 0755 {shlex.quote(env_dir)}",
        f"sudo install -m 0644 {o}/{NODE_UNIT} {o}/{API_UNIT} /etc/systemd/system/",
        "sudo systemctl daemon-reload",
    ]
    by_host: dict[str, list] = {}
    for s in slots:
        by_host.setdefault(s.host or "(discovered host)", []).append(s)
    for host, ss in by_host.items():
        cmds.append(f"# on {host}:")
        envs = " ".join(f"{o}/env/{s.id}.env" for s in ss)
        cmds.append(f"sudo install -m 0640 {envs} {shlex.quote(env_dir)}/")
        cmds.append("sudo systemctl enable --now " + " ".join(f"p2pk3-node@{s.id}.service" for s in ss))
    cmds += [
        "# on the host that serves the API (e.g. the entry's):",
        f"sudo install -m 0640 {o}/env/api.env {shlex.quote(env_dir)}/",
        f"sudo systemctl enable --now {API_UNIT}",
        "# logs and state:",
        "journalctl -u 'p2pk3-node@*' -f",
        f"systemctl status 'p2pk3-node@*' {API_UNIT}",
    ]
    return Units(files, cmds)


def write(units: Units, out: Path) -> list[Path]:
    written = []
    for rel, text in units.files.items():
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        written.append(p)
    return written
