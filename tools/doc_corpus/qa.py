"""(question, answer, document) pairs derived from the cleaned documents' structure (``qa_pairs``) and the 10 fixed
evaluation questions of a split (``fixed_questions``)."""

from __future__ import annotations

import re
from itertools import zip_longest

from .splits import split_of
from .text import _indent, _paras

_PYSIG = re.compile(
    r"(class |exception |@|classmethod |static |coroutine |abstractmethod |awaitable )?"
    r"([A-Za-z_]\w*(?:\.\w+)*)(\s?\(.*\))?(\s*->.*)?$"
)
_CSIG = re.compile(r"(?:[\w\s*]+?[\s*])?(_?Py[A-Z_]\w*)(\(.*\))?$")
_GENERIC = set(
    "examples|example|overview|introduction|notes|usage|functions|classes|constants|exceptions|methods|"
    "attributes|summary|contents|background|details|footnotes|reference|api|module contents|data|objects|"
    "tutorial|basic usage|availability|limitations|security considerations|options|installation|other|"
    "interface|miscellaneous|command-line interface|command line interface|command-line usage|syntax|"
    "command-line options|functions and classes|module functions|description|type objects".split("|")
)
_NOT_ANSWER = ("New in version", "Changed in version", "Deprecated since", "Availability:", "Source code:")
WELL_KNOWN = {
    "os",
    "sys",
    "re",
    "json",
    "os.path",
    "math",
    "itertools",
    "functools",
    "collections",
    "subprocess",
    "pathlib",
    "random",
    "string",
    "time",
    "datetime",
    "shutil",
    "io",
    "str",
    "list",
    "dict",
    "int",
}
BUILTIN_DOCS = {"py/library/functions", "py/library/stdtypes", "py/library/exceptions", "py/library/constants"}


def _answer(par: str, limit: int = 400) -> str | None:
    """Whole sentences of a prose paragraph, at most ~`limit` chars; None when it is no fit answer."""
    text = " ".join(par.split())
    sents: list[str] = []
    for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(\"'`])", text):
        if sents and sents[-1].endswith(("e.g.", "i.e.", "cf.", "vs.")):
            sents[-1] += " " + s
        else:
            sents.append(s)
    acc: list[str] = []
    for s in sents:
        if acc and len(" ".join(acc + [s])) > limit:
            break
        acc.append(s)
    while acc and acc[-1].endswith(":"):
        acc.pop()
    ans = " ".join(acc)
    if not 40 <= len(ans) <= 600 or ans[-1] not in ".!?)\"'" or (ans.startswith("See ") and len(ans) < 120):
        return None
    return ans


def _is_code(par: str) -> bool:
    return all(x.startswith("    ") or x.lstrip().startswith(">>>") for x in par.split("\n") if x.strip())


def _first_answer(paras: list[str], k: int) -> str | None:
    for p in paras[k : k + 3]:
        if _is_code(p) or p.startswith(_NOT_ANSWER):
            continue
        if _indent(p) or ("\n" not in p and not p.rstrip().endswith((".", ":", "!", "?"))):
            return None  # indented (a definition, a list) or a heading-like line
        return _answer(p)
    return None


def _definition(par: str) -> tuple[str, str] | None:
    """(kind, question) of a signature paragraph of a cleaned Python document."""
    lines = par.split("\n")
    ms, cs = [_PYSIG.match(x) for x in lines], [_CSIG.match(x) for x in lines]
    if all(ms) and (ms[0].group(1) or ms[0].group(3) or "." in ms[0].group(2)):
        m = ms[0]
        obj = m.group(1) in ("class ", "exception ") or (not m.group(3) and m.group(1) != "@")
        return ("py-object", f"What is `{m.group(2)}`?") if obj else ("py-callable", f"What does `{m.group(2)}` do?")
    if all(cs) and len(lines[0]) < 200:
        return "py-c-api", (f"What does `{cs[0].group(1)}` do?" if cs[0].group(2) else f"What is `{cs[0].group(1)}`?")
    return None


def _py_items(name: str, text: str):
    paras = _paras(text)
    for k, p in enumerate(paras):
        d = _definition(p)
        if d:
            ans = _first_answer(paras, k + 1)
            if ans:
                yield d[0], d[1], ans
            continue
        head = p.strip()
        mod = re.match(r"([a-z_][\w.]*) (?:---|—|-) \S", head)
        if (
            "\n" in head
            or len(head) > 80
            or head.endswith((".", ",", ":", ";"))
            or head.lower() in _GENERIC
            or not (mod or head[0].isupper())
            or head.startswith(("Note:", "Warning:", "See also"))
            or re.search(r"\*|->|\w_\w+$", head)
        ):  # no C declarations or diagrams
            continue
        ans = _first_answer(paras, k + 1)
        if ans:
            q = (
                f"What is the {mod.group(1)} module?"
                if mod
                else head
                if head.endswith("?")
                else f"Tell me about {head}."
            )
            yield "py-section", q, ans


def _man_item(name: str, text: str):
    paras = _paras(text)
    if "NAME" not in paras or paras.index("NAME") + 1 >= len(paras):
        return
    m = re.match(r"(.+?)\s+[-\u2010\u2013\u2014\u2212]\s+(.+)$", " ".join(paras[paras.index("NAME") + 1].split()))
    if not m:
        return
    page, sec = name[4:].rsplit(".", 1)
    names = [x.strip() for x in m.group(1).split(",")]
    prime = page if page in names else names[0]
    q = {
        "2": f"What does the {prime}() system call do?",
        "3": f"What does the {prime}() function do?",
        "4": f"What is the {prime} device?",
    }.get(sec, f"What does the {prime} command do?" if sec in "168" else f"What is {prime}?")
    ans = _first_answer(paras, paras.index("DESCRIPTION") + 1) if "DESCRIPTION" in paras else None
    desc = m.group(2).strip()
    yield "man", q, ans or desc[0].upper() + desc[1:].rstrip(".") + "."


def _qa_items(docs: dict[str, str]) -> list[tuple[str, str, str, str]]:
    out, seen = [], set()
    for name in sorted(docs):
        items = _man_item(name, docs[name]) if name.startswith("man/") else _py_items(name, docs[name])
        for kind, q, a in items:
            key = re.search(r"`([^`]+)`|$", q).group(1) or q  # one question per Python object
            if key not in seen:
                seen.add(key)
                out.append((kind, q, a, name))
    return out


def qa_pairs(docs: dict[str, str]) -> list[tuple[str, str, str]]:
    """(question, answer, document name) from the structure of `load_documents()`'s cleaned documents: Python object
    signatures and section headings, man pages' NAME and DESCRIPTION. Sorted by document, then document order."""
    return [(q, a, name) for _, q, a, name in _qa_items(docs)]


def fixed_questions(docs: dict[str, str], split: str, n: int = 10) -> list[tuple[str, str, str]]:
    """`n` deterministic (question, reference answer, document) of `split`'s documents: Python and man-page questions
    taken in turn, well-known names first, one per document before a document's second."""
    items = _qa_items({k: v for k, v in docs.items() if split_of(k) == split})

    def rank(it):
        kind, q, _, name = it
        m = re.search(r"`([^`]+)`|the (\S+?)(?:\(\))? ", q)
        ident = (m.group(1) or m.group(2)) if m else q
        known = ident.rsplit(".", 1)[0] in WELL_KNOWN if "." in ident else name in BUILTIN_DOCS
        tier = {
            "py-callable": 0 if known else 1,
            "py-object": 1 if known else 2,
            "py-section": 3,
            "py-c-api": 4,
            "man": 0 if re.search(r"\.[18]$", name) else 1 if re.search(r"\.[23]$", name) else 2,
        }[kind]
        return tier, len(ident), q

    def best_per_doc(src: str) -> list:
        ranked = sorted((it for it in items if it[3].startswith(src)), key=rank)
        firsts = {it[3]: it for it in reversed(ranked)}
        return sorted(firsts.values(), key=rank)

    firsts = [it for pair in zip_longest(best_per_doc("py/"), best_per_doc("man/")) for it in pair if it]
    chosen = set(firsts)
    ranked = firsts + [it for it in sorted(items, key=rank) if it not in chosen]  # then the other questions
    return [(q, a, name) for _, q, a, name in ranked[:n]]
