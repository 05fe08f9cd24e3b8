"""Commands that put a model on a rack: `download` (only the shards of some slots, verified, from the hub
or LAN peers), `manifest` (record a local model's files), and `systemd` (units + per-slot env files).
Step by step: docs/deploy.md."""

from __future__ import annotations

from pathlib import Path

import click

from .group import main
from .options import topology_option
from .common import UserError


def _parse_peer(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{s!r}: expected HOST:PORT", param_hint="--peer")
    return host.strip("[]"), int(port)


@main.command()
@topology_option()
@click.option("--slot", "slots", multiple=True, help="a slot whose files to fetch (repeatable)")
@click.option("--all-local", is_flag=True, help="every slot of the topology whose host is this machine")
@click.option("--repo", default=None, help="hub repo id (default: the topology's [model] repo, else the manifest's)")
@click.option("--revision", default=None, help="branch, tag or commit (default: the topology's, else main)")
@click.option(
    "--local-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="model directory to fill (default: the topology's [model] path)",
)
@click.option(
    "--from-peers",
    is_flag=True,
    help="fetch from cluster nodes that hold the files first (LAN), the hub only for what no peer has",
)
@click.option(
    "--peer",
    "peers",
    multiple=True,
    help="HOST:PORT of a node to ask (default with --from-peers: the static address of every slot)",
)
@click.option(
    "--peer-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="MB/s to ask peers for (they cap it at their P2PK3_SHARE_MBPS)",
)
@click.option("--quiet", is_flag=True, help="no progress bars")
def download(topology_path, slots, all_local, repo, revision, local_dir, from_peers, peers, peer_rate, quiet):
    """Fetch the checkpoint files some slots need (index, config, tokenizer, and only their shards),
    SHA-256-verified and recorded in the model directory's p2pk3-manifest.json.

    Honours HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE=1 (then: check what is here, say what is missing)."""
    from p2pk3.deploy.download import Downloader, DownloadError, offline_mode
    from p2pk3.deploy.files import local_slots
    from p2pk3.deploy.manifest import Manifest
    from p2pk3.model.config import K3Config
    from p2pk3.topology import Topology

    topo = Topology.load(topology_path)
    if bool(slots) == bool(all_local):
        raise click.UsageError("give --slot ID (one or more) or --all-local")
    known = [s.id for s in topo.slots]
    for s in slots:
        if s not in known:
            raise click.BadParameter(
                f"unknown slot {s!r} in {topology_path} (slots: {', '.join(known)})", param_hint="--slot"
            )
    targets = [topo.slot(s) for s in slots] if slots else local_slots(topo)
    if not targets:
        hosts = ", ".join(sorted({s.host or "(none)" for s in topo.slots}))
        raise UserError(f"--all-local: no slot of {topology_path} has a host of this machine (hosts: {hosts})")
    if local_dir:
        mdir = Path(local_dir).expanduser()
    elif topo.model.path:
        mdir = topo.resolve(topo.model.path)
    else:
        raise UserError(
            f"{topology_path}: [model] has no path: pass --local-dir DIR (and set [model] path = DIR for the nodes)"
        )
    if repo is None:
        repo = topo.model.repo
    if repo is None and mdir.is_dir():
        try:
            m = Manifest.load(mdir)
        except ValueError:
            m = None
        repo = m.repo if m is not None else None
    revision = revision or topo.model.revision
    offline = offline_mode()
    if repo is None and not offline and not from_peers:
        raise UserError("no hub repo: pass --repo ORG/NAME (or set [model] repo), or --from-peers / HF_HUB_OFFLINE=1")
    peer_addrs: list[tuple[str, int]] = [_parse_peer(p) for p in peers]
    secret = None
    if from_peers or peer_addrs:
        secret = topo.secret()
        if not peer_addrs:
            peer_addrs = list(dict.fromkeys(topo.static_addresses().values()))
            if not peer_addrs:
                raise UserError(
                    f"--from-peers: {topology_path} gives no slot a host and port; name peers with --peer HOST:PORT"
                )
    try:
        mdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{mdir}: cannot create the model directory ({e.strerror})") from None

    def cfg_fn(d: Path) -> K3Config:
        return K3Config.from_pretrained(d) if not topo.model.preset else topo.model_config()

    def plans_fn(cfg):
        topo.validate(cfg)
        return [topo.slot_plan(s, cfg) for s in targets]

    click.echo(
        f"slots {', '.join(s.id for s in targets)} -> {mdir}"
        + (f" from {repo}" if repo and not offline else "")
        + (" (offline)" if offline else "")
        + (f", peers first: {', '.join(f'{h}:{p}' for h, p in peer_addrs)}" if peer_addrs else ""),
        err=True,
    )
    d = Downloader(
        mdir,
        repo=repo,
        revision=revision,
        peers=peer_addrs,
        secret=secret,
        peer_rate_mbps=peer_rate,
        offline=offline,
        quiet=quiet,
        echo=lambda s: click.echo(s, err=True),
    )
    try:
        out = d.run(cfg_fn, plans_fn)
    except DownloadError as e:
        raise UserError(str(e)) from None
    for shard, who in sorted(out.shards.items()):
        click.echo(f"  {shard}: slots {', '.join(sorted(who))}")
    mb = out.bytes_fetched / 1e6
    rate = f", {mb / out.seconds:.1f} MB/s" if out.seconds > 0 and mb else ""
    click.echo(
        f"done: {len(out.fetched_hub)} file(s) from the hub, {len(out.fetched_peer)} from peers, "
        f"{len(out.present)} already verified; {mb:.1f} MB in {out.seconds:.1f} s{rate}; "
        f"manifest {mdir / 'p2pk3-manifest.json'}"
    )


@main.command()
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.option("--repo", default=None, help="the hub repo the files are a copy of (recorded; `download` checks it)")
def manifest(model_dir, repo):
    """Record the files of a model directory not fetched with `p2pk3 download` (a local or retrained model,
    the embedded ones) in its p2pk3-manifest.json: size and SHA-256 of each, checked at every load."""
    from p2pk3.deploy.manifest import ManifestError, record_directory

    if not Path(model_dir).is_dir():
        raise UserError(
            f"{model_dir}: no such directory"
            + (" (give the model's folder, not a file)" if Path(model_dir).exists() else "")
        )
    try:
        m = record_directory(model_dir, repo=repo)
    except ManifestError as e:
        raise UserError(str(e)) from None
    size = sum(e.size for e in m.files.values())
    click.echo(
        f"wrote {m.path}: {len(m.files)} files, {size / 1e6:.1f} MB" + (" (shipped with p2pk3)" if m.shipped else "")
    )


@main.command()
@topology_option()
@click.option("--slot", "slots", multiple=True, help="write env files for these slots only (default: every slot)")
@click.option("--user", default=None, help="run the daemons as this user (default: root)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="p2pk3-systemd", show_default=True)
@click.option("--env-dir", default="/etc/p2pk3", show_default=True, help="where the hosts keep the env files")
@click.option(
    "--systemd-version",
    type=int,
    default=None,
    help="systemd of the hosts (default: this machine's); >= 254 gets RestartSteps/RestartMaxDelaySec",
)
def systemd(topology_path, slots, user, out_dir, env_dir, systemd_version):
    """systemd units for the ring: p2pk3-node@.service (instance = slot id), p2pk3-api.service, one env
    file per slot; prints the commands that install and enable them."""
    from p2pk3.deploy import systemd as sd
    from p2pk3.topology import Topology

    topo = Topology.load(topology_path)
    known = [s.id for s in topo.slots]
    for s in slots:
        if s not in known:
            raise click.BadParameter(
                f"unknown slot {s!r} in {topology_path} (slots: {', '.join(known)})", param_hint="--slot"
            )
    if not topo.cluster.secret_file:
        raise UserError(f"{topology_path}: [cluster] has no secret_file; the nodes need one (p2pk3 secret --out PATH)")
    if (problem := topo.secret_problem()) is not None:  # it may live only on the hosts: say so, write the units
        click.echo(f"warning: {problem}; copy it next to the topology on every host", err=True)
    if not env_dir.startswith("/"):
        raise click.BadParameter(f"{env_dir!r}: must be an absolute path", param_hint="--env-dir")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{out}: cannot create the output folder ({e.strerror})") from None
    version = systemd_version if systemd_version is not None else sd.local_systemd_version()
    units = sd.build(
        topo,
        Path(topology_path).resolve(),
        list(slots) or None,
        user=user,
        env_dir=env_dir,
        out=out,
        systemd_version=version,
    )
    for p in sd.write(units, out):
        click.echo(f"wrote {p}", err=True)
    click.echo("\n".join(units.commands))
