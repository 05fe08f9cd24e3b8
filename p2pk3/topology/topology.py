"""`Topology`: a parsed topology file (the tables of specs.py), its queries, and the entry points to a
slot's plan (plans.py) and to validation (checks.py). Reading and writing the TOML is format.py's job."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from p2pk3.model.config import K3Config, preset as _preset

from . import format as toml
from .checks import WeightBytesFn, check
from .plans import SlotPlan, slot_plan
from .specs import ClusterSpec, MemorySpec, ModelSpec, Slot, TopologyError


@dataclass
class Topology:
    cluster: ClusterSpec
    model: ModelSpec
    slots: list[Slot]
    memory: MemorySpec = field(default_factory=MemorySpec)
    source: str | None = None  # the file it was loaded from: relative paths in it are relative to its folder

    # ---------------------------------------------------------------- I/O (the TOML: format.py)
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
        return cls.from_dict(toml.decode(text, source), source=source)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str | None = None) -> "Topology":
        """Parse (structure and types; `validate(cfg)` checks the model-dependent rules)."""
        return cls(*toml.parse_tables(d, source), source=source)

    def to_dict(self) -> dict[str, Any]:
        return toml.tables(self.cluster, self.model, self.slots, self.memory)

    def dump(self, path: str | os.PathLike | None = None, *, comment: str | None = None) -> str:
        """The topology as TOML text, after `comment` as "# " lines (written to `path` when given)."""
        text = toml.encode(self.to_dict(), comment)
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
            raise TopologyError(
                f'[cluster] has no secret_file: add secret_file = "cluster.key" and create it with '
                f"`p2pk3 secret --out {where / 'cluster.key'}`",
                self.source,
            )
        p = self.resolve(self.cluster.secret_file)
        try:
            data = p.read_bytes().strip()
        except FileNotFoundError:
            raise TopologyError(
                f"secret file {p} does not exist (create one with `p2pk3 secret --out {p}`)", self.source
            ) from None
        except IsADirectoryError:
            raise TopologyError(
                f"secret_file {p} is a folder, not a file (point secret_file at the file `p2pk3 secret --out` wrote)",
                self.source,
            ) from None
        except PermissionError:
            raise TopologyError(f"secret file {p} is not readable by this user", self.source) from None
        if len(data) < 16:
            raise TopologyError(
                f"secret file {p} holds {len(data)} bytes; use at least 16 random bytes "
                f"(`p2pk3 secret --out {p}` writes 64 hex characters)",
                self.source,
            )
        return data

    def secret_problem(self) -> str | None:
        """Why the nodes of this topology would refuse to start for want of a secret (None: it is usable)."""
        try:
            self.secret()
        except TopologyError as e:
            return "; ".join(e.errors) + " (every node refuses to start without it)"
        return None

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

    def check(self, cfg: K3Config, weight_bytes_fn: WeightBytesFn | None = None) -> tuple[list[str], list[str]]:
        """(errors, warnings) against the model config (the rules: checks.py)."""
        return check(self, cfg, weight_bytes_fn)

    def validate(self, cfg: K3Config, weight_bytes_fn: WeightBytesFn | None = None) -> list[str]:
        """Raise TopologyError listing every problem; return the warnings otherwise."""
        errs, warns = self.check(cfg, weight_bytes_fn)
        if errs:
            raise TopologyError(errs, self.source)
        return warns


def generate_secret() -> str:
    """A new cluster secret (64 hex characters) for a secret_file."""
    return secrets.token_hex(32)
