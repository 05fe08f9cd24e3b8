"""Receiving frames: `FrameDecoder`, a sans-IO state machine for an `asyncio.BufferedProtocol`.

The prefix and header go through a small staging buffer; the payload gets ONE buffer of exactly
`payload_len` bytes (after all limits are checked) and the socket reads straight into it (page-aligned and
recycled for large payloads). Received tensors are memoryviews into that payload.
"""

from __future__ import annotations

import struct
import sys
import zlib
from typing import Any, Callable

import numpy as np

from .codec import (
    DEFAULT_MAX_PAYLOAD,
    FLAG_CRC32,
    KNOWN_FLAGS,
    MAGIC,
    MAX_HEADER_LEN,
    PREFIX,
    PREFIX_SIZE,
    TRAILER_SIZE,
    VERSION,
    Frame,
    ProtocolError,
    decode_header,
    parse_prefix,
)

_PAGE = 4096


def _aligned_empty(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(base, view): n bytes of uninitialised memory starting on a page boundary, and the array owning them.

    Alignment matters for receiving: the kernel's copy into a buffer that starts a few bytes past a page
    boundary (where malloc puts every large block: 16 bytes in) runs at half speed or worse on x86, and
    that is exactly where a plain np.empty / bytearray of a megabyte or more lands."""
    base = np.empty(n + _PAGE, dtype=np.uint8)
    off = -base.__array_interface__["data"][0] % _PAGE
    return base, base[off : off + n]


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

    def __init__(
        self,
        *,
        max_header: int = MAX_HEADER_LEN,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        alloc: Callable[[int], Any] | None = None,
        staging_size: int = 256 << 10,
        pool: int = 2,
    ):
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
            return self._payload[self._pfill :]
        if self.error is not None:
            raise self.error
        if self._w == len(self._stage):
            # compact, and grow if one header does not fit (bounded by max_header, checked already)
            avail = self._w - self._r
            need = max(self._need_stage(), avail + 1)
            if need > len(self._stage):
                # a new buffer (the old one may still be exported to the transport)
                new = _aligned_empty(max(need, 2 * len(self._stage)))[1]
                new[:avail] = self._smv[self._r : self._w]
                self._stage, self._smv = new, memoryview(new)
            elif self._r:
                self._smv[:avail] = self._smv[self._r : self._w]
            self._r, self._w = 0, avail
        return self._smv[self._w :]

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
                    if (
                        magic != MAGIC
                        or version != VERSION
                        or flags & ~KNOWN_FLAGS
                        or not hlen
                        or hlen > self.max_header
                        or plen > self.max_payload
                    ):
                        parse_prefix(
                            smv[r : r + PREFIX_SIZE], max_header=self.max_header, max_payload=self.max_payload
                        )  # raises the precise error
                    h0 = r + PREFIX_SIZE
                    end = h0 + hlen
                    if not flags and end + plen <= w and plen < POOL_MIN and self.alloc is default_alloc:
                        # fast path: the whole (small) frame is in staging
                        hb = bytes(smv[h0:end])
                        header = decode_header(hb, plen)
                        r = end + plen
                        payload = memoryview(bytearray(smv[end:r])) if plen else _EMPTY
                        descs = header.get("tensors")
                        bufs = [payload[d["offset"] : d["offset"] + d["nbytes"]] for d in descs] if descs else []
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
                    hb = bytes(smv[r : r + hlen])
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
                        self._payload = memoryview(bytearray(smv[r : r + plen]))
                        r += plen
                        self._pfill = plen
                        self._after_payload(out)
                        continue
                    self._payload = payload = self._alloc(plen)
                    k = avail if avail < plen else plen
                    if k:
                        payload[:k] = smv[r : r + k]
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
                        raise ProtocolError(
                            f"frame checksum mismatch (crc32 0x{got:08x} != 0x{crc:08x}): corrupted in transit"
                        )
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
                return memoryview(base[off : off + n])
        if len(pool) >= self._pool_max:
            del pool[0], offs[0]
        base = np.empty(n + _PAGE, dtype=np.uint8)
        off = -base.__array_interface__["data"][0] % _PAGE
        pool.append(base)
        offs.append(off)
        return memoryview(base[off : off + n])

    def _after_payload(self, out: list[Frame]) -> None:
        if self._flags & FLAG_CRC32:
            self._state = _TRAILER
        else:
            self._emit(out)

    def _emit(self, out: list[Frame]) -> None:
        header, payload = self._header, self._payload
        descs = header.get("tensors")
        bufs = [payload[d["offset"] : d["offset"] + d["nbytes"]] for d in descs] if descs else []
        out.append(Frame(header, bufs, payload, self._hbytes))
        self.frames_decoded += 1
        self._header = self._payload = None
        self._hbytes = b""
        self._pfill = 0
        self._state = _PREFIX
