"""LAN sharing of checkpoint files between nodes, over the cluster's authenticated channel.

Frames (requests carry a `request_id`, echoed in the answer):

    file_list {}                                  -> file_index {files: {name: {size, sha256}}, commit, repo}
    file_get  {path, offset, length, max_mbps?}   -> file_chunk {path, offset, size} + tensor "data" (uint8 [n])
    either, refused                               -> error {code: bad_request, message}; the connection stays up

A node serves ONLY the files its manifest (`p2pk3-manifest.json`) lists, from its model directory: a name
that is not a plain relative name (`..`, absolute, backslash) or not in the manifest, a path that resolves
outside the directory (symlink), or a file whose size no longer matches the manifest is refused. Chunks are
at most 8 MiB and paced by a token bucket shared by every transfer of the daemon (P2PK3_SHARE_MBPS, default
200 MB/s; a request may ask for less), so serving files never starves activation traffic.

The receiver (`fetch_file`) writes to a `.part` file and resumes from its length; the caller verifies the
SHA-256 against the hub's metadata or the manifest before moving it into place (download.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets as _secrets
import time
from pathlib import Path
from typing import Callable, Iterable

from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.messages import ErrorCode, error_frame

from .manifest import Manifest, ManifestError, safe_name

CHUNK = 8 << 20
DEFAULT_SHARE_MBPS = 200.0
MB = 1_000_000
REQUEST_TIMEOUT_S = 30.0

log = logging.getLogger("p2pk3.deploy")


class PeerError(RuntimeError):
    """A peer refused or failed a file request."""


class TokenBucket:
    """`rate` bytes/s with a burst of `burst` bytes; `take(n)` waits until n bytes may go."""

    def __init__(self, rate: float, burst: float | None = None):
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(CHUNK, rate / 4))
        self.tokens = self.burst
        self.t = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
                self.t = now
                if self.tokens >= min(n, self.burst):
                    self.tokens -= n  # may go negative for n > burst: the debt is paid before the next chunk
                    return
                await asyncio.sleep((min(n, self.burst) - self.tokens) / self.rate)


def share_rate_mbps() -> float:
    v = os.environ.get("P2PK3_SHARE_MBPS")
    try:
        r = float(v) if v else DEFAULT_SHARE_MBPS
    except ValueError:
        raise ValueError(f"P2PK3_SHARE_MBPS={v!r} is not a number (MB/s)") from None
    if r <= 0:
        raise ValueError(f"P2PK3_SHARE_MBPS={v!r} must be > 0 (MB/s)")
    return r


class FileServer:
    """What one daemon serves: files of its manifest, under its model directory."""

    def __init__(self, model_dir: str | Path, rate_mbps: float | None = None):
        self.dir = Path(model_dir)
        self.bucket = TokenBucket((rate_mbps or share_rate_mbps()) * MB)
        self.bytes_sent = 0

    def manifest(self) -> Manifest | None:
        return Manifest.load(self.dir)

    def resolve(self, name) -> tuple[Path, int]:
        """(path, size) of a servable file; PeerError saying why not."""
        if not safe_name(name):
            raise PeerError(f"file_get refused: {name!r} is not a plain relative file name of the model directory "
                            f"(no '..', no absolute path)")
        try:
            m = self.manifest()
        except ManifestError as e:
            raise PeerError(f"file_get refused: this node's manifest is unusable ({e})") from None
        if m is None or name not in m.files:
            where = m.path if m is not None else self.dir / "p2pk3-manifest.json (none here)"
            raise PeerError(f"file_get refused: {name!r} is not in this node's manifest {where}; only verified "
                            f"checkpoint files are served")
        root = self.dir.resolve()
        p = (self.dir / name).resolve()
        if not p.is_relative_to(root):
            raise PeerError(f"file_get refused: {name!r} resolves outside the model directory {root}")
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise PeerError(f"file_get refused: {name!r} is in the manifest but not on this node's disk") from None
        if size != m.files[name].size:
            raise PeerError(f"file_get refused: {name!r} has {size} bytes here, the manifest says "
                            f"{m.files[name].size} (changed since it was verified)")
        return p, size

    def listing(self) -> dict:
        try:
            m = self.manifest()
        except ManifestError:
            m = None
        if m is None:
            return {"files": {}, "commit": None, "repo": None}
        files = {}
        for n, e in m.files.items():
            p = self.dir / n
            try:
                if p.stat().st_size == e.size and p.resolve().is_relative_to(self.dir.resolve()):
                    files[n] = {"size": e.size, "sha256": e.sha256}
            except OSError:
                continue
        return {"files": files, "commit": m.commit, "repo": m.repo}


def _server(daemon) -> FileServer:
    srv = getattr(daemon, "_file_server", None)
    if srv is None:
        srv = daemon._file_server = FileServer(daemon.model_dir)
    return srv


MIN_MBPS = 1.0  # a requester may slow a transfer down, not stall the connection


def _request_id(h) -> int | str | None:
    rid = h.get("request_id")
    ok = rid is None or (isinstance(rid, str) and len(rid) <= 64) or (
        isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 1 << 63)
    if not ok:
        raise ProtocolError("file request: request_id must be a string of at most 64 characters or an integer")
    return rid


async def handle_file_list(daemon, conn, f) -> None:
    """The daemon's `file_list` handler."""
    rid = _request_id(f.header)
    await conn.send(Frame.make("file_index", request_id=rid, **_server(daemon).listing()))


async def handle_file_get(daemon, conn, f) -> None:
    """The daemon's `file_get` handler: one chunk of a manifest file, or an error frame (never a crash)."""
    h = f.header
    rid = _request_id(h)
    p = h.get("path")
    if not isinstance(p, str) or len(p) > 4096:
        raise ProtocolError("file_get: path must be a string of at most 4096 characters")
    srv = _server(daemon)
    try:
        offset, length = h.get("offset", 0), h.get("length", CHUNK)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise PeerError("file_get refused: offset and length must be non-negative integers")
        path, size = srv.resolve(h.get("path"))
        if offset > size:
            raise PeerError(f"file_get refused: offset {offset} is past the end of {h.get('path')!r} ({size} bytes)")
        n = min(length, CHUNK, size - offset)
        cap = h.get("max_mbps")
        if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0:
            cap = max(float(cap), MIN_MBPS)
            per = getattr(conn, "_p2pk3_bucket", None)
            if per is None or per.rate != cap * MB:
                per = TokenBucket(cap * MB)
                conn._p2pk3_bucket = per
            await per.take(n)
        await srv.bucket.take(n)
        data = await asyncio.get_running_loop().run_in_executor(None, _read, path, offset, n)
    except PeerError as e:
        log.warning("refused a file request from %s: %s", conn.describe(), e)
        await conn.send(error_frame(ErrorCode.BAD_REQUEST, str(e), request_id=rid))
        return
    srv.bytes_sent += len(data)
    await conn.send(Frame.make("file_chunk", {"data": ("uint8", (len(data),), data)}, request_id=rid,
                               path=h.get("path"), offset=offset, size=size))


def _read(path: Path, offset: int, n: int) -> bytearray:
    buf = bytearray(n)
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        mv, got = memoryview(buf), 0
        while got < n:
            k = fh.readinto(mv[got:])
            if not k:
                raise PeerError(f"file_get failed: {path.name} ended at {offset + got} bytes while reading")
            got += k
    return buf


# ------------------------------------------------------------------------------------------ client
def _node_id() -> str:
    return f"fetch@{os.uname().nodename}:{os.getpid()}"


async def _ask(conn, frame: Frame) -> Frame:
    rid = _secrets.token_hex(6)
    frame.header["request_id"] = rid
    await conn.send(frame)
    while True:
        r = await asyncio.wait_for(conn.recv(), REQUEST_TIMEOUT_S)
        if r.header.get("request_id") not in (rid, None):
            continue
        if r.kind == "error":
            raise PeerError(r.header.get("message", "error"))
        return r


async def list_peer_files(addrs: Iterable[tuple[str, int]], secret: bytes, *, echo: Callable[[str], None] = print,
                          timeout: float = 3.0) -> dict[tuple[str, int], dict[str, dict]]:
    """addr -> {name: {size, sha256}} of every peer that answers (the others are reported and skipped)."""
    from p2pk3.transport.connection import open_connection

    async def one(addr):
        try:
            conn = await open_connection(*addr, secret, _node_id(), timeout=timeout, handshake_timeout=timeout)
        except Exception as e:
            echo(f"peer {addr[0]}:{addr[1]}: not reachable ({type(e).__name__}: {e})")
            return addr, None
        try:
            r = await _ask(conn, Frame.make("file_list"))
            files = r.header.get("files") or {}
            return addr, {n: v for n, v in files.items() if safe_name(n) and isinstance(v, dict)
                          and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)}
        except Exception as e:
            echo(f"peer {addr[0]}:{addr[1]}: no file list ({type(e).__name__}: {e})")
            return addr, None
        finally:
            conn.close("file list done")

    got = await asyncio.gather(*(one(tuple(a)) for a in addrs))
    return {a: f for a, f in got if f}


async def fetch_file(addr: tuple[str, int], secret: bytes, name: str, size: int, part: Path, *,
                     rate_mbps: float | None = None, progress: Callable[[int], None] | None = None) -> int:
    """Fetch `name` from the peer at `addr` into `part`, resuming from its length. Returns bytes received."""
    from p2pk3.transport.connection import open_connection

    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    if progress is not None and have:
        progress(have)
    got = 0
    conn = await open_connection(*addr, secret, _node_id(), timeout=5.0, handshake_timeout=5.0)
    try:
        with open(part, "ab") as out:
            while have < size:
                fr = Frame.make("file_get", path=name, offset=have, length=min(CHUNK, size - have),
                                **({"max_mbps": rate_mbps} if rate_mbps else {}))
                r = await _ask(conn, fr)
                if r.kind != "file_chunk" or r.header.get("offset") != have or r.header.get("size") != size:
                    raise PeerError(f"{name}: unexpected answer {r.kind} at offset {r.header.get('offset')} "
                                    f"(size {r.header.get('size')}, expected {size})")
                data = r.buffer("data")
                if not len(data):
                    raise PeerError(f"{name}: the peer sent an empty chunk at offset {have}")
                out.write(data)
                have += len(data)
                got += len(data)
                if progress is not None:
                    progress(len(data))
    finally:
        conn.close("file fetched")
    return got


# ------------------------------------------------------------------------------------------ takeover
async def fetch_missing_for_slot(daemon, slot_id: str) -> list[str]:
    """Before a standby takes `slot_id` over: fetch the shards it lacks from the other nodes of the ring
    (verified against the manifest / the peer's SHA-256). Returns the names fetched."""
    from .download import Downloader
    from .files import slot_files

    cfg = daemon.cfg
    plan = daemon.topo.slot_plan(daemon.topo.slot(slot_id), cfg)
    names = await asyncio.get_running_loop().run_in_executor(None, slot_files, daemon.model_dir, cfg, plan)
    m = Manifest.load(daemon.model_dir)
    # a file on disk is not lacking when there is no manifest (a model dir made by hand; the load decides),
    # nor when the manifest lists it (the integrity check at load verifies it)
    lacking = [n for n in names if not (daemon.model_dir / n).is_file() or (m is not None and n not in m.files)]
    if not lacking:
        return []
    addrs = []
    for s in daemon.topo.slots:
        if s.id == daemon.slot_id:
            continue
        try:
            addrs.append(daemon.routes.address(s.id))
        except ConnectionError:
            continue
    log.warning("slot %s: fetching %d file(s) from peers before the takeover: %s", slot_id, len(lacking),
                ", ".join(lacking))
    d = Downloader(daemon.model_dir, repo=None, peers=addrs, secret=daemon.secret, offline=True, quiet=True,
                   echo=lambda s: log.warning("%s", s))
    d.manifest = m or Manifest(daemon.model_dir)
    d.peer_files = await list_peer_files(addrs, daemon.secret, echo=lambda s: log.warning("%s", s))
    await asyncio.get_running_loop().run_in_executor(None, _fetch_all, d, lacking)
    return lacking


def _fetch_all(d, names) -> None:
    from .download import Progress
    with Progress(quiet=True) as prog:
        d._ensure(names, prog)
