"""Ring benchmarks; every figure is a ratio against a baseline measured in the same run.

1. per-hop latency: a forward frame echoed by a p2pk3 Connection vs a bare uvloop echo of the same bytes
   (round trip, median; target <= 1.3x), at a tiny-K3 decode hop and a K3 decode hop (129,024 B/token)
2. activation stream throughput: one 64 MB prefill payload as a frame vs a raw socket copy (target >= 0.7x)
3. tiny-K3 decode tokens/s: a 4-node loopback ring (4 daemon processes) vs one process, 1 and 16 sessions

    python tools/bench_ring.py [--model DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import tempfile
import threading
import time

import numpy as np


def _uvloop_run(coro):
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


# ------------------------------------------------------------------------------------------- latency
async def _latency(nbytes: int, rounds: int) -> tuple[float, float]:
    from p2pk3.transport.connection import open_connection
    from p2pk3.transport.server import serve
    from p2pk3.transport.messages import Segment, forward_frame

    secret = os.urandom(32)
    D = 64 if nbytes < 8192 else 7168
    rows = max(1, nbytes // (D * 4))

    async def echo(conn):  # a stage passing each frame on (received and validated, sent on as it came in)
        async for f in conn:
            await conn.forward(f)

    srv = await serve("127.0.0.1", 0, secret, "echo", echo)
    conn = await open_connection("127.0.0.1", srv.port, secret, "bench")
    prefix = np.random.rand(1, D).astype(np.float32)
    bank = np.random.rand(rows - 1, 1, D).astype(np.float32) if rows > 1 else None
    frame = forward_frame([Segment("s", 0, 0, 1)], prefix, bank, layer=1)
    ours = []
    for i in range(rounds + 20):
        t = time.perf_counter()
        await conn.send(frame)
        await conn.recv()
        if i >= 20:
            ours.append(time.perf_counter() - t)
    conn.close("done")
    await _maybe(srv.close())
    size = frame.nbytes + 64

    # baseline: bare uvloop protocol echo of the same number of bytes
    class Echo(asyncio.Protocol):
        def connection_made(self, tr):
            self.tr = tr

        def data_received(self, data):
            self.tr.write(data)

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = os.urandom(size)
    base = []
    for i in range(rounds + 20):
        t = time.perf_counter()
        w.write(payload)
        await r.readexactly(size)
        if i >= 20:
            base.append(time.perf_counter() - t)
    w.close()
    server.close()
    return statistics.median(ours), statistics.median(base)


async def _maybe(x):
    if asyncio.iscoroutine(x):
        await x


# ---------------------------------------------------------------------------------------- throughput
async def _throughput(nbytes: int, reps: int) -> tuple[float, float]:
    from p2pk3.transport.connection import open_connection
    from p2pk3.transport.server import serve
    from p2pk3.transport.codec import Frame

    secret = os.urandom(32)
    got = asyncio.Queue()

    async def sink(conn):
        async for f in conn:
            got.put_nowait(f.nbytes)

    srv = await serve("127.0.0.1", 0, secret, "sink", sink)
    conn = await open_connection("127.0.0.1", srv.port, secret, "bench")
    data = np.random.rand(nbytes // 4).astype(np.float32)
    frame = Frame.make("forward_bench", [("prefix", data)])
    ours = []
    for _ in range(reps):
        t = time.perf_counter()
        await conn.send(frame)
        await got.get()
        ours.append(nbytes / (time.perf_counter() - t))
    conn.close("done")
    await _maybe(srv.close())
    return max(ours), _raw_copy(nbytes, reps)


def _raw_copy(nbytes: int, reps: int) -> float:
    """Baseline: sendall of the same bytes over a loopback TCP socket into a preallocated buffer."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port = ls.getsockname()[1]
    buf = bytearray(nbytes)

    def recv_side():
        c, _ = ls.accept()
        mv = memoryview(buf)
        for _ in range(reps):
            n = 0
            while n < nbytes:
                n += c.recv_into(mv[n:], nbytes - n)
            c.sendall(b"k")
        c.close()

    th = threading.Thread(target=recv_side)
    th.start()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = os.urandom(nbytes)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        s.sendall(data)
        s.recv(1)
        best = max(best, nbytes / (time.perf_counter() - t))
    s.close()
    th.join()
    ls.close()
    return best


# -------------------------------------------------------------------------------------------- decode
def _decode_tps(model_dir: str, sessions: int, new_tokens: int, nodes: int) -> float:
    from p2pk3.engine.reference import Pipeline
    from p2pk3.engine.sampling import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 200, 16)] for _ in range(sessions)]
    params = SamplingParams(max_tokens=new_tokens)
    if nodes == 0:
        pipe = Pipeline.load(model_dir, 1, max_sessions=sessions, max_tokens=sessions * 128)
        pipe.generate(prompts[:1], SamplingParams(max_tokens=2))
        t = time.perf_counter()
        outs = pipe.generate(prompts, params)
        return sum(len(o) for o in outs) / (time.perf_counter() - t)
    from p2pk3.node.local import LocalRing

    with LocalRing(model_dir, nodes) as ring:
        async def go():
            cs = [await ring.client() for _ in range(sessions)]
            await cs[0].generate(prompts[0], SamplingParams(max_tokens=2))  # warm-up
            t = time.perf_counter()
            outs = await asyncio.gather(*(c.generate(p, params) for c, p in zip(cs, prompts)))
            dt = time.perf_counter() - t
            for c in cs:
                c.close()
            return sum(len(o.tokens) for o in outs) / dt
        return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded tiny K3, else a random tiny-k3)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out: dict = {"host": f"{os.cpu_count()} cpus", "date": time.strftime("%Y-%m-%d")}

    print("1. per-hop latency (round trip, median): p2pk3 frame echo vs bare uvloop echo of the same bytes")
    for label, nbytes in (("tiny-K3 decode hop (1 token, 3 rows x 64 fp32)", 768), ("K3 decode hop (129,024 B)", 129024)):
        ours, base = _uvloop_run(_latency(nbytes, a.rounds))
        print(f"   {label:44s} ours {ours * 1e6:8.1f} us  bare {base * 1e6:8.1f} us  ratio {ours / base:5.2f}x (target <= 1.3x)")
        out[f"latency_{nbytes}"] = {"ours_us": ours * 1e6, "bare_us": base * 1e6, "ratio": ours / base}

    print("2. 64 MB prefill payload: p2pk3 frame vs raw socket copy")
    ours, base = _uvloop_run(_throughput(64 << 20, 5))
    print(f"   ours {ours / 1e9:6.2f} GB/s  raw {base / 1e9:6.2f} GB/s  ratio {ours / base:5.2f}x (target >= 0.7x)")
    out["throughput_64MB"] = {"ours_GBps": ours / 1e9, "raw_GBps": base / 1e9, "ratio": ours / base}

    if not a.skip_decode:
        model = a.model
        tmp = None
        if model is None:
            from p2pk3.engine.reference import default_model_dir
            if (default_model_dir() / "config.json").exists():
                model = str(default_model_dir())
            else:
                from p2pk3.checkpoint.tiny import write_checkpoint
                from p2pk3.model.config import TINY_K3
                tmp = tempfile.TemporaryDirectory()
                write_checkpoint(tmp.name, TINY_K3)
                model = tmp.name
        print(f"3. decode tokens/s, 4-node loopback ring vs one process ({model})")
        for n in (1, 16):
            one = _decode_tps(model, n, a.new_tokens, 0)
            ring = _decode_tps(model, n, a.new_tokens, 4)
            print(f"   {n:2d} session(s): one process {one:8.1f} tok/s  4-node ring {ring:8.1f} tok/s  ratio {ring / one:5.2f}x")
            out[f"decode_{n}"] = {"one_process_tps": one, "ring4_tps": ring, "ratio": ring / one}
        if tmp:
            tmp.cleanup()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
