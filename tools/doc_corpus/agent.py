"""Chat-phase conversations of the demo model beyond single question/answer pairs, and its tool index.

    index = doc_index(docs)                          # {"python_doc": {name: text}, "man_page": {name: text}}
    tool_conversations(items, DocTools(index), seed) # [(messages, tools)]: call a tool, read it, answer
    multi_turn(items, seed)                          # [(messages, None)]: 2-3 questions on one document
    paraphrased(items, seed)                         # [(messages, None)]: the same answers, other wordings
    renamed(items, DocTools(index), seed)            # [(messages, tools)]: the same, about a made-up name
    unquoted(items)                                  # the items about a name the question does not quote

`items` are `qa._qa_items` rows (kind, question, answer, document). Every conversation ends with an
assistant turn; the loss of tools/train_docs.py is on the assistant turns only. A tool conversation declares
both tools, the assistant calls the one that fits the question (`python_doc` for a Python name in
backticks or a module, `man_page` for a command, system call, C function or device), the tool turn shows
what `p2pk3.agent.doctools.DocTools` returns, and the final answer restates that result. One in six asks
about a Python name and a manual page at once and gets two calls in one section.

`renamed` teaches copying: a name the model has never seen can only be written by copying it from the
question. It takes every tool conversation once and the question/answer pairs whose answer names their
subject twice, and replaces the name everywhere (question, call, tool result, answer) with a random
one of the same shape (`re.sub` -> `fo.zamir`, `memusage` -> `kelbarot`).
"""

from __future__ import annotations

import json
import random
import re

from p2pk3.agent.doctools import MAX_RESULT_CHARS, SCHEMAS, DocTools

_MAN_Q = re.compile(r"the (\S+?)(?:\(\))? (?:command|function|system call|device) do|^What is the (\S+) device")
_MOD_Q = re.compile(r"^What is the ([a-z_][\w.]*) module\?$")


def item_key(kind: str, q: str) -> tuple[str, str] | None:
    """(tool, name) the question of a QA item is about, or None (section headings)."""
    if kind == "man":
        m = _MAN_Q.search(q) or re.match(r"^What is (\S+)\?$", q)
        return ("man_page", next(g for g in m.groups() if g)) if m else None
    m = re.search(r"`([^`]+)`", q) or _MOD_Q.match(q)
    return ("python_doc", m.group(1)) if m else None


def unquoted(items) -> list:
    """The items a tool answers whose question does not quote the name in backticks: man pages ("the ctan()
    function", "What is FILE?") and modules ("the base64 module"). They are 14 % of the keyed training items and
    half the tool prompts of tools/tune_defaults; the call's argument has no backtick to end it (docs/quality.md)."""
    return [it for it in items if (k := item_key(it[0], it[1])) and f"`{k[1]}`" not in it[1]]


def doc_index(items) -> dict[str, dict[str, str]]:
    """The lookup table of both tools from QA items (module doc); man pages of one name in several sections
    are joined (`printf(1): ...` then `printf(3): ...`)."""
    py: dict[str, str] = {}
    man: dict[str, list[str]] = {}
    for kind, q, a, doc in items:
        k = item_key(kind, q)
        if k is None:
            continue
        tool, name = k
        if tool == "python_doc":
            py.setdefault(name, a)
        else:
            sec = doc.rsplit(".", 1)[-1]
            man.setdefault(name, []).append(f"{name}({sec}): {a}")
    return {
        "python_doc": py,
        "man_page": {k: "\n".join(v)[:MAX_RESULT_CHARS] for k, v in man.items()},
    }


def _call(i: int, tool: str, name: str) -> dict:
    return {
        "id": f"functions.{tool}:{i}",
        "type": "function",
        "function": {"name": tool, "arguments": json.dumps({"name": name})},
    }


def _restate(tool: str, name: str, result: str) -> str:
    """The answer after a tool call: the result's first paragraph (a man page's without its `name(sec): `
    header), the answer a question/answer pair about the same document gives. An opening that named the source
    ("The getpagesize manual page says: ...", the third run's) was learnt as the start of every answer about a
    command, with no tool called and a wrong name (docs/quality.md)."""
    first = result.split("\n")[0]
    return first.split(": ", 1)[-1] if tool == "man_page" else first


def tool_conversations(items, tools: DocTools, seed: int) -> list[tuple[list[dict], list[dict]]]:
    rng = random.Random(seed)
    keyed = [(it, k) for it in items if (k := item_key(it[0], it[1]))]
    py = [x for x in keyed if x[1][0] == "python_doc"]
    man = [x for x in keyed if x[1][0] == "man_page"]
    out = []
    for (_, q, _, _), (tool, name) in keyed:
        result = tools.lookup(tool, name)
        msgs = [
            {"role": "user", "content": q},
            {"role": "assistant", "content": "", "tool_calls": [_call(0, tool, name)]},
            {"role": "tool", "tool_call_id": f"functions.{tool}:0", "content": result},
            {"role": "assistant", "content": _restate(tool, name, result)},
        ]
        out.append((msgs, SCHEMAS))
    for _ in range(len(keyed) // 6):
        (_, qa, _, _), (_, na) = rng.choice(py)
        (_, qb, _, _), (_, nb) = rng.choice(man)
        ra, rb = tools.lookup("python_doc", na), tools.lookup("man_page", nb)
        msgs = [
            {"role": "user", "content": f"{qa} And {qb[0].lower()}{qb[1:]}"},
            {"role": "assistant", "content": "", "tool_calls": [_call(0, "python_doc", na), _call(1, "man_page", nb)]},
            {"role": "tool", "tool_call_id": "functions.python_doc:0", "content": ra},
            {"role": "tool", "tool_call_id": "functions.man_page:1", "content": rb},
            {"role": "assistant", "content": _restate("python_doc", na, ra) + "\n\n" + _restate("man_page", nb, rb)},
        ]
        out.append((msgs, SCHEMAS))
    rng.shuffle(out)
    return out


def multi_turn(items, seed: int) -> list[tuple[list[dict], None]]:
    rng = random.Random(seed)
    by_doc: dict[str, list] = {}
    for it in items:
        by_doc.setdefault(it[3], []).append(it)
    out = []
    for group in by_doc.values():
        group = group[:]
        rng.shuffle(group)
        while len(group) >= 2:
            n = min(len(group), rng.choice((2, 3)))
            turns, group = group[:n], group[n:]
            msgs = []
            for _, q, a, _ in turns:
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            out.append((msgs, None))
    return out


_REWORD = {
    "do?": ("Explain {x}.", "What is {x} used for?", "How does {x} work?", "Describe {x}."),
    "is": ("Explain {x}.", "Describe {x}.", "What can you tell me about {x}?"),
    "section": ("What is {x}?", "Explain {x}.", "What can you tell me about {x}?"),
    "statement": ("What does {x} do?", "What is {x}?", "How does {x} work?", "Explain {x}."),
}


def _section_subject(heading: str) -> str:
    """ "The with statement" -> "the with statement": a heading as the subject of a question."""
    first, _, rest = heading.partition(" ")
    return f"{first.lower()} {rest}" if first in ("The", "A", "An") and rest else heading


def paraphrased(items, seed: int) -> list[tuple[list[dict], None]]:
    """One rewording of each "What does X do?" / "What is X?" / "Tell me about X." question, the same answer;
    a section on a statement in every wording of a statement ("What does the with statement do?", ...)."""
    rng = random.Random(seed)
    out = []
    for _, q, a, _ in items:
        m = re.match(r"^What does (.+) do\?$", q)
        forms = _REWORD["do?"] if m else _REWORD["is"]
        m = m or re.match(r"^What is (.+)\?$", q)
        if not m and (m := re.match(r"^Tell me about (.+)\.$", q)):
            x = _section_subject(m.group(1))
            if re.search(r"\bstatements?$", x):  # every wording: the README's own question is one of them
                picked = _REWORD["statement"]
            else:
                picked = (rng.choice(_REWORD["section"]),)
            for form in picked:
                out.append(([{"role": "user", "content": form.format(x=x)}, {"role": "assistant", "content": a}], None))
            continue
        if not m:
            continue
        x = m.group(1)
        out.append(
            ([{"role": "user", "content": rng.choice(forms).format(x=x)}, {"role": "assistant", "content": a}], None)
        )
    return out


_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def fake_name(name: str, rng: random.Random) -> str:
    """A made-up name of `name`'s shape: each dotted and underscored part replaced by random syllables of
    about its length, its capitals kept (`PyCodec_Unregister` -> `PyVuse_Bimarotal`); never `name` itself."""

    def word(w: str) -> str:
        if w in ("Py", "") or w.isdigit():
            return w
        n = max(1, round(len(w) / 2))
        out = "".join(rng.choice(_SYLLABLES) for _ in range(n))[: max(2, len(w))]
        return out.capitalize() if w[0].isupper() else out

    def part(p: str) -> str:
        pre = "Py" if p.startswith("Py") and p[2:3].isupper() else ""
        return pre + "_".join(word(w) for w in p[len(pre) :].split("_"))

    while (new := ".".join(part(p) for p in name.split("."))) == name:
        pass
    return new


def _swap(text: str, name: str, new: str) -> str:
    """`name` replaced where it stands as a whole name (not in `ldd.so`, `xldd`; a sentence's final dot is fine)."""
    return re.sub(r"(?<![\w.])" + re.escape(name) + r"(?!\w|\.\w)", lambda _: new, text)


def renamed(items, tools: DocTools, seed: int) -> list[tuple[list[dict], list[dict] | None]]:
    """Conversations about made-up names (module doc): the answer can only name its subject by copying."""
    rng = random.Random(seed)
    out: list[tuple[list[dict], list[dict] | None]] = []
    for kind, q, a, _ in items:
        k = item_key(kind, q)
        if k is None:
            continue
        tool, name = k
        named = _swap(a, name, "") != a
        if named:  # the answer names its subject: twice, with two made-up names
            for _ in range(2):
                new = fake_name(name, rng)
                msgs = [
                    {"role": "user", "content": _swap(q, name, new)},
                    {"role": "assistant", "content": _swap(a, name, new)},
                ]
                out.append((msgs, None))
        # every tool conversation: the call's argument is copied from the question
        new = fake_name(name, rng)
        result = _swap(tools.lookup(tool, name), name, new)
        msgs = [
            {"role": "user", "content": _swap(q, name, new)},
            {"role": "assistant", "content": "", "tool_calls": [_call(0, tool, new)]},
            {"role": "tool", "tool_call_id": f"functions.{tool}:0", "content": result},
            {"role": "assistant", "content": _restate(tool, new, result)},
        ]
        out.append((msgs, SCHEMAS))
    rng.shuffle(out)
    return out
