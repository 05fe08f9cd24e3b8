"""Quality of the embedded demo model against the one it replaces, on the new held-out documents.

    python -m tools.eval_demo --run runs/k3-docs --new p2pk3/assets/k3-docs [--ring 4] [--bench]

1. Held-out perplexity AND bits per byte (the two models have different tokenizers, so only bits per byte
   compare them): every held-out document of tools/doc_corpus/ (cut to its first `CUT` characters) as
   `[BOS] text [EOS]`, non-overlapping windows of T tokens, fresh context per window. Bits per byte = summed
   NLL of the scored targets / ln 2 / their UTF-8 bytes (special tokens have 0 bytes; the per-id byte
   lengths come from the byte-level BPE vocabulary). For the new model: the fp32 masters (QAT forward), the
   export (bf16 + MXFP4 experts) through the real loader in fp32 and in bf16 compute.
2. The export through a local ring of N `p2pk3 node` daemons (the served path) against one process: the same
   windows' perplexity and the same greedy answers.
3. Twenty fixed questions (tools/doc_corpus.fixed_questions): ten about names whose documents were held out,
   ten in-domain; each model's greedy answer (chat template, up to `MAX_NEW` tokens) and a word-overlap score:
   the fraction of the answer's content words (>= 3 letters, not a stop word) found in the reference
   paragraph. An empty answer scores 0.
4. `--bench`: decode tokens/s of both models through a 4-node loopback ring (tools/bench_ring.py's
   `_decode_tps`), 1 and 4 sessions, alternating old / new twice to cancel load drift; ratio new / old.

Results: `eval.json` and `quality.md` (markdown tables pasted into docs/quality.md) in --run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import doc_corpus  # noqa: E402
from tools.trainlib.evaluate import forward_batch, greedy, load_shipped, ring_eval, write_eval_slice  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OLD = ROOT / "p2pk3" / "assets" / "tiny-k3-pydoc"
CUT = 2000
MAX_NEW = 64
STOP = set(
    "the and for are with that this from not but you can its has have was were will which when into "
    "than then also any all one two may use used using does what there their them they these those "
    "such each other more most some only been being how who why where".split()
)


def byte_lengths(model_dir: str | Path, vocab: int) -> torch.Tensor:
    """UTF-8 byte length of every token id (0 for the special slots)."""
    from tokenizers import Tokenizer

    from p2pk3.tokenizer.bpe import hf_to_tiktoken_ranks

    out = torch.zeros(vocab, dtype=torch.float64)
    for b, i in hf_to_tiktoken_ranks(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))).items():
        out[i] = len(b)
    return out


def eval_stream(tok, docs: dict[str, str]) -> list[int]:
    ids: list[int] = []
    for v in docs.values():
        ids += [tok.bos_id] + tok.encode(v[:CUT]) + [tok.eos_id]
    return ids


@torch.no_grad()
def score(stage, ids: list[int], T: int, blen: torch.Tensor, max_windows: int | None = None, batch: int = 8) -> dict:
    stage.eval()
    n_win = (len(ids) - 1) // T
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    xs = torch.tensor([ids[w * T : w * T + T + 1] for w in range(n_win)], dtype=torch.long)
    tot = 0.0
    with torch.inference_mode():
        for i in range(0, n_win, batch):
            xb = xs[i : i + batch]
            lg = forward_batch(stage, xb[:, :-1])
            tot += float(F.cross_entropy(lg.float(), xb[:, 1:].reshape(-1), reduction="sum"))
    tgt = xs[:, 1:].reshape(-1)
    nbytes = float(blen[tgt].sum())
    return {
        "ppl": math.exp(tot / tgt.numel()),
        "bpb": tot / math.log(2) / nbytes,
        "tokens": int(tgt.numel()),
        "bytes": int(nbytes),
        "window": T,
    }


def content_words(s: str) -> list[str]:
    return [w for w in re.findall(r"[a-z0-9_]+", s.lower()) if len(w) >= 3 and w not in STOP]


def overlap_score(answer: str, reference: str) -> float:
    words = content_words(answer)
    if not words:
        return 0.0
    ref = set(content_words(reference))
    return sum(w in ref for w in words) / len(words)


def answer(stage, tok, question: str, max_new: int = MAX_NEW) -> str:
    ids = tok.apply_chat_template([{"role": "user", "content": question}])
    out = greedy(stage, ids, max_new, {tok.im_end_id, tok.eos_id})
    return tok.decode([t for t in out if t not in (tok.im_end_id, tok.eos_id)]).strip()


def questions(split: dict[str, dict[str, str]]) -> list[dict]:
    out = []
    for kind, name in (("held-out", "heldout"), ("in-domain", "train")):
        for q, ref, doc in doc_corpus.fixed_questions(split[name], name):
            out.append({"kind": kind, "question": q, "reference": ref, "doc": doc})
    return out


def evaluate_export(
    run: str | Path, export_dir: str | Path, master, state: dict, a, ring: int = 0, earlier_runs: list[dict] = ()
) -> dict:
    """Called by tools/train_docs.py after the export: every number of the model card. `earlier_runs`: the
    training runs of the checkpoint a warm start continued (tools/trainlib/lineage.py); this run is added."""
    from tools.trainlib import lineage
    from p2pk3.tokenizer import load_tokenizer

    run, export_dir = Path(run), Path(export_dir)
    docs = doc_corpus.load_documents(getattr(a, "corpus", None))
    split = doc_corpus.split_documents(docs)
    tok = load_tokenizer(export_dir)
    T = a.seq
    blen = byte_lengths(export_dir, tok.vocab_size)
    held = eval_stream(tok, split["heldout"])
    shipped = load_shipped(export_dir)
    m: dict = {"params_m": sum(p.numel() for p in master.parameters()) / 1e6}
    m["heldout"] = {
        "master": score(master, held, T, blen),
        "mxfp4": score(shipped, held, T, blen),
        "mxfp4_bf16": score(load_shipped(export_dir, torch.bfloat16), held, T, blen),
    }
    m["heldout_docs"] = sorted(split["heldout"])
    train_ids = [t for v in split["train"].values() for t in tok.encode(v[:CUT])]
    counts = torch.bincount(torch.tensor(train_ids), minlength=tok.vocab_size).double() + 1
    ev = write_eval_slice(export_dir, tok, "\n\n".join(v[:CUT] for v in split["heldout"].values()), counts, shipped, T)
    m["eval_slice"] = {k: ev[k] for k in ("num_tokens", "ppl_mxfp4", "unigram_ppl")}
    qs = questions(split)
    for q in qs:
        q["answer"] = answer(shipped, tok, q["question"])
        q["score"] = overlap_score(q["answer"], q["reference"])
    m["questions"] = qs
    if ring:
        n_win = 16
        prompts = [tok.apply_chat_template([{"role": "user", "content": q["question"]}]) for q in qs]
        ring_ppl, outs = ring_eval(
            export_dir, held[: n_win * T + 1], T, ring, prompts, [{tok.im_end_id, tok.eos_id}] * len(qs), MAX_NEW
        )
        one = score(shipped, held, T, blen, max_windows=n_win)
        answers_ring = [tok.decode([t for t in o if t not in (tok.im_end_id, tok.eos_id)]).strip() for o in outs]
        m["ring"] = {
            "nodes": ring,
            "windows": n_win,
            "ppl_one_process": one["ppl"],
            "ppl_ring": ring_ppl,
            "answers_identical": answers_ring == [q["answer"] for q in qs],
        }
    m["train"] = {
        "minutes": {k: v / 60 for k, v in state["elapsed"].items()},
        "steps": {k: len(v["step"]) for k, v in state["hist"].items()},
        "tokens_seen_pretrain": len(state["hist"]["pretrain"]["step"]) * a.batch * a.seq,
        "final_train_loss": statistics.mean(state["hist"]["pretrain"]["loss"][-20:]),
        # None: a run with no pretrain validation (--eval-every past its steps, as the copy curriculum's stages)
        "val_loss": (state["hist"]["pretrain"]["val_loss"] or [None])[-1],
        "chat_val_answer_loss": state["hist"]["chat"]["val_loss"][-1] if state["hist"]["chat"]["val_loss"] else None,
    }
    finished = Path(run, "master.pt").stat().st_mtime if Path(run, "master.pt").exists() else time.time()
    m["runs"] = list(earlier_runs) + [
        lineage.this_run(
            time.strftime("%Y-%m-%d", time.gmtime(finished)),
            bool(getattr(a, "init_from", None)),
            m["train"]["steps"],
            a,
            sum(state["elapsed"].values()) / 60,
        )
    ]
    lineage.write(export_dir, m["runs"])
    m["data"] = {k: {"documents": len(v), "chars": sum(len(t) for t in v.values())} for k, v in split.items()}
    m["chat_pairs_train"] = len(doc_corpus.qa_pairs(split["train"]))
    m["train_tokens"] = sum(len(tok.encode(v)) + 2 for v in split["train"].values())  # [BOS] doc [EOS]
    m["args"] = vars(a)
    m["python"], m["torch"] = sys.version.split()[0], torch.__version__
    m["export_bytes"] = sum(f.stat().st_size for f in export_dir.rglob("*") if f.is_file())
    from tools.model_card import write_card

    write_card(export_dir, m)
    (run / "eval_new.json").write_text(json.dumps(m, indent=2, ensure_ascii=False) + "\n")
    return m


def old_model_eval(split: dict[str, dict[str, str]], old_dir: str | Path = OLD) -> dict:
    """The previous demo model on the new held-out documents and the same questions."""
    from p2pk3.tokenizer import load_tokenizer

    old_tok = load_tokenizer(old_dir)
    old = load_shipped(old_dir)
    ob = byte_lengths(old_dir, old_tok.vocab_size)
    old_ids = eval_stream(old_tok, split["heldout"])
    res = {"old": {"w128": score(old, old_ids, 128, ob), "w256": score(old, old_ids, 256, ob)}, "old_answers": []}
    for q in questions(split):
        a = answer(old, old_tok, q["question"])
        res["old_answers"].append({"question": q["question"], "answer": a, "score": overlap_score(a, q["reference"])})
    return res


def compare(run: str | Path, new_dir: str | Path, corpus: str | None, bench: bool, old_dir: str | Path = OLD) -> dict:
    """The old model against the new one (eval_new.json of the run); markdown for docs/quality.md."""
    from p2pk3.tokenizer import load_tokenizer

    run = Path(run)
    m = json.loads((run / "eval_new.json").read_text())
    split = doc_corpus.split_documents(doc_corpus.load_documents(corpus))
    cache = run / "eval_old.json"
    res = json.loads(cache.read_text()) if cache.exists() else old_model_eval(split, old_dir)
    res["old_name"] = Path(old_dir).name
    cache.write_text(json.dumps(res, indent=2, ensure_ascii=False) + "\n")
    assert [a["question"] for a in res["old_answers"]] == [q["question"] for q in m["questions"]]
    new_tok = load_tokenizer(new_dir)
    new = load_shipped(new_dir)
    res["new_w128"] = score(new, eval_stream(new_tok, split["heldout"]), 128, byte_lengths(new_dir, new_tok.vocab_size))
    if bench:
        res["bench"] = decode_bench(str(old_dir), str(new_dir))
    (run / "eval_compare.json").write_text(json.dumps(res, indent=2, ensure_ascii=False) + "\n")
    (run / "quality.md").write_text(markdown(m, res))
    return res


def decode_bench(old_dir: str, new_dir: str, new_tokens: int = 48) -> dict:
    from tools.bench_ring import _decode_tps

    out: dict = {}
    for sessions in (1, 4):
        runs: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(2):
            for name, d in (("old", old_dir), ("new", new_dir)):
                runs[name].append(_decode_tps(d, sessions, new_tokens, 4))
        o, n = statistics.mean(runs["old"]), statistics.mean(runs["new"])
        out[f"sessions_{sessions}"] = {"old_tps": runs["old"], "new_tps": runs["new"], "ratio_new_old": n / o}
        print(
            f"decode through a 4-node ring, {sessions} session(s): old {o:.1f} tok/s new {n:.1f} tok/s ratio {n / o:.2f}"
        )
    out["date"] = time.strftime("%Y-%m-%d %H:%M")
    return out


def _cell(s: str, n: int = 220) -> str:
    s = " ".join(s.split()).replace("|", "\\|")
    return (s[:n] + " …") if len(s) > n else s


def markdown(m: dict, res: dict) -> str:
    h = m["heldout"]
    o = res["old"]
    lines = [
        f"Held-out documents: {len(m['heldout_docs'])} (first {CUT} characters of each).",
        "",
        "| model | window | tokens scored | perplexity | bits per byte |",
        "|---|---|---|---|---|",
    ]
    name = res.get("old_name", "tiny-k3-pydoc")
    lines.append(f"| old {name} (export) | 128 | {o['w128']['tokens']} | {o['w128']['ppl']:.1f} | {o['w128']['bpb']:.3f} |")
    lines.append(f"| old {name} (export) | 256 | {o['w256']['tokens']} | {o['w256']['ppl']:.1f} | {o['w256']['bpb']:.3f} |")
    nw = res["new_w128"]
    lines.append(f"| new, export | 128 | {nw['tokens']} | {nw['ppl']:.1f} | {nw['bpb']:.3f} |")
    for k, label in (
        ("master", "new, fp32 masters (QAT forward)"),
        ("mxfp4", "new, export (bf16 + MXFP4), fp32 compute"),
        ("mxfp4_bf16", "new, export, bf16 compute"),
    ):
        r = h[k]
        lines.append(f"| {label} | {r['window']} | {r['tokens']} | {r['ppl']:.1f} | {r['bpb']:.3f} |")
    if "ring" in m:
        r = m["ring"]
        lines += [
            "",
            f"Through a {r['nodes']}-node local ring vs one process, first {r['windows']} windows: perplexity "
            f"{r['ppl_ring']:.4f} vs {r['ppl_one_process']:.4f}; the 20 greedy answers identical: {r['answers_identical']}.",
        ]
    lines += [
        "",
        "| | question | new model (greedy) | score | old model (greedy) | score |",
        "|---|---|---|---|---|---|",
    ]
    for q, oa in zip(m["questions"], res["old_answers"]):
        lines.append(
            f"| {q['kind']} | {_cell(q['question'], 80)} | {_cell(q['answer'])} | {q['score']:.2f} | "
            f"{_cell(oa['answer'])} | {oa['score']:.2f} |"
        )
    for kind in ("held-out", "in-domain"):
        ns = [q["score"] for q in m["questions"] if q["kind"] == kind]
        os_ = [a["score"] for q, a in zip(m["questions"], res["old_answers"]) if q["kind"] == kind]
        lines.append(f"| **{kind} mean** | | | **{statistics.mean(ns):.2f}** | | **{statistics.mean(os_):.2f}** |")
    lines += ["", "Reference paragraphs:", ""]
    for q in m["questions"]:
        lines.append(f"- {q['kind']} `{q['doc']}` — {_cell(q['question'], 80)}: {_cell(q['reference'], 400)}")
    if "bench" in res:
        lines += [
            "",
            "| decode through `p2pk3 local --nodes 4` (loopback) | old tok/s | new tok/s | new / old |",
            "|---|---|---|---|",
        ]
        for s in (1, 4):
            b = res["bench"][f"sessions_{s}"]
            lines.append(
                f"| {s} session(s), 48 new tokens, mean of 2 alternating runs | {statistics.mean(b['old_tps']):.1f} | "
                f"{statistics.mean(b['new_tps']):.1f} | {b['ratio_new_old']:.2f}× |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="runs/k3-docs")
    ap.add_argument("--new", default=str(ROOT / "p2pk3" / "assets" / "k3-docs"))
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--old", default=str(OLD), help="the model the new one replaces (default: tiny-k3-pydoc)")
    ap.add_argument("--bench", action="store_true", help="also the decode-speed comparison through a 4-node ring")
    ap.add_argument("--old-only", action="store_true", help="only the old model's numbers (eval_old.json)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.old_only:
        split = doc_corpus.split_documents(doc_corpus.load_documents(a.corpus))
        Path(a.run, "eval_old.json").write_text(
            json.dumps(old_model_eval(split, a.old), indent=2, ensure_ascii=False) + "\n"
        )
        print(Path(a.run, "eval_old.json").read_text()[:3000])
        return 0
    compare(a.run, a.new, a.corpus, a.bench, a.old)
    print((Path(a.run) / "quality.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
