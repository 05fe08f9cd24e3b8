"""A daemon's prefix cache, set up: the budgets (`--prefix-cache-gb`, `--host-cache-gb`, or defaults from
the free memory), the stage's caches with the cache's blocks in the MLA pool, and the reports of what
the stage can resume at, on their way to the entry (p2pk3/model/prefix_cache.py holds the cache itself,
p2pk3/node/prefix_match.py the entry's side)."""

from __future__ import annotations

import hashlib
import json

from p2pk3.model.cache_sizes import kda_session_bytes, mla_blocks
from p2pk3.model.prefix_cache import PrefixCache, stage_namespace
from p2pk3.transport.messages.ring import MAX_REPORT, PrefixReport

from .prefix_match import PrefixMatcher

GB = 1 << 30
CPU_DEFAULT_SHARE, CPU_DEFAULT_CAP = 0.10, 4 * GB  # of the host's available memory, on a CPU-only host
CUDA_DEFAULT_SHARE = 0.25  # of the card's free memory once the weights are loaded
HOST_DEFAULT_SHARE, HOST_DEFAULT_CAP = 0.25, 64 * GB  # host tier beside a GPU


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def budgets(prefix_gb: float | None, host_gb: float | None, device: str, reserve: int = 0) -> tuple[int, int]:
    """(device tier, host tier) bytes: the options where given (0 = off), else the defaults: on a GPU a
    quarter of its free memory once `reserve` more bytes (the sessions' caches, not allocated yet) are
    taken, and a quarter of the available RAM (at most 64 GiB) for the host tier; on a CPU-only host a
    tenth of the available RAM (at most 4 GiB) and no second tier."""
    cuda = str(device).startswith("cuda")
    if prefix_gb is not None:
        dev = int(prefix_gb * GB)
    elif cuda:
        import torch

        dev = int(CUDA_DEFAULT_SHARE * max(0, torch.cuda.mem_get_info(torch.device(device))[0] - reserve))
    else:
        dev = int(min(CPU_DEFAULT_SHARE * available_ram(), CPU_DEFAULT_CAP))
    if host_gb is not None:
        host = int(host_gb * GB)
    else:
        host = int(min(HOST_DEFAULT_SHARE * available_ram(), HOST_DEFAULT_CAP)) if cuda else 0
    if dev < 0 or host < 0:
        raise ValueError(f"--prefix-cache-gb and --host-cache-gb must be >= 0 (got {prefix_gb}, {host_gb})")
    return dev, (host if dev > 0 else 0)


def model_id(cfg, formats) -> str:
    """Names the model in the cache keys: its configuration and weight formats."""
    blob = json.dumps([repr(cfg), sorted(dict(formats or {}).items())], default=str)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def make_caches(stage, opts, cfg, formats):
    """(StageCache, PrefixCache or None) for a loaded stage: the MLA pool grows by the blocks the device
    budget buys (at most what the budget would be all blocks)."""
    B = opts.prefix_block
    kda, mla = stage.cache_layers()
    item = stage.act_dtype.itemsize
    sessions = opts.max_sessions * len(kda) * kda_session_bytes(
        cfg.kda_num_heads, cfg.kda_head_dim, 3 * cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_conv_size
    ) + len(mla) * mla_blocks(opts.cache_tokens, opts.max_sessions, B) * B * cfg.mla_cache_width * item
    dev, host = budgets(opts.prefix_cache_gb, opts.host_cache_gb, opts.device, reserve=sessions)
    if dev <= 0:
        return stage.new_cache(opts.max_sessions, opts.cache_tokens, B), None
    block_bytes = len(mla) * B * cfg.mla_cache_width * item
    extra = dev // block_bytes if block_bytes else 0
    cache = stage.new_cache(opts.max_sessions, opts.cache_tokens, B, prefix_blocks=extra)
    p = stage.plan
    layers = ",".join(f"{i}{''.join(x[0] for x in p.parts_of(i))}" for i in p.layers)
    ns = stage_namespace(model_id(cfg, formats), str(sorted(dict(formats or {}).items())), layers, str(stage.act_dtype), B)
    return cache, PrefixCache(cache, budget=dev, host_budget=host, namespace=ns)


def reports(slot: str, holder: str, added, evicted, *, reset: bool = False, stateless: bool = False):
    """The PrefixReports of a change, cut to the frame's limit."""
    added, evicted = list(added), list(evicted)
    out = [PrefixReport(slot, holder, added[:MAX_REPORT], evicted[:MAX_REPORT], reset, stateless)]
    a, e = added[MAX_REPORT:], evicted[MAX_REPORT:]
    while a or e:
        out.append(PrefixReport(slot, holder, a[:MAX_REPORT], e[:MAX_REPORT], False, stateless))
        a, e = a[MAX_REPORT:], e[MAX_REPORT:]
    return out


def make_matcher(topo, opts, cfg) -> PrefixMatcher:
    """The entry's side: the route is the topology's active slots; keys rooted in the model and B."""
    return PrefixMatcher(
        [s.id for s in topo.active],
        block=opts.prefix_block,
        snapshot_every=opts.snapshot_every,
        model=model_id(cfg, topo.model.formats),
    )


def deliver(matcher: PrefixMatcher | None, r: PrefixReport) -> None:
    """A report into the entry's matcher (none: this entry does not use the cache)."""
    if matcher is not None:
        matcher.on_report(r.slot, r.holder, r.added, r.evicted, reset=r.reset, stateless=r.stateless)


def prefix_status(st: dict, runner, entry) -> None:
    """The status fields of the prefix cache: this stage's (`prefix`, its bytes in `memory`) and the
    entry's hits and misses (`prefix_entry`)."""
    if runner is not None and runner.prefix is not None:
        st["prefix"] = runner.prefix.status()
        st["memory"]["prefix_cache"] = runner.prefix.device_bytes
        st["memory"]["host_cache"] = runner.prefix.host_bytes
    if entry is not None and entry.prefixes is not None:
        st["prefix_entry"] = entry.prefixes.status()
