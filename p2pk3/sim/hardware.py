"""Hardware profiles for the simulator: one TOML file holds every assumption and its source
(p2pk3/sim/profiles/rtx5090.toml is the default; tools/calibrate_host.py writes a "this host" one)."""

from __future__ import annotations

import copy
import functools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILES = Path(__file__).resolve().parent / "profiles"
DEFAULT = PROFILES / "rtx5090.toml"
ACT_BYTES = {"bf16": 2.0, "fp8": 1 + 1 / 32}


class ProfileError(ValueError):
    pass


@dataclass
class Profile:
    name: str
    raw: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)
    path: str | None = None

    def get(self, dotted: str, default: Any = None) -> Any:
        d: Any = self.raw
        for k in dotted.split("."):
            if not isinstance(d, dict) or k not in d:
                return default
            d = d[k]
        return d

    def need(self, dotted: str) -> Any:
        v = self.get(dotted)
        if v is None:
            raise ProfileError(f"{self.path or self.name}: missing {dotted} (see {DEFAULT} for every key)")
        return v

    @property
    def gpu(self) -> dict[str, Any]:
        name = self.need("card.gpu")
        g = self.get(f"gpus.{name}")
        if g is None:
            raise ProfileError(f"{self.path}: card.gpu = {name!r} has no [gpus.{name}] table")
        return g

    @property
    def bandwidth(self) -> float:  # bytes/s
        return float(self.gpu["memory_bandwidth_gbs"]) * 1e9

    def eff(self, fmt: str) -> float:
        key = {"fp32": "state", "uint8": "mxfp4"}.get(fmt, fmt)
        return float(self.get(f"efficiency.{key}", self.need("efficiency.bf16")))

    def tflops(self, fmt: str) -> float:
        t = self.gpu.get("tflops", {})
        return float(t.get(fmt, t.get("bf16", 1e9))) * 1e12

    @property
    def measured(self) -> dict[str, Any] | None:
        return self.get("measured")

    def with_overrides(self, **dotted: Any) -> "Profile":
        raw = copy.deepcopy(self.raw)
        for k, v in dotted.items():
            d = raw
            *head, last = k.split(".")
            for h in head:
                d = d.setdefault(h, {})
            d[last] = v
        return Profile(self.name, raw, self.sources, self.path)

    def source(self, key: str) -> str:
        return self.sources.get(key, "")


def load_profile(path: str | Path | None = None) -> Profile:
    p = Path(path) if path else DEFAULT
    if not p.is_file():
        raise ProfileError(
            f"{p}: no such hardware profile (the default is {DEFAULT}; "
            f"`python tools/calibrate_host.py` writes one for this host)"
        )
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{p}: not valid TOML: {e}") from None
    base = raw.get("inherit")
    if base:  # a profile may start from another one and change a few keys
        parent = load_profile((p.parent / base) if not Path(base).is_absolute() else base)
        merged = copy.deepcopy(parent.raw)
        _merge(merged, raw)
        srcs = {**parent.sources, **raw.get("sources", {})}
        raw = merged
    else:
        srcs = dict(raw.get("sources", {}))
    prof = Profile(str(raw.get("name", p.stem)), raw, srcs, str(p))
    prof.need("card.gpu")
    return prof


def _merge(a: dict, b: dict) -> None:
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            _merge(a[k], v)
        else:
            a[k] = v


@functools.lru_cache(maxsize=1)
def datasheet() -> dict[str, dict[str, Any]]:
    """Card kinds with their datasheet figures (the [gpus.*] tables of the default profile)."""
    return tomllib.loads(DEFAULT.read_text())["gpus"]
