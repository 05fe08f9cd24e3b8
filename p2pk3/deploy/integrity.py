"""The check before a model's shards are loaded: every shard read against the model directory's manifest
(manifest.check_files: size always, SHA-256 on first use or after a change, else the cached (size, mtime)
verdict; the embedded models' shipped manifests are hashed at every load). A node checks its slot's shards
(`check_slot`), the in-process engine every shard of the checkpoint (`check_checkpoint`). A directory
without a manifest (a model copied in by hand) is loaded as it is: the loader's own checks still apply,
and `p2pk3 manifest DIR` records one."""

from __future__ import annotations

import logging
from pathlib import Path

from p2pk3.checkpoint.loader import INDEX_FILE, SINGLE_FILE

from .files import read_weight_map, slot_files
from .manifest import CheckReport, IntegrityError, Manifest, check_files

log = logging.getLogger("p2pk3.deploy")


def _no_manifest(model_dir) -> None:
    log.info(
        "%s has no p2pk3-manifest.json: shards not checked (`p2pk3 manifest %s` records one)", model_dir, model_dir
    )


def check_slot(model_dir: str | Path, cfg, plan) -> CheckReport | None:
    """Raise IntegrityError (naming the file and what is wrong) unless every shard of `plan` is intact."""
    m = Manifest.load(model_dir)
    if m is None:
        _no_manifest(model_dir)
        return None
    names = slot_files(model_dir, cfg, plan)
    rep = check_files(model_dir, names, manifest=m)
    log.info(
        "slot %s: %d shard(s) verified against %s in %.3f s (%d hashed, %d unchanged since their last check)",
        plan.slot,
        len(names),
        m.path,
        rep.seconds,
        len(rep.hashed),
        len(rep.cached),
    )
    return rep


def check_checkpoint(model_dir: str | Path) -> CheckReport | None:
    """Every shard of the checkpoint in `model_dir` against its manifest (IntegrityError naming the file)."""
    d = Path(model_dir)
    m = Manifest.load(d)
    if m is None:
        _no_manifest(d)
        return None
    if (d / INDEX_FILE).is_file():
        names = sorted(set(read_weight_map(d / INDEX_FILE).values()))
    elif (d / SINGLE_FILE).is_file():
        names = [SINGLE_FILE]
    else:
        raise IntegrityError(f"{d}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    rep = check_files(d, names, manifest=m)
    log.info("%s: %d shard(s) verified against %s in %.3f s", d, len(names), m.path, rep.seconds)
    return rep
