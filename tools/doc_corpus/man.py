"""Man pages (the ``manpages`` and ``manpages-dev`` packages): the installed files (``man_files``), their groff text
rendering (``render_man``) and its cleaning (``clean_man``)."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
from multiprocessing import Pool

from .text import _collapse, _indent

MAN_PACKAGES = ("manpages", "manpages-dev")
_MANHDR = re.compile(r"\S\([0-9][\w]*\)\s*$")


def clean_man(rendered: str) -> str:
    """groff's text rendering of a man page -> text without header/footer, COLOPHON or the 7-space body indent."""
    lines = [x.rstrip().expandtabs() for x in rendered.strip("\n").split("\n")]
    if lines and _MANHDR.search(lines[0]):
        lines.pop(0)
    if lines and _MANHDR.search(lines[-1]):
        lines.pop()
    out: list[str] = []
    skip = False
    for line in lines:
        ind = _indent(line)
        if line and ind == 0:
            skip = line.strip() == "COLOPHON"
        if skip:
            continue
        if line and ind < 7:
            out += ["", line.strip(), ""]  # a section (indent 0) or subsection (3) heading
        elif line:
            body = re.sub(r"(?<=[\w)\"'][.!?])  (?=[A-Z(])", " ", line.strip())
            if (
                out
                and re.search(r"[A-Za-z]-$", out[-1])
                and not out[-1].endswith("--")
                and ind - 7 == _indent(out[-1])
                and re.match(r"[a-z]", body)
            ):
                word, _, body = body.partition(" ")
                out[-1] += word
                if not body:
                    continue
            out.append(" " * (ind - 7) + body)
        else:
            out.append("")
    return _collapse(out)


def _render(path: str) -> tuple[str, str | None]:
    base = os.path.basename(path)[:-3]
    page, _, sec = base.rpartition(".")
    data = gzip.open(path).read()
    if re.search(rb"^\.so ", data, re.M) and len(re.findall(rb"^\.(?!\\\")", data, re.M)) < 3:
        return f"man/{page}.{sec}", None  # a redirect to another page
    r = subprocess.run(
        ["groff", "-k", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=80n", "-rHY=0"],
        input=b".ad l\n" + data,
        capture_output=True,
        timeout=120,
    )
    return f"man/{page}.{sec}", r.stdout.decode("utf-8", "replace") if r.returncode == 0 else None


def man_files() -> list[str]:
    try:
        out = subprocess.run(["dpkg-query", "-L", *MAN_PACKAGES], capture_output=True, text=True).stdout
    except OSError:
        return []
    return sorted(
        p
        for p in out.split("\n")
        if re.search(r"/man/man\w+/[^/]+\.gz$", p) and not os.path.islink(p) and os.path.isfile(p)
    )


def render_man(files: list[str], processes: int = 2) -> dict[str, str]:
    if not files:
        return {}
    with Pool(processes, initializer=os.nice, initargs=(10,)) as pool:
        return {k: v for k, v in pool.imap(_render, files, chunksize=8) if v}
