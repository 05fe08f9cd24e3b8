"""A training corpus for a small language model, built from documentation installed as Debian packages.

Sources (read at build time, nothing is downloaded):

* ``python3.11-doc``: the reStructuredText sources of the CPython 3.11 documentation,
  ``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt``. Licence: the documentation is under the PSF License
  Agreement; code examples in it are dual-licensed under the PSF License and the Zero-Clause BSD licence (see
  ``license.rst`` in the sources and /usr/share/doc/python3.11-doc/copyright).
* ``manpages`` and ``manpages-dev``: the Linux man-pages project, sections 1-8 (roff, rendered to text with groff).
  Licence: per page (/usr/share/doc/manpages/copyright): mostly the "Linux-man-pages-copyleft" verbatim-copying
  licence (verbatim and modified copies allowed if the permission notice is kept), the rest GPL-2+/GPL-1+/GPL-2,
  BSD-2/3/4-clause or Expat; the packages are in Debian main (the non-free POSIX pages are in manpages-posix).

``load_documents()`` gives {name: cleaned text}: ``py/library/functions`` (``clean_rst``: markup stripped to prose,
signature lines and 4-space-indented code blocks) and ``man/open.2`` (``clean_man``). ``split_documents`` splits by a
hash of the name (``split_of``) and removes held-out paragraphs from val/train (and val paragraphs from train,
repeated paragraphs within train); ``overlap`` measures what leaks. ``qa_pairs`` derives (question, answer, document)
from the cleaned documents' structure: object signatures and section headings of the Python docs, the NAME and
DESCRIPTION sections of man pages; ``fixed_questions`` picks 10 of them for evaluation.

    python -m tools.doc_corpus --out runs/corpus      # build (or load the cache in runs/corpus) and summarise
"""

from __future__ import annotations

import json
from pathlib import Path

from .man import MAN_PACKAGES, clean_man, man_files, render_man
from .qa import BUILTIN_DOCS, WELL_KNOWN, fixed_questions, qa_pairs
from .rst import clean_rst, rst_labels
from .splits import overlap, split_documents, split_of

__all__ = [
    "BUILTIN_DOCS",
    "MAN_PACKAGES",
    "MIN_CHARS",
    "PY_SOURCES",
    "VERSION",
    "WELL_KNOWN",
    "clean_man",
    "clean_rst",
    "fixed_questions",
    "load_documents",
    "man_files",
    "overlap",
    "py_sources",
    "qa_pairs",
    "render_man",
    "rst_labels",
    "split_documents",
    "split_of",
]

PY_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
VERSION = 1  # of the cleaning; a docs.json written by another version is rebuilt
MIN_CHARS = 200


def py_sources(root: Path | None = None) -> dict[str, str]:
    root = root or PY_SOURCES
    return {
        "py/" + str(p.relative_to(root))[: -len(".rst.txt")]: p.read_text("utf-8", "replace")
        for p in sorted(root.rglob("*.rst.txt"))
    }


def load_documents(cache: str | Path | None = None) -> dict[str, str]:
    """{name: cleaned text}, sorted by name. `cache`: a directory holding docs.json (+ docs.meta.json, and the
    rendered man pages man_rendered.json); reused when written by this VERSION, else rebuilt and written."""
    cdir = Path(cache) if cache is not None else None

    def cached(name: str):
        return json.loads((cdir / name).read_text()) if cdir and (cdir / name).exists() else None

    def write(name: str, obj) -> None:
        if cdir:
            cdir.mkdir(parents=True, exist_ok=True)
            (cdir / name).write_text(json.dumps(obj, ensure_ascii=False))

    docs = cached("docs.json") if (cached("docs.meta.json") or {}).get("version") == VERSION else None
    if docs is not None:
        return docs
    rendered = cached("man_rendered.json")
    if rendered is None:
        rendered = render_man(man_files())
        write("man_rendered.json", rendered)
    if not PY_SOURCES.is_dir():  # without it the corpus, its splits and every held-out question would change
        raise RuntimeError(
            f"no Python documentation sources at {PY_SOURCES}: install them (apt-get install python3.11-doc) "
            "and run again; the demo corpus is the Python docs and the man pages together"
        )
    sources = py_sources()
    labels = rst_labels(sources)
    docs = {name: clean_rst(text, labels) for name, text in sources.items() if name != "py/whatsnew/changelog"}
    docs.update({name: clean_man(text) for name, text in rendered.items()})
    docs = {k: docs[k] for k in sorted(docs) if len(docs[k]) >= MIN_CHARS}
    if not docs:
        raise RuntimeError("no documents: python3.11-doc / manpages / manpages-dev not installed and no cache")
    write("docs.json", docs)
    write("docs.meta.json", {"version": VERSION, "documents": len(docs)})
    return docs
