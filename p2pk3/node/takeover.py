"""The files a standby lacks before it takes a slot over: the shards of that slot's plan that are not on
its disk (or not in its manifest), fetched from the other nodes of the ring over the cluster's
authenticated channel and verified (deploy/download.py `Downloader.fetch`, deploy/peers.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from p2pk3.deploy.download import Downloader
from p2pk3.deploy.files import slot_files
from p2pk3.deploy.manifest import Manifest
from p2pk3.model.config import K3Config
from p2pk3.topology import SlotPlan

log = logging.getLogger("p2pk3.node")


def lacking_files(model_dir: Path, cfg: K3Config, plan: SlotPlan) -> list[str]:
    """The files `plan` needs that `model_dir` lacks. A file on disk is not lacking when there is no
    manifest (a model directory made by hand: the load decides), nor when the manifest lists it (the
    integrity check at load verifies it)."""
    m = Manifest.load(model_dir)
    return [
        n
        for n in slot_files(model_dir, cfg, plan)
        if not (model_dir / n).is_file() or (m is not None and n not in m.files)
    ]


async def fetch_lacking_files(
    model_dir: str | Path, cfg: K3Config, plan: SlotPlan, peers: list[tuple[str, int]], secret: bytes
) -> list[str]:
    """Fetch what `plan` lacks here from `peers` (addresses of the other nodes); returns the names
    fetched. Raises DownloadError naming a file no peer has (the takeover then fails and is retried)."""
    model_dir = Path(model_dir)
    loop = asyncio.get_running_loop()
    lacking = await loop.run_in_executor(None, lacking_files, model_dir, cfg, plan)
    if not lacking:
        return []
    log.warning(
        "slot %s: fetching %d file(s) from peers before the takeover: %s", plan.slot, len(lacking), ", ".join(lacking)
    )
    d = Downloader(
        model_dir, repo=None, peers=peers, secret=secret, offline=True, quiet=True, echo=lambda s: log.warning("%s", s)
    )
    await loop.run_in_executor(None, d.fetch, lacking)
    return lacking
