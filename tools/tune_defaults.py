"""Sampling defaults of the demo model by measurement, and the figures of its answers and tool calls.

    python -m tools.tune_defaults --model p2pk3/assets/k3-docs --corpus runs/corpus --out runs/tune [--write]
        [--old runs/k3-docs-old]

1. Choice. Each candidate (temperature, top_p, repetition_penalty, frequency_penalty) answers the 20
   *validation* questions (`doc_corpus.fixed_questions(split, "val", 20)`; sampled candidates with seeds
   0..SEEDS-1). Per candidate: the answers that loop and the mean word-overlap score (tools/eval_demo.py
   `overlap_score`). The choice: the fewest looping answers; among those, the candidates within `SCORE_TIE`
   of the best score count as equal, and of them a greedy one wins (the same answer every time), then the
   weaker repetition penalty, then the weaker frequency penalty, then the higher score. The repetition
   penalty counts the prompt too, so it also holds back the name a question asks about; the frequency
   penalty counts the answer only. Validation documents were never trained on, and the held-out ones below
   are not looked at while choosing.
2. `--write`: the model's generation_config.json gets the choice (`do_sample`, `temperature`, `top_p`,
   `repetition_penalty`, `frequency_penalty`; every front end applies them through p2pk3/frontends/prompt.py).
3. Figures with the chosen defaults, through the front ends' prompt path (`PromptBuilder`): the 20 held-out
   questions (loops, score, each answer), the README's scripted question, and 20 held-out tool prompts
   (both tools declared, no grammar): the share whose output parses (p2pk3/agent/toolcalls.py) to a call of
   the right tool, the share with exactly the right `name` argument, and the share whose call, run through
   the model's own tools (`DocTools`, which forgives spaces, backticks and case), returns the right entry:
   what an agent gets. `--old`: the same for another model
   (the one this replaces), with its own defaults.

A loop: a non-empty line that occurs 3 times, or a run of 6 tokens that occurs 3 times, in one answer.
Output: `tune.json` and `tune.md` (tables for docs/quality.md) in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import doc_corpus  # noqa: E402
from tools.eval_demo import overlap_score  # noqa: E402

SEEDS = 2
MAX_NEW = 128
SCORE_TIE = 0.02
CANDIDATES = [  # (temperature, top_p, repetition_penalty, frequency_penalty)
    (0.0, 1.0, 1.0, 0.0),
    (0.0, 1.0, 1.1, 0.0),
    (0.0, 1.0, 1.2, 0.0),
    (0.0, 1.0, 1.3, 0.0),
    (0.0, 1.0, 1.5, 0.0),
    (0.0, 1.0, 1.0, 0.3),
    (0.0, 1.0, 1.0, 0.6),
    (0.0, 1.0, 1.0, 1.0),
    (0.0, 1.0, 1.0, 1.5),
    (0.0, 1.0, 1.0, 2.0),
    (0.0, 1.0, 1.1, 0.5),
    (0.3, 0.9, 1.1, 0.0),
    (0.3, 0.9, 1.2, 0.0),
    (0.5, 0.9, 1.1, 0.0),
    (0.5, 0.9, 1.2, 0.0),
    (0.5, 0.9, 1.0, 0.5),
    (0.7, 0.9, 1.1, 0.0),
    (0.7, 0.95, 1.0, 0.0),
]
KNOBS = ("temperature", "top_p", "repetition_penalty", "frequency_penalty")  # a candidate's fields, in order
README_QUESTION = "What does the with statement do?"


def loops(text: str, ids: list[int], times: int = 3, run: int = 6) -> bool:
    """A non-empty line or a `run`-token sequence occurring `times` times (module doc)."""
    lines = Counter(x.strip() for x in text.split("\n") if x.strip())
    if lines and max(lines.values()) >= times:
        return True
    grams = Counter(tuple(ids[i : i + run]) for i in range(len(ids) - run + 1))
    return bool(grams) and max(grams.values()) >= times


class Answerer:
    """One model in this process (p2pk3.engine.reference.Pipeline), prompted as the front ends prompt."""

    def __init__(self, model_dir: str | Path):
        from p2pk3.engine.reference import Pipeline
        from p2pk3.frontends.prompt import PromptBuilder

        self.dir = Path(model_dir)
        self.pipe = Pipeline.load(model_dir, max_sessions=32)
        self.prompts = PromptBuilder.from_pretrained(model_dir)

    def answers(
        self, messages: list[list[dict]], temp=None, top_p=None, rep=None, freq=None, seed=None, tools=None, keep=False
    ):
        """[(text, ids)] of each conversation's answer; None knobs: the model's generation_config."""
        from p2pk3.frontends.prompt import SamplingOverrides

        asked = SamplingOverrides(
            temperature=temp, top_p=top_p, repetition_penalty=rep, frequency_penalty=freq, seed=seed, max_tokens=MAX_NEW
        )
        ps = [self.prompts.chat(m, asked, tools) for m in messages]
        outs = self.pipe.generate([p.ids for p in ps], [p.params for p in ps])
        tok = self.prompts.tok
        res = []
        for p, out in zip(ps, outs):
            ids = [t for t in out if t not in p.params.stop_ids]
            text = tok.decode(ids, skip_special=not keep)  # keep: the tool-call markers the parser reads
            res.append((text.strip(), ids))
        return res


def score_questions(model: Answerer, qs, **knobs) -> dict:
    msgs = [[{"role": "user", "content": q}] for q, _, _ in qs]
    got = model.answers(msgs, **knobs)
    rows = [
        {
            "question": q,
            "reference": ref,
            "doc": doc,
            "answer": text,
            "loops": loops(text, ids),
            "score": overlap_score(text, ref),
        }
        for (q, ref, doc), (text, ids) in zip(qs, got)
    ]
    return {
        "loops": sum(r["loops"] for r in rows),
        "score": statistics.mean(r["score"] for r in rows),
        "rows": rows,
    }


def tool_prompts(split_docs: dict[str, str], n: int = 20) -> list[tuple[str, str, str]]:
    """`n` (question, tool, name) of the split's documents, Python and man-page ones in turn."""
    from tools.doc_corpus.agent import item_key
    from tools.doc_corpus.qa import _qa_items

    by_tool: dict[str, list] = {"python_doc": [], "man_page": []}
    seen_docs: set[str] = set()
    for kind, q, _, doc in _qa_items(split_docs):
        k = item_key(kind, q)
        if k and doc not in seen_docs:
            seen_docs.add(doc)
            by_tool[k[0]].append((q, k[0], k[1]))
    out = []
    for a, b in zip(by_tool["python_doc"], by_tool["man_page"]):
        out += [a, b]
    return out[:n]


def score_tools(model: Answerer, prompts) -> dict:
    from p2pk3.agent.doctools import SCHEMAS, DocTools
    from p2pk3.agent.toolcalls import discover_tool_format, parse_tool_calls

    tok = model.prompts.tok
    fmt = discover_tool_format(tok.special, "\n".join(src for src, _ in tok.templates.values()))
    if not fmt:
        return {"right_tool": 0.0, "right_name": 0.0, "right_doc": 0.0, "rows": [], "note": fmt.reason}
    got = model.answers([[{"role": "user", "content": q}] for q, _, _ in prompts], seed=0, tools=SCHEMAS, keep=True)
    rows = []
    docs = DocTools.load(model.dir)
    for (q, tool, name), (text, _) in zip(prompts, got):
        calls = parse_tool_calls(text, fmt, SCHEMAS).tool_calls
        names = [c["function"]["name"] for c in calls]
        args = [json.loads(c["function"]["arguments"]).get("name") for c in calls if c["function"]["name"] == tool]
        want = docs.lookup(tool, name)
        rows.append(
            {
                "prompt": q,
                "tool": tool,
                "name": name,
                "output": text,
                "right_tool": tool in names,
                "right_name": name in args,
                "right_doc": any(isinstance(x, str) and docs.lookup(tool, x) == want for x in args),
            }
        )
    n = max(1, len(rows))
    return {
        "right_tool": sum(r["right_tool"] for r in rows) / n,
        "right_name": sum(r["right_name"] for r in rows) / n,
        "right_doc": sum(r["right_doc"] for r in rows) / n,
        "rows": rows,
    }


def choose(model: Answerer, val_qs) -> tuple[tuple, list[dict]]:
    table = []
    for temp, top_p, rep, freq in CANDIDATES:
        seeds = [None] if temp == 0 else list(range(SEEDS))
        runs = [score_questions(model, val_qs, temp=temp, top_p=top_p, rep=rep, freq=freq, seed=s) for s in seeds]
        table.append(
            {
                "temperature": temp,
                "top_p": top_p,
                "repetition_penalty": rep,
                "frequency_penalty": freq,
                "loops": statistics.mean(r["loops"] for r in runs),
                "score": statistics.mean(r["score"] for r in runs),
            }
        )
        r = table[-1]
        print(
            f"  T={temp} top_p={top_p} rep={rep} freq={freq}: loops {r['loops']:.1f}/20 score {r['score']:.3f}",
            flush=True,
        )
    fewest = min(r["loops"] for r in table)
    top = max(r["score"] for r in table if r["loops"] == fewest)
    tied = [r for r in table if r["loops"] == fewest and r["score"] >= top - SCORE_TIE]
    best = min(tied, key=lambda r: (r["temperature"] > 0, r["repetition_penalty"], r["frequency_penalty"], -r["score"]))
    return tuple(best[k] for k in KNOBS), table


def write_defaults(model_dir: Path, temp: float, top_p: float, rep: float, freq: float = 0.0) -> None:
    p = model_dir / "generation_config.json"
    gen = json.loads(p.read_text())
    gen.update(do_sample=temp > 0, repetition_penalty=rep)
    if freq:
        gen.update(frequency_penalty=freq)  # a p2pk3 key (p2pk3/tokenizer/generation.py)
    else:
        gen.pop("frequency_penalty", None)
    if temp > 0:
        gen.update(temperature=temp, top_p=top_p)
    else:
        gen.pop("temperature", None)
        gen.pop("top_p", None)
    p.write_text(json.dumps(gen, indent=2) + "\n")
    from tools.model_card import refresh_sampling_line

    refresh_sampling_line(model_dir)  # the model card names the defaults it ships with


def figures(model: Answerer, held_qs, tprompts) -> dict:
    q = score_questions(model, held_qs, seed=0)  # seed 0: sampled defaults give the same figures every run
    readme = model.answers([[{"role": "user", "content": README_QUESTION}]], seed=0)[0]
    return {
        "heldout": q,
        "readme": {"question": README_QUESTION, "answer": readme[0], "loops": loops(*readme)},
        "tools": score_tools(model, tprompts),
    }


def markdown(res: dict) -> str:
    out = [
        "| temperature | top_p | repetition penalty | frequency penalty | answers that loop (of 20) |"
        " word-overlap score |",
        "|---|---|---|---|---|---|",
    ]
    ch = res["choice"]
    for r in res["candidates"]:
        mark = "**" if tuple(r.get(k, 0.0) for k in KNOBS) == tuple(ch) else ""
        out.append(
            f"| {mark}{r['temperature']}{mark} | {r['top_p']} | {r['repetition_penalty']} | "
            f"{r.get('frequency_penalty', 0.0)} | "
            f"{r['loops']:.1f} | {r['score']:.3f} |"
        )
    out += [
        "",
        "| model | held-out answers that loop (of 20) | held-out word-overlap | tool prompts: right tool |"
        " right name | call finds the entry |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in res["models"].items():
        out.append(
            f"| {name} | {f['heldout']['loops']} | {f['heldout']['score']:.3f} | "
            f"{f['tools']['right_tool']:.0%} | {f['tools']['right_name']:.0%} | {f['tools']['right_doc']:.0%} |"
        )
    for name, f in res["models"].items():
        out += [
            "",
            f"**{name}**, README question: {f['readme']['question']}",
            "",
            "> " + f["readme"]["answer"].replace("\n", "\n> "),
        ]
    f = res["models"]["new"]
    out += ["", "| question | reference | answer (shipped defaults) | loops | score |", "|---|---|---|---|---|"]
    for r in f["heldout"]["rows"]:
        cell = lambda s: " ".join(s.split()).replace("|", "\\|")  # noqa: E731
        out.append(
            f"| {cell(r['question'])} | {cell(r['reference'])[:200]} | {cell(r['answer'])} | "
            f"{'yes' if r['loops'] else 'no'} | {r['score']:.2f} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="p2pk3/assets/k3-docs")
    ap.add_argument("--corpus", default="runs/corpus")
    ap.add_argument("--out", default="runs/tune")
    ap.add_argument("--old", default=None, help="also score this model (the one the new one replaces)")
    ap.add_argument("--write", action="store_true", help="write the choice into --model's generation_config.json")
    a = ap.parse_args(argv)
    split = doc_corpus.split_documents(doc_corpus.load_documents(a.corpus))
    val_qs = doc_corpus.fixed_questions(split["val"], "val", 20)
    held_qs = doc_corpus.fixed_questions(split["heldout"], "heldout", 20)
    tprompts = tool_prompts(split["heldout"])
    new = Answerer(a.model)
    print("choosing on the validation questions:", flush=True)
    choice, table = choose(new, val_qs)
    print("choice: " + ", ".join(f"{k} {v}" for k, v in zip(KNOBS, choice)), flush=True)
    if a.write:
        write_defaults(Path(a.model), *choice)
        new = Answerer(a.model)  # its prompts read the new generation_config
    res = {"choice": choice, "candidates": table, "models": {"new": figures(new, held_qs, tprompts)}}
    if a.old:
        res["models"]["old"] = figures(Answerer(a.old), held_qs, tprompts)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(res, indent=2, ensure_ascii=False) + "\n")
    (out / "tune.md").write_text(markdown(res))
    for name, f in res["models"].items():
        print(
            f"{name}: held-out loops {f['heldout']['loops']}/20, score {f['heldout']['score']:.3f}, "
            f"tool calls right {f['tools']['right_tool']:.0%} (name {f['tools']['right_name']:.0%}, "
            f"finds the entry {f['tools']['right_doc']:.0%})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
