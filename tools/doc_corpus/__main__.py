"""``python -m tools.doc_corpus --out DIR``: build (or load the cache in DIR) and summarise the corpus."""

from __future__ import annotations

import argparse
import random
from collections import Counter

from . import __doc__ as corpus_doc
from . import fixed_questions, load_documents, overlap, split_documents
from .qa import _qa_items


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=corpus_doc.split("\n")[0])
    ap.add_argument("--out", default="runs/corpus", help="cache / output directory (docs.json)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    docs = load_documents(a.out)
    splits = split_documents(docs)
    print(
        f"{'source':8}{'split':>9}{'docs':>7}{'MB':>8}   (after dedup; before: {len(docs)} docs, "
        f"{sum(map(len, docs.values())) / 1e6:.2f} MB)"
    )
    for src in ("py", "man"):
        for split, part in splits.items():
            texts = [t for k, t in part.items() if k.startswith(src + "/")]
            print(f"{src:8}{split:>9}{len(texts):>7}{sum(map(len, texts)) / 1e6:>8.2f}")
    total = sum(len(t) for p in splits.values() for t in p.values())
    print(f"total {total / 1e6:.2f} MB")
    items = _qa_items(docs)
    print("QA pairs:", dict(Counter(k for k, *_ in items)), "total", len(items))
    print("held-out:", " ".join(splits["heldout"]))
    print(f"8-gram overlap held-out/train: {overlap(splits['heldout'], splits['train']):.4f}")
    rng = random.Random(a.seed)
    for name in rng.sample(sorted(docs), 3):
        text = docs[name]
        start = max(0, text.rfind("\n\n", 0, rng.randrange(max(1, len(text) - 800))) + 2)
        print(f"\n--- {name} @{start}\n{text[start : start + 800]}")
    print()
    for _, q, ans, name in rng.sample(items, min(5, len(items))):
        print(f"Q [{name}]: {q}\nA: {ans}\n")
    print("fixed held-out questions:")
    for q, _, name in fixed_questions(docs, "heldout"):
        print(f"  {q}  [{name}]")


if __name__ == "__main__":
    main()
