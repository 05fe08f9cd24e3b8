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
the caller's buffers with zero padding between them) for `os.writev` / `transport.writelines`. A
received frame keeps its header bytes (`Frame.wire`), so a stage passing it on sends them and its
payload as they came in (`encode(frame, forward=True)`), without packing the header again.
Receiving: `FrameDecoder` is a sans-IO state machine for an `asyncio.BufferedProtocol`. The prefix and
header go through a small staging buffer; the payload gets ONE buffer of exactly `payload_len` bytes
(after all limits are checked) and the socket reads straight into it (page-aligned and recycled for
large payloads, see FrameDecoder). Received tensors are memoryviews into that payload.
Per frame, header validation costs one msgpack unpack, a scan of the header bytes (which spares the
walk over the header's values unless it holds bin data or deep nesting) and the tensor descriptor checks.
"""
from __future__ import annotations

import math
import struct
import sys
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import msgpack
import numpy as np

_unpackb = msgpack.unpackb

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
_PADS = [_ZEROS[:i] for i in range(ALIGN)]
_ALIGN_M1 = ALIGN - 1
_ALIGN_MASK = -ALIGN

# dtype name -> itemsize. Names follow torch (without the "torch." prefix).
DTYPES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# numpy view of each dtype. numpy has no bfloat16 / float8: they are returned as raw integers of the
# same width (torch: `torch.frombuffer(mv, dtype=torch.bfloat16)` reads them directly).
_DTYPE_SIZE = DTYPES  # (alias used on the hot path)
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
    """A tensor descriptor for a header's `tensors` list. `offset` is filled in by `Frame.make` / `encode`."""
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

    For sending, `buffers[i]` is the data of `header["tensors"][i]` (offsets are assigned by `Frame.make`
    or `encode`). For received frames, `buffers[i]` is a memoryview into the single payload buffer
    (`payload`), and `wire` holds the header bytes as received (see `encode(..., forward=True)`).
    """

    header: dict[str, Any]
    buffers: list[memoryview] = field(default_factory=list)
    payload: memoryview | None = field(default=None, repr=False)
    wire: bytes | None = field(default=None, repr=False, compare=False)

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
            off = 0
            for name, t in items:
                d, mv = _tensor_arg(name, t)
                off = (off + _ALIGN_M1) & _ALIGN_MASK
                d["offset"] = off  # laid out now, so that encode() can use the descriptors as they are
                off += d["nbytes"]
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


_tls = threading.local()


def _packer() -> msgpack.Packer:
    p = getattr(_tls, "packer", None)
    if p is None:
        p = _tls.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    return p


def pack_header(header: Mapping[str, Any]) -> bytes:
    try:
        return _packer().pack(header)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"header is not msgpack-serializable without extensions: {e}") from None


def encode(frame: Frame, *, checksum: bool = False, forward: bool = False) -> list[Any]:
    """Chunks of the encoded frame, for `writelines`/`sendmsg`. Tensor buffers are not copied.

    Descriptors whose "offset" already equals the laid-out offset (frames built by `Frame.make`,
    received frames) are used as they are, otherwise the header is shallow-copied with the offsets
    filled in; the caller's header is never modified.

    forward=True, for a received frame (one with `wire`): the frame goes out as it came in, its header
    bytes as received and its payload buffer, without packing the header again (the header was validated
    on receipt). The caller vouches that header and buffers were not modified since; other frames are
    encoded normally."""
    if forward and frame.wire is not None and frame.payload is not None:
        return _encode_received(frame, checksum)
    header = frame.header
    kind = header.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ValueError("frame header needs a non-empty string 'kind'")
    descs = header.get("tensors") or ()
    bufs = frame.buffers
    if len(descs) != len(bufs):
        raise ValueError(f"header describes {len(descs)} tensors but {len(bufs)} buffers were given")
    chunks: list[Any] = [b""]
    pos = 0
    if descs:
        laid: list[dict[str, Any]] | None = None
        for i, (d, b) in enumerate(zip(descs, bufs)):
            if type(b) is not memoryview or b.ndim != 1 or b.format != "B" or not b.c_contiguous:
                b = as_bytes(b)
            nb = b.nbytes
            if nb != d["nbytes"]:
                raise ValueError(f"tensor {d['name']!r}: buffer has {nb} bytes, descriptor says {d['nbytes']}")
            off = (pos + _ALIGN_M1) & _ALIGN_MASK
            if off != pos:
                chunks.append(_PADS[off - pos])
            if nb:
                chunks.append(b)
            o = d.get("offset")
            if type(o) is not int or o != off:  # noqa: E721 - bools and floats do not count as laid out
                if laid is None:
                    laid = list(descs[:i])
                laid.append({**d, "offset": off})
            elif laid is not None:
                laid.append(d)
            pos = off + nb
        if laid is not None:
            header = {**header, "tensors": laid}
    hb = pack_header(header)
    if len(hb) > MAX_HEADER_LEN:
        raise ValueError(f"header is {len(hb)} bytes, the limit is {MAX_HEADER_LEN}")
    flags = FLAG_CRC32 if checksum else 0
    chunks[0] = PREFIX.pack(MAGIC, VERSION, flags, len(hb), pos) + hb
    if checksum:
        crc = zlib.crc32(hb)
        for c in chunks[1:]:
            crc = zlib.crc32(c, crc)
        chunks.append(struct.pack("<I", crc))
    return chunks


def _encode_received(frame: Frame, checksum: bool) -> list[Any]:
    hb, payload = frame.wire, frame.payload
    plen = payload.nbytes
    head = PREFIX.pack(MAGIC, VERSION, FLAG_CRC32 if checksum else 0, len(hb), plen) + hb
    chunks: list[Any] = [head, payload] if plen else [head]
    if checksum:
        chunks.append(struct.pack("<I", zlib.crc32(payload, zlib.crc32(hb))))
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
# exact types: msgpack builds exactly these (anything else, e.g. a msgpack.Timestamp, is refused)
_SCALARS = frozenset(_PLAIN)
_MAX_DEPTH = 32


def _check_plain(obj: Any, depth: int = 0) -> None:
    """Only string-keyed maps, lists and nil/bool/int/float/str/bin, at most _MAX_DEPTH levels deep.
    Recurses into containers only (scalars are checked in their parent's loop)."""
    t = type(obj)
    if t is dict:
        if not obj:
            return
        for k in obj:
            if type(k) is not str:
                raise ProtocolError(f"frame header map key {k!r} is not a string")
        vals: Any = obj.values()
    elif t is list:
        if not obj:
            return
        vals = obj
    elif t in _SCALARS:
        return
    else:
        raise ProtocolError(f"frame header holds a value of type {t.__name__}")
    if depth >= _MAX_DEPTH:
        raise ProtocolError("frame header nests too deeply")
    for v in vals:
        tv = type(v)
        if tv in _SCALARS:
            continue
        if tv is dict or tv is list:
            _check_plain(v, depth + 1)
        else:
            raise ProtocolError(f"frame header holds a value of type {tv.__name__}")


# Byte classes for a conservative pre-check of raw header bytes (see _surely_plain): 1 for the type
# bytes that start a bin or ext object (bin 8/16/32, ext 8/16/32, fixext 1..16), 2 for those that start
# a map or array (fixmap, fixarray, array 16/32, map 16/32).
_CLASS = bytearray(256)
for _b in (0xc4, 0xc5, 0xc6, 0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8):
    _CLASS[_b] = 1
for _b in list(range(0x80, 0xa0)) + [0xdc, 0xdd, 0xde, 0xdf]:
    _CLASS[_b] = 2
_CLASS = bytes(_CLASS)
del _b


def _surely_plain(hb: bytes) -> bool:
    """True when the header unpacked from `hb` cannot hold a bytes key, an ext/timestamp value, or
    containers nested deeper than _MAX_DEPTH: every bin/ext object starts with a class-1 byte and every
    container with a class-2 byte, so if no class-1 byte and at most _MAX_DEPTH class-2 bytes occur
    anywhere in `hb` (also counting ones inside strings and numbers), none of those can be there and
    the walk of _check_plain would find nothing. Otherwise (e.g. a header with bin values) it runs."""
    c = hb.translate(_CLASS)
    return b"\x01" not in c and c.count(b"\x02") <= _MAX_DEPTH


def decode_header(hb: bytes | memoryview, payload_len: int) -> dict[str, Any]:
    """Unpack and validate a header (structure, `kind`, tensor descriptors against `payload_len`)."""
    if type(hb) is not bytes:
        hb = bytes(hb)
    try:
        header = _unpackb(hb, raw=False, strict_map_key=True, ext_hook=_reject_ext, use_list=True, timestamp=0)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolError(f"frame header is not valid msgpack: {e}") from None
    if type(header) is not dict:
        raise ProtocolError(f"frame header is a {type(header).__name__}, expected a map")
    c = hb.translate(_CLASS)  # _surely_plain, inlined
    if b"\x01" in c or c.count(b"\x02") > _MAX_DEPTH:
        _check_plain(header)
    kind = header.get("kind")
    if type(kind) is not str or not kind:
        raise ProtocolError("frame header has no string 'kind'")
    descs = header.get("tensors")
    if descs is not None:
        validate_tensors(header, payload_len)
    return header


def _bad_tensor(i: int, name: Any, msg: str) -> ProtocolError:
    where = f"tensor {name!r}" if isinstance(name, str) else f"tensor descriptor {i}"
    return ProtocolError(f"{where}: {msg}")


def validate_tensors(header: Mapping[str, Any], payload_len: int) -> list[dict[str, Any]]:
    descs = header.get("tensors", [])
    if type(descs) is not list:
        raise ProtocolError("'tensors' must be a list")
    if len(descs) > MAX_TENSORS:
        raise ProtocolError(f"{len(descs)} tensors in one frame (limit {MAX_TENSORS})")
    names: set[str] = set()
    for i, d in enumerate(descs):
        if type(d) is not dict:
            raise ProtocolError(f"tensor descriptor {i} is not a map")
        name, dtype, shape, off, n = d.get("name"), d.get("dtype"), d.get("shape"), d.get("offset"), d.get("nbytes")
        if type(name) is not str or not name:
            raise _bad_tensor(i, name, "missing name")
        if name in names:
            raise _bad_tensor(i, name, "duplicate tensor name")
        names.add(name)
        want = _DTYPE_SIZE.get(dtype) if type(dtype) is str else None
        if want is None:
            raise _bad_tensor(i, name, f"unknown dtype {dtype!r}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise _bad_tensor(i, name, f"bad shape {shape!r}")
        for s in shape:
            if type(s) is not int or s < 0:  # exact int: bools are refused
                raise _bad_tensor(i, name, f"bad shape {shape!r}")
            want *= s
        if type(off) is not int or off < 0:
            raise _bad_tensor(i, name, f"bad offset {off!r}")
        if n != want or type(n) is not int:
            if type(n) is not int or n < 0:
                raise _bad_tensor(i, name, f"bad nbytes {n!r}")
            raise _bad_tensor(i, name, f"nbytes {n} != prod({shape}) * {DTYPES[dtype]} = {want}")
        if off + n > payload_len:
            raise _bad_tensor(i, name, f"bytes [{off}, {off + n}) lie outside the {payload_len}-byte payload")
    return descs


_PAGE = 4096


def _aligned_empty(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(base, view): n bytes of uninitialised memory starting on a page boundary, and the array owning them.

    Alignment matters for receiving: the kernel's copy into a buffer that starts a few bytes past a page
    boundary (where malloc puts every large block: 16 bytes in) runs at half speed or worse on x86, and
    that is exactly where a plain np.empty / bytearray of a megabyte or more lands."""
    base = np.empty(n + _PAGE, dtype=np.uint8)
    off = -base.__array_interface__["data"][0] % _PAGE
    return base, base[off:off + n]


def default_alloc(n: int) -> memoryview:
    """The payload buffer: uninitialised, page-aligned memory (no zero fill; pages are committed as the
    socket writes)."""
    return memoryview(_aligned_empty(n)[1])


_PREFIX, _HEADER, _PAYLOAD, _TRAILER = range(4)
_EMPTY = memoryview(b"")
_unpack_prefix = PREFIX.unpack_from
POOL_MIN = 64 << 10  # payloads from this size on are read into (recycled, page-aligned) pool buffers


def _refs(lst: list, i: int) -> int:
    return sys.getrefcount(lst[i])


def _calibrate_refs() -> int | None:
    """What `_refs` says for an object only a list holds (None: refcounts are not reliable here)."""
    lst = [np.empty(1, np.uint8)]
    free = _refs(lst, 0)
    held = lst[0]
    ok = _refs(lst, 0) == free + 1
    del held
    return free if ok and _refs(lst, 0) == free else None


_FREE_REFS = _calibrate_refs()


class FrameDecoder:
    """Sans-IO frame reader for `asyncio.BufferedProtocol`: `get_buffer()` says where the socket should
    read next, `buffer_updated(n)` returns the frames completed by those n bytes (or raises ProtocolError;
    the decoder is then dead). The payload of each frame is one buffer of exactly `payload_len` bytes,
    obtained after the limits are checked; while a payload is being read `get_buffer()` returns the
    unfilled part of it, so the kernel writes the data straight into its final place.

    Payload buffers with the default allocator: a small payload that arrived whole with its header is
    copied out of the staging buffer into a new bytearray; other payloads under POOL_MIN get a new numpy
    buffer. Payloads of POOL_MIN bytes or more are read into page-aligned buffers (see _aligned_empty)
    from a pool of up to `pool` recycled ones: a pooled buffer is reused once nothing but the pool
    references it (every frame, memoryview, numpy array or tensor over it is gone), so a stream of
    large frames neither page-faults fresh memory nor pays for the allocation each time. The pool keeps
    at most `pool` buffers (the most recently used) alive; `pool=0` disables it. A custom `alloc`
    replaces all of this."""

    def __init__(self, *, max_header: int = MAX_HEADER_LEN, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 alloc: Callable[[int], Any] | None = None, staging_size: int = 256 << 10, pool: int = 2):
        self.max_header = max_header
        self.max_payload = max_payload
        self.alloc = alloc or default_alloc
        self._stage = _aligned_empty(max(staging_size, PREFIX_SIZE + 64))[1]
        self._smv = memoryview(self._stage)
        self._r = 0  # read position in staging
        self._w = 0  # write position in staging
        self._state = _PREFIX
        self._flags = self._hlen = self._plen = 0
        self._hbytes: bytes = b""
        self._header: dict[str, Any] | None = None
        self._payload: memoryview | None = None
        self._pfill = 0
        self._pool: list[np.ndarray] = []  # base arrays; _pool_off: where the page-aligned part starts
        self._pool_off: list[int] = []
        self._pool_max = pool if _FREE_REFS is not None else 0
        self.error: ProtocolError | None = None
        self.frames_decoded = 0
        self.bytes_received = 0

    # -- the staging buffer
    def _need_stage(self) -> int:
        return {_PREFIX: PREFIX_SIZE, _HEADER: self._hlen, _TRAILER: TRAILER_SIZE}.get(self._state, 0)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._state == _PAYLOAD and self.error is None:
            return self._payload[self._pfill:]
        if self.error is not None:
            raise self.error
        if self._w == len(self._stage):
            # compact, and grow if one header does not fit (bounded by max_header, checked already)
            avail = self._w - self._r
            need = max(self._need_stage(), avail + 1)
            if need > len(self._stage):
                # a new buffer (the old one may still be exported to the transport)
                new = _aligned_empty(max(need, 2 * len(self._stage)))[1]
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
                if self._pfill < self._plen:
                    return out
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
        smv = self._smv
        r, w = self._r, self._w
        try:
            while True:
                avail = w - r
                state = self._state
                if state == _PREFIX:
                    if avail < PREFIX_SIZE:
                        break
                    magic, version, flags, hlen, plen = _unpack_prefix(smv, r)
                    if (magic != MAGIC or version != VERSION or flags & ~KNOWN_FLAGS or not hlen
                            or hlen > self.max_header or plen > self.max_payload):
                        parse_prefix(smv[r:r + PREFIX_SIZE], max_header=self.max_header,
                                     max_payload=self.max_payload)  # raises the precise error
                    h0 = r + PREFIX_SIZE
                    end = h0 + hlen
                    if not flags and end + plen <= w and plen < POOL_MIN and self.alloc is default_alloc:
                        # fast path: the whole (small) frame is in staging
                        hb = bytes(smv[h0:end])
                        header = decode_header(hb, plen)
                        r = end + plen
                        payload = memoryview(bytearray(smv[end:r])) if plen else _EMPTY
                        descs = header.get("tensors")
                        bufs = [payload[d["offset"]:d["offset"] + d["nbytes"]] for d in descs] if descs else []
                        out.append(Frame(header, bufs, payload, hb))
                        self.frames_decoded += 1
                        continue
                    self._flags, self._hlen, self._plen = flags, hlen, plen
                    r = h0
                    self._state = _HEADER
                elif state == _HEADER:
                    hlen = self._hlen
                    if avail < hlen:
                        break
                    hb = bytes(smv[r:r + hlen])
                    plen = self._plen
                    self._header = decode_header(hb, plen)
                    self._hbytes = hb
                    r += hlen
                    avail -= hlen
                    if plen == 0:
                        self._payload = _EMPTY
                        self._pfill = 0
                        self._after_payload(out)
                        continue
                    if avail >= plen and plen < POOL_MIN and self.alloc is default_alloc:
                        # the whole (small) payload is here: one allocation of exactly plen bytes
                        self._payload = memoryview(bytearray(smv[r:r + plen]))
                        r += plen
                        self._pfill = plen
                        self._after_payload(out)
                        continue
                    self._payload = payload = self._alloc(plen)
                    k = avail if avail < plen else plen
                    if k:
                        payload[:k] = smv[r:r + k]
                        r += k
                    self._pfill = k
                    self._state = _PAYLOAD
                    if k == plen:
                        self._after_payload(out)
                        continue
                    break  # the rest of the payload is read directly into self._payload
                elif state == _TRAILER:
                    if avail < TRAILER_SIZE:
                        break
                    (crc,) = struct.unpack_from("<I", smv, r)
                    r += TRAILER_SIZE
                    got = zlib.crc32(self._payload, zlib.crc32(self._hbytes))
                    if got != crc:
                        raise ProtocolError(f"frame checksum mismatch (crc32 0x{got:08x} != 0x{crc:08x}): "
                                            "corrupted in transit")
                    self._emit(out)
                else:  # _PAYLOAD, more to read
                    break
        finally:
            if r == w:
                r = w = 0
            self._r, self._w = r, w

    def _alloc(self, n: int) -> memoryview:
        if self.alloc is default_alloc:
            if n >= POOL_MIN and self._pool_max:
                return self._pooled(n)
            return memoryview(np.empty(n, dtype=np.uint8))
        buf = self.alloc(n)
        mv = buf if isinstance(buf, memoryview) else memoryview(buf)
        mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
        if mv.nbytes < n or mv.readonly:
            raise ProtocolError("payload allocator returned a too small or read-only buffer")
        return mv[:n]

    def _pooled(self, n: int) -> memoryview:
        """A free pooled buffer of n .. n + n/8 bytes, else a new one (which joins the pool, evicting the
        least recently used). Free: only the pool references it (refcount, see _calibrate_refs)."""
        pool, offs = self._pool, self._pool_off
        for i in range(len(pool)):
            if _refs(pool, i) == _FREE_REFS and n <= pool[i].size - _PAGE <= n + (n >> 3):
                base, off = pool.pop(i), offs.pop(i)
                pool.append(base)
                offs.append(off)
                return memoryview(base[off:off + n])
        if len(pool) >= self._pool_max:
            del pool[0], offs[0]
        base = np.empty(n + _PAGE, dtype=np.uint8)
        off = -base.__array_interface__["data"][0] % _PAGE
        pool.append(base)
        offs.append(off)
        return memoryview(base[off:off + n])

    def _after_payload(self, out: list[Frame]) -> None:
        if self._flags & FLAG_CRC32:
            self._state = _TRAILER
        else:
            self._emit(out)

    def _emit(self, out: list[Frame]) -> None:
        header, payload = self._header, self._payload
        descs = header.get("tensors")
        bufs = [payload[d["offset"]:d["offset"] + d["nbytes"]] for d in descs] if descs else []
        out.append(Frame(header, bufs, payload, self._hbytes))
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
