"""`Topology`: the parsed topology file (TOML in with tomllib, out with tomli-w), its queries, and the
entry points to plans (plans.py) and validation (checks.py)."""
from __future__ import annotations

import difflib
import os
import re
import secrets
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import tomli_w

from p2pk3.model.config import K3Config, preset as _preset

from . import checks
from .plans import SlotPlan, slot_plan
from .ranges import parse_ranges
from .specs import BROADCAST, DEFAULT_BEACON_PORT, ClusterSpec, MemorySpec, ModelSpec, Slot, TopologyError

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_CLUSTER_KEYS = {f.name for f in fields(ClusterSpec)}
_MODEL_KEYS = {f.name for f in fields(ModelSpec)}
_MEMORY_KEYS = {f.name for f in fields(MemorySpec)}
_SLOT_KEYS = {f.name for f in fields(Slot)}
_TOP_KEYS = {"cluster", "model", "memory", "slots"}


@dataclass
class Topology:
    cluster: ClusterSpec
    model: ModelSpec
    slots: list[Slot]
    memory: MemorySpec = field(default_factory=MemorySpec)
    source: str | None = None  # the file it was loaded from: relative paths in it are relative to its folder

    # ---------------------------------------------------------------- I/O
    @classmethod
    def load(cls, path: str | os.PathLike) -> "Topology":
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise TopologyError(f"no such topology file: {p}") from None
        return cls.loads(text, source=str(p))

    @classmethod
    def loads(cls, text: str, source: str | None = None) -> "Topology":
        try:
            d = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise TopologyError(f"not valid TOML: {e}", source) from None
        return cls.from_dict(d, source=source)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str | None = None) -> "Topology":
        """Parse (structure and types; `validate(cfg)` checks the model-dependent rules)."""
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
        return cls(cluster, model, slots, memory, source)

    def to_dict(self) -> dict[str, Any]:
        c: dict[str, Any] = {"name": self.cluster.name}
        if self.cluster.secret_file:
            c["secret_file"] = self.cluster.secret_file
        c["beacon_port"] = self.cluster.beacon_port
        if self.cluster.beacon_addrs != [BROADCAST]:
            c["beacon_addrs"] = list(self.cluster.beacon_addrs)
        m = {k: getattr(self.model, k) for k in ("preset", "path", "repo", "revision") if getattr(self.model, k)}
        if self.model.formats:
            m["formats"] = dict(self.model.formats)
        out: dict[str, Any] = {"cluster": c, "model": m}
        if self.memory != MemorySpec():
            out["memory"] = {f.name: getattr(self.memory, f.name) for f in fields(MemorySpec)}
        out["slots"] = [s.to_dict() for s in self.slots]
        return out

    def dump(self, path: str | os.PathLike | None = None, *, comment: str | None = None) -> str:
        """The topology as TOML text, after `comment` as "# " lines (written to `path` when given)."""
        head = "".join(f"# {c}".rstrip() + "\n" for c in comment.splitlines()) + "\n" if comment else ""
        text = head + tomli_w.dumps(self.to_dict())
        if path is not None:
            Path(path).write_text(text)
        return text

    # ---------------------------------------------------------------- queries
    @property
    def active(self) -> list[Slot]:
        return [s for s in self.slots if not s.standby]

    @property
    def standby(self) -> list[Slot]:
        return [s for s in self.slots if s.standby]

    def slot(self, slot_id: str) -> Slot:
        for s in self.slots:
            if s.id == slot_id:
                return s
        raise KeyError(f"no slot {slot_id!r} in the topology (slots: {', '.join(s.id for s in self.slots)})")

    def owners(self, layer: int) -> list[Slot]:
        return [s for s in self.active if s.holds(layer)]

    def static_addresses(self) -> dict[str, tuple[str, int]]:
        """slot id -> (host, port) for slots with a fixed address (the fallback when discovery fails)."""
        return {s.id: (s.host, s.port) for s in self.slots if s.host and s.port}

    def resolve(self, path: str | os.PathLike) -> Path:
        """A path written in the topology file: `~` expanded; a relative path is relative to the folder of
        the topology file (to the working directory for a topology not loaded from a file)."""
        p = Path(path).expanduser()
        if not p.is_absolute() and self.source:
            p = Path(self.source).parent / p
        return p

    def secret(self) -> bytes:
        """The cluster secret from secret_file (relative to the topology file); whitespace stripped."""
        where = Path(self.source).parent if self.source else Path(".")
        if not self.cluster.secret_file:
            raise TopologyError(f"[cluster] has no secret_file: add secret_file = \"cluster.key\" and create it with "
                                f"`p2pk3 secret --out {where / 'cluster.key'}`", self.source)
        p = self.resolve(self.cluster.secret_file)
        try:
            data = p.read_bytes().strip()
        except FileNotFoundError:
            raise TopologyError(f"secret file {p} does not exist (create one with `p2pk3 secret --out {p}`)",
                                self.source) from None
        except IsADirectoryError:
            raise TopologyError(f"secret_file {p} is a folder, not a file (point secret_file at the file "
                                f"`p2pk3 secret --out` wrote)", self.source) from None
        except PermissionError:
            raise TopologyError(f"secret file {p} is not readable by this user", self.source) from None
        if len(data) < 16:
            raise TopologyError(f"secret file {p} holds {len(data)} bytes; use at least 16 random bytes "
                                f"(`p2pk3 secret --out {p}` writes 64 hex characters)", self.source)
        return data

    def model_config(self) -> K3Config:
        if self.model.preset:
            return _preset(self.model.preset)
        if self.model.path:
            return K3Config.from_pretrained(self.resolve(self.model.path))
        raise TopologyError("[model] needs preset or path to know the model's shape", self.source)

    # ---------------------------------------------------------------- plans and validation
    def slot_plan(self, slot: Slot | str, cfg: K3Config) -> SlotPlan:
        """What `slot` (a Slot of `slots`, or its id) runs, given the current active slots."""
        s = self.slot(slot) if isinstance(slot, str) else slot
        return slot_plan(cfg, self.active, s)

    def slot_plans(self, cfg: K3Config) -> list[SlotPlan]:
        act = self.active
        return [slot_plan(cfg, act, s) for s in act]

    def check(self, cfg: K3Config, weight_bytes_fn: checks.WeightBytesFn | None = None) -> tuple[list[str], list[str]]:
        """(errors, warnings) against the model config (the rules: checks.py)."""
        return checks.check(self, cfg, weight_bytes_fn)

    def validate(self, cfg: K3Config, weight_bytes_fn: checks.WeightBytesFn | None = None) -> list[str]:
        """Raise TopologyError listing every problem; return the warnings otherwise."""
        errs, warns = self.check(cfg, weight_bytes_fn)
        if errs:
            raise TopologyError(errs, self.source)
        return warns


def generate_secret() -> str:
    """A new cluster secret (64 hex characters) for a secret_file."""
    return secrets.token_hex(32)


# ----------------------------------------------------------------------------- parsing helpers
def _unknown(keys: Iterable[str], known: set[str], where: str) -> list[str]:
    out = []
    for k in keys:
        if k not in known:
            near = difflib.get_close_matches(k, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(sorted(known))})"
            out.append(f"unknown key {k!r} in {where}{hint}")
    return out


def _typed(d: Mapping[str, Any], key: str, types: tuple[type, ...], where: str, errs: list[str],
           default: Any = None) -> Any:
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
        from p2pk3.quant.formats import FormatError, parse_formats
        try:
            if not isinstance(m["formats"], dict):
                raise FormatError(f"formats must be a table like {{ attention = \"mxfp8\" }}, got {m['formats']!r}")
            model.formats = parse_formats(m["formats"])
        except FormatError as e:
            errs.append(f"[model]: {e}")
    if model.path and model.repo:
        errs.append("[model]: give either path or repo, not both")
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
        if (not isinstance(lv, list) or len(lv) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in lv)):
            errs.append(f"{where}: layers must be [first, last] (two integers, inclusive), got {lv!r}")
        else:
            layers = (lv[0], lv[1])
    return Slot(sid if isinstance(sid, str) else f"#{i}", layers, mem, host, port,
                _parse_experts(rs.get("experts", {}), where, errs), standby)


def _parse_experts(ev: Any, where: str, errs: list[str]) -> dict[int, tuple[int, ...]]:
    if not isinstance(ev, dict):
        errs.append(f"{where}: experts must be a table like {{ \"5\" = \"0-447\" }}")
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
