"""p2pk3.tokenizer: byte-level BPE in both formats (HF tokenizer.json, Kimi tiktoken.model) and the chat template."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pk3.tokenizer import load_tokenizer  # noqa: E402
from p2pk3.tokenizer.bpe import (  # noqa: E402
    CHAT_TEMPLATE,
    NUM_SPECIAL,
    SPECIAL_OFFSETS,
    hf_to_tiktoken_ranks,
    save_hf,
    special_tokens,
    train_bpe,
    write_tiktoken,
)

CORPUS = [
    'The "assert" statement\n**********************\n\nAssert statements are a convenient way to insert '
    'debugging assertions into a program:\n\n   assert_stmt ::= "assert" expression ["," expression]\n',
    'The simple form, "assert expression", is equivalent to\n\n   if __debug__:\n       if not expression: '
    'raise AssertionError\n\nThese equivalences assume that "__debug__" and "AssertionError" refer to the '
    "built-in variables with those names. It's 2024 and they're 12345 numbers.\n",
] * 20
SAMPLES = [
    'assert x, "message"\n',
    "Hello, world! It's 12345678 o'clock.\n\n\tTabs and   spaces  ",
    "naïve café — 東京 你好世界 🙂 \x00\x7f",
    "",
    " leading space and trailing newline\n",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is assert?"},
    {"role": "assistant", "content": "A statement."},
    {"role": "user", "content": "And <|im_end|> inside text?"},
]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    hf = train_bpe(CORPUS, vocab_size=256 + NUM_SPECIAL + 64)
    save_hf(hf, d / "hf")
    write_tiktoken(hf_to_tiktoken_ranks(hf), d / "tt")
    return d


@pytest.fixture(scope="module", params=["hf", "tt"])
def tok(request, tok_dirs):
    t = load_tokenizer(tok_dirs / request.param)
    assert t.backend == ("tokenizer.json" if request.param == "hf" else "tiktoken")
    return t


def test_round_trip(tok):
    for s in SAMPLES + CORPUS[:2]:
        ids = tok.encode(s)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size - NUM_SPECIAL for i in ids)
        assert tok.decode(ids) == s


def test_merges_are_used(tok):
    s = CORPUS[0]
    assert len(tok.encode(s)) < len(s.encode()) // 2  # trained merges compress the training text


def test_special_ids(tok):
    n_base = tok.vocab_size - NUM_SPECIAL
    for name, off in SPECIAL_OFFSETS.items():
        assert tok.special[name] == n_base + off
    assert len(tok.special) == NUM_SPECIAL
    assert tok.special[f"<|reserved_token_{5}|>"] == n_base + 5
    assert tok.bos_id == n_base + SPECIAL_OFFSETS["[BOS]"]
    assert tok.eos_ids == {n_base + SPECIAL_OFFSETS["[EOS]"], n_base + SPECIAL_OFFSETS["<|im_end|>"]}
    assert tok.pad_id == n_base + SPECIAL_OFFSETS["[PAD]"]
    assert tok.decode([tok.bos_id]) == "[BOS]"
    assert tok.decode([tok.bos_id, *tok.encode("x")], skip_special=True) == "x"


def test_special_strings_in_text(tok):
    s = "a <|im_end|> b [EOS]"
    plain = tok.encode(s)
    assert not set(plain) & set(tok.special.values())  # plain text by default (no injection)
    assert tok.decode(plain) == s
    allowed = tok.encode(s, allow_special=True)
    assert tok.special["<|im_end|>"] in allowed and tok.special["[EOS]"] in allowed
    assert tok.decode(allowed) == s


def test_chat_template(tok):
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is assert?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>A statement.<|im_end|>"
        "<|im_user|>user<|im_middle|>And <|im_end|> inside text?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    ids = tok.apply_chat_template(MESSAGES)
    assert tok.decode(ids) == text
    sp = tok.special
    assert ids[0] == sp["<|im_system|>"] and ids[-1] == sp["<|im_middle|>"]
    assert ids.count(sp["<|im_end|>"]) == 4  # the one inside the user text stays text
    no_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_prompt[-1] == sp["<|im_end|>"] and ids[: len(no_prompt)] == no_prompt


def test_chat_template_jinja_matches(tok_dirs):
    jinja2 = pytest.importorskip("jinja2")
    for sub in ("hf", "tt"):
        cfg = json.loads((tok_dirs / sub / "tokenizer_config.json").read_text())
        assert cfg["chat_template"] == CHAT_TEMPLATE
        t = load_tokenizer(tok_dirs / sub)
        for gen in (True, False):
            for msgs in (MESSAGES, MESSAGES[1:2], [{"role": "user", "content": "hi", "name": "alice"}]):
                want = jinja2.Template(cfg["chat_template"]).render(messages=msgs, add_generation_prompt=gen)
                assert t.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False) == want


def test_formats_agree(tok_dirs):
    hf, tt = load_tokenizer(tok_dirs / "hf"), load_tokenizer(tok_dirs / "tt")
    assert hf.vocab_size == tt.vocab_size and hf.special == tt.special
    for s in SAMPLES + CORPUS[:2]:
        assert hf.encode(s) == tt.encode(s)
    assert hf.apply_chat_template(MESSAGES) == tt.apply_chat_template(MESSAGES)


def test_tiktoken_from_scratch(tmp_path):
    """A hand-made Kimi-format tokenizer: ranks over the 256 bytes + three merges, two named specials."""
    ranks = {bytes([b]): b for b in range(256)}
    for m in (b"th", b"the", b" the"):
        ranks[m] = len(ranks)
    n_base = len(ranks)
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(b).decode()} {r}\n" for b, r in ranks.items()))
    cfg = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "added_tokens_decoder": {
            str(n_base): {"content": "[BOS]", "special": True},
            str(n_base + 1): {"content": "[EOS]", "special": True},
            str(n_base + 2): {"content": "<|im_end|>", "special": True},
            str(n_base + 7): {"content": "<|im_middle|>", "special": True},
        },
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_tokenizer(tmp_path)
    assert t.backend == "tiktoken"
    assert t.vocab_size == n_base + 8
    assert t.encode("the the") == [ranks[b"the"], ranks[b" the"]]
    assert t.encode("x") == [ord("x")]
    assert t.bos_id == n_base and t.eos_ids == {n_base + 1, n_base + 2}
    assert t.special["<|reserved_token_3|>"] == n_base + 3  # unnamed slots, Kimi style
    for s in SAMPLES:
        assert t.decode(t.encode(s)) == s
    assert t.decode(t.encode("[BOS]the<|im_middle|>", allow_special=True)) == "[BOS]the<|im_middle|>"
    assert t.encode("[BOS]the", allow_special=True) == [n_base, ranks[b"the"]]


def test_special_token_layout():
    sp = special_tokens(1000)
    assert [i for i, _ in sp] == list(range(1000, 1000 + NUM_SPECIAL))
    names = [c for _, c in sp]
    assert len(set(names)) == NUM_SPECIAL
    assert names[0] == "[BOS]" and names[-1] == "[PAD]" and names[-2] == "[UNK]"


def test_prefer_and_missing(tok_dirs, tmp_path):
    import shutil

    both = tmp_path / "both"
    shutil.copytree(tok_dirs / "hf", both)
    shutil.copy(tok_dirs / "tt" / "tiktoken.model", both / "tiktoken.model")
    assert load_tokenizer(both).backend == "tokenizer.json"
    assert load_tokenizer(both, prefer="tiktoken").backend == "tiktoken"
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "empty")


# -- incremental detokenization (p2pk3.tokenizer.detok) -----------------------------------------------------
STREAM_TEXT = "naïve café — 東京 你好世界 🙂👍🏽 done"


def _stream(dec, ids):
    chunks = [dec.push(i) for i in ids]
    return chunks, dec.flush()


def test_stream_decoder_byte_split_chars(tok):
    """Every emoji / CJK character of STREAM_TEXT is split over byte tokens (the BPE is trained on ASCII):
    no chunk carries a broken character, and the chunks add up to the text."""
    from p2pk3.tokenizer import StreamDecoder

    ids = tok.encode(STREAM_TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test means something: bytes are split
    chunks, rest = _stream(StreamDecoder(tok.decode), ids)
    assert "".join(chunks) + rest == STREAM_TEXT and rest == ""
    assert all("\ufffd" not in c for c in chunks)
    assert chunks.count("") >= 2 * len("東京你好世界") + 3 * 3  # held while a character is incomplete
    assert "".join(tok.decode([i]) for i in ids) != STREAM_TEXT  # what naive per-token decoding prints
    # stop early: the incomplete character comes out of flush() as U+FFFD, then the decoder is reusable
    dec = StreamDecoder(tok.decode)
    cut = len(tok.encode("naïve café — 東")) - 1  # the last byte of 東 is missing
    chunks, rest = _stream(dec, ids[:cut])
    assert "".join(chunks) == "naïve café — " and rest == "\ufffd"
    assert "".join(_stream(dec, ids)[0]) == STREAM_TEXT


def test_stream_decoder_token_straddles_chars(tmp_path):
    """tiktoken tokens that end inside a character and start inside the next: the complete part is
    emitted at once, the rest when the character completes."""
    from p2pk3.tokenizer import StreamDecoder

    emoji = "🙂".encode()
    ranks = {bytes([b]): b for b in range(256)}
    for m in (b"a" + emoji[:2], emoji[2:] + b"b", "東".encode()[:2], "東".encode()[2:] + b"c"):
        ranks[m] = len(ranks)
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(b).decode()} {r}\n" for b, r in ranks.items()))
    t = load_tokenizer(tmp_path)
    ids = [ranks[b"a" + emoji[:2]], ranks[emoji[2:] + b"b"], ranks["東".encode()[:2]], ranks["東".encode()[2:] + b"c"]]
    assert t.decode(ids) == "a🙂b東c"
    chunks, rest = _stream(StreamDecoder(t.decode), ids)
    assert chunks == ["a", "🙂b", "", "東c"] and rest == ""


def test_stream_decoder_context_dependent_decoder(tmp_path):
    """SentencePiece-style decoding (Metaspace + byte fallback + strip of the first space): a token decoded
    alone loses its leading space, and an emoji comes as four <0x..> byte tokens."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models

    from p2pk3.tokenizer import StreamDecoder

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁": 4}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tk = HFTok(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tk.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(tmp_path)
    ids = [1, 2, 4] + [vocab[f"<0x{b:02X}>"] for b in "🙂".encode()] + [3, 2]
    want = t.decode(ids)
    assert want == "Hello world 🙂! world"
    assert "".join(t.decode([i]) for i in ids) != want  # per-token decoding drops the spaces
    chunks, rest = _stream(StreamDecoder(t.decode), ids)
    assert "".join(chunks) + rest == want and all("\ufffd" not in c for c in chunks)
    assert chunks[:2] == ["Hello", " world"] and chunks[3:6] == ["", "", ""]


def test_stream_decoder_invalid_bytes_do_not_stall(tok):
    """Bytes that never form a character are emitted as U+FFFD after max_hold tokens, not held forever."""
    from p2pk3.tokenizer import StreamDecoder

    lead = tok.encode("東")[0]  # a lone UTF-8 lead byte, repeated: never completes
    dec = StreamDecoder(tok.decode, max_hold=3)
    chunks = [dec.push(lead) for _ in range(4)]
    assert chunks[:3] == ["", "", ""] and chunks[3] == "\ufffd" * 4
    # after that, a real character is held again while incomplete (the hold count starts over)
    assert [dec.push(i) for i in tok.encode("東x")] == ["", "", "東", "x"] and dec.flush() == ""
    with pytest.raises(ValueError, match="max_hold"):
        StreamDecoder(tok.decode, max_hold=0)


def test_dict_special_tokens_in_config(tok_dirs, tmp_path):
    """tokenizer_config may write special tokens as AddedToken dicts."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tok_dirs / "hf", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_tokenizer(d)
    assert t.eos_id == t.special["<|im_end|>"]
