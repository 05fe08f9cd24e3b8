"""Which files of a checkpoint a set of slots needs, and which slots of a topology run on this machine.

* `needed_shards(cfg, weight_map, plans)`: the shard files holding the tensors the plans load (the names of
  `p2pk3.topology.slot_tensors`, i.e. `p2pk3.model.weights`), matched to the index's `weight_map` the way the
  loader matches them (`language_model.` prefix stripped, vision tower skipped).
* `SMALL_FILES` / `is_small_file`: config, generation config, tokenizer and chat-template files: always fetched.
* `local_slots(topo)`: the slots whose `host` is this machine (loopback, or an address this host can bind).
"""

from __future__ import annotations

import fnmatch
import ipaddress
import json
import socket
from pathlib import Path
from typing import Iterable, Mapping

from p2pk3.checkpoint.loader import INDEX_FILE, SINGLE_FILE, canonical_name, is_skipped_name
from p2pk3.model.config import K3Config
from p2pk3.topology import Topology, slot_tensors

from .manifest import IntegrityError

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_SMALL_PATTERNS = ("tokenizer*.json", "*.tiktoken", "tiktoken*.model", "chat_template*")


def is_small_file(name: str) -> bool:
    """Config / tokenizer / chat template files (top level of the repo)."""
    if "/" in name:
        return False
    return name in SMALL_FILES or any(fnmatch.fnmatch(name, p) for p in _SMALL_PATTERNS)


def read_weight_map(index_path: Path) -> dict[str, str]:
    try:
        raw = json.loads(Path(index_path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{index_path}: cannot read the checkpoint index ({e})") from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise IntegrityError(f"{index_path}: no 'weight_map' in the checkpoint index")
    for name, fn in wm.items():
        if not isinstance(fn, str) or not fn or Path(fn).name != fn or fn in (".", ".."):
            raise IntegrityError(f"{index_path}: tensor {name!r} maps to an invalid shard file name {fn!r}")
    return wm


def needed_shards(
    cfg: K3Config, weight_map: Mapping[str, str], plans: Iterable, *, where: str = INDEX_FILE
) -> dict[str, set[str]]:
    """shard file -> ids of the slots (of `plans`) that read tensors from it."""
    canon: dict[str, str] = {}
    for stored, fn in weight_map.items():
        if not is_skipped_name(stored):
            canon[canonical_name(stored)] = fn
    out: dict[str, set[str]] = {}
    for plan in plans:
        names = slot_tensors(cfg, plan)
        missing = [n for n in names if n not in canon]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise IntegrityError(
                f"{where}: tensor {missing[0]!r} that slot {plan.slot} needs is in no shard "
                f"(missing: {missing[:3]}{more}): the checkpoint does not fit the model config"
            )
        for n in names:
            out.setdefault(canon[n], set()).add(plan.slot)
    return out


def slot_files(model_dir: str | Path, cfg: K3Config, plan) -> list[str]:
    """The checkpoint files one slot reads from `model_dir` (shards; `model.safetensors` for one file)."""
    d = Path(model_dir)
    if not plan.layers and not plan.embed and not plan.head:
        return []
    if (d / INDEX_FILE).is_file():
        return sorted(needed_shards(cfg, read_weight_map(d / INDEX_FILE), [plan], where=str(d / INDEX_FILE)))
    if (d / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise IntegrityError(f"{d}: neither {INDEX_FILE} nor {SINGLE_FILE} found (run `p2pk3 download` for this slot)")


# ------------------------------------------------------------------------------------------ hosts
def is_local_host(host: str | None) -> bool:
    """True when `host` names this machine: a loopback address or name, this host's name, or an address
    that a socket here can bind (every address of every interface)."""
    if not host:
        return False
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for fam, _, _, _, addr in infos:
        ip = ipaddress.ip_address(addr[0].split("%")[0])
        if ip.is_loopback:
            return True
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def local_slots(topo: Topology) -> list:
    return [s for s in topo.slots if is_local_host(s.host)]
