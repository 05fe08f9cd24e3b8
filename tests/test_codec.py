"""Frame encoding/decoding: zero-copy round trips, limits before allocation, malformed input."""

from __future__ import annotations

import tracemalloc

import msgpack
import numpy as np
import pytest

from p2pk3.transport import codec as F
from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.decoder import POOL_MIN, FrameDecoder


def _feed_in_pieces(dec: FrameDecoder, data: bytes, piece: int) -> list[Frame]:
    out = []
    for i in range(0, len(data), piece):
        out += dec.feed(data[i : i + piece])
    return out


def test_round_trip_several_dtypes_zero_copy_buffers():
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    i64 = np.arange(7, dtype=np.int64)
    f16 = rng.standard_normal(9).astype(np.float16)
    bf16 = bytearray(rng.integers(0, 255, 2 * 4 * 6, dtype=np.uint8).tobytes())  # raw bf16 bits
    u8 = np.frombuffer(b"\x01\x02\x03", dtype=np.uint8)
    frame = Frame.make(
        "x",
        {"a": f32, "b": i64, "c": f16, "d": ("bfloat16", (4, 6), bf16), "e": u8, "empty": np.zeros((0, 4), np.float32)},
        session="s1",
        pos=[1, 2],
    )
    chunks = F.encode(frame)
    # the tensor data is passed through, not copied: the chunks reference the caller's memory
    assert any(isinstance(c, memoryview) and c.obj is bf16 for c in chunks)
    assert any(isinstance(c, memoryview) and np.shares_memory(np.frombuffer(c, np.uint8), f32) for c in chunks)
    data = b"".join(bytes(c) for c in chunks)
    for piece in (1, 7, 100, len(data)):
        (g,) = _feed_in_pieces(FrameDecoder(staging_size=64), data, piece)
        assert g.kind == "x" and g.header["session"] == "s1" and g.header["pos"] == [1, 2]
        np.testing.assert_array_equal(g.array("a"), f32)
        np.testing.assert_array_equal(g.array("b"), i64)
        np.testing.assert_array_equal(g.array("c"), f16)
        assert bytes(g.buffer("d")) == bytes(bf16) and g.array("d").dtype == np.uint16 and g.array("d").shape == (4, 6)
        assert bytes(g.buffer("e")) == b"\x01\x02\x03"
        assert g.array("empty").shape == (0, 4)
        # received tensors are views into the one payload buffer
        assert all(b.obj is g.payload.obj for b in g.buffers)
        assert all(d["offset"] % F.ALIGN == 0 for d in g.tensors)


def test_several_frames_in_one_stream_and_checksum():
    fs = [Frame.make("ping", id=i) for i in range(3)] + [Frame.make("t", {"x": np.arange(100, dtype=np.int32)})]
    data = b"".join(F.encode_bytes(f, checksum=(i % 2 == 0)) for i, f in enumerate(fs))
    got = FrameDecoder().feed(data)
    assert [g.kind for g in got] == ["ping", "ping", "ping", "t"]
    assert [g.header.get("id") for g in got[:3]] == [0, 1, 2]
    np.testing.assert_array_equal(got[3].array("x"), np.arange(100))


def test_large_header_grows_staging():
    big = {
        "kind": "forward",
        "segments": [{"session": f"s{i}", "epoch": 0, "start_pos": i, "n_tokens": 1} for i in range(5000)],
    }
    data = F.encode_bytes(Frame(big))
    assert len(data) > 64 << 10
    (g,) = _feed_in_pieces(FrameDecoder(staging_size=1024), data, 4096)
    assert len(g.header["segments"]) == 5000


def test_checksum_detects_corruption():
    data = bytearray(F.encode_bytes(Frame.make("t", {"x": np.arange(10, dtype=np.int64)}), checksum=True))
    data[-10] ^= 0x40  # a payload byte
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        FrameDecoder().feed(bytes(data))


def _prefix(magic=F.MAGIC, version=F.VERSION, flags=0, hlen=10, plen=0) -> bytes:
    return F.PREFIX.pack(magic, version, flags, hlen, plen)


@pytest.mark.parametrize(
    "prefix,msg",
    [
        (_prefix(magic=b"HTTP"), "bad magic"),
        (_prefix(version=9), "unknown frame version 9"),
        (_prefix(flags=0x80), "unknown frame flags"),
        (_prefix(hlen=0), "empty frame header"),
        (_prefix(hlen=F.MAX_HEADER_LEN + 1), "exceeds the limit of 1048576 bytes"),
        (_prefix(plen=(4 << 30) + 1), "exceeds the limit of 4294967296 bytes"),
        (_prefix(plen=2**63), "exceeds the limit"),
    ],
)
def test_prefix_limits(prefix, msg):
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match=msg):
        dec.feed(prefix)
    with pytest.raises(ProtocolError):  # the decoder stays dead
        dec.get_buffer()


def test_absurd_lengths_do_not_allocate():
    allocs = []
    dec = FrameDecoder(alloc=lambda n: allocs.append(n) or bytearray(n))
    tracemalloc.start()
    try:
        for plen in (2**64 - 1, 2**40, (4 << 30) + 1):
            d = FrameDecoder(alloc=lambda n: allocs.append(n) or bytearray(n))
            with pytest.raises(ProtocolError):
                d.feed(_prefix(plen=plen))
        with pytest.raises(ProtocolError):
            dec.feed(_prefix(hlen=2**32 - 1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert allocs == []
    assert peak < 4 << 20


def test_configurable_max_payload():
    data = F.encode_bytes(Frame.make("t", {"x": np.zeros(100, np.uint8)}))
    with pytest.raises(ProtocolError, match="payload of 100 bytes exceeds the limit of 50"):
        FrameDecoder(max_payload=50).feed(data)
    assert len(FrameDecoder(max_payload=100).feed(data)) == 1


def _raw(header: dict | bytes, payload: bytes = b"") -> bytes:
    hb = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    return _prefix(hlen=len(hb), plen=len(payload)) + hb + payload


def _td(**kw):
    d = {"name": "x", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    d.update(kw)
    return d


@pytest.mark.parametrize(
    "data,msg",
    [
        (_raw(b"\xc1\xc1\xc1"), "not valid msgpack"),
        (_raw([1, 2]), "expected a map"),
        (_raw({"no": "kind"}), "no string 'kind'"),
        (_raw({"kind": 5}), "no string 'kind'"),
        (_raw({1: 2, "kind": "x"}), "not allowed for map key"),
        (_raw(msgpack.packb({"kind": "x", "e": msgpack.ExtType(5, b"zz")})), "extension type 5"),
        (_raw({"kind": "x", "tensors": "nope"}), "'tensors' must be a list"),
        (_raw({"kind": "x", "tensors": [_td(dtype="complex64")]}, bytes(8)), "unknown dtype 'complex64'"),
        (_raw({"kind": "x", "tensors": [_td(nbytes=12)]}, bytes(12)), "nbytes 12 != prod"),
        (_raw({"kind": "x", "tensors": [_td(offset=4)]}, bytes(8)), "outside the 8-byte payload"),
        (_raw({"kind": "x", "tensors": [_td(shape=[-2])]}, bytes(8)), "bad shape"),
        (_raw({"kind": "x", "tensors": [_td(), _td()]}, bytes(8)), "duplicate tensor name"),
        (_raw({"kind": "x", "tensors": [_td(offset=-1)]}, bytes(8)), "bad offset"),
    ],
)
def test_malformed_headers(data, msg):
    with pytest.raises(ProtocolError, match=msg):
        FrameDecoder().feed(data)


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="C-contiguous"):
        Frame.make("x", {"a": np.zeros((4, 4), np.float32)[:, 1]})
    with pytest.raises(ValueError, match="buffer has 3 bytes"):
        Frame.make("x", {"a": ("float32", (1,), b"abc")})
    with pytest.raises(ValueError, match="unknown dtype"):
        F.tensor_desc("a", "float128", (1,))
    with pytest.raises(ValueError, match="msgpack-serializable"):
        F.encode(Frame({"kind": "x", "obj": object()}))


def test_transport_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, p2pk3.transport.codec, p2pk3.transport.decoder, p2pk3.transport.messages, "
        "p2pk3.transport.connection, p2pk3.node.discovery, p2pk3.node.claims, p2pk3.params; assert 'torch' not in sys.modules, 'torch imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "header,msg",
    [
        ({"kind": "x", b"k": 1}, "map key b'k' is not a string"),
        ({"kind": "x", "t": msgpack.Timestamp(1, 0)}, "holds a value of type Timestamp"),
        (
            {"kind": "x", "deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
            "nests too deeply",
        ),
        ({"kind": "x", "e": [{"k": {b"inner": 2}}]}, "map key b'inner' is not a string"),
    ],
)
def test_header_plain_types_only(header, msg):
    # the raw-byte pre-check must never let these through (they hold bin / ext / container markers)
    hb = msgpack.packb(header, use_bin_type=True, datetime=False)
    with pytest.raises(ProtocolError, match=msg):
        FrameDecoder().feed(_raw(hb))


def test_header_depth_limit_is_exact():
    ok = {"kind": "x", "d": []}
    inner = ok["d"]
    for _ in range(30):  # containers at depth 1..31, the innermost one empty or holding a scalar
        inner.append([])
        inner = inner[0]
    inner.append(1)
    (g,) = FrameDecoder().feed(_raw(ok))
    assert g.header == ok
    inner[0] = [1]
    with pytest.raises(ProtocolError, match="nests too deeply"):
        FrameDecoder().feed(_raw(ok))


def test_bin_values_are_walked_and_accepted():
    data = _raw({"kind": "hello", "nonce": b"\x01" * 32, "m": {"a": [1, 2.5, None, True, "s"]}})
    (g,) = FrameDecoder().feed(data)
    assert g.header["nonce"] == b"\x01" * 32 and g.header["m"]["a"] == [1, 2.5, None, True, "s"]


def test_make_lays_out_offsets_and_encode_keeps_caller_header():
    a, b = np.zeros(3, np.uint8), np.ones(5, np.float32)
    fr = Frame.make("x", {"a": a, "b": b})
    assert [d["offset"] for d in fr.tensors] == [0, 64]
    # a header built by hand (no offsets): encode lays it out without touching the caller's dicts
    hand = Frame(
        {"kind": "x", "tensors": [F.tensor_desc("a", "uint8", (3,)), F.tensor_desc("b", "float32", (5,))]},
        [memoryview(a), b],
    )
    assert "offset" not in hand.tensors[0]
    assert F.encode_bytes(hand) == F.encode_bytes(fr)
    assert "offset" not in hand.tensors[0]
    bad = Frame({"kind": "x", "tensors": [{**F.tensor_desc("a", "uint8", (3,)), "offset": False}]}, [memoryview(a)])
    (g,) = FrameDecoder().feed(F.encode_bytes(bad))  # a bool is not taken for offset 0
    assert g.tensors[0]["offset"] == 0 and type(g.tensors[0]["offset"]) is int


def test_forward_resends_the_received_bytes():
    fr = Frame.make("x", {"a": np.arange(10, dtype=np.int64), "b": np.ones((2, 3), np.float16)}, n=[1, {"k": "v"}])
    for checksum in (False, True):
        data = F.encode_bytes(fr, checksum=checksum)
        (g,) = FrameDecoder().feed(data)
        assert g.wire is not None
        chunks = F.encode(g, forward=True)
        assert any(isinstance(c, memoryview) and c.obj is g.payload.obj for c in chunks)  # payload not copied
        assert b"".join(bytes(c) for c in chunks) == F.encode_bytes(fr)
        assert b"".join(bytes(c) for c in F.encode(g, forward=True, checksum=True)) == F.encode_bytes(fr, checksum=True)
    assert F.encode(fr, forward=True) == F.encode(fr)  # not a received frame: encoded normally


def _addr(mv: memoryview) -> int:
    return np.frombuffer(mv, np.uint8).__array_interface__["data"][0]


def test_large_payloads_page_aligned_and_pooled_only_when_free():
    n = POOL_MIN * 2
    data = F.encode_bytes(Frame.make("x", {"a": np.arange(n, dtype=np.uint8)}))
    dec = FrameDecoder(staging_size=1024)
    (g1,) = _feed_in_pieces(dec, data, 50000)
    assert _addr(g1.payload) % 4096 == 0
    (g2,) = _feed_in_pieces(dec, data, 50000)
    assert g2.payload.obj is not g1.payload.obj  # g1 is alive: its buffer is not reused
    (g3,) = _feed_in_pieces(dec, data, 50000)
    assert g3.payload.obj is not g1.payload.obj and g3.payload.obj is not g2.payload.obj
    arr = g3.array("a")  # a numpy view keeps the buffer alive too
    del g3
    addr1 = _addr(g1.payload)
    del g1, g2  # g1's and g2's buffers are free again (g1's was evicted from the pool of 2)
    (g4,) = _feed_in_pieces(dec, data, 50000)
    addr4 = _addr(g4.payload)
    assert addr4 != _addr(memoryview(arr)) and addr4 != addr1  # g2's pooled buffer, not g3's (in use)
    np.testing.assert_array_equal(arr, np.arange(n, dtype=np.uint8))
    np.testing.assert_array_equal(g4.array("a"), np.arange(n, dtype=np.uint8))
    del g4
    (g5,) = _feed_in_pieces(dec, data, 50000)  # the free pooled buffer is reused
    assert _addr(g5.payload) == addr4
    np.testing.assert_array_equal(arr, np.arange(n, dtype=np.uint8))
    # a custom allocator bypasses all of this
    allocs = []
    (g,) = FrameDecoder(alloc=lambda k: allocs.append(k) or bytearray(k)).feed(data)
    assert allocs == [len(g.payload)]
