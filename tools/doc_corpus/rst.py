"""reStructuredText (the python3.11-doc sources) -> prose, signature lines and 4-space-indented code: ``clean_rst``,
and the section titles of ``:ref:`` targets: ``rst_labels``."""

from __future__ import annotations

import re
import textwrap

from .text import _collapse, _indent

_ADORN = set('=*-^~#"')
_DIRECTIVE = re.compile(r"\.\.\s+([\w:-]+)::(?:\s+(.*))?$")
_OPTION = re.compile(r":[\w -]+:(\s|$)")
_SIMPLE = re.compile(r"=+( +=+)+\s*$")
_ITEM = re.compile(r"([-*+•]|#\.|\d+\.|\(?[a-zA-Z0-9]\)) +\S")
_PREFIX = {
    "class": "class ",
    "exception": "exception ",
    "decorator": "@",
    "decoratormethod": "@",
    "classmethod": "classmethod ",
    "staticmethod": "static ",
    "coroutinefunction": "coroutine ",
    "coroutinemethod": "coroutine ",
    "abstractmethod": "abstractmethod ",
    "awaitablefunction": "awaitable ",
    "awaitablemethod": "awaitable ",
    "function": "",
    "method": "",
    "attribute": "",
    "data": "",
    "property": "",
}
_VERBATIM = {
    "describe",
    "object",
    "opcode",
    "cmdoption",
    "option",
    "envvar",
    "pdbcommand",
    "c:function",
    "c:member",
    "c:type",
    "c:var",
    "c:macro",
    "c:struct",
    "c:union",
    "c:enum",
    "c:enumerator",
}
_ADMONITION = {
    "note": "Note: ",
    "warning": "Warning: ",
    "important": "Important: ",
    "caution": "Caution: ",
    "tip": "Tip: ",
    "hint": "Hint: ",
    "attention": "Attention: ",
    "danger": "Danger: ",
    "error": "Error: ",
    "impl-detail": "CPython implementation detail: ",
    "seealso": "See also: ",
}
_VERSIONED = {
    "versionadded": "New in version {}",
    "versionchanged": "Changed in version {}",
    "deprecated": "Deprecated since version {}",
    "deprecated-removed": "Deprecated since version {}, will be removed in version {}",
}
_CODE = {"code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "parsed-literal"}
_DROP = {
    "index",
    "moduleauthor",
    "sectionauthor",
    "highlight",
    "toctree",
    "tabularcolumns",
    "audit-event",
    "audit-event-table",
    "include",
    "literalinclude",
    "testsetup",
    "testcleanup",
    "contents",
    "image",
    "figure",
    "raw",
    "program",
    "limited-api-list",
    "miscnews",
    "c:namespace",
    "c:namespace-push",
    "c:namespace-pop",
    "default-role",
    "role",
    "sectnum",
    "meta",
    "opcode-list",
}
_TITLED = {"topic", "sidebar", "table", "rubric", "admonition"}


def _dedent(lines: list[str]) -> list[str]:
    return textwrap.dedent("\n".join(lines)).split("\n") if lines else []


def _is_adorn(line: str) -> bool:
    s = line.rstrip()
    return len(s) >= 2 and s[0] in _ADORN and s == s[0] * len(s)


def _block_end(lines: list[str], i: int) -> int:
    """The end of the block of blank or indented lines starting at i (trailing blank lines left out)."""
    j = i
    while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > 0):
        j += 1
    while j > i and not lines[j - 1].strip():
        j -= 1
    return j


def _code(lines: list[str]) -> list[str]:
    lines = _dedent(lines)
    while lines and not lines[0].strip():
        lines = lines[1:]
    return ["", *("    " + x.rstrip() if x.strip() else "" for x in lines), ""]


def _role(role: str, text: str, labels: dict) -> str:
    text = re.sub(r"\\(.)", r"\1", " ".join(text.split()))
    titled = re.match(r"(.*?\S)\s*<([^<>]+)>$", text) if role not in ("samp", "kbd", "file", "code") else None
    if titled:
        return titled.group(1)
    text = text.lstrip("!")
    if role in ("pep", "rfc"):
        return f"{role.upper()} {text.split('#')[0]}"
    if role in ("ref", "doc", "numref"):
        return labels.get(text.lower(), text.rsplit("/", 1)[-1].replace("-", " "))
    if role in ("issue", "gh"):
        return ("bpo-" if role == "issue" else "gh-") + text
    if role in ("samp", "file"):
        text = re.sub(r"(?<!\\)[{}]", "", text)
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    if role in ("func", "meth") and not text.endswith(")"):
        text += "()"
    return text


def _inline(text: str, subs: dict, labels: dict) -> str:
    """Inline markup of one paragraph (line breaks kept) to plain text."""
    text = re.sub(r"(?<![\w|])\|(?=\S)([^|\n`]+?)(?<=\S)\|(?:__?)?(?![\w|])", lambda m: subs.get(m.group(1), ""), text)
    kept: list[str] = []

    def keep(s: str) -> str:
        kept.append(s)
        return f"\x00{len(kept) - 1}\x00"

    text = re.sub(r"``(.+?)``", lambda m: keep(" ".join(m.group(1).split())), text, flags=re.S)
    text = re.sub(
        r":(?:[a-zA-Z][\w+.-]*:)?([a-zA-Z][\w+.-]*):`(.+?)(?<!\\)`",
        lambda m: keep(_role(m.group(1), m.group(2), labels)),
        text,
        flags=re.S,
    )
    text = re.sub(
        r"`([^`<]*?)\s*<([^`>]*)>`__?", lambda m: keep(" ".join((m.group(1) or m.group(2)).split())), text, flags=re.S
    )
    text = re.sub(r"`([^`]+)`(?:__?)?", lambda m: keep(" ".join(m.group(1).split())), text, flags=re.S)
    text = re.sub(r" ?\[(?:#[\w-]*|\d+|\*|[A-Z][\w-]*)\]_", "", text)
    text = re.sub(r"(?<![\w.])([A-Za-z][\w-]*[A-Za-z0-9])__?(?=[\s.,;:)!?]|$)", r"\1", text)  # reference_
    text = re.sub(r"(?<![\w\\*])\*\*(?=\S)(.{1,300}?)(?<=[^\s\\])\*\*(?![\w*])", r"\1", text, flags=re.S)
    text = re.sub(r"(?<![\w\\*])\*(?=[^\s*])(.{1,300}?)(?<=[^\s\\*])\*(?![\w*])", r"\1", text, flags=re.S)
    text = re.sub(r"\\(.)", lambda m: "" if m.group(1) in " \n" else m.group(1), text, flags=re.S)
    return re.sub("\x00(\\d+)\x00", lambda m: kept[int(m.group(1))], text)


def _table(lines: list[str], inl) -> list[str]:
    """A grid or simple table: one line per row, cells joined by ' | ' (border lines dropped)."""
    border = lines[0].rstrip()
    if border.startswith("+"):
        cuts = [k for k, ch in enumerate(border) if ch == "+"]
        rows, cur = [], None
        for line in lines[1:]:
            if line.startswith("+"):
                if cur:
                    rows.append(cur)
                cur = None
                continue
            if len(cuts) == 2:  # a one-column frame around a nested table: its lines as rows
                rows.append([re.sub(r"^\|(?:\s+|$)", "", x.strip()) for x in re.split(r"\s\|(?:\s+\|)?\s", line[1:-1])])
                continue
            cells = [line[a + 1 : b].strip(" |") for a, b in zip(cuts, cuts[1:])]
            cur = cells if cur is None else [f"{x} {y}".strip() for x, y in zip(cur, cells)]
        if cur:
            rows.append(cur)
    else:
        starts = [m.start() for m in re.finditer(r"=+", border)]
        rows = []
        for line in lines:
            if line.strip() and not re.fullmatch(r"[=\- ]+", line):
                cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
                if rows and not cells[0]:  # a continuation line of the row above
                    cells = [f"{x} {y}".strip() for x, y in zip(rows.pop(), cells)]
                rows.append(cells)
    rows = [[re.sub(r"^\.\. [\w:-]+:: ", "", c) for c in row if c] for row in rows]
    return ["", *(inl(" | ".join(row)) for row in rows if row), ""]


def _signature(kind: str, sig: str, ctx: dict, cls: str | None) -> tuple[str, str]:
    """(display line, qualified name) of one object description signature."""
    sig = re.sub(r"\\(.)", r"\1", sig.strip())
    m = re.match(r"([A-Za-z_][\w.]*)(.*)$", sig)
    if kind in _VERBATIM or not m:
        return sig, sig
    name, rest = m.groups()
    mod = ctx.get("module")
    if cls and not name.startswith(cls.rsplit(".", 1)[-1] + "."):
        name = f"{cls}.{name}"
    elif mod and not name.startswith(mod + "."):
        name = f"{mod}.{name}"
    return _PREFIX.get(kind, "") + name + rest, name


def _prefixed(prefix: str, lines: list[str]) -> list[str]:
    for k, line in enumerate(lines):
        if line.strip():
            return lines[:k] + [prefix + line.lstrip()] + lines[k + 1 :]
    return ["", prefix.rstrip(": ") + "."]


def _directive(name: str, arg: str, blk: list[str], ctx: dict, cls: str | None) -> list[str]:
    k = 0
    if (
        name in _PREFIX
        or name in _VERBATIM
        or name in _VERSIONED
        or name in _CODE
        or name in _TITLED
        or name in ("availability", "module", "currentmodule")
    ):
        while k < len(blk) and blk[k].strip() and not _OPTION.match(blk[k].strip()):
            k += 1  # continuation lines of the arguments
    args = [arg] if arg else []
    args = re.sub(r"\\\n\s*", "", "\n".join(args + [x.strip() for x in blk[:k]])).split("\n") if args or k else []
    k0 = k
    while k < len(blk) and _OPTION.match(blk[k].strip()):
        k += 1  # options
    body = blk[k:]

    def sub(lines: list[str], c: str | None = cls) -> list[str]:
        return _rst_lines(lines, ctx, c)

    if name in ("module", "currentmodule"):
        ctx["module"] = None if arg.strip() == "None" else arg.strip()
        return []
    if name in _DROP or any(o.strip().startswith(":hide:") for o in blk[k0:k]):
        return []
    if name in _PREFIX or name in _VERBATIM:
        sigs = [_signature(name, s, ctx, cls) for s in args]
        inner = sigs[0][1] if name in ("class", "exception") and sigs else cls
        return ["", *(s for s, _ in sigs), "", *sub(body, inner), ""]
    if name in _VERSIONED:
        nv = 2 if name == "deprecated-removed" else 1
        words = "\n".join(args).split(None, nv)
        text = _VERSIONED[name].format(*(words[:nv] + ["?"] * nv))
        rest = words[nv].split("\n") if len(words) > nv else []
        return ["", *_prefixed(text + ": ", sub([*rest, "", *body] if rest else body)), ""]
    if name in _ADMONITION:
        return ["", *_prefixed(_ADMONITION[name], sub(args + body)), ""]
    if name in _CODE:
        return _code([_inline(x, ctx["subs"], ctx["labels"]) for x in body] if name == "parsed-literal" else body)
    if name == "productionlist":
        return _code([x.replace("`", "") for x in ([arg] if ":" in arg else []) + blk])
    if name == "availability":
        return ["", "Availability: " + _inline(" ".join(args), ctx["subs"], ctx["labels"]).rstrip(".") + ".", ""]
    if name in _TITLED and args:
        return ["", _inline(" ".join(args), ctx["subs"], ctx["labels"]), "", *sub(body), ""]
    return ["", *sub(body), ""]  # only, glossary, seealso-like containers, list-table, unknown: the content


def _rst_lines(lines: list[str], ctx: dict, cls: str | None = None) -> list[str]:
    out: list[str] = []

    def inl(s: str) -> str:
        return _inline(s, ctx["subs"], ctx["labels"])

    i, n, literal = 0, len(lines), False
    while i < n:
        line = lines[i]
        if not line.strip():
            out.append("")
            i += 1
            continue
        if _indent(line):  # an indented block: literal (after ::), doctest, or a block quote / definition
            j = _block_end(lines, i)
            block = _dedent(lines[i:j])
            if literal or block[0].startswith(">>>"):
                out += _code(block)
            else:
                pad = " " * min(_indent(line), 3)
                out += [pad + x if x else "" for x in _rst_lines(block, ctx, cls)]
            i, literal = j, False
            continue
        literal = False
        nxt = lines[i + 1] if i + 1 < n else ""
        if _is_adorn(line) and i + 2 < n and nxt.strip() and lines[i + 2].rstrip() == line.rstrip():
            out += ["", inl(nxt.strip()), ""]  # title with an overline
            i += 3
            continue
        if _is_adorn(nxt) and not _is_adorn(line) and len(nxt.rstrip()) >= len(line.rstrip()):
            out += ["", inl(line.strip()), ""]
            i += 2
            continue
        if _is_adorn(line) and not nxt.strip() and not line.startswith("+"):
            i += 1  # transition
            continue
        if line.startswith(".."):
            j = _block_end(lines, i + 1)
            blk, text = _dedent(lines[i + 1 : j]), line[2:].strip()
            m = _DIRECTIVE.match(line)
            if m and not text.startswith("|"):
                out += _directive(m.group(1).lower(), (m.group(2) or "").strip(), blk, ctx, cls)
            elif re.match(r"\[[^\]]+\]\s", text):  # a footnote or citation: keep its text
                out += ["", *_rst_lines(_dedent([text.split("]", 1)[1].strip(), *blk]), ctx, cls), ""]
            i = j  # a comment, target or substitution definition is dropped
            continue
        if re.match(r"\+[-=+]+\+\s*$", line) or _SIMPLE.match(line):
            j = i + 1  # a grid table ends at a blank line, a simple one at a border line before a blank one
            while j < n and (lines[j].strip() or line.startswith("=")):
                j += 1
                if line.startswith("=") and _SIMPLE.match(lines[j - 1]) and (j == n or not lines[j].strip()):
                    break
            out += _table(lines[i:j], inl)
            i = j
            continue
        item = _ITEM.match(line)
        if item:  # a list item: its body (the lines indented under it) cleaned as a block, under the marker
            j = _block_end(lines, i + 1)
            w = min([item.end() - 1] + [_indent(x) for x in lines[i + 1 : j] if x.strip()])
            body = _rst_lines([line[w:]] + [x[w:] for x in lines[i + 1 : j]], ctx, cls)
            k = next((k for k, x in enumerate(body) if x.strip()), 0)
            out += ["" if not x else (line[:w] if k == m else " " * w) + x for m, x in enumerate(body)]
            i = j
            continue
        j = i + 1
        while j < n and lines[j].strip() and _indent(lines[j]) == 0:
            j += 1
        para = "\n".join(x.rstrip() for x in lines[i:j])
        if para.startswith(">>>"):
            out += _code(lines[i:j])
            i = j
            continue
        if para.endswith("::"):
            literal = True
            para = para[:-2].rstrip() if para[:-2].endswith((" ", "\n")) or para == "::" else para[:-1]
        para = re.sub(r"^\| ?", "", para, flags=re.M) if para.startswith("| ") else para
        out += inl(para).split("\n") if para.strip() else []
        i = j
    return out


def clean_rst(text: str, labels: dict | None = None) -> str:
    """reStructuredText -> prose, signature lines and 4-space-indented code (see the module docstring).
    `labels`: {ref label: section title} for `:ref:` without an explicit title (`rst_labels`)."""
    lines = text.expandtabs(8).split("\n")
    subs = {"version": "3.11", "release": "3.11", "today": ""}
    for line in lines:
        m = re.match(r"\.\. \|([^|]+)\| replace:: (.*)", line)
        if m:
            subs[m.group(1)] = m.group(2)
    return _collapse(_rst_lines(lines, {"module": None, "subs": subs, "labels": labels or {}}))


def rst_labels(sources: dict[str, str]) -> dict[str, str]:
    """{label: title} of every `.. _label:` target directly followed by a section title."""
    labels = {}
    for text in sources.values():
        for m in re.finditer(
            r"^\.\. _([^:\n]+):\s*\n(?:\.\. _[^\n]+\n|\s*\n)*(?:[=*\-^~#\"]+\n)?(\S[^\n]*)\n"
            r"([=*\-^~#\"])\3+\n",
            text,
            re.M,
        ):
            labels[m.group(1).lower()] = " ".join(_inline(m.group(2), {}, {}).split())
    return labels
