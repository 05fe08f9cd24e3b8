"""NODES.toml: the hosts a ring is planned for.

    [[nodes]]
    name = "rtx5090"            # required; with count > 1 cards are rtx5090-00, rtx5090-01, ... ("gpu": gpu00, ...)
    gpu_memory_gb = 31.5        # required: usable device memory per card (GiB, as in topology files)
    count = 8                   # optional (default 1)
    memory_bandwidth_gbs = 1792 # optional: measured (or datasheet) memory bandwidth per card, GB/s
    link_gbps = 25              # optional: the host's network link, Gbit/s
    gpu = "rtx5090"             # optional: a datasheet name (p2pk3/sim/profiles/datasheet.toml) for defaults
    standby = true              # optional: these cards are hot spares
    host = "10.0.0.5"           # optional, with port: a static address (count 1), or a base port (count > 1)
    port = 47920

Cards keep the file's order: that is the ring order."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KNOWN = {"name", "gpu_memory_gb", "count", "memory_bandwidth_gbs", "link_gbps", "gpu", "standby", "host", "port"}


class NodesError(ValueError):
    pass


@dataclass
class Card:
    id: str
    kind: str  # the [[nodes]] entry's name
    gpu_memory_gb: float
    bandwidth_gbs: float | None = None  # None: unknown (the planner then balances by bytes)
    link_gbps: float | None = None
    standby: bool = False
    host: str | None = None
    port: int | None = None
    bandwidth_source: str = ""


def parse_nodes(d: dict[str, Any], source: str = "NODES.toml") -> list[Card]:
    from p2pk3.sim.hardware import datasheet

    errs: list[str] = []
    rows = d.get("nodes")
    extra = set(d) - {"nodes"}
    if extra:
        errs.append(f"unknown top-level key(s) {', '.join(sorted(extra))} (expected only [[nodes]] tables)")
    if not isinstance(rows, list) or not rows:
        raise NodesError(f"{source}: no [[nodes]] tables (each needs name and gpu_memory_gb)")
    sheet = datasheet()
    cards: list[Card] = []
    seen: set[str] = set()
    for i, r in enumerate(rows):
        where = f"nodes[{i}]"
        if not isinstance(r, dict):
            errs.append(f"{where} is not a table")
            continue
        unknown = set(r) - KNOWN
        if unknown:
            errs.append(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(KNOWN))})")
        name = r.get("name")
        if not isinstance(name, str) or not name:
            errs.append(f"{where} has no name")
            continue
        where = f"node {name!r}"
        mem = r.get("gpu_memory_gb")
        gpu = r.get("gpu")
        if gpu is not None and gpu not in sheet:
            errs.append(
                f"{where}: unknown gpu {gpu!r} (datasheet knows {', '.join(sorted(sheet))}); "
                f"give memory_bandwidth_gbs instead"
            )
            gpu = None
        if mem is None and gpu:
            mem = sheet[gpu]["usable_memory_gib"]
        if not isinstance(mem, (int, float)) or isinstance(mem, bool) or mem <= 0:
            errs.append(f"{where}: gpu_memory_gb must be a positive number of GiB (got {mem!r})")
            continue
        count = r.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            errs.append(f"{where}: count must be a positive integer (got {count!r})")
            continue
        bw, src = r.get("memory_bandwidth_gbs"), "NODES.toml"
        if bw is None and gpu:
            bw, src = sheet[gpu]["memory_bandwidth_gbs"], f"datasheet {gpu}: {sheet[gpu]['source']}"
        if bw is not None and (not isinstance(bw, (int, float)) or bw <= 0):
            errs.append(f"{where}: memory_bandwidth_gbs must be a positive number (GB/s), got {bw!r}")
            continue
        link = r.get("link_gbps")
        if link is not None and (not isinstance(link, (int, float)) or link <= 0):
            errs.append(f"{where}: link_gbps must be a positive number (Gbit/s), got {link!r}")
            continue
        host, port = r.get("host"), r.get("port")
        if (host is None) != (port is None):
            errs.append(f"{where}: give both host and port, or neither")
            continue
        for k in range(count):
            cid = name if count == 1 else f"{name}{'-' if name[-1].isdigit() else ''}{k:02d}"
            if cid in seen:
                errs.append(f"duplicate card name {cid!r}: give each [[nodes]] entry its own name")
            seen.add(cid)
            cards.append(
                Card(
                    cid,
                    name,
                    float(mem),
                    float(bw) if bw else None,
                    float(link) if link else None,
                    bool(r.get("standby", False)),
                    host,
                    (port + k) if port is not None else None,
                    src if bw else "",
                )
            )
    if errs:
        raise NodesError(f"{source}: " + "; ".join(errs))
    return cards


def load_nodes(path: str | Path) -> list[Card]:
    p = Path(path)
    if not p.is_file():
        raise NodesError(f"{p}: no such file (write [[nodes]] tables with name and gpu_memory_gb; see docs/rack.md)")
    try:
        d = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise NodesError(f"{p}: not valid TOML: {e}") from None
    return parse_nodes(d, str(p))
