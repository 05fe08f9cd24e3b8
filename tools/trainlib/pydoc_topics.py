"""The data of the tiny-k3-pydoc model: `pydoc_data.topics` (topic -> reference text, ships with CPython).

Topics are split by a hash of their name (`split_of`): ~10% of the topics are HELD OUT (only the final
perplexity reads them), a few more are VALIDATION, the rest TRAIN; topics nest, so paragraphs of held-out
(validation) topics are removed from the validation and train (train) texts (`split_topics`; `overlap` measures
what is left). Chat Q/A pairs come from the train topics' section headings (`chat_documents`).
"""

from __future__ import annotations

import hashlib
import random
import re

HELDOUT_PCT = 10  # sha256(name) % 100 < 10 -> held out (7 topics, ~5% of the text on CPython 3.11)
VAL_PCT = 8  # of the rest, sha256("val/" + name) % 100 < 8 -> validation
SYSTEM_PROMPT = "You are a helpful assistant that knows the Python language reference."


# ------------------------------------------------------------------------------------------------ data
def _h(s: str) -> int:
    return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16) % 100


def split_of(name: str) -> str:
    if _h(name) < HELDOUT_PCT:
        return "heldout"
    if _h("val/" + name) < VAL_PCT:
        return "val"
    return "train"


def load_topics() -> dict[str, str]:
    import pydoc_data.topics

    return {k: pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)}


def _paragraphs(text: str) -> list[str]:
    return re.split(r"\n[ \t]*\n", text)


def _dedup(text: str, banned: set[str]) -> str:
    """`text` without the paragraphs (>= 40 chars, exact match after strip) listed in `banned`."""
    return "\n\n".join(p for p in _paragraphs(text) if p.strip() not in banned)


def _para_set(texts) -> set[str]:
    return {p.strip() for t in texts for p in _paragraphs(t) if len(p.strip()) >= 40}


def split_topics(topics: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """topic -> text per split. pydoc topics nest (e.g. `specialnames` contains all of `attribute-access`),
    so a topic-level split alone leaks: every paragraph of a held-out topic is removed from the train and
    validation texts, and every validation paragraph from the train texts."""
    topics = load_topics() if topics is None else topics
    out: dict[str, dict[str, str]] = {"train": {}, "val": {}, "heldout": {}}
    for k, v in topics.items():
        out[split_of(k)][k] = v
    held = _para_set(out["heldout"].values())
    out["val"] = {k: _dedup(v, held) for k, v in out["val"].items()}
    val = _para_set(out["val"].values())
    out["train"] = {k: _dedup(v, held | val) for k, v in out["train"].items()}
    return out


def overlap(held: dict[str, str], train: dict[str, str], n: int = 8) -> float:
    """Fraction of the held-out word n-grams that also occur in the train text (a leak check)."""

    def grams(t: str) -> set[tuple[str, ...]]:
        w = t.split()
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    h = grams("\n".join(held.values()))
    tr = grams("\n".join(train.values()))
    return len(h & tr) / max(1, len(h))


_HEAD = re.compile(r"^(\S[^\n]*)\n([*=\-^~]+)\n", re.M)


def _first_sentences(text: str, max_chars: int = 300) -> str:
    """First prose paragraph (not an indented code block / grammar), cut to whole sentences."""
    for para in re.split(r"\n\s*\n", text):
        if not para.strip() or para.startswith(" ") or _HEAD.match(para + "\n"):
            continue
        p = " ".join(para.split())
        if len(p) < 40:
            continue
        sents = re.split(r"(?<=[.!?])\s+(?=[A-Z\"])", p)
        out = ""
        for s in sents:
            if out and len(out) + len(s) > max_chars:
                break
            out = (out + " " + s).strip()
        return out
    return ""


def chat_pairs(topics: dict[str, str]) -> list[tuple[str, str]]:
    """(question, answer) from every section heading of the given topics: answer = first sentences."""
    pairs = []
    for text in topics.values():
        heads = [m for m in _HEAD.finditer(text) if len(m.group(2)) == len(m.group(1))]
        for j, m in enumerate(heads):
            end = heads[j + 1].start() if j + 1 < len(heads) else len(text)
            ans = _first_sentences(text[m.end() : end])
            if ans:
                pairs.append((m.group(1).strip(), ans))
    return pairs


QUESTION_FORMS = ("Tell me about {h}.", "What does the Python reference say about {h}?", "Explain {h}.")


def chat_documents(topics: dict[str, str]) -> list[list[dict]]:
    rng = random.Random(0)
    docs = []
    for h, ans in chat_pairs(topics):
        for form in QUESTION_FORMS[:2]:
            msgs = [{"role": "user", "content": form.format(h=h)}, {"role": "assistant", "content": ans}]
            if rng.random() < 0.5:
                msgs.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
            docs.append(msgs)
    return docs


def encode_documents(tok, texts: dict[str, str], chats: list[list[dict]] = ()) -> list[int]:
    """One token stream: `[BOS] text [EOS]` per topic, then `chat ... <|im_end|> [EOS]` per chat."""
    ids: list[int] = []
    for v in texts.values():
        ids += [tok.bos_id] + tok.encode(v) + [tok.eos_id]
    for msgs in chats:
        ids += tok.apply_chat_template(msgs, add_generation_prompt=False) + [tok.eos_id]
    return ids
