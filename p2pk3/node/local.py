"""`p2pk3 local`: a ring of N daemons on loopback, each its own process, with a generated topology and
secret; plus helpers that run `score` / `generate` through such a ring."""
from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from p2pk3.engine.sampling import SamplingParams
from p2pk3.model.config import K3Config
from p2pk3.topology import even_split

from .client import Client


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def write_local_topology(model_dir: Path, nodes: int, workdir: Path, topology_dict_hook=None) -> Path:
    cfg = K3Config.from_pretrained(model_dir)
    ports = free_ports(nodes)
    topo = even_split(cfg, nodes, host="127.0.0.1", base_port=ports[0], model_path=str(Path(model_dir).resolve()),
                      secret_file="secret", name="local")
    for s, p in zip(topo.slots, ports):
        s.port = p
    (workdir / "secret").write_text(secrets.token_hex(32) + "\n")
    os.chmod(workdir / "secret", 0o600)
    path = workdir / "topology.toml"
    path.write_text(topo.dump())
    return path


class LocalRing:
    """Start N `p2pk3 node` processes; `stop()` ends them all."""

    def __init__(self, model_dir: str | Path, nodes: int, workdir: str | Path | None = None, dtype: str = "float32",
                 extra_args: list[str] | None = None, log_dir: str | Path | None = None):
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="p2pk3-local-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.model_dir = Path(model_dir)
        self.nodes = nodes
        self.topology = write_local_topology(self.model_dir, nodes, self.workdir)
        from p2pk3.topology import Topology
        self.topo = Topology.load(self.topology)
        self.secret = self.topo.secret()
        self.dtype = dtype
        self.extra = extra_args or []
        self.log_dir = Path(log_dir) if log_dir else self.workdir
        self.procs: list[subprocess.Popen] = []

    @property
    def entry_addr(self) -> tuple[str, int]:
        s = self.topo.active[0]
        return s.host, s.port

    def start(self, timeout: float = 120.0) -> "LocalRing":
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        for s in self.topo.active:
            log = open(self.log_dir / f"node-{s.id}.log", "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "p2pk3.cli", "node", "--topology", str(self.topology), "--slot", s.id,
                 "--dtype", self.dtype, "--no-discovery", *self.extra],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.time() + timeout
        pending = {s.id: (s.host, s.port) for s in self.topo.active}
        while pending:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    self.stop()
                    sid = self.topo.active[i].id
                    raise RuntimeError(f"node {sid} exited with {p.returncode}: "
                                       f"{(self.log_dir / f'node-{sid}.log').read_text()[-2000:]}")
            for sid, (h, port) in list(pending.items()):
                try:
                    socket.create_connection((h, port), timeout=0.2).close()
                    del pending[sid]
                except OSError:
                    pass
            if time.time() > deadline:
                self.stop()
                raise TimeoutError(f"ring not up after {timeout}s; waiting for {sorted(pending)}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []

    def __enter__(self) -> "LocalRing":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._tmp:
            self._tmp.cleanup()

    async def client(self) -> Client:
        h, p = self.entry_addr
        return await Client.connect(h, p, self.secret)


def score_on_ring(model_dir, tokens: list[int], nodes: int, incremental: bool = False, dtype: str = "float32"):
    with LocalRing(model_dir, nodes, dtype=dtype) as ring:
        async def go():
            c = await ring.client()
            try:
                r = await c.generate(tokens, SamplingParams(max_tokens=0), logits=True, incremental=incremental)
            finally:
                c.close()
            return torch.from_numpy(r.logits)
        return asyncio.run(go())
