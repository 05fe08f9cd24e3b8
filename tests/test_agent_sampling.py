"""Logprobs (p2pk3.agent.logprobs) and penalties (p2pk3.agent.penalties) against plain-Python oracles written
here: a float64 log-sum-exp per row for the logprobs, a per-row per-id loop for the penalties."""

import math
import random
from pathlib import Path

import pytest
import torch

from p2pk3.agent.logprobs import (
    NEG_INF_LOGPROB,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
    token_logprobs,
)
from p2pk3.agent.penalties import Penalties, PenaltyError, apply_min_p, apply_penalties, parse_logit_bias
from p2pk3.agent.vocab import token_bytes
from p2pk3.tokenizer import load_tokenizer

MODEL = Path(__file__).resolve().parents[1] / "p2pk3/assets/k3-docs"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def oracle_logprobs(row: list[float]) -> list[float]:
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def test_token_logprobs_match_the_oracle(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 300, generator=g) * 5
    ids = torch.randint(0, 300, (6,), generator=g)
    lp = token_logprobs(logits, ids, top=20)
    for t in range(6):
        want = oracle_logprobs(logits[t].double().tolist())
        assert lp.logprobs[t] == pytest.approx(want[int(ids[t])], abs=1e-5), seed
        top = sorted(range(300), key=lambda i: -want[i])[:20]
        assert lp.top_ids[t] == top, seed
        assert lp.top_logprobs[t] == pytest.approx([want[i] for i in top], abs=1e-5)
    # bf16 logits: computed in float32 from the bf16 values
    lb = logits.bfloat16()
    got = token_logprobs(lb, ids, top=3)
    want0 = oracle_logprobs(lb[0].float().double().tolist())
    assert got.logprobs[0] == pytest.approx(want0[int(ids[0])], abs=1e-5)
    one = token_logprobs(logits[2], [int(ids[2])], top=0)  # one row
    assert one.logprobs == [lp.logprobs[2]] and one.top_ids == [[]]
    with pytest.raises(ValueError, match="between 0 and 20"):
        token_logprobs(logits, ids, top=21)
    with pytest.raises(ValueError, match="ids for logits"):
        token_logprobs(logits, ids[:3])


def test_masked_token_logprob_is_finite():
    row = torch.tensor([0.0, float("-inf"), 1.0])
    lp = token_logprobs(row, [1], top=3)
    assert lp.logprobs == [NEG_INF_LOGPROB] and lp.top_logprobs[0][-1] == NEG_INF_LOGPROB


def test_chat_shape(tok):
    tb, _ = token_bytes(tok)
    ids = tok.encode("Grüße ☃")
    logits = torch.randn(len(ids), len(tb))
    body = chat_logprobs(token_logprobs(logits, ids, top=2), tb)
    assert body["refusal"] is None and len(body["content"]) == len(ids)
    for i, item in zip(ids, body["content"]):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(item["bytes"]) == tb[i] and item["token"] == tb[i].decode("utf-8", errors="replace")
        assert len(item["top_logprobs"]) == 2 and set(item["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert bytes(sum((c["bytes"] for c in body["content"]), [])).decode() == "Grüße ☃"


def test_completions_shape_and_echo(tok):
    tb, _ = token_bytes(tok)
    prompt, completion = tok.encode("Über den ☃ "), tok.encode("schnee.")
    ids = prompt + completion
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(ids), len(tb), generator=g)  # row i predicts token i + 1
    echo = prompt_logprobs(logits[: len(prompt)], prompt, top=3)
    gen = token_logprobs(logits[len(prompt) - 1 : len(ids) - 1], completion, top=3)
    body = completion_logprobs(echo + gen, tb)
    assert set(body) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert body["token_logprobs"][0] is None and body["top_logprobs"][0] is None
    for t in range(1, len(ids)):
        want = oracle_logprobs(logits[t - 1].double().tolist())
        assert body["token_logprobs"][t] == pytest.approx(want[ids[t]], abs=1e-5)
        top = sorted(range(len(tb)), key=lambda i: -want[i])[:3]
        assert list(body["top_logprobs"][t].values()) == pytest.approx([want[i] for i in top], abs=1e-5)
    # the same prompt logprobs when all P rows are given (the last one is not used)
    assert (
        prompt_logprobs(logits[: len(prompt) + 1][:-1], prompt).logprobs
        == prompt_logprobs(logits[: len(prompt) - 1], prompt).logprobs
    )
    # text_offset: characters of the decoded text before each token
    for t in range(len(ids)):
        assert body["text_offset"][t] == len(b"".join(tb[i] for i in ids[:t]).decode("utf-8", errors="ignore"))
    assert body["tokens"] == [tb[i].decode("utf-8", errors="replace") for i in ids]
    assert "\ufffd" in body["tokens"][0]  # this vocabulary splits "Ü" into two byte tokens
    shifted = completion_logprobs(gen, tb, text_offset0=100)["text_offset"]
    assert shifted[0] == 100 and shifted[1] == 100 + len(tb[completion[0]].decode())
    assert prompt_logprobs(torch.zeros(0, 5), []).ids == []
    with pytest.raises(ValueError, match="prompt logits"):
        prompt_logprobs(logits[:2], prompt)


def oracle_penalties(row, p: Penalties, prompt, output):
    row = list(row)
    for t, b in p.logit_bias.items():
        row[t] += b
    seen = set(prompt) | set(output)
    counts = {t: output.count(t) for t in set(output)}
    for t in range(len(row)):
        if t in seen and p.repetition_penalty != 1:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        if t in counts:
            row[t] -= p.frequency_penalty * counts[t] + p.presence_penalty
    return row


def test_penalties_match_the_oracle(seed):
    rng = random.Random(seed)
    v = 64
    params = [
        Penalties(),
        Penalties(frequency_penalty=0.7),
        Penalties(presence_penalty=-1.5),
        Penalties(repetition_penalty=1.3),
        Penalties(repetition_penalty=0.8, frequency_penalty=2.0, presence_penalty=0.5, logit_bias={3: 100.0, 7: -42.5}),
        Penalties(logit_bias=parse_logit_bias({"5": 250, "9": -1000, "0": 1.5}, v)),
    ]
    b = len(params)
    logits = torch.randn(b, v) * 3
    prompt = [[rng.randrange(v) for _ in range(rng.randint(0, 20))] for _ in range(b)]
    output = [[rng.randrange(v) for _ in range(rng.randint(0, 30))] for _ in range(b)]
    output[1] = []  # a row with nothing generated yet
    got = apply_penalties(logits.clone(), params, prompt, [torch.tensor(o, dtype=torch.long) for o in output])
    for r in range(b):
        want = oracle_penalties(logits[r].tolist(), params[r], prompt[r], output[r])
        assert got[r].tolist() == pytest.approx(want, rel=1e-6, abs=1e-5), (seed, r)
    assert torch.equal(got[0], logits[0])  # neutral row bit-identical
    assert params[5].logit_bias == {5: 100.0, 9: -100.0, 0: 1.5}
    # bf16 logits stay bf16, rows without penalties untouched
    lb = logits.bfloat16()
    out = apply_penalties(lb.clone(), [Penalties()] * (b - 1) + [params[4]], prompt, output)
    assert out.dtype == torch.bfloat16 and torch.equal(out[:-1], lb[:-1]) and not torch.equal(out[-1], lb[-1])


def test_min_p_matches_the_oracle(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 50, generator=g) * 3
    mp = [0.0, 0.05, 0.3, 1.0]
    got = apply_min_p(logits.clone(), mp)
    for r in range(4):
        probs = torch.softmax(logits[r].double(), 0).tolist()
        keep = [p >= mp[r] * max(probs) * (1 - 1e-9) for p in probs]
        assert [bool(x) for x in torch.isfinite(got[r])] == keep, (seed, r)
        assert torch.equal(got[r][torch.isfinite(got[r])], logits[r][torch.tensor(keep)])
    assert torch.isfinite(got[3]).sum() == 1  # min_p 1: only the most likely


def test_penalty_errors():
    for kw, msg in [
        ({"frequency_penalty": 2.5}, "between -2 and 2"),
        ({"repetition_penalty": 0}, "> 0"),
        ({"min_p": 1.5}, "between 0 and 1"),
    ]:
        with pytest.raises(PenaltyError, match=msg):
            Penalties(**kw)
    for bias, msg in [
        ({"x": 1}, "not a token id"),
        ({"99": 1}, "outside the vocabulary"),
        ({"1": "a"}, "number"),
        ([1], "object"),
    ]:
        with pytest.raises(PenaltyError, match=msg):
            parse_logit_bias(bias, 10)
    p = Penalties.from_request({"frequency_penalty": 1, "presence_penalty": None, "logit_bias": {"2": 3}}, 10)
    assert p == Penalties(frequency_penalty=1.0, logit_bias={2: 3.0}) and not p.neutral
    assert Penalties.from_request({}, 10).neutral
    with pytest.raises(PenaltyError, match="must be a number"):
        Penalties.from_request({"min_p": "0.1"}, 10)
    with pytest.raises(ValueError, match="Penalties for"):
        apply_penalties(torch.zeros(2, 4), [Penalties()])
