"""Running the API server: `serve(...)` (what `p2pk3 serve` runs, on the uvloop loop) and the pieces it
reads from the topology (model name, API key); prompts and the context length come from the model
directory through p2pk3/frontends/prompt.py."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from aiohttp import web

from .app import ApiConfig, create_app
from .cluster import Cluster


def read_api_key(path: str | Path) -> str:
    """The key in `path` (whitespace stripped); ValueError for an empty or unreadable file."""
    p = Path(path)
    try:
        key = p.read_text().strip()
    except OSError as e:
        raise ValueError(f"--api-key-file {p}: cannot read it ({e.strerror})") from None
    if not key or any(c.isspace() for c in key):
        raise ValueError(
            f"--api-key-file {p}: must hold one key (no spaces), found {'nothing' if not key else 'whitespace inside'}"
        )
    return key


def default_model_name(model_dir: Path, topo) -> str:
    """The default model id: the topology's hub repo, else the model folder's name."""
    return topo.model.repo or Path(model_dir).name


async def serve(
    topo,
    model_dir: Path,
    *,
    host: str,
    port: int,
    api_key: str | None,
    model_name: str | None,
    ready=None,
    max_queue: int | None = None,
    queue_timeout: float | None = None,
) -> None:
    """Serve until SIGINT / SIGTERM. `ready(url)` is called once the port listens. `max_queue` /
    `queue_timeout`: this server's requests' bounds in the entry's queue (only tighter than the entry's)."""
    from p2pk3.frontends.prompt import PromptBuilder

    cluster = Cluster(topo, max_queue=max_queue, queue_timeout=queue_timeout)
    app = create_app(
        cluster,
        PromptBuilder.from_pretrained(model_dir),
        ApiConfig(model_name or default_model_name(model_dir, topo), api_key),
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        url = f"http://{host}:{port}"
        if ready is not None:
            ready(url)
        await stop.wait()
    finally:
        cluster.close()
        await runner.cleanup()


def log_ready(url: str) -> None:
    print(f"p2pk3 API serving on {url}/v1 (metrics at {url}/metrics)", file=sys.stderr, flush=True)
