"""File sharing between nodes (deploy/peers.py serves and fetches): `file_list` -> `file_index`,
`file_get` -> `file_chunk` (+ tensor `data`); a refused request is answered with `error` (bad_request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..codec import Frame, ProtocolError
from .fields import brief, count, expect, is_int

FILE_CHUNK = 8 << 20  # the most a file_get is answered with
MAX_PATH = 4096


def parse_request_id(h: Mapping[str, Any], where: str) -> int | str | None:
    rid = h.get("request_id")
    if not (rid is None or (isinstance(rid, str) and len(rid) <= 64) or (is_int(rid) and 0 <= rid < 1 << 63)):
        raise ProtocolError(
            f"{where}: request_id must be a string of at most 64 characters or an integer, got {brief(rid)}"
        )
    return rid


def file_list_frame(request_id: int | str | None) -> Frame:
    """Which files do you serve?"""
    return Frame.make("file_list", request_id=request_id)


def parse_file_list(frame: Frame) -> int | str | None:
    """The request id."""
    return parse_request_id(expect(frame, "file_list"), "file_list frame")


@dataclass(frozen=True)
class FileInfo:
    size: int
    sha256: str


@dataclass
class FileIndex:
    """`file_index`, the answer to `file_list`: name -> FileInfo of the files the node serves (its
    manifest's files on its disk), and the checkpoint's `repo` and `commit`."""

    request_id: int | str | None
    files: dict[str, FileInfo]
    commit: str | None = None
    repo: str | None = None


def file_index_frame(ix: FileIndex) -> Frame:
    files = {n: {"size": f.size, "sha256": f.sha256} for n, f in ix.files.items()}
    return Frame.make("file_index", request_id=ix.request_id, files=files, commit=ix.commit, repo=ix.repo)


def parse_file_index(frame: Frame) -> FileIndex:
    h = expect(frame, "file_index")
    w = "file_index frame"
    files = h.get("files")
    if not isinstance(files, dict):
        raise ProtocolError(f"{w}: files must be a map of name -> {{size, sha256}}")
    out = {}
    for n, f in files.items():
        if not isinstance(n, str) or not 0 < len(n) <= MAX_PATH:
            raise ProtocolError(f"{w}: file name {brief(n)} must be a string of at most {MAX_PATH} characters")
        if not isinstance(f, dict) or not isinstance(f.get("sha256"), str):
            raise ProtocolError(f"{w}: files[{n!r}] must be {{size, sha256 (string)}}")
        out[n] = FileInfo(count(f.get("size"), f"{w}: files[{n!r}].size"), f["sha256"])
    for k in ("commit", "repo"):
        if h.get(k) is not None and not isinstance(h[k], str):
            raise ProtocolError(f"{w}: {k} must be a string or nil")
    return FileIndex(parse_request_id(h, w), out, h.get("commit"), h.get("repo"))


@dataclass(frozen=True)
class FileGet:
    """`file_get`: `length` bytes (<= FILE_CHUNK) of `path` from `offset`; `max_mbps`: a slower pace asked for."""

    request_id: int | str | None
    path: str
    offset: int = 0
    length: int = FILE_CHUNK
    max_mbps: float | None = None


def file_get_frame(g: FileGet) -> Frame:
    cap = {"max_mbps": g.max_mbps} if g.max_mbps else {}
    return Frame.make("file_get", path=g.path, offset=g.offset, length=g.length, **cap, request_id=g.request_id)


def parse_file_get(frame: Frame) -> FileGet:
    """Raises ProtocolError for a malformed frame (bad request_id or path), ValueError for invalid
    contents (answered with a bad_request error; the connection stays open)."""
    h = expect(frame, "file_get")
    rid = parse_request_id(h, "file_get frame")
    p = h.get("path")
    if not isinstance(p, str) or len(p) > MAX_PATH:
        raise ProtocolError(f"file_get frame: path must be a string of at most {MAX_PATH} characters")
    offset, length = h.get("offset", 0), h.get("length", FILE_CHUNK)
    if not all(is_int(v) and v >= 0 for v in (offset, length)):
        raise ValueError("file_get refused: offset and length must be non-negative integers")
    cap = h.get("max_mbps")  # anything but a positive number: no cap of its own
    cap = float(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0 else None
    return FileGet(rid, p, offset, length, cap)


@dataclass
class FileChunk:
    """`file_chunk`, the answer to `file_get`: `data` (the frame's uint8 tensor) at `offset` of `path`,
    whose whole size is `size`."""

    request_id: int | str | None
    path: str
    offset: int
    size: int
    data: Any  # a memoryview (received) or bytes-like (to send)


def file_chunk_frame(c: FileChunk) -> Frame:
    return Frame.make(
        "file_chunk",
        {"data": ("uint8", (len(c.data),), c.data)},
        request_id=c.request_id,
        path=c.path,
        offset=c.offset,
        size=c.size,
    )


def parse_file_chunk(frame: Frame) -> FileChunk:
    h = expect(frame, "file_chunk")
    w = "file_chunk frame"
    if not frame.has("data") or frame.names() != ["data"]:
        raise ProtocolError(f"{w}: needs exactly one tensor, 'data'")
    d = frame.desc("data")
    if d["dtype"] != "uint8" or len(d["shape"]) != 1:
        raise ProtocolError(f"{w}: data must be uint8 [n], got {d['dtype']}{d['shape']}")
    path = h.get("path")
    if not isinstance(path, str):
        raise ProtocolError(f"{w}: path must be a string")
    return FileChunk(
        parse_request_id(h, w),
        path,
        count(h.get("offset"), f"{w}: offset"),
        count(h.get("size"), f"{w}: size"),
        frame.buffer("data"),
    )
