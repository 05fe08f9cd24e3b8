"""Tokenizers of a model directory: Hugging Face `tokenizer.json` or Kimi's `tiktoken.model`.

    tok = load_tokenizer(model_dir)
    ids = tok.encode("text")                      # special-token strings in the text stay plain text
    tok.decode(ids)
    tok.apply_chat_template([{"role": "user", "content": "hi"}])   # ids, ends with the generation prompt
    tok.eos_ids, tok.bos_id, tok.vocab_size

(a) `tokenizer.json` is read with `tokenizers`; (b) `tiktoken.model` (one `<base64 bytes> <rank>` line per
BPE token) + `tokenizer_config.json` (`added_tokens_decoder`: id -> special token) is read with
`tiktoken.Encoding` and Kimi's pre-tokenizer regex (`bpe.KIMI_PAT_STR`, uncertain, see there). Special ids
not named in `added_tokens_decoder` are `<|reserved_token_{i}|>`, as in Kimi's `tokenization_kimi.py`.
When a directory has both, `tokenizer.json` wins unless `prefer="tiktoken"`.

There is one chat format: the checkpoint's own template, rendered by `ChatTokenizer` (`chat.py`) as
transformers renders it, with its stop ids, generation_config defaults and streaming detokenization.
`Tokenizer.apply_chat_template` is a shorthand for the same rendering (`tok.chat`, the ChatTokenizer of
the tokenizer's directory). Front ends build prompts through p2pk3/frontends/prompt.py, which uses it:

    tok = ChatTokenizer.from_pretrained(model_dir)      # or load_tokenizer(model_dir).chat
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tools=None)
    tok.stop_ids, tok.generation_defaults, tok.stream_decoder()
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Sequence

from .bpe import BOS, CHAT_TEMPLATE, EOS, IM_END, KIMI_PAT_STR, PAD

__all__ = [
    "Tokenizer",
    "load_tokenizer",
    "CHAT_TEMPLATE",
    "ChatTokenizer",
    "ChatTemplateError",
    "StreamDecoder",
    "GenerationDefaults",
    "load_generation_defaults",
]


def _token_str(v) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    """Common interface over the two backends."""

    backend: str

    def __init__(self, config: dict, special: dict[str, int], vocab_size: int, directory: Path):
        self.config = config
        self.directory = directory  # the model directory (its chat template, generation_config)
        self.special = special  # content -> id, every special slot
        self.id_to_special = {i: c for c, i in special.items()}
        self.vocab_size = vocab_size
        self.bos_id = special.get(_token_str(config.get("bos_token")) or BOS)
        self.eos_id = special.get(_token_str(config.get("eos_token")) or EOS)
        self.pad_id = special.get(_token_str(config.get("pad_token")) or PAD)
        self.im_end_id = special.get(IM_END)
        self.eos_ids = {i for i in (self.eos_id, self.im_end_id) if i is not None}
        self._chat = None

    # backends implement these two
    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Ids of `text`. Special-token strings are plain text unless `allow_special` (then they map to
        their ids)."""
        if not allow_special or not text:
            return self._encode_plain(text)
        ids: list[int] = []
        rest = text
        while rest:
            hits = [(rest.find(c), c) for c in self.special if c in rest]
            if not hits:
                ids += self._encode_plain(rest)
                break
            pos, c = min(hits, key=lambda h: (h[0], -len(h[1])))
            ids += self._encode_plain(rest[:pos]) + [self.special[c]]
            rest = rest[pos + len(c) :]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        out, run = [], []
        for i in ids:
            i = int(i)
            if i in self.id_to_special:
                if run:
                    out.append(self._decode(run))
                    run = []
                if not skip_special:
                    out.append(self.id_to_special[i])
            else:
                run.append(i)
        if run:
            out.append(self._decode(run))
        return "".join(out)

    @property
    def chat(self):
        """The ChatTokenizer over this tokenizer and its directory (built once)."""
        if self._chat is None:
            self._chat = ChatTokenizer.for_tokenizer(self)
        return self._chat

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, tokenize: bool = True
    ) -> list[int] | str:
        """The checkpoint's chat template (`self.chat`): the prompt ids, or with tokenize=False the text."""
        if not tokenize:
            return self.chat.render(messages, add_generation_prompt=add_generation_prompt)
        return self.chat.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend} vocab={self.vocab_size}>"


class HFTokenizer(Tokenizer):
    backend = "tokenizer.json"

    def __init__(self, path: Path, config: dict):
        from tokenizers import Tokenizer as _Tok

        self.tok = _Tok.from_file(str(path))
        self.tok.encode_special_tokens = True  # plain encode: special strings are text
        special = {t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        super().__init__(config, special, self.tok.get_vocab_size(with_added_tokens=True), path.parent)

    def _encode_plain(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    backend = "tiktoken"

    def __init__(self, path: Path, config: dict, pat_str: str = KIMI_PAT_STR):
        import tiktoken

        ranks: dict[bytes, int] = {}
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
        n_base = len(ranks)
        if sorted(ranks.values()) != list(range(n_base)):
            raise ValueError(f"{path}: ranks must be 0..{n_base - 1}, each once")
        named = {int(i): v["content"] for i, v in (config.get("added_tokens_decoder") or {}).items()}
        n_special = max([i - n_base + 1 for i in named] + [0])
        n_special = max(n_special, int(config.get("num_reserved_special_tokens", 0)))
        special = {named.get(n_base + i, f"<|reserved_token_{i}|>"): n_base + i for i in range(n_special)}
        self.enc = tiktoken.Encoding(
            name=path.parent.name or "kimi", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special
        )
        super().__init__(config, special, n_base + n_special, path.parent)

    def _encode_plain(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(list(ids))


def load_tokenizer(model_dir: str | Path, prefer: str | None = None) -> Tokenizer:
    """The tokenizer of a model directory (see the module doc). prefer: "hf" or "tiktoken"."""
    d = Path(model_dir)
    cfg_path = d / "tokenizer_config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    hf, tt = d / "tokenizer.json", d / "tiktoken.model"
    order = [tt, hf] if prefer == "tiktoken" else [hf, tt]
    for p in order:
        if p.exists():
            return HFTokenizer(p, config) if p is hf else TiktokenTokenizer(p, config)
    raise FileNotFoundError(f"{d}: neither tokenizer.json nor tiktoken.model")


# The front-end API (imported last: chat.py imports load_tokenizer from this module).
from .chat import ChatTemplateError, ChatTokenizer  # noqa: E402
from .detok import StreamDecoder  # noqa: E402
from .generation import GenerationDefaults, load_generation_defaults  # noqa: E402
