"""The tables of a topology file as dataclasses ([cluster], [model], [memory], one [[slots]] entry), the
error type and the defaults. The `Topology` that holds them is in format.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pk3.model.config import K3Config

from .ranges import format_ranges

GiB = 1 << 30
DEFAULT_BEACON_PORT = 47900
DEFAULT_BASE_PORT = 47920
BROADCAST = "255.255.255.255"


class TopologyError(ValueError):
    """An invalid topology. `errors` lists every problem found (the message joins them)."""

    def __init__(self, errors: list[str] | str, source: str | None = None):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        self.source = source
        head = f"{source}: " if source else ""
        if len(self.errors) == 1:
            msg = head + self.errors[0]
        else:
            msg = head + f"{len(self.errors)} problems:\n" + "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(msg)


@dataclass
class ClusterSpec:
    name: str
    secret_file: str | None = None
    beacon_port: int = DEFAULT_BEACON_PORT
    beacon_addrs: list[str] = field(default_factory=lambda: [BROADCAST])


@dataclass
class ModelSpec:
    path: str | None = None
    repo: str | None = None
    revision: str | None = None
    preset: str | None = None
    # weight format per tensor class, e.g. {"attention": "mxfp8", "shared_experts": "mxfp4"}; classes not named
    # stay BF16 as shipped (p2pk3.quant.formats: TENSOR_CLASSES, FORMATS)
    formats: dict[str, str] = field(default_factory=dict)


@dataclass
class MemorySpec:
    """What the memory check reserves on top of the weights (per slot)."""

    sessions: int = 8  # concurrent sequences whose KDA/MLA caches live on the slot
    context: int = 32768  # tokens of MLA cache per session
    prefill_chunk: int = 2048  # tokens per forward (activation workspace, AttnRes bank)
    overhead_gb: float = 1.0  # CUDA context, allocator slack, kernels' scratch (GiB)
    # whether the file has a [memory] table (not written back): only then do nodes size their caches by it
    given: bool = field(default=False, compare=False)


@dataclass(eq=False)
class Slot:
    """One [[slots]] entry. A slot knows nothing of the ring it is in: its plan comes from the topology's
    current slot list (`Topology.slot_plan`)."""

    id: str
    layers: tuple[int, int] | None = None
    gpu_memory_gb: float | None = None
    host: str | None = None
    port: int | None = None
    experts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    standby: bool = False

    @property
    def layer_range(self) -> range:
        return range(self.layers[0], self.layers[1] + 1) if self.layers else range(0)

    def holds(self, layer: int) -> bool:
        return layer in self.layer_range

    def experts_for(self, layer: int, cfg: K3Config) -> tuple[int, ...]:
        """The routed experts of `layer` on this slot (all of them unless listed; () for dense layers)."""
        if not cfg.is_moe_layer(layer):
            return ()
        return self.experts.get(layer, tuple(range(cfg.num_experts)))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id}
        if self.host is not None:
            d["host"] = self.host
        if self.port is not None:
            d["port"] = self.port
        if self.gpu_memory_gb is not None:
            d["gpu_memory_gb"] = self.gpu_memory_gb
        if self.standby:
            d["standby"] = True
        if self.layers is not None:
            d["layers"] = list(self.layers)
        if self.experts:
            d["experts"] = {str(l): format_ranges(e) for l, e in sorted(self.experts.items())}
        return d
