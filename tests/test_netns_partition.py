"""A partition of a ring of daemons on separate network hosts (namespaces on a private bridge): the entry
and a client on one side, the other stages and the standby on the other (tests/netns.py `split`), then
healed. The entry's side fails its requests with a clear error within the detector's deadline; the
other side's standby takes the entry slot at a higher epoch; after the heal the old entry learns it was
replaced and steps down, and the client is served again by the new one, with the tokens of an
undisturbed run, without restarting anything. The claims log (every node's "claimed slot" lines) never
has two holders of one slot at one epoch."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time

import pytest

from p2pk3.engine.reference import Pipeline
from p2pk3.engine.sampling import SamplingParams
from p2pk3.model.config import TINY_K3
from p2pk3.topology import even_split

from netns import NetnsLab, require_netns  # tests/ is on sys.path (pytest rootdir-relative import)

pytestmark = pytest.mark.slow  # a ring of processes across network namespaces, through a partition

PORT = 7421
PROMPT, LONG, SHORT = [31, 7, 200, 45, 9], 600, 12
PARTITION_S = 25  # detection (3 s) and the standby loading the entry's shards on a loaded host

CLIENT = r"""
import asyncio, json, sys, time
from p2pk3.node.client import Client, RequestError
from p2pk3.params import SamplingParams
from p2pk3.topology import Topology
topo, prompt, long_n, short_n = Topology.load(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = {}
async def line():
    return (await asyncio.to_thread(sys.stdin.readline)).strip()
async def main():
    for attempt in range(240):  # the ring may still be forming
        try:
            c = await Client.for_topology(topo, timeout=1.0)
            await c.generate(prompt, SamplingParams(max_tokens=1))
            break
        except Exception:
            await asyncio.sleep(0.5)
    got, first = [], asyncio.Event()
    def on_token(t):
        got.append(t)
        first.set()
    task = asyncio.create_task(c.generate(prompt, SamplingParams(max_tokens=long_n), on_token=on_token))
    await first.wait()
    print("STREAMING", flush=True)
    assert await line() == "split"
    t0 = time.time()
    try:
        await task
        out["in_flight"] = {"error": None}
    except RequestError as e:
        out["in_flight"] = {"error": str(e), "after_s": time.time() - t0}
    out["streamed"] = got
    t1 = time.time()
    try:
        await c.generate(prompt, SamplingParams(max_tokens=short_n))
        out["during"] = {"error": None}
    except RequestError as e:
        out["during"] = {"error": str(e), "after_s": time.time() - t1}
    c.close()
    print("FAILED", flush=True)
    assert await line() == "healed"
    t2, last = time.time(), None
    while time.time() - t2 < 90:
        try:
            c = await Client.for_topology(topo, timeout=2.0)
            r = await c.generate(prompt, SamplingParams(max_tokens=short_n))
            c.close()
            out["after"] = {"tokens": r.tokens, "after_s": time.time() - t2}
            break
        except Exception as e:
            last = str(e)
            await asyncio.sleep(0.5)
    else:
        out["after"] = {"error": last}
    print(json.dumps(out), flush=True)
asyncio.run(asyncio.wait_for(main(), 400))
"""


def _claims_log(texts: dict[str, str]) -> dict[tuple[str, int], list[str]]:
    """(slot, epoch) -> the nodes (log files) that claimed it."""
    out: dict[tuple[str, int], list[str]] = {}
    for who, t in texts.items():
        for slot, epoch in re.findall(r"claimed slot (\S+) \(epoch (\d+)\)", t):
            out.setdefault((slot, int(epoch)), []).append(who)
    return out


def test_partition_and_heal(tmp_path, ckpt):
    require_netns()
    ref = Pipeline.load(ckpt, 1, max_sessions=2, max_tokens=1024)
    want_long = ref.generate([PROMPT], SamplingParams(max_tokens=LONG))[0]
    want = ref.generate([PROMPT], SamplingParams(max_tokens=SHORT))[0]
    with NetnsLab(5) as lab:  # 0 entry, 1-2 stages, 3 standby, 4 the client (on the entry's side)
        topo = even_split(TINY_K3, 3, host=None, model_path=str(ckpt), secret_file="secret", name="split", n_standby=1)
        for i, s in enumerate(topo.slots):
            s.host, s.port = lab.addr(i), PORT
        (tmp_path / "secret").write_text(secrets.token_hex(32))
        (tmp_path / "topology.toml").write_text(topo.dump())
        procs = []
        try:
            for i, s in enumerate(topo.slots):
                argv = [sys.executable, "-m", "p2pk3.cli", "node", "--topology", str(tmp_path / "topology.toml")]
                argv += ["--slot", s.id, "--host", lab.addr(i), "--port", str(PORT), "--no-discovery"]
                log = open(tmp_path / f"node{i}.log", "w")
                procs.append(lab.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1"}))
            client = lab.popen(
                4,
                [sys.executable, "-c", CLIENT, str(tmp_path / "topology.toml"), json.dumps(PROMPT), str(LONG), str(SHORT)],
                stdin=subprocess.PIPE,
            )

            def logs():
                return "\n".join(f"--- node{i}\n" + (tmp_path / f"node{i}.log").read_text()[-1500:] for i in range(4))

            line = client.stdout.readline()
            assert line.strip() == "STREAMING", line + client.stderr.read()[-2000:] + logs()
            time.sleep(4)  # the standby's detector has heard the entry (it takes over only a slot it saw up)
            lab.split([0, 4])
            t_split = time.time()
            client.stdin.write("split\n")
            client.stdin.flush()
            line = client.stdout.readline()
            assert line.strip() == "FAILED", line + client.stderr.read()[-2000:] + logs()
            time.sleep(max(0.0, t_split + PARTITION_S - time.time()))  # the other side's standby takes the entry
            lab.heal()
            client.stdin.write("healed\n")
            client.stdin.flush()
            out, err = client.communicate(timeout=200)
            assert client.returncode == 0, err[-2000:] + logs()
            res = json.loads(out.strip().splitlines()[-1])
            try:
                procs[0].wait(30)  # the old entry steps down once it hears of the new one
            except subprocess.TimeoutExpired:
                pass
            texts = {f"node{i}": (tmp_path / f"node{i}.log").read_text() for i in range(4)}
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    inf, during, after = res["in_flight"], res["during"], res["after"]
    claims = _claims_log(texts)
    print(
        f"\n[partition] in-flight request failed {inf.get('after_s', 0):.1f} s after the split "
        f"({inf['error']}); a new one {during.get('after_s', 0):.2f} s; served again "
        f"{after.get('after_s', 0):.1f} s after the heal; claims {sorted(claims)}"
    )
    assert inf["error"] and "unavailable" in inf["error"], inf
    # heartbeat + dead-after (3 s), plus one takeover try's 5 s connect timeout when the entry asked the
    # standby before its detector saw it gone too
    assert inf["after_s"] < 3.0 + 5.0 + 2.0, inf
    assert res["streamed"] == want_long[: len(res["streamed"])]  # nothing lost or repeated before the error
    assert during["error"] and "unavailable" in during["error"] and during["after_s"] < 1.0, during
    assert after.get("tokens") == want, after | {"logs": logs()}
    assert all(len(nodes) == 1 for nodes in claims.values()), claims  # 0 double holders
    assert claims.get(("s0", 2)) == ["node3"], claims  # the standby took the entry slot, above epoch 1
    assert procs[0].poll() is not None and "this node steps down" in texts["node0"], texts["node0"][-2000:]
