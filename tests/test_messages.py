"""Frame kinds (transport/messages/): builders and parsers, and the one sampling schema."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from p2pk3.params import SamplingParams
from p2pk3.transport import messages as M
from p2pk3.transport.codec import Frame, ProtocolError, encode_bytes
from p2pk3.transport.decoder import FrameDecoder


def _roundtrip(f: Frame) -> Frame:
    (g,) = FrameDecoder().feed(encode_bytes(f))
    return g


def test_forward_frame_helpers():
    N, D, R, W = 5, 16, 3, 8
    prefix = np.arange(N * D, dtype=np.uint16).reshape(N, D)
    bank = np.ones((R, N, D), np.uint16)
    lat = np.zeros((N, W), np.uint16)
    segs = [
        M.Segment("a", 1, 10, 2),
        M.Segment("b", 0, 0, 3, SamplingParams(temperature=0.7, top_p=0.9, seed=5)),
        M.Segment("c", 2, 0, 0 + 1, None, want_logits=True),
    ]
    N = 6
    prefix = np.arange(N * D, dtype=np.uint16).reshape(N, D)
    bank = np.ones((R, N, D), np.uint16)
    lat = np.zeros((N, W), np.uint16)
    fr = M.forward_frame(
        segs,
        ("bfloat16", prefix.shape, prefix),
        ("bfloat16", bank.shape, bank),
        ("bfloat16", lat.shape, lat),
        layer=7,
        mid_moe=True,
    )
    v = M.parse_forward(_roundtrip(fr))
    assert v.segments == segs and v.layer == 7 and v.mid_moe and (v.n_tokens, v.hidden, v.bank_rows) == (N, D, R)
    assert bytes(v.frame.buffer("prefix")) == prefix.tobytes() and v.frame.has("partial_latent")
    with pytest.raises(ValueError, match="partial_latent is sent exactly when mid_moe"):
        M.forward_frame(segs, prefix, layer=3, mid_moe=True)
    with pytest.raises(ValueError, match=r"prefix shape \[4, 16\] must be \[N=6, D\]"):
        M.forward_frame(segs, prefix[:4], layer=3)
    # receivers check consistency of what arrives
    bad = Frame.make("forward", {"prefix": prefix[:4]}, segments=[s.to_wire() for s in segs], layer=1, mid_moe=False)
    with pytest.raises(ProtocolError, match="does not match the 6 tokens"):
        M.parse_forward(_roundtrip(bad))
    bad = Frame.make(
        "forward", {"prefix": prefix}, segments=[{"session": "a", "epoch": 0, "start_pos": 0, "n_tokens": 0}], layer=1
    )
    with pytest.raises(ProtocolError, match="n_tokens must be a positive integer"):
        M.parse_forward(bad)


@pytest.mark.parametrize(
    "sample,msg",
    [
        ({"temperature": "hot"}, "'temperature' has the wrong type"),
        ({"top_k": True}, "'top_k' has the wrong type"),
        ({"typical_p": 0.1}, r"unknown sampling parameter\(s\) \['typical_p'\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"frequency_penalty": 3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": float("nan")}, "must be finite"),
        ({"logit_bias": [[5]]}, r"\(token id, bias\) pairs"),
        ({"logit_bias": [[5, float("inf")]]}, "must be a finite number"),
        ({"logprobs": 21}, r"logprobs must be None or an integer in \[0, 20\]"),
        ({"prompt_logprobs": True}, "'prompt_logprobs' has the wrong type"),
        ({"grammar": {"type": "regex"}}, "grammar type must be one of"),
        ({"grammar": {"type": "lark"}}, "a lark grammar needs"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"stop_ids": [-1]}, "stop_ids must be"),
        ({"seed": -3}, "seed must be in"),
    ],
)
def test_segment_sample_is_sampling_params(sample, msg):
    seg = {"session": "a", "epoch": 0, "start_pos": 0, "n_tokens": 1, "sample": sample}
    with pytest.raises(ProtocolError, match=msg):
        M.Segment.from_wire(seg)


def test_sampling_params_round_trip():
    p = SamplingParams(temperature=0.5, top_k=3, top_p=0.8, seed=9, max_tokens=7, stop_ids=(1, 2))
    assert SamplingParams.from_wire(p.to_wire()) == p
    assert M.Segment.from_wire(M.Segment("x", 1, 0, 2, p).to_wire()).sample == p
    # the agent fields are absent at their defaults (older frames stay valid) and round-trip when set
    assert set(p.to_wire()) == {"temperature", "top_k", "top_p", "seed", "max_tokens", "stop_ids"}
    q = SamplingParams(
        frequency_penalty=0.5,
        presence_penalty=-1,
        repetition_penalty=1.2,
        min_p=0.05,
        logit_bias=((7, 500.0), (3, -2)),
        logprobs=5,
        prompt_logprobs=0,
        grammar={"type": "json_object"},
    )
    assert q.logit_bias == ((3, -2.0), (7, 100.0))  # sorted, clamped to +-100
    assert SamplingParams.from_wire(q.to_wire()) == q
    assert M.Segment.from_wire(M.Segment("x", 1, 0, 2, q).to_wire()).sample == q
    assert q.stateful and q.penalized and not p.stateful and not p.penalized


def test_sampling_wire_map_is_built_once_and_handed_out_as_a_copy():
    p = SamplingParams(temperature=0.5, top_k=3, top_p=0.8, seed=9, max_tokens=7, stop_ids=(1, 2))
    want = {"temperature": 0.5, "top_k": 3, "top_p": 0.8, "seed": 9, "max_tokens": 7, "stop_ids": [1, 2]}
    assert p.to_wire() == want and p.wire_map() is p.wire_map()
    p.to_wire()["seed"] = 1  # a caller's copy: the next frame still says seed 9
    assert p.to_wire() == want
    q = replace(p, seed=5)  # a new instance: its own map, not the cached one
    assert q.to_wire()["seed"] == 5 and p.to_wire()["seed"] == 9
    assert p == SamplingParams.from_wire(want) and hash(p) == hash(SamplingParams.from_wire(want))


def test_segments_of_a_frame_share_equal_sampling_params_and_each_is_still_checked():
    def frame(samples):
        segs = [
            {"session": f"s{i}", "epoch": 0, "start_pos": 3, "n_tokens": 1, "sample": d} for i, d in enumerate(samples)
        ]
        return _roundtrip(
            Frame.make("forward", {"prefix": np.zeros((len(segs), 4), np.float32)}, segments=segs, layer=1)
        )

    g = SamplingParams(max_tokens=9).to_wire()
    v = M.parse_forward(frame([g, dict(g), {**g, "seed": 4}, dict(g)]))
    a, b, c, d = (s.sample for s in v.segments)
    assert a is b and c.seed == 4 and a.seed is None and d == a
    with pytest.raises(ProtocolError, match=r"segment 1: sample: .*top_p"):
        M.parse_forward(frame([g, {**g, "top_p": 7.0}]))
    with pytest.raises(ProtocolError, match=r"segment 1: sample: unknown sampling parameter"):
        M.parse_forward(frame([g, {**g, "nonsense": 1}]))
    k = SamplingParams(top_k=1, stop_ids=(2,)).to_wire()  # equal to it in Python, but a bool for a number
    for bad in ({**k, "top_k": True}, {**k, "stop_ids": [True]}):
        with pytest.raises(ProtocolError, match=r"segment 1: sample: .*(wrong type|stop_ids)"):
            M.parse_forward(frame([k, bad]))


def test_sampler_ids_and_logprobs_round_trip():
    seg = M.Segment("x", 2, 4, 3, None, ids=(5, 6, 7, 8), output_from=9, prompt_logprobs=2)
    assert M.Segment.from_wire(seg.to_wire()) == seg
    assert "ids" not in M.Segment("x", 0, 0, 1).to_wire()
    with pytest.raises(ProtocolError, match="ids must be a list of at most 4"):
        M.Segment.from_wire({**seg.to_wire(), "ids": [1, 2, 3, 4, 5]})
    with pytest.raises(ProtocolError, match="prompt_logprobs needs the segment's ids"):
        M.Segment.from_wire({**seg.to_wire(), "ids": []})
    lp = M.TokenLogprob(3, -0.5, (3, 9), (-0.5, -1.25))
    r = M.Result("x", 2, 7, 3, accepted=(4,), logprobs=(lp, lp), prompt_logprobs=(lp,), prompt_from=5)
    (back,) = M.parse_result(_roundtrip(M.result_frame([r])))
    assert back == r
    with pytest.raises(ProtocolError, match="1 logprob entries for 2 tokens"):
        M.Result.from_wire({**r.to_wire(), "logprobs": [lp.to_wire()]}, "r")
    with pytest.raises(ProtocolError, match="logprob must be a finite number <= 0"):
        M.Result.from_wire({**r.to_wire(), "logprobs": [[3, 0.5, [], []]] * 2}, "r")
    f = _roundtrip(M.token_frame(1, "x", 3, lp))
    assert M.parse_token(f) == (1, "x", 3) and M.parse_token_logprob(f) == lp
    assert M.parse_token_logprob(M.token_frame(1, "x", 3)) is None
    d = M.parse_done(_roundtrip(M.done_frame(1, "x", [3], {}, {}, prompt_logprobs=[M.TokenLogprob(1, None), lp])))
    assert d.prompt_logprobs == (M.TokenLogprob(1, None), lp)
    req = M.GenerateRequest(4, [1, 2, 3], SamplingParams(logit_bias=((99, 1.0),)), generated=1)
    with pytest.raises(ValueError, match="logit_bias token ids \\[99\\] are outside the vocabulary"):
        M.GenerateRequest.parse(_roundtrip(req.frame()), 50)
    assert M.GenerateRequest.parse(_roundtrip(req.frame()), 100).generated == 1


def test_result_free_error_ping():
    rs = [
        M.Result("a", 0, 3, 42),
        M.Result("b", 1, 4, skip=True),
        M.Result("c", 0, 5, 7, rows=2),
        M.Result("d", 0, 1, error="boom", code=M.ErrorCode.BUSY),
    ]
    logits = np.zeros((2, 10), np.float32)
    got = M.parse_result(_roundtrip(M.result_frame(rs, logits)))
    assert got == rs
    with pytest.raises(ProtocolError, match="2 logits rows announced but no 'logits' tensor"):
        M.parse_result(_roundtrip(M.result_frame(rs)))
    bad = Frame.make("result", results=[{"session": "a", "epoch": 0, "pos": 3, "token": -1}])
    with pytest.raises(ProtocolError, match="token must be a non-negative integer"):
        M.parse_result(bad)
    fr = M.free_frame([("a", 0), (7, 2)], origin="n1")
    assert M.parse_free(_roundtrip(fr)) == ([("a", 0), (7, 2)], "n1")
    e = M.error_frame("unknown_session", "no session a", session="a")
    assert e.header == {"kind": "error", "code": "unknown_session", "message": "no session a", "session": "a"}
    p = M.ping_frame(3, 123)
    assert M.pong_frame(p, load=0.5).header == {"kind": "pong", "id": 3, "t_ns": 123, "load": 0.5}


def test_prefix_cache_fields_and_frames():
    seg = M.Segment("a", 1, 64, 8, prefix="k" * 32, blocks=("b1",), snap="s1")
    fr = M.forward_frame([seg], np.zeros((8, 4), np.float32), layer=0)
    assert M.parse_forward(_roundtrip(fr)).segments == [seg]
    assert M.Segment.from_wire(M.Segment("a", 0, 0, 2).to_wire()).prefix is None  # absent on the wire
    for bad, msg in (
        ({"prefix": "k", "start_pos": 0}, "start_pos > 0"),
        ({"prefix": "x" * 65}, "prefix must be a block key"),
        ({"blocks": ["a"] * 9}, "at most n_tokens block keys"),
        ({"snap": 3}, "snap must be a block key"),
        ({"history": [1] * 64}, "history holds the 64 ids below start_pos .* carries its ids"),  # no ids
        ({"history": [1] * 63, "ids": [1] * 8}, "history holds the 64 ids"),
        ({"history": [-1] * 64, "ids": [1] * 8}, "history must be a list of non-negative token ids"),
    ):
        with pytest.raises(ProtocolError, match=msg):
            M.Segment.from_wire({**seg.to_wire(), **bad})
    hist = M.Segment("a", 1, 4, 2, ids=(5, 6, 7), output_from=6, prefix="k" * 32, history=(1, 2, 3, 4))
    assert M.Segment.from_wire(hist.to_wire()) == hist
    with pytest.raises(ProtocolError, match="history holds"):  # only a segment that starts at a cached prefix
        M.Segment.from_wire({**hist.to_wire(), "prefix": None})
    r = M.PrefixReport("s1", "node-a", [("k1", 64), ("k2", 70)], ["k0"], reset=True)
    assert M.parse_prefix_report(_roundtrip(M.prefix_report_frame(r))) == r
    with pytest.raises(ProtocolError, match=r"\[key, position > 0\]"):
        M.parse_prefix_report(Frame.make("prefix_report", slot="s", holder="h", added=[["k", 0]]))
    keep = {"a": M.Keep(10, 5, ("b",), "s")}
    fr = _roundtrip(M.free_frame([("a", 0)], origin="n1", keep=keep))
    assert M.parse_free(fr) == ([("a", 0)], "n1") and M.parse_free_keep(fr) == keep
    assert M.parse_free_keep(M.free_frame([("a", 0)])) == {}
    with pytest.raises(ProtocolError, match="start >= 0 and n > 0"):
        M.parse_free_keep(Frame.make("free", sessions=[], keep=[{"session": "a", "start": 1, "n": 0}]))


def test_client_frames():
    req = M.GenerateRequest(5, [1, 2, 3], SamplingParams(max_tokens=4), logits=False, incremental=True)
    got = M.GenerateRequest.parse(_roundtrip(req.frame()), vocab_size=10)
    assert got == req
    with pytest.raises(ValueError, match=r"token ids in 0\.\.9"):
        M.GenerateRequest.parse(M.GenerateRequest(1, [1, 10]).frame(), vocab_size=10)
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        M.GenerateRequest.parse(Frame.make("generate", request_id=1, prompt=[1], params={"bogus": 1}), 10)
    assert M.parse_cancel(_roundtrip(M.cancel_frame(9))) == 9
    d = M.done_frame(5, "s1", [4, 5], {"a": 1}, {"slot": "s0"})
    assert d.header["tokens"] == [4, 5] and d.header["request_id"] == 5
    assert M.token_frame(5, "s1", 3).header == {"kind": "token", "request_id": 5, "session": "s1", "token": 3}


# ------------------------------------------------------------------- control and file frames (issue 20)
# tests/data/frames_before_issue20.json: the wire bytes these kinds had when node/claims.py, node/failover.py,
# node/routes.py, node/daemon.py and deploy/peers.py built them (captured before the move). The builders here
# must produce the same bytes, and the parsers must read those bytes back.
FIXTURE = json.loads((Path(__file__).parent / "data" / "frames_before_issue20.json").read_text())
HOLDER = M.ClaimHolder("gpu2", 3, 1764600000.5, True)
NEW = {
    "claim request": lambda: M.claim_frame("s1", "gpu3", 4),
    "claim commit": lambda: M.claim_frame("s1", "gpu3", 4, "commit", 1764600000.25),
    "claim takeover": lambda: M.claim_frame("s2", "spare", 7, replaces=("gpu5", 6)),
    "claim release": lambda: M.claim_frame("s0", "gpu1", 2, "release", 1764600000.0),
    "claim_result granted": lambda: M.claim_result_frame(M.ClaimResult("s1", True, "granted", "granted", None, 4)),
    "claim_result held": lambda: M.claim_result_frame(
        M.ClaimResult("s1", False, "held", "slot s1 is held by node gpu2 (epoch 3) since x", HOLDER, 3)
    ),
    "takeover": lambda: M.takeover_frame("s2", ("gpu5", 6)),
    "takeover no holder": lambda: M.takeover_frame("s0", None),
    "retain": lambda: M.retain_frame([("a", 0), ("b", 2)]),
    "retain empty": lambda: M.retain_frame([]),
    "route": lambda: M.route_frame(M.Route("s2", "spare", "10.0.0.9", 47811, 7)),
    "route (daemon)": lambda: M.route_frame(M.Route("s0", "sb@h", "127.0.0.1", 5000, 3)),
    "file_list": lambda: M.file_list_frame("00aa11bb22cc"),
    "file_index": lambda: M.file_index_frame(
        M.FileIndex("a1b2c3d4e5f6", {"config.json": M.FileInfo(12, "ab" * 32)}, "c0ffee", "org/model")
    ),
    "file_index empty": lambda: M.file_index_frame(M.FileIndex(None, {})),
    "file_get": lambda: M.file_get_frame(M.FileGet("00aa11bb22cd", "model-00001.safetensors", 8 << 20, 1234, 50.0)),
    "file_get no cap": lambda: M.file_get_frame(M.FileGet("00aa11bb22ce", "x.safetensors", 0, 8 << 20)),
    "file_chunk": lambda: M.file_chunk_frame(M.FileChunk("r1", "x.safetensors", 0, 5, bytearray(b"hello"))),
}
PARSED = {
    "claim request": (M.parse_claim, M.ClaimMessage("s1", "gpu3", 4)),
    "claim commit": (M.parse_claim, M.ClaimMessage("s1", "gpu3", 4, "commit", 1764600000.25)),
    "claim takeover": (M.parse_claim, M.ClaimMessage("s2", "spare", 7, replaces=("gpu5", 6))),
    "claim release": (M.parse_claim, M.ClaimMessage("s0", "gpu1", 2, "release", 1764600000.0)),
    "claim_result granted": (M.parse_claim_result, M.ClaimResult("s1", True, "granted", "granted", None, 4)),
    "claim_result held": (
        M.parse_claim_result,
        M.ClaimResult("s1", False, "held", "slot s1 is held by node gpu2 (epoch 3) since x", HOLDER, 3),
    ),
    "takeover": (M.parse_takeover, ("s2", ("gpu5", 6))),
    "takeover no holder": (M.parse_takeover, ("s0", None)),
    "retain": (M.parse_retain, {"a": 0, "b": 2}),
    "retain empty": (M.parse_retain, {}),
    "route": (M.parse_route, M.Route("s2", "spare", "10.0.0.9", 47811, 7)),
    "route (daemon)": (M.parse_route, M.Route("s0", "sb@h", "127.0.0.1", 5000, 3)),
    "file_list": (M.parse_file_list, "00aa11bb22cc"),
    "file_index": (
        M.parse_file_index,
        M.FileIndex("a1b2c3d4e5f6", {"config.json": M.FileInfo(12, "ab" * 32)}, "c0ffee", "org/model"),
    ),
    "file_index empty": (M.parse_file_index, M.FileIndex(None, {})),
    "file_get": (M.parse_file_get, M.FileGet("00aa11bb22cd", "model-00001.safetensors", 8 << 20, 1234, 50.0)),
    "file_get no cap": (M.parse_file_get, M.FileGet("00aa11bb22ce", "x.safetensors", 0, 8 << 20)),
}


def test_handover_round_trips():
    f = _roundtrip(M.handover_frame("s2", 3, "3.4x its expected time per token"))
    assert f.kind == "handover" and M.parse_handover(f) == ("s2", 3, "3.4x its expected time per token")


def test_every_moved_kind_is_covered():
    assert set(NEW) == set(FIXTURE) and set(PARSED) | {"file_chunk"} == set(FIXTURE)


@pytest.mark.parametrize("name", sorted(FIXTURE))
def test_moved_kinds_keep_their_wire_bytes(name):
    assert encode_bytes(NEW[name]()).hex() == FIXTURE[name]["bytes"]


@pytest.mark.parametrize("name", sorted(PARSED))
def test_moved_kinds_parse_the_old_bytes(name):
    (f,) = FrameDecoder().feed(bytes.fromhex(FIXTURE[name]["bytes"]))
    parse, want = PARSED[name]
    assert parse(f) == want


def test_file_chunk_parses_the_old_bytes():
    (f,) = FrameDecoder().feed(bytes.fromhex(FIXTURE["file_chunk"]["bytes"]))
    c = M.parse_file_chunk(f)
    assert (c.request_id, c.path, c.offset, c.size, bytes(c.data)) == ("r1", "x.safetensors", 0, 5, b"hello")


@pytest.mark.parametrize(
    "kind,fields,parse,msg",
    [
        (
            "claim",
            {"slot": "s1", "node": "n", "epoch": True},
            M.parse_claim,
            "claim frame: epoch must be a non-negative integer, got True",
        ),
        (
            "claim",
            {"slot": "s1", "node": "n", "epoch": 1, "op": "steal"},
            M.parse_claim,
            "claim frame: op must be one of",
        ),
        (
            "claim",
            {"slot": "s1", "node": "n", "epoch": 1, "since": "x"},
            M.parse_claim,
            "claim frame: since must be a unix time or nil",
        ),
        (
            "claim",
            {"slot": "s1", "node": "n", "epoch": 1, "replaces": [1, 2]},
            M.parse_claim,
            "claim frame: 'replaces' must be",
        ),
        (
            "claim",
            {"slot": "z" * 300, "node": "n", "epoch": 1},
            M.parse_claim,
            "claim frame: slot must be a non-empty string",
        ),
        (
            "claim_result",
            {"slot": "s1", "granted": 1, "code": "held", "reason": ""},
            M.parse_claim_result,
            "claim_result frame: granted must be a bool",
        ),
        (
            "claim_result",
            {"slot": "s1", "granted": False, "code": "maybe", "reason": ""},
            M.parse_claim_result,
            "claim_result frame: code must be one of",
        ),
        (
            "claim_result",
            {"slot": "s1", "granted": False, "code": "held", "reason": "", "holder": {"node": "x"}},
            M.parse_claim_result,
            "claim_result frame: holder.epoch must be a non-negative integer",
        ),
        ("takeover", {"slot": 5}, M.parse_takeover, "takeover frame: slot must be a non-empty string"),
        (
            "takeover",
            {"slot": "s1", "replaces": {"node": "x", "epoch": -1}},
            M.parse_takeover,
            "takeover frame: replaces.epoch must be a non-negative integer",
        ),
        (
            "route",
            {"slot": "s1", "node": "n", "host": "h", "port": 0, "epoch": 1},
            M.parse_route,
            "route frame: port must be an integer in 1..65535, got 0",
        ),
        (
            "route",
            {"slot": "s1", "node": "n", "host": "h", "port": 5, "epoch": -1},
            M.parse_route,
            "route frame: epoch must be a non-negative integer",
        ),
        ("retain", {"sessions": [["a", 1, 2]]}, M.parse_retain, r"retain frame: sessions\[0\] must be \[session"),
        ("retain", {"sessions": {"a": 1}}, M.parse_retain, "retain frame: 'sessions' must be a list"),
        ("file_list", {"request_id": [1]}, M.parse_file_list, "file_list frame: request_id must be"),
        (
            "file_index",
            {"files": {"a": {"size": -1, "sha256": "x"}}},
            M.parse_file_index,
            r"file_index frame: files\['a'\].size must be a non-negative integer",
        ),
        ("file_get", {"path": 7}, M.parse_file_get, "file_get frame: path must be a string"),
        (
            "file_chunk",
            {"path": "a", "offset": 0, "size": 1},
            M.parse_file_chunk,
            "file_chunk frame: needs exactly one tensor, 'data'",
        ),
        ("route", {"slot": "s1"}, M.parse_takeover, "expected a takeover frame, got 'route'"),
        ("handover", {"slot": "s1", "epoch": -2}, M.parse_handover, "handover frame: epoch must be a non-negative"),
        ("handover", {"slot": "s1", "epoch": 2, "reason": 7}, M.parse_handover, "handover frame: reason must be"),
    ],
)
def test_control_and_file_parsers_name_the_bad_field(kind, fields, parse, msg):
    with pytest.raises(ProtocolError, match=msg):
        parse(_roundtrip(Frame.make(kind, **fields)))


def test_file_get_bad_range_is_a_request_error_not_a_protocol_error():
    f = Frame.make("file_get", path="a", offset=-1, length=5, request_id="r")
    with pytest.raises(ValueError, match="offset and length must be non-negative integers"):
        M.parse_file_get(f)
    with pytest.raises(ValueError, match="claim op must be one of"):
        M.claim_frame("s1", "n", 1, op="steal")


def test_client_replies_round_trip_and_name_the_bad_field():
    assert M.parse_token(_roundtrip(M.token_frame(3, "s-1", 42))) == (3, "s-1", 42)
    lg = np.zeros((2, 4), np.float32)
    d = M.parse_done(_roundtrip(M.done_frame(3, "s-1", [5, 6], {"prompt_tokens": 2}, {"slot": "s0"}, lg)))
    assert (d.request_id, d.session, d.tokens, d.stats, d.stage_stats) == (
        3,
        "s-1",
        [5, 6],
        {"prompt_tokens": 2},
        {"slot": "s0"},
    )
    e = M.parse_error(_roundtrip(M.error_frame(M.ErrorCode.BUSY, "full", request_id=3, fatal=True)))
    assert e == M.ErrorReply("busy", "full", 3, True)
    with pytest.raises(ProtocolError, match="token frame: token must be a non-negative integer, got -1"):
        M.parse_token(Frame.make("token", request_id=3, session="s", token=-1))
    with pytest.raises(ProtocolError, match="done frame: request_id must be an integer, got 'x'"):
        M.parse_done(Frame.make("done", request_id="x", session="s", tokens=[]))
    with pytest.raises(ProtocolError, match="done frame: tokens must be a list"):
        M.parse_done(Frame.make("done", request_id=1, session="s", tokens=["a"]))
    with pytest.raises(ProtocolError, match="error frame: code and message must be strings"):
        M.parse_error(Frame.make("error", code=5, message="m"))


def test_status_and_pong_have_parsers_that_refuse_other_kinds():
    from p2pk3.transport.codec import Frame, ProtocolError
    from p2pk3.transport.messages import parse_pong, parse_status, ping_frame, pong_frame, status_frame

    assert parse_status(status_frame(slot="s1", role="entry", sessions=3)) == {
        "kind": "status",
        "slot": "s1",
        "role": "entry",
        "sessions": 3,
    }
    pong = parse_pong(pong_frame(ping_frame(7, 123), slot="s2", epoch=4))
    assert (pong["id"], pong["t_ns"], pong["slot"], pong["epoch"]) == (7, 123, "s2", 4)
    with pytest.raises(ProtocolError, match="expected a status frame, got 'pong'"):
        parse_status(pong_frame(ping_frame(1, 2)))
    with pytest.raises(ProtocolError, match="expected a pong frame"):
        parse_pong(status_frame())
    with pytest.raises(ProtocolError, match="pong frame: id"):
        parse_pong(Frame.make("pong", id="x" * 10, t_ns=1))
