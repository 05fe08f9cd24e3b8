"""`p2pk3 local`: a ring of N daemons (plus S standbys) on loopback, each its own process, with a
generated topology and secret; helpers to kill / restart one of them, to follow which node holds which
slot (the `--state` file), and to run `score` / `generate` through such a ring."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from p2pk3.model.config import K3Config
from p2pk3.params import SamplingParams
from p2pk3.topology import Topology, even_split
from p2pk3.transport.connection import open_connection
from p2pk3.transport.messages import parse_status, status_frame

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


def write_local_topology(model_dir: Path, nodes: int, workdir: Path, standby: int = 0) -> Path:
    cfg = K3Config.from_pretrained(model_dir)
    ports = free_ports(nodes + standby)
    topo = even_split(
        cfg,
        nodes,
        host="127.0.0.1",
        base_port=ports[0],
        model_path=str(Path(model_dir).resolve()),
        secret_file="secret",
        name="local",
        n_standby=standby,
    )
    for s, p in zip(topo.slots, ports):
        s.port = p
    (workdir / "secret").write_text(secrets.token_hex(32) + "\n")
    os.chmod(workdir / "secret", 0o600)
    path = workdir / "topology.toml"
    path.write_text(topo.dump())
    return path


async def probe(addr: tuple[str, int], secret: bytes, timeout: float = 1.0) -> dict | None:
    """A node's status over an authenticated connection (None when it does not answer)."""
    try:
        conn = await open_connection(*addr, secret, "local-probe", timeout=timeout, handshake_timeout=timeout)
    except Exception:
        return None
    try:
        await asyncio.wait_for(conn.send(status_frame()), timeout)
        return parse_status(await asyncio.wait_for(conn.recv(), timeout))
    except Exception:
        return None
    finally:
        conn.close("probe done")


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT / SIGTERM / SIGHUP for the block (main thread only), then deliver the first that came to the
    handler that was in place."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {sig: signal.signal(sig, lambda n, frame: came.append(n)) for sig in sigs}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        if came:
            signal.raise_signal(came[0])


class LocalRing:
    """Start N `p2pk3 node` processes (and S standbys); `stop()` ends them all, also on failure."""

    def __init__(
        self,
        model_dir: str | Path,
        nodes: int,
        workdir: str | Path | None = None,
        dtype: str = "float32",
        extra_args: list[str] | None = None,
        log_dir: str | Path | None = None,
        standby: int = 0,
    ):
        self._tmp = None  # a folder we made: removed at the end unless something failed (logs are kept)
        if workdir is None:
            workdir = self._tmp = tempfile.mkdtemp(prefix="p2pk3-local-")
        self.workdir = Path(workdir)
        self.model_dir = Path(model_dir)
        self.nodes, self.n_standby = nodes, standby
        self.topology = write_local_topology(self.model_dir, nodes, self.workdir, standby)
        self.topo = Topology.load(self.topology)
        self.secret = self.topo.secret()
        self.dtype = dtype
        self.extra = list(extra_args or [])
        cores = str(max(1, min(nodes, os.cpu_count() or 1)))
        for flag in ("--micro-batches", "--prefill-depth"):  # the daemons share this host's cores: no more
            # decode micro-batches, nor chunks of one prompt, in flight than can compute at once (more only
            # take the cores from the others' decode steps: docs/architecture.md, "The scheduler")
            if flag not in self.extra:
                self.extra += [flag, cores]
        self.log_dir = Path(log_dir) if log_dir else self.workdir
        self.procs: dict[str, subprocess.Popen] = {}  # by the slot each process was started on (or spare name)
        self.spare_ports: dict[str, int] = {}  # pool spares (spawn_spare) by name: the port each listens on
        self.failed = False

    @property
    def entry_addr(self) -> tuple[str, int]:
        s = self.topo.active[0]
        return s.host, s.port

    def address(self, slot: str) -> tuple[str, int]:
        """Where the process started on `slot` (or the pool spare of that name) listens."""
        if slot in self.spare_ports:
            return "127.0.0.1", self.spare_ports[slot]
        s = self.topo.slot(slot)
        return s.host, s.port

    def log_path(self, slot: str) -> Path:
        return self.log_dir / f"node-{slot}.log"

    def spawn(self, slot: str, extra: list[str] | None = None) -> subprocess.Popen:
        """Start the daemon of `slot` (again; `extra`: more `p2pk3 node` flags). The daemon runs with -P and
        the work folder as its working directory, so a folder named p2pk3 where the user stands cannot
        shadow the installed package."""
        s = self.topo.slot(slot)
        return self._popen(slot, ["--slot", slot, *(["--standby"] if s.standby else []), *(extra or [])])

    def spawn_spare(self, *, any_port: bool = False, timeout: float = 120.0) -> str:
        """Start one more spare that no topology slot names (`p2pk3 node --standby` without --slot: it joins
        the entry's spare pool); returns its name in `procs` (pool1, pool2, ...) once it is up. On a free
        port chosen here, or with `any_port` exactly as a user would start it (the port it says it took)."""
        name = f"pool{len([n for n in self.procs if n.startswith('pool')]) + 1}"
        port = None if any_port else free_ports(1)[0]
        p = self._popen(name, ["--standby", *(["--port", str(port)] if port else [])])
        deadline = time.time() + timeout
        while port is None:  # "node ID: spare pool up on HOST:PORT (standby)"
            m = re.search(r"spare pool up on [\d.]+:(\d+)", self.log_path(name).read_text())
            if m:
                port = int(m.group(1))
            elif p.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"spare {name} did not come up; its log:\n{self.log_path(name).read_text()[-2000:]}")
            else:
                time.sleep(0.2)
        self.spare_ports[name] = port
        self.wait_up([name], timeout)
        return name

    def _popen(self, name: str, role: list[str]) -> subprocess.Popen:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        log = open(self.log_path(name), "a")
        with _signals_held():  # a Ctrl-C between the start and `self.procs` would orphan the daemon
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-P",
                    "-m",
                    "p2pk3.cli",
                    "node",
                    "--topology",
                    str(self.topology),
                    *role,
                    "--dtype",
                    self.dtype,
                    "--no-discovery",
                    *self.extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=self.workdir,
            )
            self.procs[name] = p
        log.close()
        return p

    def start(self, timeout: float = 120.0, *, standbys: bool = True) -> "LocalRing":
        """Start every active slot's daemon (and the standbys', unless standbys=False) and wait until
        each answers an authenticated status request."""
        slots = [s.id for s in self.topo.slots if standbys or not s.standby]
        try:
            for sid in slots:
                self.spawn(sid)
            self.wait_up(slots, timeout)
        except BaseException as e:
            self.failed = not isinstance(e, KeyboardInterrupt)  # Ctrl-C while starting: a normal end
            self.stop()
            self._clean_up()
            raise
        return self

    def wait_up(self, slots: list[str], timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        pending = set(slots)
        while pending:
            for sid in list(pending):
                p = self.procs.get(sid)
                if p is not None and p.poll() is not None:
                    raise RuntimeError(
                        f"node {sid} exited with {p.returncode}; its log ({self.log_path(sid)}):\n"
                        f"{self.log_path(sid).read_text()[-2000:]}"
                    )
                st = asyncio.run(probe(self.address(sid), self.secret, 0.5))
                if st is not None and st.get("role") in ("entry", "stage", "standby"):
                    pending.discard(sid)
            if pending and time.time() > deadline:
                raise TimeoutError(
                    f"ring not up after {timeout}s; waiting for {sorted(pending)} (logs in {self.log_dir})"
                )
            if pending:
                time.sleep(0.2)

    def signal(self, slot: str, sig: int) -> None:
        self.procs[slot].send_signal(sig)

    def kill(self, slot: str) -> None:
        p = self.procs[slot]
        p.kill()
        p.wait(10)

    def exited(self) -> list[str]:
        return [sid for sid, p in self.procs.items() if p.poll() is not None]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                except OSError:
                    pass
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs = {}

    def __enter__(self) -> "LocalRing":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C / SIGTERM: a normal end
            self.failed = True
        self._clean_up()

    def _clean_up(self) -> None:
        """After the daemons stopped: remove the folder we made, or after a failure keep its logs but not
        the ring's secret."""
        if self._tmp and not self.failed:
            shutil.rmtree(self._tmp, ignore_errors=True)
        elif self._tmp:
            (self.workdir / "secret").unlink(missing_ok=True)

    async def client(self, *, resume: bool = True) -> Client:
        if resume:
            return await Client.for_topology(self.topo, self.secret)
        h, p = self.entry_addr
        return await Client.connect(h, p, self.secret)

    async def statuses(self) -> dict[str, dict | None]:
        """The status of the process started on each slot (None: not answering)."""
        slots = list(self.procs)
        res = await asyncio.gather(*(probe(self.address(s), self.secret, 1.0) for s in slots))
        return dict(zip(slots, res))

    async def state(self) -> dict:
        """The `--state` document: which process serves which slot now, in ring order, standbys last."""
        sts = await self.statuses()
        nodes, entry = [], None
        for started_on, st in sts.items():
            p = self.procs[started_on]
            alive = p.poll() is None
            if st is None:
                role, slot = ("unreachable" if alive else "dead"), started_on
            else:
                role, slot = st.get("role"), st.get("slot")
            h, port = self.address(started_on)
            if role == "entry":
                entry = f"{h}:{port}"
            nodes.append({"slot": slot, "role": role, "pid": p.pid, "address": f"{h}:{port}", "started_on": started_on})
        order = {s.id: i for i, s in enumerate(self.topo.slots)}
        rank = {"entry": 0, "stage": 0, "loading": 0, "standby": 1}
        nodes.sort(key=lambda n: (rank.get(n["role"], 2), order.get(n["slot"], 99)))
        return {
            "topology": str(self.topology),
            "secret_file": str(self.topology.parent / "secret"),
            "entry": entry,
            "api": None,
            "logs": str(self.log_dir),
            "pid": os.getpid(),
            "nodes": nodes,
        }


def claim_state_file(path: str | Path) -> None:
    """Before a ring writes its state to `path`: refuse (ValueError) when a running `p2pk3 local` owns the
    file, remove a stale one (so that waiting for the file to appear waits for this ring)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        doc = {}
    pid = doc.get("pid") if isinstance(doc, dict) else None
    if isinstance(pid, int) and pid != os.getpid() and _alive(pid):
        raise ValueError(
            f"{path} is the state of a running ring (p2pk3 local, pid {pid}); stop that one first "
            f"(kill {pid}) or give another --state file"
        )
    path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def ring_events(last: dict | None, doc: dict, topo: Topology) -> list[str]:
    """The lines `p2pk3 local` prints between two state documents: a node down, a slot taken over, the
    ring recovered (every active slot served again)."""
    if last is None:
        return []
    before = {n["started_on"]: n for n in last["nodes"]}
    out = []
    for n in doc["nodes"]:
        was = before.get(n["started_on"])
        if was is None:
            continue
        if n["role"] in ("dead", "unreachable") and was["role"] not in ("dead", "unreachable"):
            what = f"slot {was['slot']}" if was["role"] != "standby" else f"standby {n['started_on']}"
            out.append(f"node down: {what} (pid {n['pid']}) is {n['role']}")
        elif n["role"] in ("entry", "stage") and n["slot"] != was["slot"]:
            out.append(f"taken over: standby {n['started_on']} (pid {n['pid']}) serves slot {n['slot']} now")

    def served(d: dict) -> set:
        return {n["slot"] for n in d["nodes"] if n["role"] in ("entry", "stage")}

    active = {s.id for s in topo.active}
    if active <= served(doc) and not active <= served(last):
        out.append(f"recovered: every slot is served again (entry {doc['entry']})")
    return out


def write_state(path: str | Path, doc: dict) -> None:
    """Write atomically (readers never see half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


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
