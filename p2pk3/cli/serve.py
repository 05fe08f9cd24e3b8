"""`p2pk3 serve`: the OpenAI-compatible HTTP API in front of a ring (p2pk3/api)."""

from __future__ import annotations

import click

from .group import main
from .options import queue_options, topology_option
from .common import UserError, run_async, topology_model_dir


@main.command()
@topology_option()
@click.option("--host", default="127.0.0.1", show_default=True, help="listen address")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="file holding the bearer API key clients must send (default: no auth)",
)
@click.option("--model-name", default=None, help="the model id clients use (default: the model folder's name)")
@queue_options(tighten=True)
def serve(topology_path, host, port, api_key_file, model_name, max_queue, queue_timeout):
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /metrics) for a ring."""
    from p2pk3.api.server import log_ready, read_api_key, serve as run_server
    from p2pk3.topology import Topology

    topo = Topology.load(topology_path)
    mdir = topology_model_dir(topo)
    try:
        key = read_api_key(api_key_file) if api_key_file else None
    except ValueError as e:
        raise click.BadParameter(str(e).split(": ", 1)[1], param_hint="--api-key-file") from None
    try:
        topo.secret()
    except Exception as e:
        raise UserError(f"{topology_path}: cannot read the cluster secret: {e}") from None
    if model_name is not None and not model_name.strip():
        raise click.BadParameter("must not be empty", param_hint="--model-name")

    async def go():
        try:
            await run_server(
                topo,
                mdir,
                host=host,
                port=port,
                api_key=key,
                model_name=model_name,
                ready=log_ready,
                max_queue=max_queue,
                queue_timeout=queue_timeout,
            )
        except OSError as e:
            if e.errno == 98:
                raise UserError(f"port {port} on {host} is already in use") from None
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None

    run_async(go())
