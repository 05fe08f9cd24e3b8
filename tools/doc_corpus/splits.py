"""The held-out / val / train split of the documents by a hash of their names (``split_of``, ``split_documents``,
with the paragraph de-duplication) and the word n-gram ``overlap`` that measures what leaks."""

from __future__ import annotations

import hashlib

from .text import _paras


def split_of(name: str) -> str:
    if int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100 < 5:
        return "heldout"
    return "val" if int(hashlib.sha256(("val/" + name).encode()).hexdigest()[:8], 16) % 100 < 3 else "train"


def split_documents(docs: dict[str, str]) -> dict[str, dict[str, str]]:
    """{"heldout"|"val"|"train": {name: text}}: held-out paragraphs (>= 40 chars) removed from val and train, val ones
    from train, and a paragraph repeated within train kept in its first document only."""
    out: dict[str, dict[str, str]] = {"heldout": {}, "val": {}, "train": {}}
    for name in sorted(docs):
        out[split_of(name)][name] = docs[name]
    seen = {key for t in out["heldout"].values() for key in map(_key, _paras(t)) if len(key) >= 40}
    for split in ("val", "train"):
        new: set[str] = set()
        for name, text in list(out[split].items()):
            kept = [p for p in _paras(text) if _key(p) not in seen]
            (new if split == "val" else seen).update(k for k in map(_key, kept) if len(k) >= 40)
            out[split][name] = "\n\n".join(kept) + "\n"
            if not kept:
                del out[split][name]
        seen |= new
    return out


def _key(par: str) -> str:
    return " ".join(par.split())


def _ngrams(text: str, n: int) -> set:
    w = text.split()
    return {" ".join(w[k : k + n]) for k in range(len(w) - n + 1)}


def overlap(held: dict[str, str], train: dict[str, str], n: int = 8) -> float:
    """Fraction of the held-out documents' distinct word n-grams that also occur in a train document."""
    grams = set().union(*(_ngrams(t, n) for t in held.values())) if held else set()
    if not grams:
        return 0.0
    found = set()
    for t in train.values():
        found |= _ngrams(t, n) & grams
    return len(found) / len(grams)
