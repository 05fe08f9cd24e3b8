"""LAN sharing of checkpoint files between nodes, over the cluster's authenticated channel.

Frames (transport/messages/files.py builds and parses them; requests carry a `request_id`, echoed in the
answer):

    file_list {}                                  -> file_index {files: {name: {size, sha256}}, commit, repo}
    file_get  {path, offset, length, max_mbps?}   -> file_chunk {path, offset, size} + tensor "data" (uint8 [n])
    either, refused                               -> error {code: bad_request, message}; the connection stays up

A node serves ONLY the files its manifest (`p2pk3-manifest.json`) lists, from its model directory: a name
that is not a plain relative name (`..`, absolute, backslash) or not in the manifest, a path that resolves
outside the directory (symlink), or a file whose size no longer matches the manifest is refused. Chunks are
at most 8 MiB and paced by a token bucket shared by every transfer of the daemon (P2PK3_SHARE_MBPS, default
200 MB/s; a request may ask for less), so serving files never starves activation traffic.

The receiver (`fetch_file`) writes to a `.part` file and resumes from its length; the caller verifies the
SHA-256 against the hub's metadata or the manifest before moving it into place (download.py). A standby
fetches the shards it lacks before a takeover through download.py too (node/takeover.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets as _secrets
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from p2pk3.transport.codec import Frame
from p2pk3.transport.messages import (
    FILE_CHUNK,
    ErrorCode,
    FileChunk,
    FileGet,
    FileIndex,
    FileInfo,
    error_frame,
    file_chunk_frame,
    file_get_frame,
    file_index_frame,
    file_list_frame,
    parse_error,
    parse_file_chunk,
    parse_file_get,
    parse_file_index,
    parse_file_list,
)

from .manifest import Manifest, ManifestError, safe_name

CHUNK = FILE_CHUNK  # the most one file_get is answered with
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
        self.paced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # connection -> its own max_mbps bucket
        self.bytes_sent = 0

    def manifest(self) -> Manifest | None:
        return Manifest.load(self.dir)

    def resolve(self, name) -> tuple[Path, int]:
        """(path, size) of a servable file; PeerError saying why not."""
        if not safe_name(name):
            raise PeerError(
                f"file_get refused: {name!r} is not a plain relative file name of the model directory "
                f"(no '..', no absolute path)"
            )
        try:
            m = self.manifest()
        except ManifestError as e:
            raise PeerError(f"file_get refused: this node's manifest is unusable ({e})") from None
        if m is None or name not in m.files:
            where = m.path if m is not None else self.dir / "p2pk3-manifest.json (none here)"
            raise PeerError(
                f"file_get refused: {name!r} is not in this node's manifest {where}; only verified "
                f"checkpoint files are served"
            )
        root = self.dir.resolve()
        p = (self.dir / name).resolve()
        if not p.is_relative_to(root):
            raise PeerError(f"file_get refused: {name!r} resolves outside the model directory {root}")
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise PeerError(f"file_get refused: {name!r} is in the manifest but not on this node's disk") from None
        if size != m.files[name].size:
            raise PeerError(
                f"file_get refused: {name!r} has {size} bytes here, the manifest says "
                f"{m.files[name].size} (changed since it was verified)"
            )
        return p, size

    def listing(self, request_id: int | str | None = None) -> FileIndex:
        try:
            m = self.manifest()
        except ManifestError:
            m = None
        if m is None:
            return FileIndex(request_id, {})
        files = {}
        for n, e in m.files.items():
            p = self.dir / n
            try:
                if p.stat().st_size == e.size and p.resolve().is_relative_to(self.dir.resolve()):
                    files[n] = FileInfo(e.size, e.sha256)
            except OSError:
                continue
        return FileIndex(request_id, files, m.commit, m.repo)


MIN_MBPS = 1.0  # a requester may slow a transfer down, not stall the connection


async def handle_file_list(srv: FileServer, conn, f: Frame) -> None:
    """The daemon's `file_list` handler."""
    await conn.send(file_index_frame(srv.listing(parse_file_list(f))))


async def handle_file_get(srv: FileServer, conn, f: Frame) -> None:
    """The daemon's `file_get` handler: one chunk of a manifest file, or an error frame (never a crash).
    A malformed frame (ProtocolError) closes the connection; a refused request is answered."""
    try:
        g = parse_file_get(f)
    except ValueError as e:
        await conn.send(error_frame(ErrorCode.BAD_REQUEST, str(e), request_id=f.header.get("request_id")))
        return
    try:
        path, size = srv.resolve(g.path)
        if g.offset > size:
            raise PeerError(f"file_get refused: offset {g.offset} is past the end of {g.path!r} ({size} bytes)")
        n = min(g.length, CHUNK, size - g.offset)
        if g.max_mbps is not None:
            cap = max(g.max_mbps, MIN_MBPS)
            per = srv.paced.get(conn)
            if per is None or per.rate != cap * MB:
                per = srv.paced[conn] = TokenBucket(cap * MB)
            await per.take(n)
        await srv.bucket.take(n)
        data = await asyncio.get_running_loop().run_in_executor(None, _read, path, g.offset, n)
    except PeerError as e:
        log.warning("refused a file request from %s: %s", conn.describe(), e)
        await conn.send(error_frame(ErrorCode.BAD_REQUEST, str(e), request_id=g.request_id))
        return
    srv.bytes_sent += len(data)
    await conn.send(file_chunk_frame(FileChunk(g.request_id, g.path, g.offset, size, data)))


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


async def _ask(conn, make: Callable[[str], Frame]) -> Frame:
    """Send the request `make(request_id)` and return the answer with that id (an error: PeerError)."""
    rid = _secrets.token_hex(6)
    await conn.send(make(rid))
    while True:
        r = await asyncio.wait_for(conn.recv(), REQUEST_TIMEOUT_S)
        if r.header.get("request_id") not in (rid, None):
            continue
        if r.kind == "error":
            raise PeerError(parse_error(r).message)
        return r


async def list_peer_files(
    addrs: Iterable[tuple[str, int]], secret: bytes, *, echo: Callable[[str], None] = print, timeout: float = 3.0
) -> dict[tuple[str, int], dict[str, dict]]:
    """addr -> {name: {size, sha256}} of every peer that answers (the others are reported and skipped)."""
    from p2pk3.transport.connection import open_connection

    async def one(addr):
        try:
            conn = await open_connection(*addr, secret, _node_id(), timeout=timeout, handshake_timeout=timeout)
        except Exception as e:
            echo(f"peer {addr[0]}:{addr[1]}: not reachable ({type(e).__name__}: {e})")
            return addr, None
        try:
            ix = parse_file_index(await _ask(conn, file_list_frame))
            return addr, {n: {"size": f.size, "sha256": f.sha256} for n, f in ix.files.items() if safe_name(n)}
        except Exception as e:
            echo(f"peer {addr[0]}:{addr[1]}: no file list ({type(e).__name__}: {e})")
            return addr, None
        finally:
            conn.close("file list done")

    got = await asyncio.gather(*(one(tuple(a)) for a in addrs))
    return {a: f for a, f in got if f}


async def fetch_file(
    addr: tuple[str, int],
    secret: bytes,
    name: str,
    size: int,
    part: Path,
    *,
    rate_mbps: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
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
                get = FileGet(None, name, have, min(CHUNK, size - have), rate_mbps)
                r = await _ask(conn, lambda rid, get=get: file_get_frame(replace(get, request_id=rid)))
                if r.kind != "file_chunk":
                    raise PeerError(f"{name}: unexpected answer {r.kind!r} to file_get at offset {have}")
                c = parse_file_chunk(r)
                if c.path != name or c.offset != have or c.size != size:
                    raise PeerError(
                        f"{name}: unexpected answer {c.path!r} at offset {c.offset} (size {c.size}, "
                        f"expected offset {have} of {size})"
                    )
                data = c.data
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
