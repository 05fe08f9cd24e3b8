"""Structured outputs (p2pk3.agent.grammar, vocab): 200 generations over 10 schemas by an adversarial random
"model" sampled under the mask all parse and validate (jsonschema is the independent oracle); rollback,
reset, validate, violations, errors; the vocabulary bytes are the tokenizer's; tool_choice required / named
(toolgrammar) gives calls that parse and whose arguments validate against their tool's parameters."""

import builtins
import json
from pathlib import Path

import jsonschema
import pytest
import torch

from p2pk3.agent.grammar import (
    GrammarEngineMissing,
    GrammarError,
    GrammarMatcher,
    GrammarTokenizer,
    GrammarViolation,
    response_format_schema,
    unpack_bitmask,
)
from p2pk3.agent.vocab import token_bytes
from p2pk3.tokenizer import ChatTokenizer

MODEL = Path(__file__).resolve().parents[1] / "p2pk3/assets/k3-docs"
S = {"type": "string", "maxLength": 12}

SCHEMAS = [
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "role"],
        "properties": {"name": S, "role": {"enum": ["admin", "user", "guest"]}},
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["a"],
        "properties": {
            "a": {
                "type": "object",
                "additionalProperties": False,
                "required": ["b", "n"],
                "properties": {
                    "n": {"type": "integer"},
                    "b": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["c"],
                        "properties": {"c": {"type": "boolean"}},
                    },
                },
            }
        },
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["items"],
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["id", "label"],
                    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "label": S},
                },
            }
        },
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["v"],
        "properties": {"v": {"enum": ["x", 3, None, True]}},
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["flag", "nothing", "kind"],
        "properties": {"flag": {"type": "boolean"}, "nothing": {"type": "null"}, "kind": {"const": "fixed"}},
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["year", "month"],
        "properties": {
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "month": {"type": "integer", "minimum": 1, "maximum": 12},
        },
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["id"],
        "properties": {"id": {"type": "integer"}, "note": S, "tags": {"type": "array", "maxItems": 3, "items": S}},
    },
    {"type": "array", "minItems": 2, "maxItems": 5, "items": {"enum": ["red", "green", "blue"]}},
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["value"],
        "properties": {
            "value": {"anyOf": [{"type": "integer"}, S, {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}]}
        },
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["code", "score"],
        "properties": {
            "code": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
    },
]


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def gtok(tok):
    return GrammarTokenizer(tok, vocab_size=tok.vocab_size + 64)  # logits wider than the tokenizer, as models pad


def rf(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": strict}}


def generate(m: GrammarMatcher, gen: torch.Generator, boost: list[int], max_tokens: int = 4000) -> list[int]:
    """The adversarial model: peaked random logits (ids in `boost` pushed up), sampled under the mask until
    the grammar is done; the stop token the mask then allows is sampled too."""
    v = m.gtok.vocab_size
    while True:
        logits = torch.randn(v, generator=gen) * 4
        logits[boost] += 12
        m.apply(logits)
        t = int(torch.multinomial(torch.softmax(logits, 0), 1, generator=gen))
        m.advance(t)
        if t in m.gtok.stop_ids:
            return m.tokens[:-1]
        assert len(m.tokens) < max_tokens, "the grammar never finished"


@pytest.mark.slow
def test_200_adversarial_generations_parse_and_validate(tok, gtok):
    gen = torch.Generator().manual_seed(1234)
    specials = sorted(tok.special.values())
    quote_ids = [i for i, b in enumerate(token_bytes(tok)[0]) if b in (b'"', b"}", b"]", b"\n", b" ")]
    results = []
    for k, schema in enumerate(SCHEMAS):
        jsonschema.Draft202012Validator.check_schema(schema)
        m = GrammarMatcher(gtok, rf(schema))
        for j in range(20):
            # a third plain random, a third pushing specials and stop ids (end early), a third structure tokens
            boost = [[], specials, quote_ids][j % 3]
            m.reset()
            ids = generate(m, gen, boost)
            text = tok.decode(ids)
            value = json.loads(text)  # raises: the test fails with the text
            jsonschema.validate(value, schema)
            assert not set(ids) & set(specials), text
            results.append((k, text))
    assert len(results) == 200
    assert len({t for _, t in results}) > 150  # the adversary really explores


def test_rollback_replays_to_the_same_state(tok, gtok):
    gen = torch.Generator().manual_seed(7)
    m = GrammarMatcher(gtok, rf(SCHEMAS[2]))
    ids = generate(m, gen, [])
    m.reset()
    masks = []
    for t in ids:
        masks.append(m.allowed().clone())
        m.advance(t)
    for k in (1, 3, len(ids) // 2, len(ids)):
        m.rollback(k)
        assert torch.equal(m.allowed(), masks[len(ids) - k]), k
        for t in ids[len(ids) - k :]:
            m.advance(t)
    assert m.done and m.accepting and m.tokens == ids
    stop = m.gtok.stop_ids[0]
    m.advance(stop)  # after the finished grammar: not in the engine's history, rollback still exact
    m.rollback(2)
    assert torch.equal(m.allowed(), masks[-1])
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(len(ids) + 5)


def test_validate_counts_an_allowed_draft_prefix(tok, gtok):
    m = GrammarMatcher(gtok, rf(SCHEMAS[0]))
    good = tok.encode('{"name": "ab", "role": "user"}')
    bad = tok.encode('{"name": "ab", "rol": 1}')
    assert m.validate(good) == len(good)
    n = m.validate(bad)
    assert 0 < n < len(bad) and bad[:n] == tok.encode('{"name": "ab", "rol')[:n]
    assert m.tokens == []  # validate does not advance


def test_mask_forbids_and_violation_is_refused(tok, gtok):
    m = GrammarMatcher(gtok, {"type": "json_object"})
    allowed = m.allowed()
    assert allowed.shape == (gtok.vocab_size,) and allowed.dtype == torch.bool
    assert not allowed[tok.vocab_size :].any()  # padded ids
    assert not allowed[list(tok.special.values())].any()  # no special token at the start
    first = [i for i, b in enumerate(token_bytes(tok)[0]) if allowed[i]]
    assert all(token_bytes(tok)[0][i].lstrip(b" \n\r\t")[:1] in (b"{", b"") for i in first)
    x = tok.encode("x")[0]
    with pytest.raises(GrammarViolation, match=f"token {x} is not allowed"):
        m.advance(x)
    assert m.tokens == []
    logits = torch.zeros(2 * gtok.vocab_size).view(1, -1)[:, : gtok.vocab_size + 10]  # wider than the grammar
    m.apply(logits)
    assert torch.equal(torch.isfinite(logits[0, : gtok.vocab_size]), allowed)
    assert not torch.isfinite(logits[0, gtok.vocab_size :]).any()
    for t in tok.encode('{"k": [1, {"z": null}]}'):
        m.advance(t)
    assert m.done and set(m.allowed().nonzero().flatten().tolist()) == set(gtok.stop_ids)


def test_unpack_bitmask_bit_order():
    bm = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # ids 0, 2 and 63
    assert unpack_bitmask(bm, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]


def test_response_format_errors(gtok):
    assert response_format_schema(None) == (None, False)
    assert response_format_schema({"type": "text"}) == (None, False)
    assert response_format_schema({"type": "json_object"}) == ({"type": "object"}, False)
    for bad, msg in [
        ({"type": "xml"}, "must be"),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": 3}}, "JSON schema object"),
        ("x", "object"),
    ]:
        with pytest.raises(GrammarError, match=msg):
            response_format_schema(bad)
    with pytest.raises(GrammarError, match="cannot be enforced|schema"):
        GrammarMatcher(gtok, rf({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}))
    with pytest.raises(GrammarError, match="text"):
        GrammarMatcher(gtok, {"type": "text"})


def test_missing_engine_names_the_install(monkeypatch, tok):
    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "llguidance":
            raise ImportError("No module named 'llguidance'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(GrammarEngineMissing, match="pip install llguidance"):
        GrammarTokenizer(tok)


def test_token_bytes_are_the_tokenizers(tok):
    tb, special = token_bytes(tok)
    assert len(tb) == tok.vocab_size and special == set(tok.special.values())
    text = 'Grüße, {"json": [1, 2.5e3, "ünï ☃"]}\n\tend'
    ids = tok.encode(text)
    assert b"".join(tb[i] for i in ids).decode() == text
    assert tb[tok.special["<|im_end|>"]] == b"<|im_end|>"


def test_token_bytes_tiktoken_and_sentencepiece(tmp_path):
    import base64

    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models

    from p2pk3.tokenizer import load_tokenizer

    tt = tmp_path / "tt"
    tt.mkdir()
    ranks = {bytes([b]): b for b in range(256)}
    for m in (b"th", b"the", "ü".encode()[:1] + b"x"):
        ranks[m] = len(ranks)
    (tt / "tiktoken.model").write_text("".join(f"{base64.b64encode(b).decode()} {r}\n" for b, r in ranks.items()))
    (tt / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": "[EOS]", "added_tokens_decoder": {str(len(ranks)): {"content": "[EOS]", "special": True}}}
        )
    )
    t = load_tokenizer(tt)
    tb, special = token_bytes(t)
    assert tb[: len(ranks)] == list(ranks) and tb[len(ranks)] == b"[EOS]" and special == {len(ranks)}
    sp = tmp_path / "sp"
    sp.mkdir()
    vocab = {"<unk>": 0, "▁Hello": 1, "!": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tk = HFTok(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.save(str(sp / "tokenizer.json"))
    tb, _ = token_bytes(load_tokenizer(sp))
    assert tb[1] == b" Hello" and tb[2] == b"!" and tb[3 + 0xE4] == b"\xe4"


def test_strict_refuses_what_cannot_be_enforced(gtok):
    schema = {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}
    with pytest.raises(GrammarError, match="Unimplemented keys.*uniqueItems"):
        GrammarMatcher(gtok, rf(schema, strict=True))
    GrammarMatcher(gtok, rf(schema, strict=False))  # without strict the keyword is ignored, the rest enforced


WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}},
}
SEARCH = {
    "type": "object",
    "additionalProperties": False,
    "required": ["q"],
    "properties": {"q": S, "n": {"type": "integer", "minimum": 1, "maximum": 10}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
]


@pytest.mark.parametrize(
    "choice,parallel",
    [("required", True), ("required", False), ({"type": "function", "function": {"name": "search"}}, True)],
)
def test_forced_tool_calls_parse_into_valid_calls(tok, gtok, choice, parallel):
    from p2pk3.agent.toolcalls import ToolCallFormat, parse_tool_calls
    from p2pk3.agent.toolgrammar import tool_call_grammar

    # the embedded tokenizer has no tool tokens: reserved slots stand in (call, argument, end, section)
    fmt = ToolCallFormat(*[f"<|reserved_token_{i}|>" for i in (7, 8, 9, 5, 6)])
    lark = tool_call_grammar(fmt, TOOLS, choice, gtok.special, parallel_tool_calls=parallel)
    m = GrammarMatcher(gtok, lark=lark, what="tool_choice")
    gen = torch.Generator().manual_seed(5)
    specials = sorted(tok.special.values())
    schemas = {"get_weather": WEATHER, "search": SEARCH}
    names, counts = set(), set()
    for j in range(12):
        m.reset()
        ids = generate(m, gen, specials if j % 2 else [])
        p = parse_tool_calls(tok.decode(ids), fmt, tools=TOOLS)
        assert p.errors == [] and p.content == "" and p.tool_calls, tok.decode(ids)
        for c in p.tool_calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])
            names.add(c["function"]["name"])
        counts.add(len(p.tool_calls))
    assert names == ({"search"} if isinstance(choice, dict) else {"get_weather", "search"})
    if parallel:
        assert max(counts) > 1
    else:
        assert counts == {1}


def test_tool_choice_errors(tok, gtok):
    from p2pk3.agent.toolcalls import NoToolFormat, ToolCallFormat
    from p2pk3.agent.toolgrammar import tool_call_grammar

    fmt = ToolCallFormat("<|reserved_token_7|>", "<|reserved_token_8|>", "<|reserved_token_9|>")
    assert tool_call_grammar(fmt, TOOLS, "auto", gtok.special) is None
    assert tool_call_grammar(fmt, TOOLS, None, gtok.special) is None
    for tools, choice, msg in [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([], "required", "non-empty tools"),
        (TOOLS, "always", "tool_choice must be"),
    ]:
        with pytest.raises(GrammarError, match=msg):
            tool_call_grammar(fmt, tools, choice, gtok.special)
    with pytest.raises(GrammarError, match="no tool-call tokens"):
        tool_call_grammar(NoToolFormat("this checkpoint has no tool-call tokens"), TOOLS, "required", gtok.special)
    # text markers (not special tokens) are literals; without section markers the calls stand alone
    lark = tool_call_grammar(ToolCallFormat("<call>", "<args>", "</call>"), TOOLS[1:], "required", gtok.special)
    assert '"<call>"' in lark and "<[" not in lark
    m = GrammarMatcher(gtok, lark=lark)
    ids = tok.encode('<call>functions.search:0<args>{"q": "a"}</call>')
    assert m.validate(ids) == len(ids)
    ids_bad = tok.encode("<call>functions.get_weather:0<args>")
    assert m.validate(ids_bad) < len(ids_bad)
