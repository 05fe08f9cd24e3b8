"""Two network namespaces on a private bridge: TCP between them, and discovery beacons across the bridge."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from netns import NetnsLab, netns_unavailable_reason

pytestmark = pytest.mark.skipif(netns_unavailable_reason() is not None, reason=netns_unavailable_reason() or "")

SERVER = textwrap.dedent("""
    import asyncio, sys
    from p2pk3.transport.server import serve
    async def main():
        async def echo(conn):
            async for f in conn:
                await conn.send(f)
        srv = await serve(sys.argv[1], 7400, b"netns-secret-0123456789abcdef!!", "srv", echo)
        print("ready", flush=True)
        await asyncio.sleep(15)
    asyncio.run(main())
""")

CLIENT = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    from p2pk3.transport.connection import open_connection
    from p2pk3.transport.codec import Frame
    async def main():
        for _ in range(50):
            try:
                c = await open_connection(sys.argv[1], 7400, b"netns-secret-0123456789abcdef!!", "cli")
                break
            except OSError:
                await asyncio.sleep(0.1)
        await c.send(Frame.make("x", {"a": np.arange(100000, dtype=np.int32)}))
        f = await c.recv()
        print("ok", c.peer_id, c.peer_addr[0], int(f.array("a").sum()), flush=True)
    asyncio.run(main())
""")

BEACON = textwrap.dedent("""
    import asyncio, json, sys
    from p2pk3.node.discovery import Discovery
    async def main():
        node, bcast, port, secret, expect = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].encode(), int(sys.argv[5])
        seen = {}
        d = Discovery("lab", secret, node, port=7000, slot="s-" + node, epoch=1, beacon_port=port,
                      beacon_addrs=[bcast], interval=0.1,
                      on_event=lambda ev, p: seen.setdefault(p.node_id, [p.host, p.port, p.slot]))
        await d.start()
        try:
            await d.wait_for(lambda ps: len(seen) >= expect, 10 if expect else 2)
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(1.0)  # keep beaconing for the slower ones
        print(json.dumps({"peers": seen, "bad_signature": d.stats["bad_signature"]}), flush=True)
        await d.stop(bye=False)
    asyncio.run(main())
""")


@pytest.mark.slow
def test_namespaces_tcp_and_beacons():
    with NetnsLab(3) as lab:
        # TCP (an authenticated p2pk3 connection) from namespace 0 to namespace 1
        srv = lab.popen(1, [sys.executable, "-c", SERVER, lab.addr(1)])
        try:
            assert srv.stdout.readline().strip() == "ready"
            r = lab.run(0, [sys.executable, "-c", CLIENT, lab.addr(1)], timeout=30)
            assert r.returncode == 0, r.stderr
            assert r.stdout.split() == ["ok", "srv", lab.addr(1), str(sum(range(100000)))]
        finally:
            srv.kill()
            srv.wait()
        # discovery beacons across the bridge; namespace 2 uses another secret and stays invisible
        port = 47990
        procs = [
            lab.popen(
                i,
                [
                    sys.executable,
                    "-c",
                    BEACON,
                    f"n{i}",
                    lab.broadcast,
                    str(port),
                    "right-secret-0123456789" if i < 2 else "wrong-secret-0123456789",
                    "1" if i < 2 else "0",
                ],
            )
            for i in range(3)
        ]
        outs = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            assert p.returncode == 0, err
            outs.append(json.loads(out))
        assert outs[0]["peers"] == {"n1": [lab.addr(1), 7000, "s-n1"]}
        assert outs[1]["peers"] == {"n0": [lab.addr(0), 7000, "s-n0"]}
        assert outs[0]["bad_signature"] > 0 and outs[2]["peers"] == {}
    # everything is gone afterwards
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    assert lab.tag not in r.stdout
    r = subprocess.run(["ip", "link", "show", lab.bridge], capture_output=True, text=True)
    assert r.returncode != 0


def test_lab_cleans_up_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsLab(2) as lab:
            raise RuntimeError("boom")
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    assert lab.tag not in r.stdout
