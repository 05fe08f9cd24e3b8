"""Train a small byte-level BPE with Kimi-style special tokens and write it in two formats.

Formats (both readable by `p2pk3.tokenizer.load_tokenizer`):
(a) Hugging Face: `tokenizer.json` (+ `tokenizer_config.json` with the chat template and special ids);
(b) Kimi's own: `tiktoken.model` (one `<base64 bytes> <rank>` line per BPE token, rank = token id) +
    `tokenizer_config.json` whose `added_tokens_decoder` names the special tokens (what
    `tokenization_kimi.py` of Kimi K2 / K3 reads).

Id layout (mirrors Kimi, where the BPE ranks are 0..163583 and 256 special slots follow at
163584..163839): BPE tokens take ids 0..n_base-1, then `NUM_SPECIAL` special slots. The named specials
sit at the same offsets from n_base as in Kimi K2's tokenizer_config (`[BOS]` +0, `[EOS]` +1,
`<|im_end|>` +2, `<|im_user|>` +3, `<|im_assistant|>` +4, `<|im_system|>` +10, the five tool-call markers
`<|tool_calls_section_begin|>` `<|tool_calls_section_end|>` `<|tool_call_begin|>` `<|tool_call_argument_begin|>`
`<|tool_call_end|>` +11..+15, `<|im_middle|>` +17, `<think>` `</think>` +22, +23);
`[UNK]` and `[PAD]` take the last two slots (Kimi: 163838, 163839); every other slot is
`<|reserved_token_{i}|>` (Kimi's naming for unlisted slots). Kimi reserves 256 slots; we reserve 32 to
keep the embedding small.

The special-token *names* follow Kimi K2's published tokenizer_config.json (from memory; no source was
available while writing this, so treat the exact K2 offsets as best knowledge, not verified). The K2/K3 chat
format is `<|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...<|im_end|>`
`<|im_assistant|>assistant<|im_middle|>`.

    python -m p2pk3.tokenizer.bpe --out /tmp/tok   # trains on CPython's pydoc topics (all of them)
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Iterable

# Pre-tokenizer regex of Kimi K2's `tokenization_kimi.py` (tiktoken `pat_str`), written from memory:
# UNCERTAIN in its details (in particular the exact letter classes and the contraction suffixes). It needs
# character-class intersection (`&&`), which both tiktoken's fancy-regex / regex crate and the Oniguruma
# engine of HF tokenizers support. Han characters are split off as their own runs; digits go in groups of
# at most 3.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_SPECIAL = 32
# name -> offset from the first special id (n_base). Kimi K2 offsets for the chat tokens; UNK/PAD last.
SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": NUM_SPECIAL - 2,
    "[PAD]": NUM_SPECIAL - 1,
}
BOS, EOS, IM_END, PAD, UNK = "[BOS]", "[EOS]", "<|im_end|>", "[PAD]", "[UNK]"
ROLE_TOKENS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}
IM_MIDDLE = "<|im_middle|>"

# Jinja chat template stored in tokenizer_config.json (HF `apply_chat_template` compatible; rendered by
# p2pk3.tokenizer.chat, also for a checkpoint that has no template of its own). It writes what Kimi K2 / K3's
# published template writes: the request's tools as a `tool_declare` system turn (JSON), past assistant tool
# calls as a section of `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>` (ID is
# `functions.NAME:IDX`), a tool result as a `tool` system turn headed `## Return of ID`, and past reasoning
# between `<think>` `</think>`. Unlike Kimi's shipped template there is no default system prompt, and the
# generation prompt opens no thinking section. A message may carry a `name` that replaces the role name after
# the role token (as in Kimi's template).
CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>{{ message.get('name') or 'system' }}<|im_middle|>"
    "{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of "
    "{{ message.get('tool_call_id') }}\n{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>{{ message.get('name') or 'user' }}<|im_middle|>"
    "{{ message['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>{{ message.get('name') or message['role'] }}<|im_middle|>"
    "{%- if message.get('reasoning_content') -%}<think>{{ message['reasoning_content'] }}</think>{%- endif -%}"
    "{{ message.get('content') or '' }}"
    "{%- if message.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in message['tool_calls'] -%}<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>"
    "{%- if tc['function']['arguments'] is string -%}{{ tc['function']['arguments'] }}"
    "{%- else -%}{{ tc['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def special_tokens(n_base: int) -> list[tuple[int, str]]:
    """All `NUM_SPECIAL` special tokens as (id, content), in id order."""
    by_off = {o: n for n, o in SPECIAL_OFFSETS.items()}
    return [(n_base + i, by_off.get(i, f"<|reserved_token_{i}|>")) for i in range(NUM_SPECIAL)]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char map (what the ByteLevel pre-tokenizer uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """Train a byte-level BPE (Kimi pre-tokenizer regex) with `vocab_size` ids in total, the last
    `NUM_SPECIAL` of which are special tokens. Returns a `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - NUM_SPECIAL,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    n_base = tok.get_vocab_size()
    specials = special_tokens(n_base)
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for _, c in specials])
    for i, c in specials:
        assert tok.token_to_id(c) == i, (c, tok.token_to_id(c), i)
    return tok


def _config(n_base: int, extra: dict | None = None) -> dict:
    specials = special_tokens(n_base)
    ids = {c: i for i, c in specials}
    cfg = {
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "unk_token_id": ids[UNK],
        "im_end_token_id": ids[IM_END],
        "stop_token_ids": [ids[EOS], ids[IM_END]],
        "num_base_tokens": n_base,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": c,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, c in specials
        },
    }
    if extra:
        cfg.update(extra)
    return cfg


def save_hf(tok, out_dir: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    n_base = tok.get_vocab_size() - NUM_SPECIAL
    cfg = _config(n_base, {"tokenizer_class": "PreTrainedTokenizerFast"})
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return out


def hf_to_tiktoken_ranks(tok) -> dict[bytes, int]:
    """BPE tokens of a byte-level HF tokenizer -> tiktoken mergeable ranks (bytes -> id)."""
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    n_base = tok.get_vocab_size() - NUM_SPECIAL
    ranks: dict[bytes, int] = {}
    for s, i in tok.get_vocab(with_added_tokens=False).items():
        if i < n_base:
            ranks[bytes(u2b[ch] for ch in s)] = i
    assert len(ranks) == n_base and sorted(ranks.values()) == list(range(n_base))
    return ranks


def write_tiktoken(ranks: dict[bytes, int], out_dir: str | Path) -> Path:
    """Kimi's format: `tiktoken.model` (`<base64> <rank>` per line, rank order) + tokenizer_config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(b).decode()} {r}" for b, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    cfg = _config(len(ranks), {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}})
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="train the pydoc BPE")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tiktoken", action="store_true", help="also write tiktoken.model (Kimi format)")
    a = ap.parse_args(argv)
    import pydoc_data.topics

    tok = train_bpe([pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)], a.vocab)
    save_hf(tok, a.out)
    if a.tiktoken:
        write_tiktoken(hf_to_tiktoken_ranks(tok), Path(a.out) / "tiktoken")
    print(f"wrote {a.out}: {tok.get_vocab_size()} ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
