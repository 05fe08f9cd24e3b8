"""The check a node runs before it loads its slot: every shard it reads against the model directory's
manifest (manifest.check_files: size always, SHA-256 on first use or after a change, else the cached
(size, mtime) verdict). A directory without a manifest (a model not fetched with `p2pk3 download`, the
embedded tiny model) is loaded as it is: the loader's own checks still apply."""
from __future__ import annotations

import logging
from pathlib import Path

from .files import slot_files
from .manifest import CheckReport, Manifest, check_files

log = logging.getLogger("p2pk3.deploy")


def check_slot(model_dir: str | Path, cfg, plan) -> CheckReport | None:
    """Raise IntegrityError (naming the file and what is wrong) unless every shard of `plan` is intact."""
    m = Manifest.load(model_dir)
    if m is None:
        log.info("%s has no p2pk3-manifest.json: shards not checked against hub hashes", model_dir)
        return None
    names = slot_files(model_dir, cfg, plan)
    rep = check_files(model_dir, names, manifest=m)
    log.info("slot %s: %d shard(s) verified against %s in %.3f s (%d hashed, %d unchanged since their last check)",
             plan.slot, len(names), m.path, rep.seconds, len(rep.hashed), len(rep.cached))
    return rep
