"""The topology file's TOML: text in with tomllib, out with tomli-w, and the tables checked and turned into
the dataclasses of specs.py (`parse_tables`) and back (`tables`). `Topology` (topology.py) reads and writes
itself through these; nothing here knows the model."""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import fields
from typing import Any, Iterable, Mapping

import tomli_w

from p2pk3.quant.formats import FormatError, parse_formats

from .ranges import parse_ranges
from .specs import BROADCAST, DEFAULT_BEACON_PORT, ClusterSpec, MemorySpec, ModelSpec, Slot, TopologyError

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_CLUSTER_KEYS = {f.name for f in fields(ClusterSpec)}
_MODEL_KEYS = {f.name for f in fields(ModelSpec)}
_MEMORY_KEYS = {f.name for f in fields(MemorySpec)}
_SLOT_KEYS = {f.name for f in fields(Slot)}
_TOP_KEYS = {"cluster", "model", "memory", "slots"}


def decode(text: str, source: str | None = None) -> dict[str, Any]:
    """TOML text -> its tables (TopologyError when it is not TOML)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"not valid TOML: {e}", source) from None


def encode(tables: Mapping[str, Any], comment: str | None = None) -> str:
    """Tables -> TOML text, after `comment` as "# " lines."""
    head = "".join(f"# {c}".rstrip() + "\n" for c in comment.splitlines()) + "\n" if comment else ""
    return head + tomli_w.dumps(tables)


def parse_tables(
    d: Mapping[str, Any], source: str | None = None
) -> tuple[ClusterSpec, ModelSpec, list[Slot], MemorySpec]:
    """The tables of a topology file -> (cluster, model, slots, memory); TopologyError listing every
    problem of structure and type (the model-dependent rules are checks.py's)."""
    errs: list[str] = _unknown(d.keys(), _TOP_KEYS, "the topology")
    cluster = _parse_cluster(d, errs)
    model = _parse_model(d, errs)
    memory = _parse_memory(d, errs)
    raw_slots = d.get("slots")
    if not isinstance(raw_slots, list) or not raw_slots:
        errs.append("no [[slots]]: the ring needs at least one slot")
        raw_slots = []
    slots = [s for i, rs in enumerate(raw_slots) if (s := _parse_slot(rs, i, errs)) is not None]
    if errs:
        raise TopologyError(errs, source)
    return cluster, model, slots, memory


def tables(cluster: ClusterSpec, model: ModelSpec, slots: list[Slot], memory: MemorySpec) -> dict[str, Any]:
    """The inverse of `parse_tables` (defaults left out)."""
    c: dict[str, Any] = {"name": cluster.name}
    if cluster.secret_file:
        c["secret_file"] = cluster.secret_file
    c["beacon_port"] = cluster.beacon_port
    if cluster.beacon_addrs != [BROADCAST]:
        c["beacon_addrs"] = list(cluster.beacon_addrs)
    m = {k: getattr(model, k) for k in ("preset", "path", "repo", "revision") if getattr(model, k)}
    if model.formats:
        m["formats"] = dict(model.formats)
    out: dict[str, Any] = {"cluster": c, "model": m}
    if memory.given or memory != MemorySpec():
        out["memory"] = {f.name: getattr(memory, f.name) for f in fields(MemorySpec) if f.name != "given"}
    out["slots"] = [s.to_dict() for s in slots]
    return out


# ----------------------------------------------------------------------------- parsing helpers
def _unknown(keys: Iterable[str], known: set[str], where: str) -> list[str]:
    out = []
    for k in keys:
        if k not in known:
            near = difflib.get_close_matches(k, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(sorted(known))})"
            out.append(f"unknown key {k!r} in {where}{hint}")
    return out


def _typed(
    d: Mapping[str, Any], key: str, types: tuple[type, ...], where: str, errs: list[str], default: Any = None
) -> Any:
    if key not in d:
        return default
    v = d[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        errs.append(f"{where}: {key} must be {names}, got {v!r}")
        return default
    return v


def _table(d: Mapping[str, Any], key: str, errs: list[str]) -> dict[str, Any]:
    v = d.get(key, {})
    if not isinstance(v, dict):
        errs.append(f"[{key}] must be a table")
        return {}
    return v


def _parse_cluster(d: Mapping[str, Any], errs: list[str]) -> ClusterSpec:
    c = d.get("cluster")
    if not isinstance(c, dict):
        errs.append("missing [cluster] table (name, beacon_port, secret_file)")
        c = {}
    errs += _unknown(c.keys(), _CLUSTER_KEYS, "[cluster]")
    name = _typed(c, "name", (str,), "[cluster]", errs)
    if not name and isinstance(d.get("cluster"), dict):
        errs.append("[cluster]: name is required")
    bport = _typed(c, "beacon_port", (int,), "[cluster]", errs, DEFAULT_BEACON_PORT)
    if not 1 <= bport <= 65535:
        errs.append(f"[cluster]: beacon_port {bport} is not a port number")
    addrs = _typed(c, "beacon_addrs", (list,), "[cluster]", errs, [BROADCAST])
    if not all(isinstance(a, str) for a in addrs):
        errs.append("[cluster]: beacon_addrs must be a list of addresses")
    return ClusterSpec(name or "", _typed(c, "secret_file", (str,), "[cluster]", errs), bport, list(addrs))


def _parse_model(d: Mapping[str, Any], errs: list[str]) -> ModelSpec:
    m = _table(d, "model", errs)
    errs += _unknown(m.keys(), _MODEL_KEYS, "[model]")
    model = ModelSpec(**{k: _typed(m, k, (str,), "[model]", errs) for k in _MODEL_KEYS - {"formats"}})
    if "formats" in m:
        try:
            if not isinstance(m["formats"], dict):
                raise FormatError(f'formats must be a table like {{ attention = "mxfp8" }}, got {m["formats"]!r}')
            model.formats = parse_formats(m["formats"])
        except FormatError as e:
            errs.append(f"[model]: {e}")
    if model.revision and not model.repo:
        errs.append("[model]: revision needs repo")
    return model


def _parse_memory(d: Mapping[str, Any], errs: list[str]) -> MemorySpec:
    mm = _table(d, "memory", errs)
    errs += _unknown(mm.keys(), _MEMORY_KEYS, "[memory]")
    dm = MemorySpec()
    memory = MemorySpec(
        sessions=_typed(mm, "sessions", (int,), "[memory]", errs, dm.sessions),
        context=_typed(mm, "context", (int,), "[memory]", errs, dm.context),
        prefill_chunk=_typed(mm, "prefill_chunk", (int,), "[memory]", errs, dm.prefill_chunk),
        overhead_gb=float(_typed(mm, "overhead_gb", (int, float), "[memory]", errs, dm.overhead_gb)),
        given="memory" in d,
    )
    if min(memory.sessions, memory.context, memory.prefill_chunk) < 0 or memory.overhead_gb < 0:
        errs.append("[memory]: values must be non-negative")
    return memory


def _parse_slot(rs: Any, i: int, errs: list[str]) -> Slot | None:
    if not isinstance(rs, dict):
        errs.append(f"slots[{i}] is not a table")
        return None
    sid = rs.get("id")
    where = f"slot {sid}" if isinstance(sid, str) else f"slots[{i}]"
    errs += _unknown(rs.keys(), _SLOT_KEYS, where)
    if not isinstance(sid, str) or not _ID_RE.match(sid):
        errs.append(f"{where}: id must be a string of letters, digits, '.', '_', '-' (got {sid!r})")
    standby = _typed(rs, "standby", (bool,), where, errs, False)
    host = _typed(rs, "host", (str,), where, errs)
    port = _typed(rs, "port", (int,), where, errs)
    if port is not None and not 1 <= port <= 65535:
        errs.append(f"{where}: port {port} is not a port number")
    mem = _typed(rs, "gpu_memory_gb", (int, float), where, errs)
    if mem is not None and mem <= 0:
        errs.append(f"{where}: gpu_memory_gb must be positive")
    layers = None
    if "layers" in rs:
        lv = rs["layers"]
        if (
            not isinstance(lv, list)
            or len(lv) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in lv)
        ):
            errs.append(f"{where}: layers must be [first, last] (two integers, inclusive), got {lv!r}")
        else:
            layers = (lv[0], lv[1])
    return Slot(
        sid if isinstance(sid, str) else f"#{i}",
        layers,
        mem,
        host,
        port,
        _parse_experts(rs.get("experts", {}), where, errs),
        standby,
    )


def _parse_experts(ev: Any, where: str, errs: list[str]) -> dict[int, tuple[int, ...]]:
    if not isinstance(ev, dict):
        errs.append(f'{where}: experts must be a table like {{ "5" = "0-447" }}')
        return {}
    experts: dict[int, tuple[int, ...]] = {}
    for k, v in ev.items():
        try:
            l = int(k)
            if str(l) != k.strip() or l < 0:
                raise ValueError
        except ValueError:
            errs.append(f"{where}: experts key {k!r} is not a layer number")
            continue
        try:
            experts[l] = parse_ranges(v, what=f"{where} experts of layer {l}")
        except ValueError as e:
            errs.append(str(e))
    return experts
