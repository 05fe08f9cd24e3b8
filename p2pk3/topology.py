"""The topology file: which ring slot runs which layers (and which experts of a split layer).

Format, semantics and an example: docs/topology.md. In short (TOML)::

    [cluster]                 name, secret_file (optional), beacon_port, beacon_addrs (optional)
    [model]                   path | repo (+ revision), preset (optional)
    [memory]                  optional sizing of caches/workspace for the memory check
    [[slots]]                 in ring order: id, host/port (optional when discovered), gpu_memory_gb,
                              layers = [first, last] (inclusive, 0-indexed), experts = {"<layer>" = "0-447,500"},
                              standby = false

A MoE layer may be split by experts over CONSECUTIVE active slots: the first of them runs the layer's
attention, each adds the contribution of its experts to the partial latent-MoE sum that travels with
the hop, the last one finishes the layer (shared experts, latent up-projection, residual). Standby slots
(hot spares) hold no layers.
"""
from __future__ import annotations

import difflib
import functools
import math
import os
import re
import secrets
import tomllib
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from p2pk3.model.config import K3Config, preset as _preset

GiB = 1 << 30
DEFAULT_BEACON_PORT = 47900
DEFAULT_BASE_PORT = 47920
BROADCAST = "255.255.255.255"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


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


# ----------------------------------------------------------------------------------------- ranges
def parse_ranges(text: str | Iterable[int], *, what: str = "range") -> tuple[int, ...]:
    """"0-447,500,510-515" -> sorted ids. Raises ValueError on bad syntax, reversed or repeated ids."""
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
                raise ValueError(f"{what}: cannot parse {part!r} in {text!r} (expected e.g. \"0-447,500,510-515\")")
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


# ------------------------------------------------------------------------------------------ specs
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


@dataclass
class MemorySpec:
    """What the memory check reserves on top of the weights (per slot)."""

    sessions: int = 8  # concurrent sequences whose KDA/MLA caches live on the slot
    context: int = 32768  # tokens of MLA cache per session
    prefill_chunk: int = 2048  # tokens per forward (activation workspace, AttnRes bank)
    overhead_gb: float = 1.0  # CUDA context, allocator slack, kernels' scratch (GiB)


@dataclass(eq=False)
class Slot:
    id: str
    layers: tuple[int, int] | None = None
    gpu_memory_gb: float | None = None
    host: str | None = None
    port: int | None = None
    experts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    standby: bool = False
    _topology: Any = field(default=None, repr=False, compare=False)

    @property
    def topology(self) -> "Topology | None":
        return self._topology() if self._topology is not None else None

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

    def stage_plan(self, cfg: K3Config) -> "StagePlan":
        t = self.topology
        if t is not None:
            return t.stage_plan(self, cfg)
        # A free-standing slot: roles follow from where its expert subsets sit (a subset on the last of
        # several layers: it starts that split; on the first: it continues one).
        if self.standby or not self.layers:
            return StagePlan(self.id, None, [], False, False)
        roles: dict[int, tuple[bool, bool]] = {}
        a, b = self.layers
        for l in self.experts:
            if a == b:
                raise ValueError(f"slot {self.id} holds part of layer {l} only; its role in the split needs the "
                                 f"topology (use Topology.stage_plan)")
            roles[l] = (l == b, l == a)  # (attn, continues)
        return _make_plan(self, cfg, None, roles)

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


@dataclass
class LayerPlan:
    """What one slot does for one layer.

    attn:    runs the attention half (AttnRes mix, norm, KDA/MLA, output added to the prefix);
             False when the slot continues a layer whose attention ran on the previous slot
    moe:     the layer has routed experts (False: dense MLP)
    experts: routed experts run here (all of them when the layer is not split)
    finish:  finishes the MLP half: for a split MoE layer the slot that adds the shared experts,
             projects the latent sum back up and adds the layer output to the prefix
    enters_mid_moe / exits_mid_moe: the hop arriving before / leaving after this layer carries the
             partial latent-MoE sum of this layer (docs/protocol.md, forward frames)
    Every slot of a split layer recomputes the MoE input (mlp AttnRes mix, post-attention norm, router,
    latent down-projection) from the prefix and bank it receives: routing costs no bytes on the wire."""

    layer: int
    kind: str  # "kda" | "mla"
    moe: bool
    attn: bool
    experts: tuple[int, ...]
    all_experts: bool
    finish: bool
    enters_mid_moe: bool
    exits_mid_moe: bool

    @property
    def parts(self) -> tuple[str, ...]:
        return ("attn", "mlp") if self.attn else ("mlp",)

    @property
    def split(self) -> bool:
        return self.enters_mid_moe or self.exits_mid_moe


@dataclass
class StagePlan:
    slot: str
    index: int | None  # position among the active slots (None: standby / detached)
    layers: list[LayerPlan]
    embed: bool  # holds embed_tokens and turns token ids into the first hop
    head: bool  # holds the output AttnRes, final norm and lm_head, and samples
    prev_slot: str | None = None
    next_slot: str | None = None

    @property
    def first_layer(self) -> int | None:
        return self.layers[0].layer if self.layers else None

    @property
    def last_layer(self) -> int | None:
        return self.layers[-1].layer if self.layers else None

    @property
    def enters_mid_moe(self) -> bool:
        return bool(self.layers) and self.layers[0].enters_mid_moe

    @property
    def exits_mid_moe(self) -> bool:
        return bool(self.layers) and self.layers[-1].exits_mid_moe

    def bank_rows_in(self, cfg: K3Config) -> int:
        """AttnRes snapshots in the hop this slot receives (0 for the embedding slot: it gets token ids)."""
        if self.embed or not self.layers:
            return 0
        l = self.layers[0].layer
        return cfg.bank_rows_before(l + 1 if self.enters_mid_moe else l)

    def bank_rows_out(self, cfg: K3Config) -> int:
        if self.head or not self.layers:
            return 0
        l = self.layers[-1].layer
        return cfg.bank_rows_before(l + 1)

    def hop_bytes_per_token_out(self, cfg: K3Config, itemsize: int = 2) -> int:
        """Bytes per token of the forward frame this slot sends (prefix + bank + partial latent)."""
        if self.head or not self.layers:
            return 0
        n = (1 + self.bank_rows_out(cfg)) * cfg.hidden_size * itemsize
        if self.exits_mid_moe:
            n += cfg.expert_width * 4  # the partial latent sum travels in fp32 (docs/protocol.md)
        return n

    def describe(self) -> str:
        parts = []
        for lp in self.layers:
            s = f"L{lp.layer}({lp.kind}"
            if not lp.attn:
                s += ", cont."
            if lp.moe and not lp.all_experts:
                s += f", experts {format_ranges(lp.experts)}"
            parts.append(s + ")")
        pre = "embed + " if self.embed else ""
        post = " + head" if self.head else ""
        return f"{self.slot}: {pre}{' '.join(parts)}{post}"


def _make_plan(slot: Slot, cfg: K3Config, index: int | None, roles: Mapping[int, tuple[bool, bool]],
               *, first: bool | None = None, last: bool | None = None, split_last: Mapping[int, bool] | None = None,
               prev_slot: str | None = None, next_slot: str | None = None) -> StagePlan:
    """roles[layer] = (runs_attention, continues_split) for split layers; split_last[layer] = finishes it."""
    lps = []
    a, b = slot.layers
    for l in range(a, b + 1):
        moe = cfg.is_moe_layer(l)
        exps = slot.experts_for(l, cfg)
        if l in roles:
            attn, cont = roles[l]
            fin = split_last[l] if split_last is not None else cont
            lps.append(LayerPlan(l, cfg.layer_types[l], moe, attn, exps, False, fin, cont, not fin))
        else:
            lps.append(LayerPlan(l, cfg.layer_types[l], moe, True, exps, True, True, False, False))
    embed = (a == 0 and lps[0].attn) if first is None else first
    head = (b == cfg.num_hidden_layers - 1 and lps[-1].finish) if last is None else last
    return StagePlan(slot.id, index, lps, embed, head, prev_slot, next_slot)


# ------------------------------------------------------------------------------------ weight sizes
def _nbytes(specs: Mapping[str, Any]) -> int:
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in specs.values())


def slot_tensors(cfg: K3Config, plan: StagePlan) -> dict[str, Any]:
    """The checkpoint tensors (name -> TensorSpec) a slot loads for its stage plan."""
    from p2pk3.model.weights import embed_tensors, head_tensors, layer_tensors

    t: dict[str, Any] = {}
    if plan.embed:
        t.update(embed_tensors(cfg))
    for lp in plan.layers:
        if lp.attn:
            t.update(layer_tensors(cfg, lp.layer, experts=(), parts=("attn",)))
        mlp = layer_tensors(cfg, lp.layer, experts=None if lp.all_experts else lp.experts, parts=("mlp",))
        if not lp.finish:  # shared experts and the latent up-projection run on the finishing slot only
            mlp = {k: v for k, v in mlp.items() if ".shared_experts." not in k and ".routed_expert_up_proj." not in k}
        t.update(mlp)
    if plan.head:
        t.update(head_tensors(cfg))
        if cfg.tie_word_embeddings:
            t.update(embed_tensors(cfg))
    return t


@functools.lru_cache(maxsize=4096)
def _part_bytes(cfg: K3Config, layer: int, part: str, finish: bool) -> int:
    """Bytes of one layer's attention half ("attn"), MLP half without routed experts ("mlp"), or ONE
    routed expert ("expert")."""
    from p2pk3.model.weights import layer_tensors

    if part == "attn":
        return _nbytes(layer_tensors(cfg, layer, experts=(), parts=("attn",)))
    if part == "expert":
        return (_nbytes(layer_tensors(cfg, layer, experts=(0,), parts=("mlp",)))
                - _nbytes(layer_tensors(cfg, layer, experts=(), parts=("mlp",))))
    t = layer_tensors(cfg, layer, experts=(), parts=("mlp",))
    if not finish:
        t = {k: v for k, v in t.items() if ".shared_experts." not in k and ".routed_expert_up_proj." not in k}
    return _nbytes(t)


def weight_bytes(cfg: K3Config, plan: StagePlan) -> int:
    """Bytes of `slot_tensors(cfg, plan)`, computed without listing every expert tensor."""
    from p2pk3.model.weights import embed_tensors, head_tensors

    n = _nbytes(embed_tensors(cfg)) if plan.embed else 0
    for lp in plan.layers:
        if lp.attn:
            n += _part_bytes(cfg, lp.layer, "attn", True)
        n += _part_bytes(cfg, lp.layer, "mlp", lp.finish)
        if lp.moe:
            n += len(lp.experts) * _part_bytes(cfg, lp.layer, "expert", True)
    if plan.head:
        n += _nbytes(head_tensors(cfg))
        if cfg.tie_word_embeddings and not plan.embed:
            n += _nbytes(embed_tensors(cfg))
    return n


def runtime_bytes(cfg: K3Config, plan: StagePlan, memory: MemorySpec | None = None) -> int:
    """Caches and workspace on top of the weights (an estimate, see docs/topology.md)."""
    m = memory or MemorySpec()
    cache = 0
    for lp in plan.layers:
        if not lp.attn:
            continue
        if lp.kind == "kda":
            hk = cfg.kda_num_heads * cfg.kda_head_dim
            cache += m.sessions * (cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4 + 3 * hk * (cfg.kda_conv_size - 1) * 2)
        else:
            cache += m.sessions * m.context * cfg.mla_cache_width * 2
    rows = cfg.max_bank_rows + 1
    work = m.prefill_chunk * cfg.hidden_size * 2 * (2 * rows + 16) if plan.layers else 0
    if plan.head:
        work += m.sessions * cfg.vocab_size * 4 * 2  # fp32 logits of the sampled rows (+ sampling scratch)
    return cache + work + int(m.overhead_gb * GiB)


def estimate_slot_bytes(cfg: K3Config, slot: Slot, memory: MemorySpec | None = None) -> int:
    """Device memory a slot needs: its weights (checkpoint sizes: MXFP4 experts stay packed; the first
    slot adds the embedding, the last the final norm + lm_head) plus caches and workspace."""
    if slot.standby or not slot.layers:
        return 0
    plan = slot.stage_plan(cfg)
    t = slot.topology
    mem = memory or (t.memory if t is not None else None)
    return weight_bytes(cfg, plan) + runtime_bytes(cfg, plan, mem)


# ------------------------------------------------------------------------------------------ topology
_CLUSTER_KEYS = {f.name for f in fields(ClusterSpec)}
_MODEL_KEYS = {f.name for f in fields(ModelSpec)}
_MEMORY_KEYS = {f.name for f in fields(MemorySpec)}
_SLOT_KEYS = {"id", "layers", "gpu_memory_gb", "host", "port", "experts", "standby"}
_TOP_KEYS = {"cluster", "model", "memory", "slots"}


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


@dataclass
class Topology:
    cluster: ClusterSpec
    model: ModelSpec
    slots: list[Slot]
    memory: MemorySpec = field(default_factory=MemorySpec)
    source: str | None = None

    def __post_init__(self) -> None:
        ref = weakref.ref(self)
        for s in self.slots:
            s._topology = ref

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
        cluster = ClusterSpec(name or "", _typed(c, "secret_file", (str,), "[cluster]", errs), bport, list(addrs))

        m = d.get("model", {})
        if not isinstance(m, dict):
            errs.append("[model] must be a table")
            m = {}
        errs += _unknown(m.keys(), _MODEL_KEYS, "[model]")
        model = ModelSpec(**{k: _typed(m, k, (str,), "[model]", errs) for k in _MODEL_KEYS})
        if model.path and model.repo:
            errs.append("[model]: give either path or repo, not both")
        if model.revision and not model.repo:
            errs.append("[model]: revision needs repo")

        mm = d.get("memory", {})
        if not isinstance(mm, dict):
            errs.append("[memory] must be a table")
            mm = {}
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

        raw_slots = d.get("slots")
        if not isinstance(raw_slots, list) or not raw_slots:
            errs.append("no [[slots]]: the ring needs at least one slot")
            raw_slots = []
        slots = []
        for i, rs in enumerate(raw_slots):
            s = _parse_slot(rs, i, errs)
            if s is not None:
                slots.append(s)
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
        out: dict[str, Any] = {"cluster": c, "model": m}
        if self.memory != MemorySpec():
            out["memory"] = {f.name: getattr(self.memory, f.name) for f in fields(MemorySpec)}
        out["slots"] = [s.to_dict() for s in self.slots]
        return out

    def dump(self, path: str | os.PathLike | None = None, *, comment: str | None = None) -> str:
        """The topology as TOML text (written to `path` when given)."""
        text = dumps_toml(self.to_dict(), comment=comment)
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

    def ring_index(self, slot_id: str) -> int:
        for i, s in enumerate(self.active):
            if s.id == slot_id:
                return i
        raise KeyError(f"{slot_id!r} is not an active slot")

    def next_slot(self, slot_id: str) -> Slot | None:
        """The slot the hop goes to after `slot_id` (None after the last: results return to the origin)."""
        a = self.active
        i = self.ring_index(slot_id)
        return a[i + 1] if i + 1 < len(a) else None

    def prev_slot(self, slot_id: str) -> Slot | None:
        a = self.active
        i = self.ring_index(slot_id)
        return a[i - 1] if i > 0 else None

    def owners(self, layer: int) -> list[Slot]:
        return [s for s in self.active if s.holds(layer)]

    def static_addresses(self) -> dict[str, tuple[str, int]]:
        """slot id -> (host, port) for slots with a fixed address (the fallback when discovery fails)."""
        return {s.id: (s.host, s.port) for s in self.slots if s.host and s.port}

    def secret(self) -> bytes:
        """The cluster secret from secret_file (relative to the topology file); whitespace stripped."""
        if not self.cluster.secret_file:
            raise TopologyError("[cluster] has no secret_file", self.source)
        p = Path(self.cluster.secret_file).expanduser()
        if not p.is_absolute() and self.source:
            p = Path(self.source).parent / p
        try:
            data = p.read_bytes().strip()
        except FileNotFoundError:
            raise TopologyError(f"secret file {p} does not exist (create one: p2pk3 secret > {p})", self.source) from None
        if len(data) < 16:
            raise TopologyError(f"secret file {p} holds {len(data)} bytes; use at least 16 random bytes", self.source)
        return data

    def model_config(self) -> K3Config:
        if self.model.preset:
            return _preset(self.model.preset)
        if self.model.path:
            p = Path(self.model.path).expanduser()
            if not p.is_absolute() and self.source:
                p = Path(self.source).parent / p
            return K3Config.from_pretrained(p)
        raise TopologyError("[model] needs preset or path to know the model's shape", self.source)

    # ---------------------------------------------------------------- plans
    def stage_plan(self, slot: Slot | str, cfg: K3Config) -> StagePlan:
        s = self.slot(slot) if isinstance(slot, str) else slot
        if s.standby or not s.layers:
            return StagePlan(s.id, None, [], False, False)
        act = self.active
        idx = next(i for i, x in enumerate(act) if x is s)
        roles: dict[int, tuple[bool, bool]] = {}
        fin: dict[int, bool] = {}
        for l in s.layer_range:
            own = [i for i, x in enumerate(act) if x.holds(l)]
            if len(own) > 1:
                roles[l] = (own[0] == idx, own[0] != idx)
                fin[l] = own[-1] == idx
        last_layer = cfg.num_hidden_layers - 1
        first = s.layers[0] == 0 and (0 not in roles or roles[0][0])
        last = s.layers[1] == last_layer and (last_layer not in fin or fin[last_layer])
        return _make_plan(s, cfg, idx, roles, first=first, last=last, split_last=fin,
                          prev_slot=act[idx - 1].id if idx > 0 else None,
                          next_slot=act[idx + 1].id if idx + 1 < len(act) else None)

    def stage_plans(self, cfg: K3Config) -> list[StagePlan]:
        return [self.stage_plan(s, cfg) for s in self.active]

    # ---------------------------------------------------------------- validation
    def check(self, cfg: K3Config, weight_bytes_fn: Callable[[Slot], int] | None = None) -> tuple[list[str], list[str]]:
        """(errors, warnings) against the model config."""
        errs: list[str] = []
        warns: list[str] = []
        L, E = cfg.num_hidden_layers, cfg.num_experts
        seen: dict[str, int] = {}
        for s in self.slots:
            seen[s.id] = seen.get(s.id, 0) + 1
        for sid, n in seen.items():
            if n > 1:
                errs.append(f"duplicate slot id {sid!r} ({n} slots)")
        addrs: dict[tuple[str, int], str] = {}
        for s in self.slots:
            if s.host and s.port:
                other = addrs.setdefault((s.host, s.port), s.id)
                if other != s.id:
                    errs.append(f"slots {other} and {s.id} both use {s.host}:{s.port}")
        for s in self.standby:
            if s.layers is not None or s.experts:
                errs.append(f"standby slot {s.id} must not hold layers or experts (hot spares take over a slot's work)")
        act = self.active
        if not act:
            errs.append("no active slots: every slot is standby")
            return errs, warns
        structural = False
        for s in act:
            if s.layers is None:
                errs.append(f"slot {s.id} has no layers (set layers = [first, last], or standby = true)")
                structural = True
                continue
            a, b = s.layers
            if a > b:
                errs.append(f"slot {s.id}: layers [{a}, {b}] is reversed")
                structural = True
            elif a < 0 or b >= L:
                errs.append(f"slot {s.id}: layers [{a}, {b}] outside the model's layers 0..{L - 1}")
                structural = True
            if s.gpu_memory_gb is None:
                errs.append(f"slot {s.id} has no gpu_memory_gb")
            for l, ex in sorted(s.experts.items()):
                if not a <= l <= b:
                    errs.append(f"slot {s.id} lists experts for layer {l}, which is outside its layers [{a}, {b}]")
                    structural = True
                elif not cfg.is_moe_layer(l):
                    errs.append(f"slot {s.id} lists experts for layer {l}, which is a dense layer (no routed experts)")
                    structural = True
                bad = [e for e in ex if e >= E]
                if bad:
                    errs.append(f"slot {s.id}: experts {format_ranges(bad)} of layer {l} do not exist "
                                f"(the model has experts 0..{E - 1})")
                    structural = True
                if not ex:
                    errs.append(f"slot {s.id}: empty expert list for layer {l}")
                    structural = True
        if structural:
            return errs, warns

        owners: dict[int, list[int]] = {l: [] for l in range(L)}
        for i, s in enumerate(act):
            for l in s.layer_range:
                owners[l].append(i)
        gaps = [l for l in range(L) if not owners[l]]
        if gaps:
            errs.append(f"{_plural('layer', gaps)} {format_ranges(gaps).replace(',', ', ')} "
                        f"{'is' if len(gaps) == 1 else 'are'} not assigned to any slot")
        # ring order: each active slot starts where the previous one ended (shared split layer) or right after
        reported: set[int] = set()
        for x, y in zip(act, act[1:]):
            xa, xb = x.layers
            ya, yb = y.layers
            ov = list(range(max(xa, ya), min(xb, yb) + 1))
            if len(ov) > 1 or (ov and ov[0] != xb):
                errs.append(f"slots {x.id} {list(x.layers)} and {y.id} {list(y.layers)} overlap on "
                            f"{_plural('layer', ov)} {format_ranges(ov).replace(',', ', ')}")
                reported.update(ov)
            elif ya < xb or (ya > xb + 1 and all(owners[l] for l in range(xb + 1, ya))):
                errs.append(f"slot {y.id} starts at layer {ya} but the previous active slot {x.id} ends at layer {xb}: "
                            f"slots must follow the layer order of the ring")
        for l in range(L):
            own = owners[l]
            if len(own) == 1:
                s = act[own[0]]
                if l in s.experts and len(s.experts[l]) != E:
                    miss = sorted(set(range(E)) - set(s.experts[l]))
                    errs.append(f"{_plural('expert', miss)} {format_ranges(miss)} of layer {l} "
                                f"{'is' if len(miss) == 1 else 'are'} on no slot")
                continue
            if len(own) < 2 or l in reported:
                continue
            names = " and ".join(act[i].id for i in own) if len(own) == 2 else ", ".join(act[i].id for i in own)
            if not cfg.is_moe_layer(l):
                errs.append(f"layer {l} is on slots {names}: overlap (a dense layer cannot be split)")
                continue
            whole = [act[i].id for i in own if l not in act[i].experts]
            if whole:
                errs.append(f"layer {l} is on slots {names}: overlap ({', '.join(whole)} "
                            f"{'holds' if len(whole) == 1 else 'hold'} all its experts; to split a layer, list "
                            f"experts = {{\"{l}\" = \"...\"}} on each of its slots)")
                continue
            if own != list(range(own[0], own[0] + len(own))):
                between = [act[i].id for i in range(own[0], own[-1] + 1) if i not in own]
                errs.append(f"layer {l} is split over slots {names}, which are not consecutive in the ring "
                            f"({', '.join(between)} {'is' if len(between) == 1 else 'are'} between them)")
                continue
            where: dict[int, list[str]] = {}
            for i in own:
                for e in act[i].experts[l]:
                    where.setdefault(e, []).append(act[i].id)
            dup: dict[tuple[str, ...], list[int]] = {}
            for e, ss in where.items():
                if len(ss) > 1:
                    dup.setdefault(tuple(ss), []).append(e)
            for ss, es in dup.items():
                errs.append(f"{_plural('expert', es)} {format_ranges(es)} of layer {l} "
                            f"{'is' if len(es) == 1 else 'are'} on two slots: {' and '.join(ss)}")
            miss = [e for e in range(E) if e not in where]
            if miss:
                errs.append(f"{_plural('expert', miss)} {format_ranges(miss)} of layer {l} "
                            f"{'is' if len(miss) == 1 else 'are'} on no slot (split over {names})")
        if errs:
            return errs, warns

        need: dict[str, int] = {}
        for s in act:
            n = weight_bytes_fn(s) if weight_bytes_fn is not None else estimate_slot_bytes(cfg, s, self.memory)
            need[s.id] = n
            have = (s.gpu_memory_gb or 0) * GiB
            if n > have:
                plan = s.stage_plan(cfg)
                w = weight_bytes(cfg, plan) if weight_bytes_fn is None else n
                errs.append(f"slot {s.id} needs about {n / GiB:.1f} GiB (weights {w / GiB:.1f} GiB + caches and "
                            f"workspace {(n - w) / GiB:.1f} GiB) but has gpu_memory_gb = {s.gpu_memory_gb:g}: "
                            f"give it fewer layers/experts")
        if need and self.standby:
            smallest = min(need.values())
            for s in self.standby:
                if s.gpu_memory_gb is not None and s.gpu_memory_gb * GiB < smallest:
                    warns.append(f"standby slot {s.id} ({s.gpu_memory_gb:g} GiB) cannot take over any active slot "
                                 f"(the smallest needs {smallest / GiB:.1f} GiB)")
        return errs, warns

    def validate(self, cfg: K3Config, weight_bytes_fn: Callable[[Slot], int] | None = None) -> list[str]:
        """Raise TopologyError listing every problem; return the warnings otherwise."""
        errs, warns = self.check(cfg, weight_bytes_fn)
        if errs:
            raise TopologyError(errs, self.source)
        return warns

    def summary(self, cfg: K3Config) -> str:
        lines = [f"cluster {self.cluster.name!r}: {len(self.active)} active slots, {len(self.standby)} standby"]
        for s in self.active:
            n = estimate_slot_bytes(cfg, s, self.memory)
            lines.append(f"  {s.stage_plan(cfg).describe()}  ~{n / GiB:.1f}/{s.gpu_memory_gb:g} GiB")
        for s in self.standby:
            lines.append(f"  {s.id}: standby ({s.gpu_memory_gb} GiB)")
        return "\n".join(lines)


def _plural(word: str, items: list[Any]) -> str:
    return word if len(items) == 1 else word + "s"


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
    experts: dict[int, tuple[int, ...]] = {}
    ev = rs.get("experts", {})
    if not isinstance(ev, dict):
        errs.append(f"{where}: experts must be a table like {{ \"5\" = \"0-447\" }}")
        ev = {}
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
    return Slot(sid if isinstance(sid, str) else f"#{i}", layers, mem, host, port, experts, standby)


# ------------------------------------------------------------------------------------------ builders
def even_split(cfg: K3Config, n_nodes: int, host: str | None = "127.0.0.1", base_port: int = DEFAULT_BASE_PORT, *,
               gpu_memory_gb: float = 24.0, name: str = "local", preset: str | None = None,
               model_path: str | None = None, secret_file: str | None = None,
               beacon_port: int = DEFAULT_BEACON_PORT, n_standby: int = 0, ids: list[str] | None = None) -> Topology:
    """n_nodes slots with (nearly) equal numbers of whole layers, in order; ports base_port + i.
    Raises TopologyError when n_nodes exceeds the number of layers (use `balanced_split`)."""
    L = cfg.num_hidden_layers
    if n_nodes < 1:
        raise TopologyError("need at least one node")
    if n_nodes > L:
        raise TopologyError(f"{n_nodes} nodes but only {L} layers: use balanced_split to split layers by experts")
    ids = ids or [f"s{i}" for i in range(n_nodes + n_standby)]
    q, r = divmod(L, n_nodes)
    slots, a = [], 0
    for i in range(n_nodes):
        n = q + (1 if i < r else 0)
        slots.append(Slot(ids[i], (a, a + n - 1), gpu_memory_gb, host, base_port + i if host else None))
        a += n
    for j in range(n_standby):
        i = n_nodes + j
        slots.append(Slot(ids[i], None, gpu_memory_gb, host, base_port + i if host else None, standby=True))
    return Topology(ClusterSpec(name, secret_file, beacon_port), ModelSpec(path=model_path, preset=preset), slots)


def balanced_split(cfg: K3Config, n_slots: int, *, gpu_memory_gb: float, name: str = "cluster",
                   ids: list[str] | None = None, host: str | None = None, base_port: int | None = None,
                   n_standby: int = 0, standby_ids: list[str] | None = None, preset: str | None = None,
                   model_path: str | None = None, repo: str | None = None, revision: str | None = None,
                   secret_file: str | None = None, beacon_port: int = DEFAULT_BEACON_PORT,
                   memory: MemorySpec | None = None, snap_fraction: float = 0.05) -> Topology:
    """n_slots slots with (nearly) equal weight bytes; MoE layers are split by experts where a cut falls
    inside one (each piece keeps at least one expert); a cut within snap_fraction of a slot's share from a
    layer boundary moves to that boundary. Validate the result for the memory check."""
    from p2pk3.model.weights import embed_tensors, head_tensors, layer_tensors

    L, E = cfg.num_hidden_layers, cfg.num_experts
    # units: (layer, expert or -1 for the layer's non-expert part), with their sizes
    unit_layer: list[int] = []
    unit_exp: list[int] = []
    size: list[int] = []
    for l in range(L):
        if cfg.is_moe_layer(l):
            base = _part_bytes(cfg, l, "attn", True) + _part_bytes(cfg, l, "mlp", True)
            one = _part_bytes(cfg, l, "expert", True)
            unit_layer += [l] * (E + 1)
            unit_exp += [-1] + list(range(E))
            size += [base] + [one] * E
        else:
            unit_layer.append(l)
            unit_exp.append(-1)
            size.append(_nbytes(layer_tensors(cfg, l)))
    size[0] += _nbytes(embed_tensors(cfg))
    size[-1] += _nbytes(head_tensors(cfg))
    cum = [0]
    for x in size:
        cum.append(cum[-1] + x)
    total = cum[-1]
    # allowed cut k (before unit k): a layer start, or inside a MoE layer after its first expert
    allowed = [k for k in range(1, len(size)) if unit_exp[k] == -1 or unit_exp[k] >= 1]
    if len(allowed) < n_slots - 1:
        raise TopologyError(f"cannot cut the model into {n_slots} slots")
    import bisect

    allowed_index = {k: i for i, k in enumerate(allowed)}
    layer_cuts = [k for k in allowed if unit_exp[k] == -1]
    snap = snap_fraction * total / n_slots
    cuts = [0]
    pos = 0  # index into allowed
    for m in range(1, n_slots):
        target = total * m / n_slots
        j = bisect.bisect_left(cum, target)
        # nearest allowed cut to unit j, strictly after the previous cut, leaving room for the rest
        p = bisect.bisect_left(allowed, j, lo=pos)
        cands = [q for q in (p - 1, p) if pos <= q < len(allowed) - (n_slots - 1 - m)]
        if not cands:
            cands = [max(pos, min(p, len(allowed) - (n_slots - m)))]
        q = min(cands, key=lambda q: abs(cum[allowed[q]] - target))
        # prefer a layer boundary when one is close: a split costs a duplicated router/latent projection
        # and a partial latent on the wire
        lb = bisect.bisect_left(layer_cuts, j)
        for r in (lb - 1, lb):
            if 0 <= r < len(layer_cuts):
                qb = allowed_index[layer_cuts[r]]
                if pos <= qb < len(allowed) - (n_slots - 1 - m) and abs(cum[layer_cuts[r]] - target) <= snap:
                    q = qb
                    break
        cuts.append(allowed[q])
        pos = q + 1
    cuts.append(len(size))
    ids = ids or [f"s{i}" for i in range(n_slots)]
    slots = []
    for m in range(n_slots):
        u0, u1 = cuts[m], cuts[m + 1] - 1
        a, b = unit_layer[u0], unit_layer[u1]
        experts: dict[int, tuple[int, ...]] = {}
        for l in {a, b}:
            if not cfg.is_moe_layer(l):
                continue
            es = [unit_exp[k] for k in range(u0, u1 + 1) if unit_layer[k] == l and unit_exp[k] >= 0]
            if len(es) != E:
                experts[l] = tuple(es)
        slots.append(Slot(ids[m], (a, b), gpu_memory_gb, host, (base_port + m) if (host and base_port) else None,
                          experts))
    sids = standby_ids or [f"spare{j}" for j in range(n_standby)]
    for j in range(n_standby):
        slots.append(Slot(sids[j], None, gpu_memory_gb, host,
                          (base_port + n_slots + j) if (host and base_port) else None, standby=True))
    return Topology(ClusterSpec(name, secret_file, beacon_port),
                    ModelSpec(path=model_path, repo=repo, revision=revision, preset=preset), slots,
                    memory or MemorySpec())


def generate_secret() -> str:
    """A new cluster secret (64 hex characters) for a secret_file."""
    return secrets.token_hex(32)


# ------------------------------------------------------------------------------------------ TOML out
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) and not k.isdigit() else _str(k)


def _str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        r = repr(v)
        return r if any(c in r for c in ".en") else r + ".0"
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(str(k))} = {_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dumps_toml(doc: Mapping[str, Any], *, comment: str | None = None) -> str:
    """A small TOML writer: top-level scalars, tables of scalars/arrays/inline tables, arrays of tables."""
    lines: list[str] = []
    if comment:
        lines += [f"# {c}".rstrip() for c in comment.splitlines()]
        lines.append("")
    scalars = {k: v for k, v in doc.items() if not isinstance(v, dict)
               and not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v))}
    for k, v in scalars.items():
        lines.append(f"{_key(k)} = {_value(v)}")
    if scalars:
        lines.append("")
    for k, v in doc.items():
        if k in scalars:
            continue
        if isinstance(v, dict):
            lines.append(f"[{_key(k)}]")
            for kk, vv in v.items():
                lines.append(f"{_key(kk)} = {_value(vv)}")
            lines.append("")
        else:
            for item in v:
                lines.append(f"[[{_key(k)}]]")
                for kk, vv in item.items():
                    lines.append(f"{_key(kk)} = {_value(vv)}")
                lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


__all__ = [
    "TopologyError", "ClusterSpec", "ModelSpec", "MemorySpec", "Slot", "LayerPlan", "StagePlan", "Topology",
    "parse_ranges", "format_ranges", "slot_tensors", "weight_bytes", "runtime_bytes", "estimate_slot_bytes",
    "even_split", "balanced_split", "generate_secret", "dumps_toml", "DEFAULT_BEACON_PORT", "DEFAULT_BASE_PORT",
]
