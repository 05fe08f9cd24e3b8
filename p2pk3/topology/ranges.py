"""Expert id ranges as the topology file writes them: "0-447,500,510-515"."""

from __future__ import annotations

import re
from typing import Iterable


def parse_ranges(text: str | Iterable[int], *, what: str = "range") -> tuple[int, ...]:
    """ "0-447,500,510-515" -> sorted ids. Raises ValueError on bad syntax, reversed or repeated ids."""
    if not isinstance(text, str):
        ids = list(text)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{what}: expected non-negative integers, got {ids!r}")
    else:
        ids = []
        for part in text.replace(" ", "").split(","):
            if not part:
                raise ValueError(f"{what}: empty item in {text!r}")
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if not m:
                raise ValueError(f'{what}: cannot parse {part!r} in {text!r} (expected e.g. "0-447,500,510-515")')
            a = int(m.group(1))
            b = int(m.group(2)) if m.group(2) is not None else a
            if b < a:
                raise ValueError(f"{what}: reversed range {part!r}")
            ids.extend(range(a, b + 1))
    s = sorted(ids)
    for x, y in zip(s, s[1:]):
        if x == y:
            raise ValueError(f"{what}: {x} is listed twice")
    return tuple(s)


def format_ranges(ids: Iterable[int]) -> str:
    """Sorted ids -> "0-447,500,510-515"."""
    s = sorted(set(ids))
    out, i = [], 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)
