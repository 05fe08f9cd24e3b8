"""Frame kinds (transport/messages.py): builders and parsers, and the one sampling schema."""
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
    segs = [M.Segment("a", 1, 10, 2), M.Segment("b", 0, 0, 3, SamplingParams(temperature=0.7, top_p=0.9, seed=5)),
            M.Segment("c", 2, 0, 0 + 1, None, want_logits=True)]
    N = 6
    prefix = np.arange(N * D, dtype=np.uint16).reshape(N, D)
    bank = np.ones((R, N, D), np.uint16)
    lat = np.zeros((N, W), np.uint16)
    fr = M.forward_frame(segs, ("bfloat16", prefix.shape, prefix), ("bfloat16", bank.shape, bank),
                         ("bfloat16", lat.shape, lat), layer=7, mid_moe=True)
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
    bad = Frame.make("forward", {"prefix": prefix}, segments=[{"session": "a", "epoch": 0, "start_pos": 0,
                                                               "n_tokens": 0}], layer=1)
    with pytest.raises(ProtocolError, match="n_tokens must be a positive integer"):
        M.parse_forward(bad)


@pytest.mark.parametrize("sample,msg", [
    ({"temperature": "hot"}, "'temperature' has the wrong type"),
    ({"top_k": True}, "'top_k' has the wrong type"),
    ({"min_p": 0.1}, r"unknown sampling parameter\(s\) \['min_p'\]"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"stop_ids": [-1]}, "stop_ids must be"),
    ({"seed": -3}, "seed must be in"),
])
def test_segment_sample_is_sampling_params(sample, msg):
    seg = {"session": "a", "epoch": 0, "start_pos": 0, "n_tokens": 1, "sample": sample}
    with pytest.raises(ProtocolError, match=msg):
        M.Segment.from_wire(seg)


def test_sampling_params_round_trip():
    p = SamplingParams(temperature=0.5, top_k=3, top_p=0.8, seed=9, max_tokens=7, stop_ids=(1, 2))
    assert SamplingParams.from_wire(p.to_wire()) == p
    assert M.Segment.from_wire(M.Segment("x", 1, 0, 2, p).to_wire()).sample == p


def test_result_free_error_ping():
    rs = [M.Result("a", 0, 3, 42), M.Result("b", 1, 4, skip=True), M.Result("c", 0, 5, 7, rows=2),
          M.Result("d", 0, 1, error="boom", code=M.ErrorCode.BUSY)]
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
