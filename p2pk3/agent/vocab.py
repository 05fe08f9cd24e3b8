"""The bytes of every token id of a p2pk3 tokenizer, as grammar engines need them.

    tokens, special = token_bytes(tokenizer)     # list[bytes] (index = id), set of special ids

A grammar engine decides which next tokens keep the output inside a grammar by the *bytes* each token
adds, so it needs the vocabulary as bytes, not as the display strings of the tokenizer file. The two
backends of `p2pk3.tokenizer` keep them differently: `tokenizer.json` (Hugging Face `tokenizers`) stores
byte-level BPE tokens in GPT-2's byte-to-unicode alphabet (`Ġ` = space) or SentencePiece-style tokens
(`▁` = space, `<0xNN>` byte-fallback tokens); `tiktoken.model` stores the bytes themselves. Special
tokens (`<|im_end|>`, reserved slots) are reported apart: their text must never be produced by a
grammar as if it were ordinary output.

Called by `p2pk3.agent.grammar` (the engine's tokenizer, once per tokenizer) and `tools/bench_grammar.py`.
"""

from __future__ import annotations

import re

__all__ = ["token_bytes", "VocabError"]


class VocabError(ValueError):
    """The tokenizer's vocabulary cannot be turned into bytes (an encoding this module does not know)."""


def _gpt2_unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's `bytes_to_unicode` (what byte-level BPE files write for each byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return {k for d in decoder.get("decoders", []) for k in _decoder_kinds(d)}
    return {decoder.get("type", "")}


def _hf_token_bytes(tok) -> list[bytes | None]:
    """Bytes of the tokens of a `tokenizers.Tokenizer` (None where an id has no token). Added tokens are
    their text; model tokens are decoded from the vocabulary's alphabet."""
    import json

    spec = json.loads(tok.to_str())
    kinds = _decoder_kinds(spec.get("decoder"))
    n = tok.get_vocab_size(with_added_tokens=True)
    out: list[bytes | None] = [None] * n
    vocab = tok.get_vocab(with_added_tokens=False)
    if "ByteLevel" in kinds:
        table = {ord(c): chr(b) for c, b in _gpt2_unicode_to_bytes().items()}
        for s, i in vocab.items():
            try:
                out[i] = s.translate(table).encode("latin-1")
            except UnicodeEncodeError:
                raise VocabError(f"token {i} {s!r} is not in the byte-level alphabet") from None
    elif kinds & {"Metaspace", "Replace", "ByteFallback"} or spec.get("model", {}).get("byte_fallback"):
        for s, i in vocab.items():
            m = _BYTE_FALLBACK.fullmatch(s)
            out[i] = bytes([int(m.group(1), 16)]) if m else s.replace("\u2581", " ").encode()
    else:
        raise VocabError(
            f"tokenizer.json decoder {sorted(kinds) or 'none'}: only byte-level BPE (ByteLevel) and "
            "SentencePiece-style (Metaspace / ByteFallback) vocabularies can be turned into bytes"
        )
    for i, t in tok.get_added_tokens_decoder().items():
        out[i] = t.content.encode()
    return out


def token_bytes(tokenizer) -> tuple[list[bytes], set[int]]:
    """(bytes of each id 0..vocab_size-1, special ids) of a `p2pk3.tokenizer.Tokenizer` (or a
    `ChatTokenizer`, which wraps one). Special ids get their text as bytes in the list (engines mark them
    special by the set); ids without any token get b"" and count as special."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # ChatTokenizer -> Tokenizer
    n = tokenizer.vocab_size
    special = set(tokenizer.id_to_special)
    if hasattr(tokenizer, "tok"):  # HFTokenizer
        raw = _hf_token_bytes(tokenizer.tok)
    elif hasattr(tokenizer, "enc"):  # TiktokenTokenizer
        enc = tokenizer.enc
        raw = [enc.decode_single_token_bytes(i) if i < enc.n_vocab and i not in special else None for i in range(n)]
    else:
        raise VocabError(f"{tokenizer!r}: not a p2pk3 tokenizer (HFTokenizer or TiktokenTokenizer)")
    out: list[bytes] = []
    for i in range(n):
        if i in special:
            out.append(tokenizer.id_to_special[i].encode())
        elif i < len(raw) and raw[i] is not None:
            out.append(raw[i])
        else:
            out.append(b"")
            special.add(i)
    return out, special
