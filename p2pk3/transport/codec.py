"""The frame codec: a fixed prefix, a msgpack header, and a payload of raw tensor buffers.
(Receiving is `decoder.FrameDecoder`; what each frame kind carries is `messages`.)

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
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

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
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
# numpy view of each dtype. numpy has no bfloat16 / float8: they are returned as raw integers of the
# same width (torch: `torch.frombuffer(mv, dtype=torch.bfloat16)` reads them directly).
_NUMPY: dict[str, str] = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "uint16": "uint16",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "float16": "float16",
    "bfloat16": "uint16",
    "float32": "float32",
    "float64": "float64",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
}
_FROM_NUMPY = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "uint16": "uint16",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
}


MAX_ERROR_MESSAGE = 500  # characters of a ProtocolError's message (they quote what the peer sent)


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame (or broke the protocol's rules).
    Raised by FrameDecoder.buffer_updated with `frames`: the frames completed before the error.

    The message is cut to MAX_ERROR_MESSAGE characters: messages quote values the peer sent (a `kind`,
    a shape, a field), which may be up to a header (1 MiB) long, and every rejected frame is logged and
    answered with its reason."""

    frames: list = []

    def __init__(self, *args: Any):
        if args and isinstance(args[0], str) and len(args[0]) > MAX_ERROR_MESSAGE:
            m = args[0]
            args = (f"{m[: MAX_ERROR_MESSAGE - 40]}... [{len(m) - MAX_ERROR_MESSAGE + 40} more characters]", *args[1:])
        super().__init__(*args)


# ------------------------------------------------------------------------------------------ tensors
def tensor_desc(
    name: str, dtype: str, shape: Sequence[int], offset: int | None = None, nbytes: int | None = None
) -> dict[str, Any]:
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
    def make(
        cls, kind: str, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None, **fields: Any
    ) -> "Frame":
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
def parse_prefix(
    b: bytes | memoryview, *, max_header: int = MAX_HEADER_LEN, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> tuple[int, int, int]:
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


# Byte classes for a conservative pre-check of raw header bytes (see decode_header): 1 for the type
# bytes that start a bin or ext object (bin 8/16/32, ext 8/16/32, fixext 1..16), 2 for those that start
# a map or array (fixmap, fixarray, array 16/32, map 16/32).
_CLASS = bytearray(256)
for _b in (0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8):
    _CLASS[_b] = 1
for _b in list(range(0x80, 0xA0)) + [0xDC, 0xDD, 0xDE, 0xDF]:
    _CLASS[_b] = 2
_CLASS = bytes(_CLASS)
del _b


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
    # The pre-check: every bin/ext object starts with a class-1 byte and every container with a class-2
    # byte, so if no class-1 byte and at most _MAX_DEPTH class-2 bytes occur anywhere in `hb` (ones
    # inside strings and numbers counted too), the header cannot hold a bytes key, an ext value or
    # nesting deeper than _MAX_DEPTH, and the walk of _check_plain would find nothing.
    c = hb.translate(_CLASS)
    if b"\x01" in c or c.count(b"\x02") > _MAX_DEPTH:
        _check_plain(header)
    kind = header.get("kind")
    if type(kind) is not str or not kind:
        raise ProtocolError("frame header has no string 'kind'")
    if "tensors" in header:  # (also "tensors": nil, which Frame.tensors / has() would trip over)
        validate_tensors(header, payload_len)
    elif payload_len:
        raise ProtocolError(f"frame {kind[:64]!r} declares a {payload_len}-byte payload but no tensors")
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
    end = 0
    for i, d in enumerate(descs):
        if type(d) is not dict:
            raise ProtocolError(f"tensor descriptor {i} is not a map")
        name, dtype, shape, off, n = d.get("name"), d.get("dtype"), d.get("shape"), d.get("offset"), d.get("nbytes")
        if type(name) is not str or not name:
            raise _bad_tensor(i, name, "missing name")
        if name in names:
            raise _bad_tensor(i, name, "duplicate tensor name")
        names.add(name)
        want = DTYPES.get(dtype) if type(dtype) is str else None
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
        end = max(end, off + n)
    if payload_len > end:  # bytes no tensor covers: nothing may make us allocate (and read) those
        raise ProtocolError(
            f"frame payload of {payload_len} bytes extends {payload_len - end} bytes past its last tensor"
        )
    return descs
