"""Hostile frames for the wire protocol, shared by tests/test_fuzz.py and tools/fuzz_daemon.py.

`FrameFuzzer(target, seed).frame(authenticated)` returns one `Fuzzed` item: a category, the bytes to put
on the wire, and `truncated` (the bytes end in the middle of a frame: the sender closes after them).
Categories: mutated valid frames (header fields replaced by hostile values, byte flips), random bytes,
truncated frames, msgpack bombs (deep nesting, containers / strings / bin / ext claiming 2**32 entries
or bytes, every ext type including timestamps, non-string keys, trailing data), tensor descriptors with
wrong sizes / dtypes / offsets, oversized length prefixes, and valid frames of every kind.

`judge(data, target)` is the in-process oracle: it decodes the bytes exactly as a daemon does (FrameDecoder
with the daemon's limits, then the parser of the frame's kind) and says whether the frame is rejected
(and why) or accepted, and whether it is one of the frames an authenticated peer may send BY DESIGN to
change the ring's state (`retain` frees every session a stage holds that it does not list; a `route` or a
`claim` for a real slot moves / claims it; a `generate` that is not tiny loads the ring): the live fuzzer
withholds those and counts them (`withheld`). Any exception other than ProtocolError (and ValueError for
`generate` contents, answered with bad_request) escaping a parser is a bug: `judge` lets it propagate.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2pk3.params import SamplingParams
from p2pk3.transport import messages as M
from p2pk3.transport.codec import (
    DEFAULT_MAX_PAYLOAD,
    DTYPES,
    MAGIC,
    MAX_HEADER_LEN,
    PREFIX,
    VERSION,
    Frame,
    ProtocolError,
    encode_bytes,
)
from p2pk3.transport.connection import HANDSHAKE_MAX_HEADER
from p2pk3.transport.decoder import FrameDecoder

DAEMON_KINDS = (
    "forward",
    "result",
    "free",
    "ping",
    "status",
    "claim",
    "generate",
    "cancel",
    "route",
    "takeover",
    "handover",
    "retain",
    "file_list",
    "file_get",
)
OTHER_KINDS = ("hello", "auth", "error", "pong", "token", "done", "claim_result", "tokens", "Forward", "ping\x00")
ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")  # what torch_tensor takes (p2pk3.model.dtypes)


@dataclass(frozen=True)
class Target:
    """What a valid frame for this ring looks like."""

    hidden: int  # D
    vocab: int
    layer: int  # the first layer of the last slot (a forward's `layer`)
    bank_rows: int  # R of a hop into that layer
    slots: tuple[str, ...]  # the topology's slot ids (frames naming them are withheld where destructive)

    @classmethod
    def for_topology(cls, topo, cfg) -> "Target":
        act = topo.active
        plan0 = topo.slot_plan(act[0], cfg)
        plan1 = topo.slot_plan(act[-1], cfg)
        layer = plan1.layers[0].layer if len(act) > 1 else 0
        return cls(
            cfg.hidden_size,
            cfg.vocab_size,
            layer,
            plan0.bank_rows_out(cfg) if len(act) > 1 else 0,
            tuple(s.id for s in topo.slots),
        )


@dataclass
class Fuzzed:
    category: str
    data: bytes
    truncated: bool = False
    ghost: str | None = None  # a session id a valid-shaped forward may open on a stage (freed after it)


# ------------------------------------------------------------------------------------------ raw pieces
def prefix(hlen: int, plen: int, flags: int = 0, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    return PREFIX.pack(magic, version, flags, hlen & 0xFFFFFFFF, plen & 0xFFFFFFFFFFFFFFFF)


def wrap(header_bytes: bytes, payload: bytes = b"", *, plen: int | None = None, flags: int = 0) -> bytes:
    """A frame around raw header bytes (lengths as given, or the true ones)."""
    return prefix(len(header_bytes), len(payload) if plen is None else plen, flags) + header_bytes + payload


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _mp_str(s: str) -> bytes:
    return pack(s)


def _nested(depth: int, leaf: Any = None, as_map: bool = False) -> Any:
    v = leaf
    for _ in range(depth):
        v = {"a": v} if as_map else [v]
    return v


HOSTILE_SCALARS: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    255,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    0.0,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    1e-300,
    1e308,
    -1e308,
    5e-324,
    "",
    "s0",
    "s1",
    "kind",
    "\u2603" * 3,
    "\U0001f600",
    "a\x00b",
    b"",
    b"\x00",
    b"\xff" * 33,
    "s" * 257,
]


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.55 or depth > 2:
        return rng.choice(HOSTILE_SCALARS)
    if r < 0.62:
        return "x" * rng.choice((1000, 20000, 200000))
    if r < 0.67:
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64))) * rng.choice((1, 100))
    if r < 0.75:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if r < 0.82:
        return {
            rng.choice(("session", "epoch", "a", "", "kind", "n_tokens")): hostile_value(rng, depth + 1)
            for _ in range(rng.randrange(0, 4))
        }
    if r < 0.88:
        return list(range(rng.choice((100, 5000, 60000))))
    if r < 0.94:
        return _nested(rng.choice((31, 33, 200)), rng.choice((None, 1, "x")), rng.random() < 0.5)
    return [{"session": "g", "epoch": 0}] * rng.choice((10, 3000))


# ------------------------------------------------------------------------------------------ valid frames
def _f32(shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], bytes]:
    n = math.prod(shape) * 4
    return ("float32", shape, bytes(n))


def valid_frames(t: Target, rng: random.Random) -> list[Frame]:
    """One well-formed frame of every kind a daemon handles (and a few it does not), for this ring.
    Session ids are ghosts (never a real session's id); slots mostly unknown ones."""
    D, R = t.hidden, t.bank_rows
    n = rng.randrange(1, 4)
    ghost = f"ghost-{rng.getrandbits(32):x}"
    seg = {"session": ghost, "epoch": rng.randrange(0, 3), "start_pos": rng.choice((0, 3, 17)), "n_tokens": n}
    if rng.random() < 0.5:
        seg["sample"] = {
            "temperature": rng.choice((0.0, 0.7, 1.5)),
            "top_k": rng.choice((0, 5)),
            "top_p": rng.choice((1.0, 0.9)),
            "seed": rng.randrange(100),
            "max_tokens": 4,
        }
    tens = [("prefix", _f32((n, D)))]
    if R:
        tens.append(("bank", _f32((R, n, D))))
    fwd = Frame.make("forward", tens, segments=[seg], layer=t.layer, mid_moe=False)
    res = M.result_frame([M.Result(ghost, 0, rng.randrange(0, 50), rng.randrange(t.vocab))])
    res_logits = Frame.make(
        "result",
        [("logits", _f32((1, t.vocab)))],
        results=[{"session": ghost, "epoch": 0, "pos": 3, "token": 1, "rows": 1}],
    )
    slot = rng.choice(("fuzz-slot", "s9", "spare-x"))
    frames = [
        fwd,
        res,
        res_logits,
        M.free_frame([(ghost, 0), (rng.getrandbits(20), 1)], origin="fuzzer"),
        M.ping_frame(rng.getrandbits(31), 123),
        M.status_frame(),
        Frame.make(
            "claim",
            slot=slot,
            node="fuzzer",
            epoch=rng.randrange(1, 5),
            op=rng.choice(("request", "commit", "release")),
            since=1.0,
        ),
        M.GenerateRequest(
            rng.randrange(1, 1 << 20),
            [rng.randrange(t.vocab) for _ in range(rng.randrange(1, 6))],
            SamplingParams(max_tokens=rng.randrange(0, 3)),
        ).frame(),
        M.cancel_frame(rng.randrange(1 << 20)),
        Frame.make("route", slot=slot, node="fuzzer", host="127.0.0.1", port=rng.randrange(1, 65536), epoch=1),
        Frame.make("takeover", slot=rng.choice(t.slots + ("fuzz-slot",)), replaces={"node": "x", "epoch": 1}),
        Frame.make("retain", sessions=[[ghost, 0]]),
        Frame.make("file_list", request_id=rng.randrange(100)),
        Frame.make(
            "file_get",
            request_id=rng.randrange(100),
            path=rng.choice(("config.json", "../secret", "/etc/passwd", "model.safetensors.index.json")),
            offset=rng.choice((0, 10, 2**40)),
            length=rng.choice((0, 100, 1 << 30)),
        ),
        M.error_frame("bad_frame", "fuzz"),
        Frame.make(rng.choice(OTHER_KINDS), id=1),
    ]
    return frames


# ------------------------------------------------------------------------------------------ mutations
def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            out += _paths(v, path + (i,))
    return out


def _copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def mutate_header(h: dict, rng: random.Random) -> dict:
    """Replace / delete / add one field somewhere in the header (tensors included)."""
    h = _copy(h)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = [p for p in _paths(h) if p]
        op = rng.random()
        if op < 0.1:
            h[
                rng.choice(
                    (
                        "kind",
                        "segments",
                        "tensors",
                        "results",
                        "sessions",
                        "prompt",
                        "params",
                        "slot",
                        "epoch",
                        "layer",
                        "mid_moe",
                        "request_id",
                        "op",
                        "replaces",
                        "id",
                        "x" * 40,
                    )
                )
            ] = hostile_value(rng)
            continue
        if not paths:
            break
        p = rng.choice(paths)
        parent = h
        for k in p[:-1]:
            parent = parent[k]
        if op < 0.2 and isinstance(parent, dict):
            del parent[p[-1]]
        elif op < 0.25 and p[-1] == "kind":
            parent["kind"] = rng.choice(DAEMON_KINDS + OTHER_KINDS)
        else:
            parent[p[-1]] = hostile_value(rng)
    return h


def tensor_mutation(f: Frame, rng: random.Random) -> tuple[dict, bytes, int | None]:
    """A header whose tensor descriptors lie (or are consistent but wrong for the ring): (header, payload,
    declared payload_len or None)."""
    chunks = [bytes(c) for c in _chunks(f)]
    payload = b"".join(chunks[1:])
    h = _copy(f.header)
    descs = h.get("tensors") or [{"name": "prefix", "dtype": "float32", "shape": [1, 4], "offset": 0, "nbytes": 16}]
    h["tensors"] = descs
    d = rng.choice(descs)
    r = rng.randrange(16)
    plen: int | None = None
    if r == 0:
        d["dtype"] = rng.choice(list(DTYPES) + ["float128", "complex64", "", "object", "O", 1, None])
    elif r == 1:  # consistent, but a dtype the stage cannot take
        d["dtype"] = rng.choice(list(DTYPES))
        d["nbytes"] = math.prod(d["shape"]) * DTYPES[d["dtype"]]
        payload = payload + bytes(max(0, d["offset"] + d["nbytes"] - len(payload)))
    elif r == 2:
        d["nbytes"] = rng.choice((d["nbytes"] + 1, d["nbytes"] - 1, 0, -1, 2**64 - 1, True, 1.5, None))
    elif r == 3:
        d["offset"] = rng.choice((len(payload), len(payload) - 1, -1, 2**64 - 1, 2**63, 1.0, None, True))
    elif r == 4:
        d["shape"] = rng.choice(
            ([], [0], [-1, 4], [2**62, 2**62], [1] * 9, [True, 4], [1.0], "12", None, [2**64 - 1], [0, 2**40])
        )
        if isinstance(d["shape"], list) and all(type(s) is int and s >= 0 for s in d["shape"]):
            d["nbytes"] = math.prod(d["shape"]) * DTYPES.get(d["dtype"], 1)
    elif r == 5:  # consistent, wrong width for the model
        sh = list(d["shape"])
        sh[-1] = rng.choice((sh[-1] + 3, 1, 0))
        d["shape"] = sh
        d["nbytes"] = math.prod(sh) * DTYPES[d["dtype"]]
        payload = bytes(d["offset"] + d["nbytes"]) if d is descs[-1] else payload + bytes(d["nbytes"])
        if d is not descs[-1]:
            d["offset"] = len(payload) - d["nbytes"]
    elif r == 6:
        d["name"] = rng.choice(("", None, 3, descs[0]["name"], "x" * 5000, "partial_latent", "extra"))
    elif r == 7:
        h["tensors"] = rng.choice(({}, "tensors", 5, [1], [None], [[]]))
    elif r == 8:
        h["tensors"] = [dict(d, name=f"t{i}") for i in range(4097)]
    elif r == 9:  # payload shorter than the descriptors need
        plen = max(0, len(payload) - rng.randrange(1, 64))
        payload = payload[:plen]
    elif r == 10:  # bytes after the last tensor
        payload += bytes(rng.choice((1, 64, 4096)))
    elif r == 11:
        d["extra"] = hostile_value(rng)
    elif r == 12:  # a tensor of another kind's
        descs.append(
            {"name": "partial_latent", "dtype": "float32", "shape": [1, 7], "offset": len(payload), "nbytes": 28}
        )
        payload += bytes(28)
    elif r == 13:  # a bank that does not match its prefix
        if len(descs) > 1:
            descs[1]["dtype"] = "float16"
            descs[1]["nbytes"] //= 2
    elif r == 14:  # mid_moe without partial_latent / with it
        h["mid_moe"] = not h.get("mid_moe", False)
    else:  # two descriptors over the same bytes
        descs.append(dict(d, name=d["name"] + "2"))
    return h, payload, plen


def _chunks(f: Frame) -> list[Any]:
    from p2pk3.transport.codec import encode

    return encode(f)


# ------------------------------------------------------------------------------------------ bombs
def _ext(code: int, data: bytes) -> bytes:
    n = len(data)
    c = code & 0xFF
    fix = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if n in fix:
        return bytes((fix[n], c)) + data
    if n < 256:
        return bytes((0xC7, n, c)) + data
    return b"\xc8" + struct.pack(">H", n) + bytes((c,)) + data


def bomb(rng: random.Random) -> tuple[str, bytes]:
    """(name, raw header bytes) of a msgpack bomb or malformed header."""
    k = b"\x82\xa4kind\xa4ping\xa2id"  # {"kind": "ping", "id": <value>}
    r = rng.randrange(22)
    if r == 0:
        return "array32 claims 2**32-1", k + b"\xdd\xff\xff\xff\xff"
    if r == 1:
        return "map32 claims 2**32-1", k + b"\xdf\xff\xff\xff\xff"
    if r == 2:
        return "str32 claims 2**32-1", k + b"\xdb\xff\xff\xff\xff" + b"x" * 10
    if r == 3:
        return "bin32 claims 2**32-1", k + b"\xc6\xff\xff\xff\xff" + b"x" * 10
    if r == 4:
        return "ext32 claims 2**32-1", k + b"\xc9\xff\xff\xff\xff\x05"
    if r == 5:
        return "top-level array32 claims 2**32-1", b"\xdd\xff\xff\xff\xff"
    if r == 6:
        return "top-level map32 claims 2**32-1", b"\xdf\xff\xff\xff\xff"
    if r == 7:
        n = rng.choice((33, 100, 1000, 100000, MAX_HEADER_LEN - 20))
        return f"{n} nested arrays", k + b"\x91" * n + b"\xc0"
    if r == 8:
        n = rng.choice((33, 1000, 50000))
        return f"{n} nested maps", k + b"\x81\xa1a" * n + b"\xc0"
    if r == 9:
        code = rng.randrange(-128, 128)
        ln = rng.choice((1, 2, 4, 8, 16, 3, 300))
        return f"ext type {code}", k + _ext(code, bytes(ln))
    if r == 10:
        data = rng.choice(
            (struct.pack(">I", 1), struct.pack(">Q", 1 << 34), struct.pack(">Iq", 5, -1), b"\xff" * 12, b"\x00" * 5)
        )
        return f"timestamp ext ({len(data)} bytes)", k + _ext(-1, data)
    if r == 11:
        return "non-string key", rng.choice(
            (
                b"\x82\xa4kind\xa4ping\x01\x02",
                b"\x82\xa4kind\xa4ping\xc0\x02",
                b"\x82\xa4kind\xa4ping\xc4\x01k\x02",
                b"\x82\xa4kind\xa4ping\x91\x01\x02",
                b"\x82\xa4kind\xa4ping\xcb\x3f\xf0\0\0\0\0\0\0\x02",
                b"\x82\xa4kind\xa4ping\x81\xa1a\x01\x02",
            )
        )
    if r == 12:
        return "duplicate keys", b"\x83\xa4kind\xa4ping\xa4kind\xa7forward\xa2id\x01"
    if r == 13:
        return "not a map", rng.choice((b"\x90", b"\x01", b"\xa4ping", b"\xc0", b"\xc3", b"\x92\xa4kind\xa4ping"))
    if r == 14:
        return "trailing data", pack({"kind": "ping", "id": 1}) + rng.choice((b"\x00", b"\xc1", pack({"kind": "x"})))
    if r == 15:
        h = pack({"kind": "status", "pad": "x" * 100})
        return "truncated msgpack", h[: rng.randrange(1, len(h))]
    if r == 16:
        return "reserved byte 0xc1", k + b"\xc1"
    if r == 17:
        return "invalid utf-8", b"\x82\xa4kind\xa4ping\xa2id\xa3\xff\xfe\xfd"
    if r == 18:  # valid but large: a map with many entries / a long list, up to the header limit
        n = rng.choice((1000, 60000))
        return f"map of {n} entries", pack({"kind": "status", **{f"k{i}": i for i in range(n)}})
    if r == 19:
        return "bytes key deep inside", pack({"kind": "ping", "id": [[{b"k": 1}]]})
    if r == 20:
        return "kind not a string", pack({"kind": rng.choice((1, None, b"ping", ["ping"], {"a": 1}, ""))})
    return "ext inside tensors", (b"\x82\xa4kind\xa7forward\xa7tensors\x91" + _ext(rng.randrange(-128, 128), b"\0" * 4))


# ------------------------------------------------------------------------------------------ the fuzzer
AUTH_CATEGORIES = (
    "valid",
    "mutated_header",
    "byte_flip",
    "tensor",
    "bomb",
    "prefix",
    "truncated",
    "random",
    "cross_kind",
)
RAW_CATEGORIES = ("raw_random", "raw_prefix", "raw_bomb", "raw_frame", "raw_hello", "raw_truncated", "raw_payload")


class FrameFuzzer:
    def __init__(self, target: Target, seed: int = 0):
        self.t = target
        self.rng = random.Random(seed)

    def frame(self, authenticated: bool) -> Fuzzed:
        return self.auth_frame() if authenticated else self.raw_frame()

    # -- for an authenticated peer
    def auth_frame(self) -> Fuzzed:
        rng = self.rng
        cat = rng.choices(AUTH_CATEGORIES, weights=(10, 30, 12, 20, 10, 6, 5, 4, 3))[0]
        base = rng.choice(valid_frames(self.t, rng))
        ghost = None
        if base.kind == "forward":
            ghost = base.header["segments"][0]["session"]
        if cat == "valid":
            return Fuzzed(cat, encode_bytes(base), ghost=ghost)
        if cat == "mutated_header":
            h = mutate_header(base.header, rng)
            payload = b"".join(bytes(c) for c in _chunks(base)[1:])
            try:
                hb = pack(h)
            except (TypeError, ValueError, OverflowError):
                hb = pack({"kind": "ping", "id": 0})
            if len(hb) > MAX_HEADER_LEN:
                return Fuzzed("mutated_header", prefix(len(hb), len(payload)) + hb[:4096], truncated=True)
            return Fuzzed(cat, wrap(hb, payload), ghost=ghost)
        if cat == "byte_flip":
            data = bytearray(encode_bytes(base))
            for _ in range(rng.choice((1, 1, 2, 4, 16))):
                i = rng.randrange(len(data)) if rng.random() < 0.3 else rng.randrange(18, min(len(data), 18 + 400))
                if i < len(data):
                    data[i] ^= rng.randrange(1, 256)
            return Fuzzed(cat, bytes(data), truncated=True, ghost=ghost)  # lengths may now lie: close after it
        if cat == "tensor":
            f = base if base.tensors else rng.choice([x for x in valid_frames(self.t, rng) if x.tensors])
            ghost = f.header["segments"][0]["session"] if f.kind == "forward" else None
            h, payload, plen = tensor_mutation(f, rng)
            try:
                hb = pack(h)
            except (TypeError, ValueError, OverflowError):  # e.g. nbytes 2**124: not even msgpack
                hb = pack(
                    {**h, "tensors": [dict(d, nbytes=2**64 - 1) for d in h["tensors"]]}
                    if isinstance(h.get("tensors"), list) and all(isinstance(d, dict) for d in h["tensors"])
                    else {"kind": "forward"}
                )
            if plen is not None and plen != len(payload):
                return Fuzzed(cat, wrap(hb, payload, plen=plen), truncated=True, ghost=ghost)
            return Fuzzed(cat, wrap(hb, payload, plen=plen), ghost=ghost)
        if cat == "bomb":
            name, hb = bomb(rng)
            return Fuzzed(f"bomb: {name}", wrap(hb))
        if cat == "prefix":
            return self._prefix_attack(MAX_HEADER_LEN, DEFAULT_MAX_PAYLOAD)
        if cat == "truncated":
            data = encode_bytes(base)
            if rng.random() < 0.3:  # a legal but huge declared payload, then nothing
                hb = pack(
                    {
                        "kind": "forward",
                        "segments": [],
                        "tensors": [
                            {"name": "prefix", "dtype": "uint8", "shape": [3 << 30], "offset": 0, "nbytes": 3 << 30}
                        ],
                    }
                )
                data = wrap(hb, b"\0" * 100, plen=3 << 30)
                return Fuzzed("truncated: 3 GiB payload declared", data, truncated=True)
            return Fuzzed(cat, data[: rng.randrange(1, len(data))], truncated=True)
        if cat == "random":
            n = rng.choice((1, 17, 18, 100, 5000))
            return Fuzzed(cat, bytes(rng.getrandbits(8) for _ in range(n)), truncated=True)
        # cross_kind: a valid header of one kind under another kind's name
        h = dict(base.header)
        h["kind"] = rng.choice(DAEMON_KINDS)
        payload = b"".join(bytes(c) for c in _chunks(base)[1:])
        return Fuzzed(cat, wrap(pack(h), payload), ghost=ghost)

    def _prefix_attack(self, max_header: int, max_payload: int) -> Fuzzed:
        rng = self.rng
        hb = pack({"kind": "ping", "id": 1})
        r = rng.randrange(9)
        if r == 0:
            return Fuzzed(
                "prefix: bad magic", prefix(len(hb), 0, magic=rng.choice((b"P2K4", b"\0\0\0\0", b"GET "))) + hb
            )
        if r == 1:
            return Fuzzed("prefix: bad version", prefix(len(hb), 0, version=rng.choice((0, 2, 255))) + hb)
        if r == 2:
            return Fuzzed("prefix: unknown flags", prefix(len(hb), 0, flags=rng.choice((2, 0x80, 0xFF))) + hb)
        if r == 3:
            return Fuzzed("prefix: empty header", prefix(0, 0), truncated=True)
        if r == 4:
            return Fuzzed(
                "prefix: header_len over the limit",
                prefix(rng.choice((max_header + 1, 2**32 - 1)), 0) + hb,
                truncated=True,
            )
        if r == 5:
            return Fuzzed(
                "prefix: payload_len over the limit",
                prefix(len(hb), rng.choice((max_payload + 1, 2**64 - 1, 2**63))) + hb,
                truncated=True,
            )
        if r == 6:  # payload declared (legal size) on a frame without tensors: nothing to read it into
            return Fuzzed(
                "prefix: payload without tensors", prefix(len(hb), rng.choice((1, 4096, 1 << 30))) + hb, truncated=True
            )
        if r == 7:  # header_len longer than the header: the following bytes are eaten as header
            return Fuzzed("prefix: header_len too long", prefix(len(hb) + 5, 0) + hb + b"\xc0" * 5)
        return Fuzzed("prefix: crc flag, bad crc", prefix(len(hb), 0, flags=1) + hb + b"\0\0\0\0")

    # -- before the handshake (raw TCP)
    def raw_frame(self) -> Fuzzed:
        rng = self.rng
        cat = rng.choices(RAW_CATEGORIES, weights=(15, 20, 15, 20, 15, 10, 5))[0]
        hello = {
            "kind": "hello",
            "node_id": "fuzz",
            "version": 1,
            "nonce": bytes(32),
            "role": "client",
            "software": "fuzz",
        }
        if cat == "raw_random":
            return Fuzzed(cat, bytes(rng.getrandbits(8) for _ in range(rng.choice((1, 18, 64, 3000)))), True)
        if cat == "raw_prefix":
            f = self._prefix_attack(HANDSHAKE_MAX_HEADER, 0)
            return Fuzzed("raw_" + f.category, f.data, True)
        if cat == "raw_bomb":
            name, hb = bomb(rng)
            return Fuzzed(f"raw_bomb: {name}", wrap(hb), True)
        if cat == "raw_frame":  # an authenticated-only kind before the handshake
            f = rng.choice(valid_frames(self.t, rng))
            return Fuzzed(cat, encode_bytes(f), True)
        if cat == "raw_hello":  # a hello with hostile fields, sometimes followed by a forged auth
            h = mutate_header(hello, rng) if rng.random() < 0.8 else hello
            try:
                data = wrap(pack(h))
            except (TypeError, ValueError, OverflowError):
                data = wrap(pack(hello))
            if rng.random() < 0.5:
                data += wrap(pack({"kind": "auth", "proof": rng.choice((bytes(32), b"", "x" * 32, 7))}))
            return Fuzzed(cat, data, True)
        if cat == "raw_truncated":
            d = wrap(pack(hello))
            return Fuzzed(cat, d[: rng.randrange(1, len(d))], True)
        return Fuzzed(cat, wrap(pack(hello), b"\0" * 64), True)  # a payload before the handshake


# ------------------------------------------------------------------------------------------ the oracle
@dataclass
class Verdict:
    rejected: bool
    reason: str = ""
    kind: str | None = None
    withhold: str | None = None  # why a live fuzzer must not send this valid frame (by-design effect)
    frames: list = field(default_factory=list)


def parse_for_daemon(f: Frame, target: Target) -> str | None:
    """Run the parser the daemon runs for `f` (ProtocolError: the daemon closes the connection).
    Returns why the frame must be withheld from a live ring, or None."""
    k = f.kind
    if k == "forward":
        fw = M.parse_forward(f)
        for name in ("prefix", "bank", "partial_latent"):
            if f.has(name) and f.desc(name)["dtype"] not in ACTIVATION_DTYPES:
                raise ProtocolError(f"forward frame rejected: tensor {name!r}: dtype is not an activation dtype")
        del fw
    elif k == "result":
        M.parse_result(f)
        if f.has("logits") and f.desc("logits")["dtype"] not in ACTIVATION_DTYPES:
            raise ProtocolError("result frame: logits dtype")
    elif k == "free":
        M.parse_free(f)
    elif k == "cancel":
        M.parse_cancel(f)
    elif k == "claim":
        if M.parse_claim(f).slot in target.slots:
            return "claim for a real slot"
    elif k == "generate":
        try:
            req = M.GenerateRequest.parse(f, target.vocab)
        except ValueError:
            return None  # answered with bad_request
        if len(req.prompt) > 64 or req.params.max_tokens > 4 or req.logits:
            return "generate that loads the ring"
    elif k == "route":
        r = M.parse_route(f)
        if r.slot in target.slots:
            return "route for a real slot"
    elif k == "takeover":
        M.parse_takeover(f)
    elif k == "handover":
        if M.parse_handover(f)[0] in target.slots:
            return "handover for a real slot (its holder steps down)"
    elif k == "retain":
        M.parse_retain(f)
        return "retain (frees every session not listed)"
    elif k == "file_list":
        M.parse_file_list(f)
    elif k == "file_get":
        try:
            M.parse_file_get(f)
        except ValueError:
            return None  # answered with bad_request
    elif k in ("ping", "status"):
        pass  # answered, never closes the connection
    else:
        raise ProtocolError(f"unexpected frame kind {k!r}")
    return None


def run_all_parsers(f: Frame, vocab: int) -> None:
    """Every parser on every frame, whatever its kind: each may only raise ProtocolError (GenerateRequest
    and parse_file_get also ValueError, which the receiver answers with bad_request)."""
    g = Frame(dict(f.header), f.buffers, f.payload, f.wire)
    for kind, fn in (
        ("forward", M.parse_forward),
        ("result", M.parse_result),
        ("free", M.parse_free),
        ("cancel", M.parse_cancel),
        ("route", M.parse_route),
        ("takeover", M.parse_takeover),
        ("handover", M.parse_handover),
        ("retain", M.parse_retain),
        ("claim", M.parse_claim),
        ("file_list", M.parse_file_list),
        ("file_get", M.parse_file_get),
        ("generate", lambda x: M.GenerateRequest.parse(x, vocab)),
    ):
        g.header["kind"] = kind
        try:
            fn(g)
        except ProtocolError:
            pass
        except ValueError:  # contents the receiver answers with bad_request
            if kind not in ("generate", "file_get"):
                raise
    for key in ("params", "sample"):
        v = f.header.get(key)
        if v is not None:
            try:
                SamplingParams.from_wire(v)
            except ValueError:
                pass
    segs = f.header.get("segments")
    if isinstance(segs, list):
        for s in segs[:16]:
            try:
                M.Segment.from_wire(s)
            except ProtocolError:
                pass


def check_buffers(f: Frame) -> None:
    """A decoded frame's tensors are exactly what their descriptors say, inside its payload."""
    descs = f.tensors
    assert len(descs) == len(f.buffers), "one buffer per tensor descriptor"
    plen = f.payload.nbytes if f.payload is not None else 0
    for d, b in zip(descs, f.buffers):
        assert type(d["nbytes"]) is int and b.nbytes == d["nbytes"], (
            f"tensor {d['name']!r}: {b.nbytes} bytes, descriptor says {d['nbytes']}"
        )
        assert 0 <= d["offset"] and d["offset"] + d["nbytes"] <= plen, f"tensor {d['name']!r} outside the payload"
        assert d["nbytes"] == math.prod(d["shape"]) * DTYPES[d["dtype"]]


def judge(data: bytes, target: Target, *, authenticated: bool = True) -> Verdict:
    """Decode `data` as a daemon's connection does and run the daemon's parser for its kind."""
    dec = FrameDecoder() if authenticated else FrameDecoder(max_header=HANDSHAKE_MAX_HEADER, max_payload=0)
    try:
        frames = dec.feed(data)
    except ProtocolError as e:
        return Verdict(True, f"decoder: {e}", frames=list(e.frames))
    if not frames:
        return Verdict(True, "incomplete frame")
    withhold = None
    for f in frames:
        check_buffers(f)
        run_all_parsers(f, target.vocab)
        try:
            w = parse_for_daemon(f, target)
        except ProtocolError as e:
            return Verdict(True, f"{f.kind[:64]}: {e}", f.kind, withhold, frames)
        withhold = withhold or w
    return Verdict(False, "", frames[-1].kind, withhold, frames)
