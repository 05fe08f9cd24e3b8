"""Wire frames: a fixed prefix, a msgpack header, and a payload of raw tensor buffers.

Layout (little-endian; byte by byte in docs/protocol.md)::

    0   4  magic         b"P2K3"
    4   1  version       u8   (VERSION)
    5   1  flags         u8   (bit 0: FLAG_CRC32, a 4-byte CRC-32 trailer follows the payload)
    6   4  header_len    u32  (<= MAX_HEADER_LEN)
    10  8  payload_len   u64  (<= the receiver's max_payload, default 4 GiB)
    18  header_len bytes msgpack map: {"kind": str, ..., "tensors": [{name, dtype, shape, offset, nbytes}]}
    ..  payload_len bytes: the tensor buffers at their offsets (64-byte aligned when we encode)
    ..  [4 bytes CRC-32 of header + payload, only with FLAG_CRC32]

No pickle: headers are msgpack with string keys, no ext types, only nil/bool/int/float/str/bin/array/map.
This module never imports torch: tensors travel as bytes-like objects (memoryview, bytearray, numpy).

Sending never copies tensor data: `encode()` returns the chunks (one small prefix+header buffer, then
the caller's buffers with zero padding between them) for `transport.writelines` / `socket.sendmsg`.
Receiving: `FrameDecoder` is a sans-IO state machine for an `asyncio.BufferedProtocol`. The prefix and
header go through a small staging buffer; the payload gets ONE allocation of exactly `payload_len`
bytes (after all limits are checked) and the socket reads straight into it. Received tensors are
memoryviews into that payload.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import msgpack
import numpy as np

MAGIC = b"P2K3"
VERSION = 1
PREFIX = struct.Struct("<4sBBIQ")
PREFIX_SIZE = PREFIX.size  # 18
FLAG_CRC32 = 0x01
KNOWN_FLAGS = FLAG_CRC32
TRAILER_SIZE = 4
MAX_HEADER_LEN = 1 << 20  # 1 MiB
DEFAULT_MAX_PAYLOAD = 4 << 30  # 4 GiB
ALIGN = 64  # tensor offsets inside the payload, as encoded by us (receivers accept any offset)
MAX_TENSORS = 4096
MAX_NDIM = 8
_ZEROS = bytes(ALIGN)

# dtype name -> itemsize. Names follow torch (without the "torch." prefix).
DTYPES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# numpy view of each dtype. numpy has no bfloat16 / float8: they are returned as raw integers of the
# same width (torch: `torch.frombuffer(mv, dtype=torch.bfloat16)` reads them directly).
_NUMPY: dict[str, str] = {
    "bool": "bool", "uint8": "uint8", "int8": "int8", "int16": "int16", "uint16": "uint16",
    "int32": "int32", "uint32": "uint32", "int64": "int64", "uint64": "uint64", "float16": "float16",
    "bfloat16": "uint16", "float32": "float32", "float64": "float64", "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
}
_FROM_NUMPY = {"bool": "bool", "uint8": "uint8", "int8": "int8", "int16": "int16", "uint16": "uint16",
               "int32": "int32", "uint32": "uint32", "int64": "int64", "uint64": "uint64",
               "float16": "float16", "float32": "float32", "float64": "float64"}


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame (or broke the protocol's rules).
    Raised by FrameDecoder.buffer_updated with `frames`: the frames completed before the error."""

    frames: list = []


# ------------------------------------------------------------------------------------------ tensors
def tensor_desc(name: str, dtype: str, shape: Sequence[int], offset: int | None = None,
                nbytes: int | None = None) -> dict[str, Any]:
    """A tensor descriptor for a header's `tensors` list. `offset` is filled in by `encode`."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
    shp = [int(s) for s in shape]
    if any(s < 0 for s in shp):
        raise ValueError(f"negative dimension in shape {shp}")
    n = math.prod(shp) * DTYPES[dtype]
    if nbytes is not None and nbytes != n:
        raise ValueError(f"tensor {name!r}: nbytes {nbytes} != prod({shp}) * {DTYPES[dtype]} = {n}")
    d: dict[str, Any] = {"name": name, "dtype": dtype, "shape": shp, "nbytes": n}
    if offset is not None:
        d["offset"] = int(offset)
    return d


def as_bytes(buf: Any) -> memoryview:
    """A flat, byte-format memoryview over `buf` without copying (must be C-contiguous)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("tensor buffer must be C-contiguous (call .contiguous() / np.ascontiguousarray first)")
    if mv.format == "B" and mv.ndim == 1:
        return mv
    try:
        return mv.cast("B")
    except TypeError:  # formats memoryview cannot cast (e.g. numpy structured); numpy can
        return memoryview(np.asarray(buf).reshape(-1).view(np.uint8))


def _tensor_arg(name: str, t: Any) -> tuple[dict[str, Any], memoryview]:
    """(descriptor, bytes view) from a numpy array or a (dtype, shape, buffer) tuple."""
    if isinstance(t, tuple):
        if len(t) != 3:
            raise ValueError(f"tensor {name!r}: expected (dtype, shape, buffer), got a {len(t)}-tuple")
        dtype, shape, buf = t
        mv = as_bytes(buf)
        d = tensor_desc(name, dtype, shape)
        if mv.nbytes != d["nbytes"]:
            raise ValueError(f"tensor {name!r}: buffer has {mv.nbytes} bytes, {dtype}{list(shape)} needs {d['nbytes']}")
        return d, mv
    if isinstance(t, np.ndarray):
        dt = _FROM_NUMPY.get(t.dtype.name)
        if dt is None:
            raise ValueError(f"tensor {name!r}: numpy dtype {t.dtype} has no wire dtype; pass (dtype, shape, buffer)")
        if not t.flags.c_contiguous:
            raise ValueError(f"tensor {name!r}: array must be C-contiguous")
        return tensor_desc(name, dt, t.shape), as_bytes(t.reshape(-1).view(np.uint8))
    raise TypeError(f"tensor {name!r}: expected a numpy array or (dtype, shape, buffer), got {type(t).__name__}")


# ------------------------------------------------------------------------------------------- frames
@dataclass
class Frame:
    """A header (msgpack-able dict with `kind`) and the tensor buffers described by header["tensors"].

    For sending, `buffers[i]` is the data of `header["tensors"][i]` (offsets are assigned by `encode`).
    For received frames, `buffers[i]` is a memoryview into the single payload buffer (`payload`).
    """

    header: dict[str, Any]
    buffers: list[memoryview] = field(default_factory=list)
    payload: memoryview | None = field(default=None, repr=False)

    @classmethod
    def make(cls, kind: str, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
             **fields: Any) -> "Frame":
        """Frame.make("forward", tensors={"prefix": ("bfloat16", (N, D), buf)}, segments=[...]).
        Tensors: numpy arrays (dtype inferred) or (dtype, shape, buffer) tuples; order is kept."""
        header: dict[str, Any] = {"kind": kind, **fields}
        bufs: list[memoryview] = []
        if tensors:
            items = tensors.items() if isinstance(tensors, Mapping) else tensors
            descs = []
            for name, t in items:
                d, mv = _tensor_arg(name, t)
                descs.append(d)
                bufs.append(mv)
            header["tensors"] = descs
        return cls(header, bufs)

    @property
    def kind(self) -> str:
        return self.header["kind"]

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return self.header.get("tensors", [])

    def names(self) -> list[str]:
        return [d["name"] for d in self.tensors]

    def has(self, name: str) -> bool:
        return any(d["name"] == name for d in self.tensors)

    def desc(self, name: str) -> dict[str, Any]:
        for d in self.tensors:
            if d["name"] == name:
                return d
        raise KeyError(f"frame {self.kind!r} has no tensor {name!r} (has {self.names()})")

    def buffer(self, name: str) -> memoryview:
        """The raw bytes of tensor `name` (zero copy)."""
        for d, b in zip(self.tensors, self.buffers):
            if d["name"] == name:
                return b
        raise KeyError(f"frame {self.kind!r} has no tensor {name!r} (has {self.names()})")

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` as a numpy array viewing the frame's memory (bfloat16/float8 as raw uints)."""
        d = self.desc(name)
        return np.frombuffer(self.buffer(name), dtype=_NUMPY[d["dtype"]]).reshape(d["shape"])

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def _layout(descs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    out, off = [], 0
    for d in descs:
        off = -(-off // ALIGN) * ALIGN
        out.append({**d, "offset": off})
        off += d["nbytes"]
    return out, off


def pack_header(header: Mapping[str, Any]) -> bytes:
    try:
        return msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"header is not msgpack-serializable without extensions: {e}") from None


def encode(frame: Frame, *, checksum: bool = False) -> list[Any]:
    """Chunks of the encoded frame, for `writelines`/`sendmsg`. Tensor buffers are not copied."""
    header = frame.header
    if not isinstance(header.get("kind"), str) or not header["kind"]:
        raise ValueError("frame header needs a non-empty string 'kind'")
    descs = header.get("tensors") or []
    if len(descs) != len(frame.buffers):
        raise ValueError(f"header describes {len(descs)} tensors but {len(frame.buffers)} buffers were given")
    bufs = [as_bytes(b) for b in frame.buffers]
    for d, b in zip(descs, bufs):
        if b.nbytes != d["nbytes"]:
            raise ValueError(f"tensor {d['name']!r}: buffer has {b.nbytes} bytes, descriptor says {d['nbytes']}")
    if descs:
        laid, payload_len = _layout(descs)
        header = {**header, "tensors": laid}
    else:
        laid, payload_len = [], 0
    hb = pack_header(header)
    if len(hb) > MAX_HEADER_LEN:
        raise ValueError(f"header is {len(hb)} bytes, the limit is {MAX_HEADER_LEN}")
    flags = FLAG_CRC32 if checksum else 0
    chunks: list[Any] = [PREFIX.pack(MAGIC, VERSION, flags, len(hb), payload_len) + hb]
    pos = 0
    for d, b in zip(laid, bufs):
        pad = d["offset"] - pos
        if pad:
            chunks.append(_ZEROS[:pad])
        if b.nbytes:
            chunks.append(b)
        pos = d["offset"] + b.nbytes
    if checksum:
        crc = zlib.crc32(hb)
        for c in chunks[1:]:
            crc = zlib.crc32(c, crc)
        chunks.append(struct.pack("<I", crc))
    return chunks


def encode_bytes(frame: Frame, *, checksum: bool = False) -> bytes:
    """The whole frame as one bytes object (copies; for tests and small frames)."""
    return b"".join(bytes(c) for c in encode(frame, checksum=checksum))


# ------------------------------------------------------------------------------------------ decoding
def parse_prefix(b: bytes | memoryview, *, max_header: int = MAX_HEADER_LEN,
                 max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[int, int, int]:
    """(flags, header_len, payload_len) of an 18-byte prefix, after every limit check."""
    magic, version, flags, hlen, plen = PREFIX.unpack(b)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a p2pk3 peer or a corrupted stream")
    if version != VERSION:
        raise ProtocolError(f"unknown frame version {version} (this node speaks version {VERSION})")
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(f"unknown frame flags 0x{flags:02x}")
    if hlen == 0:
        raise ProtocolError("empty frame header")
    if hlen > max_header:
        raise ProtocolError(f"frame header of {hlen} bytes exceeds the limit of {max_header} bytes")
    if plen > max_payload:
        raise ProtocolError(f"frame payload of {plen} bytes exceeds the limit of {max_payload} bytes")
    return flags, hlen, plen


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed in headers")


_PLAIN = (str, bytes, int, float, bool, type(None))


def _check_plain(obj: Any, depth: int = 0) -> None:
    if depth > 32:
        raise ProtocolError("frame header nests too deeply")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ProtocolError(f"frame header map key {k!r} is not a string")
            _check_plain(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_plain(v, depth + 1)
    elif not isinstance(obj, _PLAIN):
        raise ProtocolError(f"frame header holds a value of type {type(obj).__name__}")


def decode_header(hb: bytes | memoryview, payload_len: int) -> dict[str, Any]:
    """Unpack and validate a header (structure, `kind`, tensor descriptors against `payload_len`)."""
    try:
        header = msgpack.unpackb(hb, raw=False, strict_map_key=True, ext_hook=_reject_ext, use_list=True,
                                 timestamp=0)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolError(f"frame header is not valid msgpack: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"frame header is a {type(header).__name__}, expected a map")
    _check_plain(header)
    kind = header.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ProtocolError("frame header has no string 'kind'")
    validate_tensors(header, payload_len)
    return header


def validate_tensors(header: Mapping[str, Any], payload_len: int) -> list[dict[str, Any]]:
    descs = header.get("tensors", [])
    if not isinstance(descs, list):
        raise ProtocolError("'tensors' must be a list")
    if len(descs) > MAX_TENSORS:
        raise ProtocolError(f"{len(descs)} tensors in one frame (limit {MAX_TENSORS})")
    names = set()
    for i, d in enumerate(descs):
        if not isinstance(d, dict):
            raise ProtocolError(f"tensor descriptor {i} is not a map")
        name, dtype, shape, off, n = (d.get(k) for k in ("name", "dtype", "shape", "offset", "nbytes"))
        where = f"tensor {name!r}" if isinstance(name, str) else f"tensor descriptor {i}"
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"{where}: missing name")
        if name in names:
            raise ProtocolError(f"{where}: duplicate tensor name")
        names.add(name)
        if dtype not in DTYPES:
            raise ProtocolError(f"{where}: unknown dtype {dtype!r}")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise ProtocolError(f"{where}: bad shape {shape!r}")
        for k, v in (("offset", off), ("nbytes", n)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ProtocolError(f"{where}: bad {k} {v!r}")
        want = math.prod(shape) * DTYPES[dtype]
        if n != want:
            raise ProtocolError(f"{where}: nbytes {n} != prod({shape}) * {DTYPES[dtype]} = {want}")
        if off + n > payload_len:
            raise ProtocolError(f"{where}: bytes [{off}, {off + n}) lie outside the {payload_len}-byte payload")
    return descs


def default_alloc(n: int) -> memoryview:
    """The payload buffer: uninitialised memory (no zero fill; pages are committed as the socket writes)."""
    return memoryview(np.empty(n, dtype=np.uint8))


_PREFIX, _HEADER, _PAYLOAD, _TRAILER = range(4)


class FrameDecoder:
    """Sans-IO frame reader for `asyncio.BufferedProtocol`: `get_buffer()` says where the socket should
    read next, `buffer_updated(n)` returns the frames completed by those n bytes (or raises ProtocolError;
    the decoder is then dead). The payload of each frame is one allocation of exactly `payload_len`
    bytes, made after the limits are checked; while a payload is being read `get_buffer()` returns the
    unfilled part of it, so the kernel writes the data straight into its final place."""

    def __init__(self, *, max_header: int = MAX_HEADER_LEN, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 alloc: Callable[[int], Any] | None = None, staging_size: int = 64 << 10):
        self.max_header = max_header
        self.max_payload = max_payload
        self.alloc = alloc or default_alloc
        self._stage = bytearray(max(staging_size, PREFIX_SIZE + 64))
        self._smv = memoryview(self._stage)
        self._r = 0  # read position in staging
        self._w = 0  # write position in staging
        self._state = _PREFIX
        self._flags = self._hlen = self._plen = 0
        self._hbytes: bytes = b""
        self._header: dict[str, Any] | None = None
        self._payload: memoryview | None = None
        self._pfill = 0
        self.error: ProtocolError | None = None
        self.frames_decoded = 0
        self.bytes_received = 0

    # -- the staging buffer
    def _need_stage(self) -> int:
        return {_PREFIX: PREFIX_SIZE, _HEADER: self._hlen, _TRAILER: TRAILER_SIZE}.get(self._state, 0)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self.error is not None:
            raise self.error
        if self._state == _PAYLOAD:
            return self._payload[self._pfill:]
        if self._w == len(self._stage):
            # compact, and grow if one header does not fit (bounded by max_header, checked already)
            avail = self._w - self._r
            need = max(self._need_stage(), avail + 1)
            if need > len(self._stage):
                # a new buffer (the old one may still be exported to the transport)
                new = bytearray(max(need, 2 * len(self._stage)))
                new[:avail] = self._smv[self._r:self._w]
                self._stage, self._smv = new, memoryview(new)
            elif self._r:
                self._smv[:avail] = self._smv[self._r:self._w]
            self._r, self._w = 0, avail
        return self._smv[self._w:]

    def buffer_updated(self, n: int) -> list[Frame]:
        if self.error is not None:
            raise self.error
        self.bytes_received += n
        out: list[Frame] = []
        try:
            if self._state == _PAYLOAD:
                self._pfill += n
                if self._pfill == self._plen:
                    self._after_payload(out)
            else:
                self._w += n
            self._run(out)
        except ProtocolError as e:
            self.error = e
            e.frames = out  # frames completed before the error, still to be delivered
            raise
        return out

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        """Push bytes in (copying them through get_buffer); for tests and non-buffered transports."""
        data = memoryview(data).cast("B")
        out: list[Frame] = []
        while data.nbytes:
            buf = self.get_buffer()
            k = min(buf.nbytes, data.nbytes)
            buf[:k] = data[:k]
            data = data[k:]
            out.extend(self.buffer_updated(k))
        return out

    def _run(self, out: list[Frame]) -> None:
        while True:
            avail = self._w - self._r
            if self._state == _PREFIX:
                if avail < PREFIX_SIZE:
                    break
                self._flags, self._hlen, self._plen = parse_prefix(
                    self._smv[self._r:self._r + PREFIX_SIZE], max_header=self.max_header, max_payload=self.max_payload)
                self._r += PREFIX_SIZE
                self._state = _HEADER
            elif self._state == _HEADER:
                if avail < self._hlen:
                    break
                hb = bytes(self._smv[self._r:self._r + self._hlen])
                self._r += self._hlen
                self._header = decode_header(hb, self._plen)
                self._hbytes = hb if self._flags & FLAG_CRC32 else b""
                if self._plen == 0:
                    self._payload = memoryview(b"")
                    self._pfill = 0
                    self._after_payload(out)
                    continue
                buf = self.alloc(self._plen)
                mv = buf if isinstance(buf, memoryview) else memoryview(buf)
                mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
                if mv.nbytes < self._plen or mv.readonly:
                    raise ProtocolError("payload allocator returned a too small or read-only buffer")
                self._payload = mv[:self._plen]
                k = min(self._w - self._r, self._plen)
                if k:
                    self._payload[:k] = self._smv[self._r:self._r + k]
                    self._r += k
                self._pfill = k
                self._state = _PAYLOAD
                if k == self._plen:
                    self._after_payload(out)
                    continue
                break  # the rest of the payload is read directly into self._payload
            elif self._state == _TRAILER:
                if avail < TRAILER_SIZE:
                    break
                (crc,) = struct.unpack_from("<I", self._smv, self._r)
                self._r += TRAILER_SIZE
                got = zlib.crc32(self._payload, zlib.crc32(self._hbytes))
                if got != crc:
                    raise ProtocolError(f"frame checksum mismatch (crc32 0x{got:08x} != 0x{crc:08x}): corrupted in transit")
                self._emit(out)
            else:  # _PAYLOAD, more to read
                break
        if self._r == self._w:
            self._r = self._w = 0

    def _after_payload(self, out: list[Frame]) -> None:
        if self._flags & FLAG_CRC32:
            self._state = _TRAILER
        else:
            self._emit(out)

    def _emit(self, out: list[Frame]) -> None:
        header, payload = self._header, self._payload
        bufs = [payload[d["offset"]:d["offset"] + d["nbytes"]] for d in header.get("tensors", [])]
        out.append(Frame(header, bufs, payload))
        self.frames_decoded += 1
        self._header = self._payload = None
        self._hbytes = b""
        self._pfill = 0
        self._state = _PREFIX


def decode_bytes(data: bytes, **kw: Any) -> list[Frame]:
    """All frames in `data` (must end on a frame boundary)."""
    dec = FrameDecoder(**kw)
    frames = dec.feed(data)
    if dec._state != _PREFIX or dec._w != dec._r:
        raise ProtocolError("truncated frame")
    return frames


# ======================================================================================= message kinds
# Builders and checkers for the frame kinds of docs/protocol.md. Receivers call the `parse_*` helpers,
# which raise ProtocolError on anything malformed.

KINDS = ("hello", "auth", "forward", "tokens", "result", "free", "error", "ping", "pong", "claim", "claim_result")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_session(v: Any, where: str) -> None:
    if not ((isinstance(v, str) and 0 < len(v) <= 256) or _is_int(v)):
        raise ProtocolError(f"{where}: session id must be a non-empty string (<= 256 chars) or an integer")


SAMPLE_FIELDS = {"temperature": (int, float), "top_p": (int, float), "top_k": (int,), "min_p": (int, float),
                 "seed": (int,), "logprobs": (bool,), "max_tokens": (int,), "stop": (list,)}


@dataclass(frozen=True)
class Segment:
    """One session's run of consecutive tokens in a batched frame: positions start_pos .. start_pos+n_tokens-1.
    `sample`: set on the segment whose last position the last stage must sample (see docs/protocol.md)."""

    session: str | int
    epoch: int
    start_pos: int
    n_tokens: int
    sample: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"session": self.session, "epoch": self.epoch, "start_pos": self.start_pos,
                             "n_tokens": self.n_tokens}
        if self.sample is not None:
            d["sample"] = self.sample
        return d

    @classmethod
    def from_wire(cls, d: Any, where: str = "segment") -> "Segment":
        if not isinstance(d, dict):
            raise ProtocolError(f"{where}: not a map")
        _check_session(d.get("session"), where)
        for k in ("epoch", "start_pos"):
            if not _is_int(d.get(k)) or d[k] < 0:
                raise ProtocolError(f"{where}: {k} must be a non-negative integer, got {d.get(k)!r}")
        if not _is_int(d.get("n_tokens")) or d["n_tokens"] <= 0:
            raise ProtocolError(f"{where}: n_tokens must be a positive integer, got {d.get('n_tokens')!r}")
        s = d.get("sample")
        if s is not None:
            if not isinstance(s, dict):
                raise ProtocolError(f"{where}: sample must be a map")
            for k, v in s.items():
                t = SAMPLE_FIELDS.get(k)
                if t is not None and (not isinstance(v, t) or (t != (bool,) and isinstance(v, bool))):
                    raise ProtocolError(f"{where}: sample.{k} has the wrong type ({type(v).__name__})")
        return cls(d["session"], d["epoch"], d["start_pos"], d["n_tokens"], s)


def _segments(segs: Iterable[Segment | Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for s in segs:
        out.append(s.to_wire() if isinstance(s, Segment) else Segment.from_wire(dict(s)).to_wire())
    if not out:
        raise ValueError("a batch needs at least one segment")
    return out


def _parse_segments(header: Mapping[str, Any]) -> list[Segment]:
    segs = header.get("segments")
    if not isinstance(segs, list) or not segs:
        raise ProtocolError(f"{header.get('kind')} frame: 'segments' must be a non-empty list")
    return [Segment.from_wire(s, f"segment {i}") for i, s in enumerate(segs)]


def _shape_of(t: Any) -> tuple[int, ...]:
    return tuple(t[1]) if isinstance(t, tuple) else tuple(t.shape)


def forward_frame(segments: Iterable[Segment | Mapping[str, Any]], prefix: Any, bank: Any = None,
                  partial_latent: Any = None, *, layer: int, mid_moe: bool = False, **extra: Any) -> Frame:
    """A stage-boundary hop: `prefix` [N, D], `bank` [R, N, D] (AttnRes snapshots; None when R = 0),
    `partial_latent` [N, W] (only when `mid_moe`: the hop is inside layer `layer`'s MoE, split over slots).
    `layer`: the first layer the receiver runs (or continues, when mid_moe). Tensors are numpy arrays
    or (dtype, shape, buffer) tuples (bf16 from torch: ("bfloat16", t.shape, t.view(torch.uint8).numpy()))."""
    segs = _segments(segments)
    n = sum(s["n_tokens"] for s in segs)
    ps = _shape_of(prefix)
    if len(ps) != 2 or ps[0] != n:
        raise ValueError(f"prefix shape {list(ps)} must be [N={n}, D]")
    tensors: list[tuple[str, Any]] = [("prefix", prefix)]
    if bank is not None:
        bs = _shape_of(bank)
        if len(bs) != 3 or bs[1:] != ps:
            raise ValueError(f"bank shape {list(bs)} must be [R, {n}, {ps[1]}]")
        tensors.append(("bank", bank))
    if mid_moe != (partial_latent is not None):
        raise ValueError("partial_latent is sent exactly when mid_moe is set")
    if partial_latent is not None:
        ls = _shape_of(partial_latent)
        if len(ls) != 2 or ls[0] != n:
            raise ValueError(f"partial_latent shape {list(ls)} must be [N={n}, W]")
        tensors.append(("partial_latent", partial_latent))
    return Frame.make("forward", tensors, segments=segs, layer=int(layer), mid_moe=bool(mid_moe), **extra)


@dataclass
class ForwardView:
    segments: list[Segment]
    layer: int
    mid_moe: bool
    n_tokens: int
    hidden: int
    bank_rows: int
    frame: Frame

    @property
    def prefix(self) -> memoryview:
        return self.frame.buffer("prefix")

    @property
    def bank(self) -> memoryview | None:
        return self.frame.buffer("bank") if self.bank_rows else None

    @property
    def partial_latent(self) -> memoryview | None:
        return self.frame.buffer("partial_latent") if self.mid_moe else None


def parse_forward(frame: Frame) -> ForwardView:
    h = frame.header
    if h.get("kind") != "forward":
        raise ProtocolError(f"expected a forward frame, got {h.get('kind')!r}")
    segs = _parse_segments(h)
    layer, mid = h.get("layer"), h.get("mid_moe", False)
    if not _is_int(layer) or layer < 0:
        raise ProtocolError(f"forward frame: bad layer {layer!r}")
    if not isinstance(mid, bool):
        raise ProtocolError("forward frame: mid_moe must be a bool")
    n = sum(s.n_tokens for s in segs)
    names = frame.names()
    if not frame.has("prefix"):
        raise ProtocolError("forward frame has no 'prefix' tensor")
    p = frame.desc("prefix")
    if len(p["shape"]) != 2 or p["shape"][0] != n:
        raise ProtocolError(f"forward frame: prefix shape {p['shape']} does not match the {n} tokens of its segments")
    rows = 0
    if frame.has("bank"):
        b = frame.desc("bank")
        if len(b["shape"]) != 3 or b["shape"][1:] != p["shape"] or b["dtype"] != p["dtype"]:
            raise ProtocolError(f"forward frame: bank {b['dtype']}{b['shape']} does not match prefix {p['dtype']}{p['shape']}")
        rows = b["shape"][0]
    if mid != frame.has("partial_latent"):
        raise ProtocolError("forward frame: partial_latent must be present exactly when mid_moe is set")
    if mid:
        q = frame.desc("partial_latent")
        if len(q["shape"]) != 2 or q["shape"][0] != n:
            raise ProtocolError(f"forward frame: partial_latent shape {q['shape']} must be [{n}, W]")
    extra = set(names) - {"prefix", "bank", "partial_latent"}
    if extra:
        raise ProtocolError(f"forward frame: unexpected tensors {sorted(extra)}")
    return ForwardView(segs, layer, mid, n, p["shape"][1], rows, frame)


def tokens_frame(segments: Iterable[Segment | Mapping[str, Any]], ids: Any, **extra: Any) -> Frame:
    """Token ids entering the ring at the first slot: `ids` int32/int64 [N]."""
    segs = _segments(segments)
    n = sum(s["n_tokens"] for s in segs)
    if _shape_of(ids) != (n,):
        raise ValueError(f"ids shape {list(_shape_of(ids))} must be [N={n}]")
    return Frame.make("tokens", [("ids", ids)], segments=segs, **extra)


def parse_tokens(frame: Frame) -> tuple[list[Segment], np.ndarray]:
    h = frame.header
    if h.get("kind") != "tokens":
        raise ProtocolError(f"expected a tokens frame, got {h.get('kind')!r}")
    segs = _parse_segments(h)
    n = sum(s.n_tokens for s in segs)
    if frame.names() != ["ids"]:
        raise ProtocolError(f"tokens frame: expected exactly one tensor 'ids', got {frame.names()}")
    d = frame.desc("ids")
    if d["dtype"] not in ("int32", "int64") or d["shape"] != [n]:
        raise ProtocolError(f"tokens frame: ids must be int32/int64 [{n}], got {d['dtype']}{d['shape']}")
    return segs, frame.array("ids")


def result_frame(results: Iterable[Mapping[str, Any]], logits: Any = None, **extra: Any) -> Frame:
    """Sampled tokens leaving the last slot: results [{session, epoch, pos, token, logprob?, finished?}];
    optional `logits` float32 [len(results), V] when a segment asked for them."""
    rs = [dict(r) for r in results]
    for i, r in enumerate(rs):
        _check_result(r, i, ValueError)
    tensors = [("logits", logits)] if logits is not None else None
    return Frame.make("result", tensors, results=rs, **extra)


def _check_result(r: Any, i: int, exc: type[Exception]) -> None:
    if not isinstance(r, dict):
        raise exc(f"result {i}: not a map")
    try:
        _check_session(r.get("session"), f"result {i}")
    except ProtocolError as e:
        raise exc(str(e)) from None
    for k in ("epoch", "pos", "token"):
        if not _is_int(r.get(k)) or r[k] < 0:
            raise exc(f"result {i}: {k} must be a non-negative integer, got {r.get(k)!r}")
    if "logprob" in r and not isinstance(r["logprob"], (int, float)):
        raise exc(f"result {i}: logprob must be a number")
    if "finished" in r and not isinstance(r["finished"], (bool, str)):
        raise exc(f"result {i}: finished must be a bool or a reason string")


def parse_result(frame: Frame) -> list[dict[str, Any]]:
    h = frame.header
    if h.get("kind") != "result":
        raise ProtocolError(f"expected a result frame, got {h.get('kind')!r}")
    rs = h.get("results")
    if not isinstance(rs, list):
        raise ProtocolError("result frame: 'results' must be a list")
    for i, r in enumerate(rs):
        _check_result(r, i, ProtocolError)
    return rs


def free_frame(sessions: Iterable[tuple[str | int, int] | Mapping[str, Any]], reason: str = "") -> Frame:
    ss = []
    for s in sessions:
        d = dict(s) if isinstance(s, Mapping) else {"session": s[0], "epoch": s[1]}
        _check_session(d.get("session"), "free")
        ss.append({"session": d["session"], "epoch": int(d["epoch"])})
    return Frame.make("free", sessions=ss, reason=reason)


def parse_free(frame: Frame) -> list[tuple[str | int, int]]:
    ss = frame.header.get("sessions")
    if frame.kind != "free" or not isinstance(ss, list):
        raise ProtocolError("free frame: 'sessions' must be a list")
    out = []
    for s in ss:
        if not isinstance(s, dict) or not _is_int(s.get("epoch")):
            raise ProtocolError("free frame: each session needs 'session' and an integer 'epoch'")
        _check_session(s.get("session"), "free")
        out.append((s["session"], s["epoch"]))
    return out


def error_frame(code: str, message: str, **ctx: Any) -> Frame:
    """code: short machine-readable string (auth_failed, version_mismatch, bad_frame, unknown_session,
    stale_epoch, overloaded, internal, ...); message: for humans; ctx: session, epoch, fatal, ..."""
    return Frame.make("error", code=code, message=message, **ctx)


def ping_frame(ping_id: int, t_ns: int) -> Frame:
    return Frame.make("ping", id=int(ping_id), t_ns=int(t_ns))


def pong_frame(ping: Frame, **stats: Any) -> Frame:
    return Frame.make("pong", id=ping.header.get("id"), t_ns=ping.header.get("t_ns"), **stats)


__all__ = [
    "MAGIC", "VERSION", "PREFIX", "PREFIX_SIZE", "FLAG_CRC32", "MAX_HEADER_LEN", "DEFAULT_MAX_PAYLOAD", "ALIGN",
    "DTYPES", "ProtocolError", "Frame", "tensor_desc", "as_bytes", "encode", "encode_bytes", "pack_header",
    "parse_prefix", "decode_header", "validate_tensors", "FrameDecoder", "decode_bytes", "default_alloc",
    "KINDS", "Segment", "forward_frame", "parse_forward", "ForwardView", "tokens_frame", "parse_tokens",
    "result_frame", "parse_result", "free_frame", "parse_free", "error_frame", "ping_frame", "pong_frame",
]
