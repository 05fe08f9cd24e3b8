"""tools/doc_corpus/ on small inline samples (no Debian documentation packages needed); every expected text
below was written by hand."""

import hashlib
import json
import pytest

from tools import doc_corpus as dc

RST = """\
.. _tut-spam:

:mod:`spam` --- Spam handling
=============================

.. module:: spam
   :synopsis: Spam things.

.. index::
   single: spam
   pair: spam; eggs

.. This is a comment
   that spans two lines.

The :func:`open` function and :class:`~collections.OrderedDict` (see
:ref:`the tutorial <tut-spam>` and :pep:`8`) accept ``*args``; this is
*important* and **very** important, see `Python <https://www.python.org>`_.

.. function:: eat(food, amount=1)

   Eat *food* and return how it tasted.  Calls :meth:`Can.open` first.

   .. versionadded:: 3.2

Example::

   >>> eat("ham")
   'yum'

.. class:: Can(size)

   A tin can that holds spam for a long time.

   .. method:: open()

      Open the can and return its contents as a list.

   .. attribute:: size

      The capacity of the can in grams, set when it is made.

Sub-section
-----------

.. note::
   Spam is not ham.
"""

RST_CLEAN = """\
spam --- Spam handling

The open() function and OrderedDict (see
the tutorial and PEP 8) accept *args; this is
important and very important, see Python.

spam.eat(food, amount=1)

Eat food and return how it tasted.  Calls Can.open() first.

New in version 3.2.

Example:

    >>> eat("ham")
    'yum'

class spam.Can(size)

A tin can that holds spam for a long time.

spam.Can.open()

Open the can and return its contents as a list.

spam.Can.size

The capacity of the can in grams, set when it is made.

Sub-section

Note: Spam is not ham.
"""

RST2 = """\
################
Tables and lists
################

.. |name| replace:: Spam & Eggs

Welcome to |name| [#]_, see nargs_.

.. toctree::
   :maxdepth: 2

   intro

* First item with a :term:`long
  role <glossary>`.
* Second item::

     code here

=====  =======
Name   Meaning
=====  =======
``a``  first
b      second
=====  =======

.. versionchanged:: 3.4
   The *amount* argument was added.

.. deprecated:: 3.6
   Use :func:`eat` instead.

.. seealso::

   Module :mod:`ham`
      Documentation of the ham module.

.. code-block:: python
   :caption: example

   print("hi")

.. audit-event:: spam.eat food spam.eat

.. [#] A footnote.
"""

RST2_CLEAN = """\
Tables and lists

Welcome to Spam & Eggs, see nargs.

* First item with a long role.
* Second item:

      code here

Name | Meaning
a | first
b | second

Changed in version 3.4: The amount argument was added.

Deprecated since version 3.6: Use eat() instead.

See also: Module ham
   Documentation of the ham module.

    print("hi")

A footnote.
"""

# what `groff -man -Tutf8` prints for a page (header, 7-space body indent, a subsection, COLOPHON, footer)
MAN = """\
LS(1)                            User Commands                           LS(1)

NAME
       ls - list directory contents

SYNOPSIS
       ls [OPTION]... [FILE]...

DESCRIPTION
       List information about the FILEs (the current directory by default).  Sort
       entries alphabetically, the lowest-
       numbered first.

       -a, --all
              do not ignore entries starting with .

   Exit status
       0      if OK,



COLOPHON
       This page is part of release 6.03 of the Linux man-pages project.

GNU coreutils 9.1                 September 2022                         LS(1)
"""

MAN_CLEAN = """\
NAME

ls - list directory contents

SYNOPSIS

ls [OPTION]... [FILE]...

DESCRIPTION

List information about the FILEs (the current directory by default). Sort
entries alphabetically, the lowest-numbered
first.

-a, --all
       do not ignore entries starting with .

Exit status

0      if OK,
"""


def test_clean_rst_headings_roles_directives_literal_blocks():
    assert dc.clean_rst(RST) == RST_CLEAN


def test_clean_rst_tables_lists_substitutions_versions_seealso_code():
    assert dc.clean_rst(RST2) == RST2_CLEAN


def test_clean_rst_resolves_ref_labels_and_joins_continued_signatures():
    src = (
        ".. _eggs:\n\nEggs\n====\n\nSee :ref:`eggs`.\n\n.. method:: str.cook(a, \\\n                   b)\n\n   Cook.\n"
    )
    assert dc.rst_labels({"x": src}) == {"eggs": "Eggs"}
    assert dc.clean_rst(src, dc.rst_labels({"x": src})) == "Eggs\n\nSee Eggs.\n\nstr.cook(a, b)\n\nCook.\n"


def test_clean_man():
    assert dc.clean_man(MAN) == MAN_CLEAN


def test_qa_pairs_from_cleaned_documents():
    docs = {
        "py/spam": dc.clean_rst(RST),
        "man/ls.1": dc.clean_man(MAN),
        "man/open.2": "NAME\n\nopen, openat - open and possibly create a file\n\nSYNOPSIS\n\nint open(void);\n",
    }
    assert dc.qa_pairs(docs) == [
        (
            "What does the ls command do?",
            "List information about the FILEs (the current directory by default). "
            "Sort entries alphabetically, the lowest-numbered first.",
            "man/ls.1",
        ),
        ("What does the open() system call do?", "Open and possibly create a file.", "man/open.2"),
        (
            "What is the spam module?",
            "The open() function and OrderedDict (see the tutorial and PEP 8) accept *args; "
            "this is important and very important, see Python.",
            "py/spam",
        ),
        ("What does `spam.eat` do?", "Eat food and return how it tasted. Calls Can.open() first.", "py/spam"),
        ("What is `spam.Can`?", "A tin can that holds spam for a long time.", "py/spam"),
        ("What does `spam.Can.open` do?", "Open the can and return its contents as a list.", "py/spam"),
        ("What is `spam.Can.size`?", "The capacity of the can in grams, set when it is made.", "py/spam"),
    ]
    assert dc.qa_pairs({"py/x": dc.clean_rst(RST2)}) == []  # no definitions; the one heading has no prose after it


def test_qa_answers_are_whole_sentences_within_the_limit():
    par = "First sentence is here. " * 30
    text = "os.getcwd()\n\n" + par + "\n\nmath.pi\n\nSee foo.\n\nmath.e\n\n    code = 1\n"
    ((q, a, _),) = dc.qa_pairs({"py/os": text})
    assert q == "What does `os.getcwd` do?" and a == " ".join(["First sentence is here."] * 16) and len(a) <= 400


def _name_in(split, prefix="man/cmd", k=0):
    return [f"{prefix}{i}.1" for i in range(10000) if dc.split_of(f"{prefix}{i}.1") == split][k]


def test_split_of_is_the_documented_hash():
    names = [f"py/library/m{i}" for i in range(2000)]
    for name in names[:200]:
        h = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100
        v = int(hashlib.sha256(("val/" + name).encode()).hexdigest()[:8], 16) % 100
        assert dc.split_of(name) == ("heldout" if h < 5 else "val" if v < 3 else "train")
    share = {s: sum(dc.split_of(n) == s for n in names) / len(names) for s in ("heldout", "val", "train")}
    assert 0.03 < share["heldout"] < 0.07 and 0.015 < share["val"] < 0.045


def test_split_documents_removes_held_out_and_val_paragraphs_and_train_repeats():
    held, val, tr1, tr2 = _name_in("heldout"), _name_in("val"), _name_in("train"), _name_in("train", k=1)
    p_held = "This held-out paragraph must never be seen in training."
    p_val = "This validation paragraph must not be in the train split."
    p_rep = "This page is part of the Linux man-pages project, boilerplate."
    docs = {
        held: f"Title\n\n{p_held}\n",
        val: f"{p_held}\n\n{p_val}\n\nshort\n",
        tr1: f"Own text of the first train document, long enough.\n\n{p_held}\n\n{p_val}\n\n{p_rep}\n\nshort\n",
        tr2: f"{p_rep}\n\nOwn text of the second train document, long enough.\n\nshort\n",
    }
    s = dc.split_documents(docs)
    assert s["heldout"] == {held: docs[held]}
    assert s["val"] == {val: f"{p_val}\n\nshort\n"}
    assert s["train"] == {
        tr1: f"Own text of the first train document, long enough.\n\n{p_rep}\n\nshort\n",
        tr2: "Own text of the second train document, long enough.\n\nshort\n",
    }
    assert dc.overlap(s["heldout"], s["train"]) == 0.0
    assert dc.overlap({held: p_held}, {tr1: docs[tr1]}) == 1.0


def test_overlap_counts_distinct_held_out_ngrams():
    held = {"a": "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"}  # three 8-grams
    assert dc.overlap(held, {"b": "w2 w3 w4 w5 w6 w7 w8 w9 x"}) == 1 / 3
    assert dc.overlap(held, {"b": "w1 w2 w3"}, n=3) == 1 / 8
    assert dc.overlap({"a": "too short"}, {"b": "too short"}) == 0.0


def test_fixed_questions_are_deterministic_distinct_documents_of_the_split():
    docs = {f"man/cmd{i}.1": f"NAME\n\ncmd{i} - do thing number {i}\n" for i in range(400)}
    docs |= {
        f"py/m{i}": "".join(f"m{i}.{f}()\n\nReturn the thing number {i} of kind {f}, computed.\n\n" for f in "fg")
        for i in range(400)
    }
    fq = dc.fixed_questions(docs, "heldout")
    assert len(fq) == 10 and fq == dc.fixed_questions(dict(reversed(docs.items())), "heldout")
    assert len({name for _, _, name in fq}) == 10 and all(dc.split_of(name) == "heldout" for _, _, name in fq)
    assert [q for q, _, _ in fq[::2]] == [f"What does `{name[3:]}.f` do?" for _, _, name in fq[::2]]  # taken in turn
    assert [q for q, _, _ in fq[1::2]] == [f"What does the {name[4:-2]} command do?" for _, _, name in fq[1::2]]


def test_load_documents_reads_sources_and_reuses_its_cache(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "library").mkdir(parents=True)
    (src / "whatsnew").mkdir()
    (src / "library" / "spam.rst.txt").write_text(RST)
    (src / "library" / "tiny.rst.txt").write_text("Tiny\n====\n\nToo short.\n")
    (src / "whatsnew" / "changelog.rst.txt").write_text(RST)
    monkeypatch.setattr(dc, "PY_SOURCES", src)
    monkeypatch.setattr(dc, "man_files", lambda: [])
    docs = dc.load_documents(tmp_path / "cache")
    assert docs == {"py/library/spam": RST_CLEAN}
    assert json.loads((tmp_path / "cache" / "docs.json").read_text()) == docs
    monkeypatch.setattr(dc, "PY_SOURCES", tmp_path / "gone")
    assert dc.load_documents(tmp_path / "cache") == docs
    # no cache and no Python docs: not a corpus of man pages alone (its splits and questions would differ)
    with pytest.raises(RuntimeError, match=r"no Python documentation sources at .*gone: install them"):
        dc.load_documents(tmp_path / "other")
