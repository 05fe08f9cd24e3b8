"""The planner: a model config + cards in ring order -> a topology whose slowest stage is as fast as it can be.

The model is cut into units in layer order: for a dense layer the whole layer; for a MoE layer its base
(attention + norms, router and latent down-projection) and then one unit per routed expert (the last one
also carries the layer's finish part: shared experts + latent up-projection). Each unit has
  memory: its weights (in the chosen formats) + the KDA state / MLA cache of its attention for
          `sessions` x `context`,
  time:   the bytes it reads per generated token at one token per pass (dense weights in full, an expert
          with probability top_k / n_experts, KDA state read + written, the MLA cache read)
and a card i holding units [a, b) needs  mem(a, b) + workspace + CUDA reserve <= capacity_i  and takes
  t_i = read(a, b) / bandwidth_i + stage overhead.
A piece that starts inside a MoE layer also holds (and reads) that layer's router and latent
down-projection again. The planner finds the smallest pace T such that filling the cards in ring order
greedily (each takes the longest run of units that fits its memory and T) covers the model: a
binary search on T over an exact feasibility test (the greedy is optimal for contiguous pieces in a fixed
order, because taking more units never makes the rest harder). At that pace a second search finds the
smallest uniform fill of the cards' memory that still covers the model, so free memory is spread evenly."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from p2pk3.model.config import K3Config
from p2pk3.quant.formats import TENSOR_CLASSES, parse_formats
from p2pk3.topology import ClusterSpec, MemorySpec, ModelSpec, Slot, Topology
from p2pk3.topology.sizing import (
    formats_key,
    kda_state_bytes,
    logits_bytes,
    mla_cache_bytes,
    mla_token_bytes,
    part_items,
    workspace_bytes,
)
from p2pk3.topology.specs import DEFAULT_BEACON_PORT, GiB

from .memory import memory_table, stage_traffic
from .nodes import Card


class PlanError(ValueError):
    pass


def no_bandwidth_hint() -> str:
    from p2pk3.sim.hardware import datasheet

    return (
        f"give each [[nodes]] entry memory_bandwidth_gbs (GB/s) or gpu = a datasheet card "
        f"({', '.join(sorted(datasheet()))}) for a pace in ms"
    )


@dataclass
class Plan:
    topology: Topology
    cards: list[Card]
    tables: dict = field(default_factory=dict)  # slot id -> MemoryTable
    stage_ms: dict = field(default_factory=dict)  # slot id -> predicted ms per token (only when timed)
    formats: dict = field(default_factory=dict)
    stage_bytes: dict = field(default_factory=dict)  # slot id -> bytes the stage reads per generated token
    timed: bool = True  # False: no card's memory bandwidth is known, the plan balances bytes read per token

    @property
    def pace_ms(self) -> float | None:
        """The slowest stage's predicted ms per token; None when no bandwidth is known (nothing to predict)."""
        return max(self.stage_ms.values()) if self.timed else None

    def pace_line(self) -> str:
        if self.timed:
            return (
                f"pace (slowest stage) {self.pace_ms:.3f} ms/token, "
                f"sum of stages {sum(self.stage_ms.values()):.1f} ms/token"
            )
        return (
            f"pace not predicted: no memory bandwidth known ({no_bandwidth_hint()}); balanced by bytes read per "
            f"token, slowest stage {max(self.stage_bytes.values()) / 2**20:.1f} MiB/token"
        )

    def summary(self) -> str:
        t = self.topology
        act = t.active
        col = "stage ms" if self.timed else "MiB/tok"
        lines = [f"{len(act)} active slots + {len(t.standby)} standby; {self.pace_line()}"]
        if self.timed:
            bws = {
                c.kind: f"{c.kind} {c.bandwidth_gbs:g} GB/s ({c.bandwidth_source.split(':')[0]})"
                for c in self.cards
                if c.bandwidth_gbs
            }
            lines.append("memory bandwidth: " + ", ".join(bws.values()))
        lines.append(
            f"{'slot':12s} {'card':10s} {'layers':18s} {'weights':>9s} {'runtime':>9s} {'total':>9s} "
            f"{'of':>7s}  {col:>8s}"
        )
        kinds = {c.id: c.kind for c in self.cards}
        for s in act:
            tb = self.tables[s.id]
            lay = f"{s.layers[0]}-{s.layers[1]}" + (" (split)" if s.experts else "")
            lines.append(
                f"{s.id:12s} {kinds.get(s.id, '?'):10s} {lay:18s} {tb.weight_total / GiB:9.2f} "
                f"{tb.runtime_total / GiB:9.2f} {tb.total / GiB:9.2f} {tb.capacity / GiB:7.1f}  "
                + (f"{self.stage_ms[s.id]:8.3f}" if self.timed else f"{self.stage_bytes[s.id] / 2**20:8.1f}")
            )
        for s in t.standby:
            lines.append(f"{s.id:12s} {kinds.get(s.id, '?'):10s} standby (hot spare, {s.gpu_memory_gb:g} GiB)")
        return "\n".join(lines)


@dataclass
class _Units:
    mem: np.ndarray  # prefix sums (len n+1)
    rd: np.ndarray  # prefix sums of bytes read per token
    layer: list[int]
    exp: list[int]  # -1 for a base / dense unit, else expert index
    cont_mem: dict[int, int]  # layer -> bytes a continuing piece adds (router, latent down-proj, norms)
    cont_rd: dict[int, int]
    ends: list[int]  # allowed piece ends (exclusive), sorted; n is the last
    head_extra: int  # logits memory on the head card (counted in the last unit)


def _sum(parts) -> int:
    return sum(b for _, b in parts)


def _units(cfg: K3Config, memory: MemorySpec, formats: dict[str, str]) -> _Units:
    fk = formats_key(formats)
    L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_token
    mem, rd, lay, exp = [], [], [], []
    cont_mem, cont_rd = {}, {}
    for l in range(L):
        attn = _sum(part_items(cfg, l, "attn", True, fk))
        if cfg.layer_types[l] == "kda":
            cache, traffic = memory.sessions * kda_state_bytes(cfg), 2 * kda_state_bytes(cfg)
        else:
            cache = mla_cache_bytes(cfg, memory.sessions, memory.context)
            traffic = memory.context * mla_token_bytes(cfg)
        if not cfg.is_moe_layer(l):
            b = attn + _sum(part_items(cfg, l, "mlp", True, fk))
            mem.append(b + cache)
            rd.append(b + traffic)
            lay.append(l)
            exp.append(-1)
            continue
        nf = _sum(part_items(cfg, l, "mlp", False, fk))
        fin = _sum(part_items(cfg, l, "mlp", True, fk)) - nf
        one = _sum(part_items(cfg, l, "expert", True, fk))
        cont_mem[l] = cont_rd[l] = nf
        mem.append(attn + nf + cache)
        rd.append(attn + nf + traffic)
        lay.append(l)
        exp.append(-1)
        mem += [one] * E
        rd += [one * k / E] * E
        lay += [l] * E
        exp += list(range(E))
        mem[-1] += fin
        rd[-1] += fin
    emb = _sum(part_items(cfg, 0, "embed", True, fk))
    head = _sum(part_items(cfg, 0, "head", True, fk))
    if cfg.tie_word_embeddings:
        head += emb  # the head slot holds the tied embedding as its lm_head (sizing.weight_items)
    logits = logits_bytes(cfg, memory.sessions)
    mem[0] += emb
    mem[-1] += head + logits
    rd[-1] += head
    n = len(mem)
    ends = [u for u in range(1, n) if exp[u] == -1 or exp[u] >= 1] + [n]
    return _Units(
        np.concatenate([[0], np.cumsum(np.array(mem, dtype=np.float64))]),
        np.concatenate([[0], np.cumsum(np.array(rd, dtype=np.float64))]),
        lay,
        exp,
        cont_mem,
        cont_rd,
        ends,
        logits,
    )


def _corr(U: _Units, a: int) -> tuple[int, int]:
    if U.exp[a] >= 1:
        l = U.layer[a]
        return U.cont_mem[l], U.cont_rd[l]
    return 0, 0


def _greedy(U: _Units, caps: list[float], bws: list[float], const_mem: float, T: float | None) -> list[int] | None:
    """Piece ends (exclusive) per card, or None when the cards cannot cover the model at pace T."""
    n = len(U.mem) - 1
    a, cuts = 0, []
    ncard = len(caps)
    for i in range(ncard):
        rest = ncard - i - 1
        cm, cr = _corr(U, a)
        room = caps[i] - const_mem - cm
        e_mem = int(np.searchsorted(U.mem, U.mem[a] + room, side="right")) - 1
        e = e_mem
        if T is not None:
            e_t = int(np.searchsorted(U.rd, U.rd[a] + (T * bws[i] - cr), side="right")) - 1
            e = min(e, e_t)
        if rest == 0:
            if e < n:
                return None
            cuts.append(n)
            return cuts
        lim = U.ends[len(U.ends) - 1 - rest] if len(U.ends) > rest else 0  # leave a piece for each later card
        e = min(e, lim)
        j = bisect.bisect_right(U.ends, e) - 1
        if j < 0 or U.ends[j] <= a:
            return None
        a = U.ends[j]
        cuts.append(a)
    return None


def _card_inputs(cards: list[Card]) -> tuple[list[float], list[float], bool]:
    caps = [c.gpu_memory_gb * GiB for c in cards]
    known = [c.bandwidth_gbs for c in cards]
    if all(b is None for b in known):
        return caps, [1.0] * len(cards), False  # balance by bytes
    missing = [c.id for c in cards if c.bandwidth_gbs is None]
    if missing:
        raise PlanError(
            f"memory bandwidth unknown for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
            f"while other cards give one: {no_bandwidth_hint()} in NODES.toml"
        )
    return caps, [b * 1e9 for b in known], True


def plan_ring(
    cfg: K3Config,
    cards: list[Card],
    *,
    memory: MemorySpec | None = None,
    formats: dict | None = None,
    standby: int = 0,
    stage_overhead_us: float = 80.0,
    name: str = "cluster",
    preset: str | None = None,
    model_path: str | None = None,
    repo: str | None = None,
    secret_file: str | None = "cluster.key",
    suggest: bool = True,
) -> Plan:
    """Plan a ring over `cards` (ring order). `standby` more cards (the largest, from the end of the list)
    become hot spares besides those marked standby. Raises PlanError naming the shortfall and what would fit."""
    memory = memory or MemorySpec()
    formats = parse_formats(formats)
    cards = list(cards)
    spare_ids = {c.id for c in cards if c.standby}
    cand = [c for c in cards if not c.standby]
    if standby:
        if standby >= len(cand):
            raise PlanError(f"--standby {standby} leaves no active card ({len(cand)} cards are not standby)")
        order = sorted(range(len(cand)), key=lambda i: (-cand[i].gpu_memory_gb, -i))
        spare_ids |= {cand[i].id for i in order[:standby]}
    active = [c for c in cards if c.id not in spare_ids]
    if not active:
        raise PlanError("every card is standby: mark fewer nodes standby = true")
    caps, bws, timed = _card_inputs(active)
    U = _units(cfg, memory, formats)
    const = workspace_bytes(cfg, memory.prefill_chunk) + memory.overhead_gb * GiB
    if len(active) > len(U.ends):
        raise PlanError(
            f"{len(active)} active cards but the model has only {len(U.ends)} pieces: use fewer cards or more standby"
        )
    cuts = _greedy(U, caps, bws, const, None)
    if cuts is None:
        raise PlanError(_refusal(cfg, active, memory, formats, U, caps, const, suggest))
    lo, hi = 0.0, max((U.rd[-1] + max(U.cont_rd.values(), default=0)) / min(bws), 1e-30)
    for _ in range(60):
        mid = (lo + hi) / 2
        if _greedy(U, caps, bws, const, mid) is not None:
            hi = mid
        else:
            lo = mid
        if hi - lo <= hi * 1e-6:
            break
    pace = hi * (1 + 1e-6)
    # second: at that pace, the smallest uniform fill of the cards' memory that still covers the model, so the
    # memory left over (room for more sessions) is spread over every card instead of the last ones
    flo, fhi = 0.0, 1.0
    for _ in range(40):
        f = (flo + fhi) / 2
        if _greedy(U, [const + f * (c - const) for c in caps], bws, const, pace) is not None:
            fhi = f
        else:
            flo = f
    cuts = _greedy(U, [const + fhi * (c - const) for c in caps], bws, const, pace)
    slots = _slots(cfg, U, active, cuts)
    for c in cards:
        if c.id in spare_ids:
            slots.append(Slot(c.id, None, c.gpu_memory_gb, c.host, c.port, standby=True))
    topo = Topology(
        ClusterSpec(name, secret_file),
        ModelSpec(path=model_path, repo=repo, preset=preset, formats=dict(formats)),
        slots,
        MemorySpec(
            sessions=memory.sessions,
            context=memory.context,
            prefill_chunk=memory.prefill_chunk,
            overhead_gb=memory.overhead_gb,
            given=True,
        ),
    )  # nodes size their caches by it
    plan = Plan(topo, cards, formats=formats, timed=timed)
    bw_of = {c.id: b for c, b in zip(active, bws)}
    for s in topo.active:
        sp = topo.slot_plan(s, cfg)
        plan.tables[s.id] = memory_table(cfg, sp, topo.memory, s.gpu_memory_gb, formats)
        tr = stage_traffic(cfg, sp, formats)
        rd = (
            sum(tr.dense.values())
            + sum(h * one * kk / e for h, one, e, kk in tr.experts)
            + tr.kda_state
            + tr.mla_per_ctx_token * memory.context
        )
        plan.stage_bytes[s.id] = rd
        if timed:
            plan.stage_ms[s.id] = (rd / bw_of[s.id] + stage_overhead_us * 1e-6) * 1e3
    for s in topo.active:  # the exact table must agree with the planner's accounting
        tb = plan.tables[s.id]
        if tb.total > tb.capacity:
            raise PlanError(f"internal: slot {s.id} planned at {tb.total / GiB:.2f} GiB > {tb.capacity / GiB:.2f}")
    return plan


def balanced_split(
    cfg: K3Config,
    n_slots: int,
    *,
    gpu_memory_gb: float,
    name: str = "cluster",
    ids: list[str] | None = None,
    host: str | None = None,
    base_port: int | None = None,
    n_standby: int = 0,
    standby_ids: list[str] | None = None,
    preset: str | None = None,
    model_path: str | None = None,
    repo: str | None = None,
    revision: str | None = None,
    secret_file: str | None = None,
    beacon_port: int = DEFAULT_BEACON_PORT,
    memory: MemorySpec | None = None,
    formats: dict | str | None = None,
) -> Topology:
    """`n_slots` equal slots of `gpu_memory_gb` (+ `n_standby` spares), cut by `plan_ring` with no bandwidth
    known: balanced by the bytes each reads per token, MoE layers split by experts where a cut falls inside
    one, the memory left over spread evenly (`p2pk3 topology init --split experts`). Slot i gets port
    base_port + i when `host` and `base_port` are given. Raises PlanError when the slots cannot hold the model."""
    if n_slots < 1:
        raise PlanError(f"need at least one slot, got {n_slots}")
    ids = ids or [f"s{i}" for i in range(n_slots)]
    sids = standby_ids or [f"spare{j}" for j in range(n_standby)]
    addr = host is not None and base_port is not None
    cards = [
        Card(
            sid,
            "slot",
            gpu_memory_gb,
            host=host if addr else None,
            port=base_port + i if addr else None,
            standby=i >= n_slots,
        )
        for i, sid in enumerate([*ids[:n_slots], *sids[:n_standby]])
    ]
    topo = plan_ring(
        cfg,
        cards,
        memory=memory,
        formats=formats,
        name=name,
        preset=preset,
        model_path=model_path,
        repo=repo,
        secret_file=secret_file,
    ).topology
    topo.model.revision = revision
    topo.cluster.beacon_port = beacon_port
    return topo


def _slots(cfg: K3Config, U: _Units, active: list[Card], cuts: list[int]) -> list[Slot]:
    E = cfg.num_experts
    slots, a = [], 0
    for c, e in zip(active, cuts):
        l0, l1 = U.layer[a], U.layer[e - 1]
        experts = {}
        for l in sorted({l0, l1}):
            if not cfg.is_moe_layer(l):
                continue
            lo = U.exp[a] if (l == l0 and U.exp[a] >= 0) else 0
            hi = U.exp[e - 1] if l == l1 else E - 1
            if l == l1 and U.exp[e - 1] < 0:  # ends on a base unit: impossible (ends are allowed cuts)
                hi = -1
            if lo != 0 or hi != E - 1:
                experts[l] = tuple(range(lo, hi + 1))
        slots.append(Slot(c.id, (l0, l1), c.gpu_memory_gb, c.host, c.port, experts))
        a = e
    return slots


def _fits(cfg, cards, memory, formats) -> bool:
    try:
        caps, _, _ = _card_inputs(cards)
    except PlanError:
        caps = [c.gpu_memory_gb * GiB for c in cards]
    U = _units(cfg, memory, formats)
    const = workspace_bytes(cfg, memory.prefill_chunk) + memory.overhead_gb * GiB
    return len(cards) <= len(U.ends) and _greedy(U, caps, [1.0] * len(caps), const, None) is not None


def _refusal(cfg, active, memory, formats, U, caps, const, suggest: bool) -> str:
    need = U.mem[-1] + const * len(active)  # every unit once + each card's workspace and reserve
    have = sum(caps)
    short = need - have
    biggest = max(np.diff(U.mem))
    if short > 0:
        head = (
            f"the model does not fit: it needs about {need / GiB:.1f} GiB (weights, caches for "
            f"{memory.sessions} sessions x {memory.context} tokens, workspace, CUDA reserve) but the "
            f"{len(active)} active cards have {have / GiB:.1f} GiB: short by {short / GiB:.1f} GiB"
        )
    else:
        head = (
            f"the model does not fit on these cards even though the total memory would ({need / GiB:.1f} of "
            f"{have / GiB:.1f} GiB): the largest indivisible piece needs {(biggest + const) / GiB:.1f} GiB with "
            f"workspace, or the pieces cannot be packed in ring order"
        )
    if not suggest:
        return head
    opts = []
    m = memory
    if m.sessions > 1:
        lo, hi = 0, m.sessions - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fits(
                cfg,
                active,
                MemorySpec(sessions=mid, context=m.context, prefill_chunk=m.prefill_chunk, overhead_gb=m.overhead_gb),
                formats,
            ):
                lo = mid
            else:
                hi = mid - 1
        if lo >= 1:
            opts.append(f"--sessions {lo}")
    if m.context > 1024:
        lo, hi = 0, m.context // 1024 - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fits(
                cfg,
                active,
                MemorySpec(
                    sessions=m.sessions, context=mid * 1024, prefill_chunk=m.prefill_chunk, overhead_gb=m.overhead_gb
                ),
                formats,
            ):
                lo = mid
            else:
                hi = mid - 1
        if lo >= 1:
            opts.append(f"--context {lo * 1024}")
    for f in ("mxfp8", "mxfp4"):
        if all(formats.get(c) == f for c in TENSOR_CLASSES):
            continue
        if _fits(cfg, active, m, parse_formats(f"non-experts={f}")):
            opts.append(f"--formats non-experts={f}")
            break
    if m.overhead_gb > 0:  # the largest CUDA reserve (in 0.05 GiB steps) at which it fits
        lo, hi = -1, int(m.overhead_gb / 0.05 + 1e-9) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fits(
                cfg,
                active,
                MemorySpec(
                    sessions=m.sessions, context=m.context, prefill_chunk=m.prefill_chunk, overhead_gb=mid * 0.05
                ),
                formats,
            ):
                lo = mid
            else:
                hi = mid - 1
        if lo >= 0:
            opts.append(f"--overhead-gb {lo * 0.05:.2f} (the CUDA reserve per card, now {m.overhead_gb:g} GiB)")
    big = max(active, key=lambda c: c.gpu_memory_gb)
    for extra in range(1, 4 * len(active) + 64):
        more = active + [
            Card(f"{big.kind}-extra{j}", big.kind, big.gpu_memory_gb, big.bandwidth_gbs) for j in range(extra)
        ]
        if _fits(cfg, more, m, formats):
            opts.append(f"{extra} more card{'s' if extra > 1 else ''} of kind {big.kind!r} ({big.gpu_memory_gb:g} GiB)")
            break
    if biggest + const > max(caps):
        l = U.layer[int(np.argmax(np.diff(U.mem)))]
        work = workspace_bytes(cfg, memory.prefill_chunk)
        head += (
            f"; layer {l}'s largest indivisible piece needs {(biggest + const) / GiB:.2f} GiB (its attention "
            f"and caches {biggest / GiB:.2f} + prefill workspace {work / GiB:.2f} + CUDA reserve "
            f"{memory.overhead_gb:.2f}, --overhead-gb), more than the largest card ({max(caps) / GiB:.2f} GiB), "
            f"so more cards cannot help"
        )
    if not opts:
        return head + "; nothing simple makes it fit (larger cards, fewer sessions or a shorter context)"
    return head + ". It would fit with any one of: " + "; ".join(opts)
