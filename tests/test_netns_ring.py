"""4 daemons on 4 separate network hosts (namespaces on a private bridge, made by the test): the ring
forms by UDP beacons alone (topology without addresses), or — with every beacon dropped by the discovery's
fault hook — from the static addresses of the topology. Generation through it equals one process."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest

from p2pk3.engine.reference import Pipeline
from p2pk3.engine.sampling import SamplingParams
from p2pk3.model.config import TINY_K3
from p2pk3.topology import even_split

from netns import NetnsLab, require_netns  # tests/ is on sys.path (pytest rootdir-relative import)

pytestmark = pytest.mark.slow  # rings of processes across network namespaces

PROMPTS = [[5, 17, 300, 42, 42, 7], [99, 123, 4], [250, 260, 270, 280, 14, 15, 16, 8, 9]]
PORT = 7411

CLIENT = r"""
import asyncio, json, sys
from p2pk3.node.client import Client
from p2pk3.engine.sampling import SamplingParams
host, port, secret, prompts = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), json.loads(sys.argv[4])
async def main():
    for attempt in range(120):  # the ring may still be forming
        try:
            c = await Client.connect(host, port, secret)
            break
        except OSError:
            await asyncio.sleep(0.5)
    outs = []
    for p in prompts:
        outs.append((await c.generate(p, SamplingParams(max_tokens=6))).tokens)
    c.close()
    print(json.dumps(outs))
asyncio.run(asyncio.wait_for(main(), 240))
"""


def _ring(tmp_path, ckpt, lab, static: bool):
    topo = even_split(TINY_K3, 4, host=None, model_path=str(ckpt), secret_file="secret", name="netns-test")
    topo.cluster.beacon_addrs = [lab.broadcast]
    topo.cluster.beacon_port = 47000 + secrets.randbelow(2000)
    if static:
        for i, s in enumerate(topo.slots):
            s.host, s.port = lab.addr(i), PORT
    secret = secrets.token_hex(32)
    (tmp_path / "secret").write_text(secret)
    (tmp_path / "topology.toml").write_text(topo.dump())
    procs = []
    for i, s in enumerate(topo.active):
        argv = [
            sys.executable,
            "-m",
            "p2pk3.cli",
            "node",
            "--topology",
            str(tmp_path / "topology.toml"),
            "--slot",
            s.id,
            "--host",
            lab.addr(i),
            "--port",
            str(PORT),
            "--discovery",
        ]
        if static:
            argv.append("--drop-beacons")
        log = open(tmp_path / f"node{i}.log", "w")
        procs.append(lab.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1"}))
    return procs, secret


@pytest.mark.parametrize("static", [False, True], ids=["beacons-only", "beacons-blocked-static"])
def test_four_hosts_form_the_ring(tmp_path, ckpt, static):
    require_netns()
    want = Pipeline.load(ckpt, 1, max_sessions=4, max_tokens=512).generate(PROMPTS, SamplingParams(max_tokens=6))
    with NetnsLab(4) as lab:
        procs, secret = _ring(tmp_path, ckpt, lab, static)
        try:
            r = lab.run(
                3,
                [sys.executable, "-c", CLIENT, lab.addr(0), str(PORT), secret.encode().hex(), json.dumps(PROMPTS)],
                timeout=300,
            )
            logs = "\n".join((tmp_path / f"node{i}.log").read_text()[-1500:] for i in range(4))
            assert r.returncode == 0, r.stderr[-2000:] + logs
            assert json.loads(r.stdout.strip().splitlines()[-1]) == want
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        logs = [(tmp_path / f"node{i}.log").read_text() for i in range(4)]
        if static:
            assert not any("discovered node" in t for t in logs), "beacons were supposed to be blocked"
        else:
            assert all("discovered node" in t for t in logs)
            assert all("claimed slot" in t for t in logs)


RESUMING_CLIENT = r"""
import asyncio, json, sys
from p2pk3.node.client import Client
from p2pk3.params import SamplingParams
from p2pk3.topology import Topology
topo, prompts, n = Topology.load(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
async def main():
    for attempt in range(240):  # the ring may still be forming
        try:
            c0 = await Client.for_topology(topo, timeout=1.0)
            c0.close()
            break
        except Exception:
            await asyncio.sleep(0.5)
    first = asyncio.Event()
    async def one(p):
        c = await Client.for_topology(topo)
        try:
            return (await c.generate(p, SamplingParams(max_tokens=n), on_token=lambda t: first.set())).tokens
        finally:
            c.close()
    tasks = [asyncio.create_task(one(p)) for p in prompts]
    await first.wait()
    print("STREAMING", flush=True)
    print(json.dumps(await asyncio.gather(*tasks)), flush=True)
asyncio.run(asyncio.wait_for(main(), 240))
"""


def test_link_down_on_a_netns_host_is_taken_over(tmp_path, ckpt):
    """4 hosts + a standby host on a bridge; a middle host's cable is pulled mid-generation (no RST: only
    the heartbeat notices); the standby takes its slot over and every session ends with the tokens of an
    undisturbed run."""
    require_netns()
    n = 40
    want = Pipeline.load(ckpt, 1, max_sessions=4, max_tokens=512).generate(PROMPTS, SamplingParams(max_tokens=n))
    with NetnsLab(6) as lab:  # 0-3 ring, 4 standby, 5 the client
        topo = even_split(
            TINY_K3, 4, host=None, model_path=str(ckpt), secret_file="secret", name="netns-fail", n_standby=1
        )
        for i, s in enumerate(topo.slots):
            s.host, s.port = lab.addr(i), PORT
        (tmp_path / "secret").write_text(secrets.token_hex(32))
        (tmp_path / "topology.toml").write_text(topo.dump())
        procs = []
        try:
            for i, s in enumerate(topo.slots):
                argv = [
                    sys.executable,
                    "-m",
                    "p2pk3.cli",
                    "node",
                    "--topology",
                    str(tmp_path / "topology.toml"),
                    "--slot",
                    s.id,
                    "--host",
                    lab.addr(i),
                    "--port",
                    str(PORT),
                    "--no-discovery",
                ]
                log = open(tmp_path / f"node{i}.log", "w")
                procs.append(lab.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1"}))
            client = lab.popen(
                5, [sys.executable, "-c", RESUMING_CLIENT, str(tmp_path / "topology.toml"), json.dumps(PROMPTS), str(n)]
            )
            line = client.stdout.readline()
            assert line.strip() == "STREAMING", line + client.stderr.read()[-2000:]
            lab.set_link(2, False)
            out, err = client.communicate(timeout=240)
            logs = "\n".join((tmp_path / f"node{i}.log").read_text()[-1500:] for i in range(5))
            assert client.returncode == 0, err[-2000:] + logs
            assert json.loads(out.strip().splitlines()[-1]) == want
            entry_log = (tmp_path / "node0.log").read_text()
            assert "slot s2 is dead (no answer for" in entry_log, entry_log[-2000:]
            assert "slot s2 now served by s4@" in entry_log, entry_log[-2000:]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
