"""Commands about topology files: `topology init`, `topology check` (later), and `secret`."""

from __future__ import annotations

import os
from pathlib import Path

import click

from .group import main
from .common import MODEL_HELP, UserError, check_writable, model_dir


@main.group()
def topology() -> None:
    """Topology files."""


@topology.command("init")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--nodes", type=click.IntRange(min=1), required=True)
@click.option("--standby", type=click.IntRange(min=0), default=0, show_default=True, help="standby slots (hot spares)")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--base-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="port of the first slot; slot i gets base-port + i  [default: 47920]",
)
@click.option(
    "--split",
    type=click.Choice(["layers", "experts"]),
    default="layers",
    show_default=True,
    help="layers: whole layers per node; experts: equal weight bytes, MoE layers split by experts",
)
@click.option("--gpu-memory-gb", type=click.FloatRange(min=0, min_open=True), default=24.0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="write here (default: stdout)")
def topology_init(model, nodes, standby, host, base_port, split, gpu_memory_gb, out):
    """A split of the model's layers over N nodes."""
    import ipaddress

    from p2pk3.model.config import K3Config
    from p2pk3.plan import balanced_split
    from p2pk3.topology import DEFAULT_BASE_PORT, even_split

    mdir = model_dir(model)
    check_writable(out, "--out")
    base_port = DEFAULT_BASE_PORT if base_port is None else base_port
    if base_port + nodes + standby - 1 > 65535:
        raise click.BadParameter(
            f"slots would need ports up to {base_port + nodes + standby - 1} (> 65535)", param_hint="--base-port"
        )
    cfg = K3Config.from_pretrained(mdir)
    if split == "layers":
        topo = even_split(
            cfg,
            nodes,
            host=host,
            base_port=base_port,
            model_path=str(mdir.resolve()),
            secret_file=SECRET_FILE,
            n_standby=standby,
            gpu_memory_gb=gpu_memory_gb,
        )
    else:
        topo = balanced_split(
            cfg,
            nodes,
            gpu_memory_gb=gpu_memory_gb,
            host=host,
            base_port=base_port,
            n_standby=standby,
            model_path=str(mdir.resolve()),
            secret_file=SECRET_FILE,
        )
    try:
        if ipaddress.ip_address(host).is_loopback:
            topo.cluster.beacon_addrs = [host]
    except ValueError:
        pass
    for w in topo.validate(cfg):
        click.echo(f"warning: {w}", err=True)
    text = topo.dump()
    if out:
        Path(out).write_text(text)
        click.echo(secret_beside(out))
    else:
        click.echo(text)


SECRET_FILE = "cluster.key"  # `topology init` and `p2pk3 plan` name the secret so, beside the topology


def secret_beside(out: str | Path) -> str:
    """After writing the topology `out` (secret_file = SECRET_FILE): create the secret beside it unless one
    is there; the line to print."""
    secret = Path(out).resolve().parent / SECRET_FILE
    if secret.exists():
        return f"wrote {out}; it uses the existing cluster secret {secret}"
    _write_secret(secret)
    return f"wrote {out} and a new cluster secret {secret} (copy both to every host)"


def _write_secret(p: Path) -> None:
    from p2pk3.topology import generate_secret

    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(generate_secret() + "\n")


@main.command()
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="write the secret to this file (mode 0600; refuses to overwrite) instead of stdout",
)
def secret(out):
    """A new random cluster secret (64 hex digits) for a topology's `secret_file`."""
    from p2pk3.topology import generate_secret

    if out is None:
        click.echo(generate_secret())
        return
    check_writable(out, "--out")
    p = Path(out)
    if p.exists():
        raise UserError(f"{p} exists; remove it first to make a new secret (every node must use the same one)")
    _write_secret(p)
    click.echo(f"wrote a new cluster secret to {p}")
