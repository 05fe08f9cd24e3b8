"""Line and paragraph helpers shared by the cleaners (rst, man), the splits and the question extraction."""

from __future__ import annotations

import re


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _collapse(lines: list[str]) -> str:
    text = "\n".join(x.rstrip() for x in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def _paras(text: str) -> list[str]:
    return [p.rstrip() for p in re.split(r"\n(?:[^\S\n]*\n)+", text.strip("\n")) if p.strip()]
