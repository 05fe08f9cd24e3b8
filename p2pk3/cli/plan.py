"""`p2pk3 plan` (a topology from a model and NODES.toml), `p2pk3 simulate` (the ring on paper) and
`p2pk3 topology check` (validate any topology file and print its memory table). docs/rack.md."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .group import main
from .common import UserError, check_writable
from .options import topology_option
from .topo import SECRET_FILE, secret_beside, topology

FORMATS_HELP = (
    "weight formats per tensor class, e.g. 'non-experts=mxfp8' or 'attention=mxfp4,lm_head=bf16' "
    "(classes attention, shared_experts, dense, lm_head, latent; formats bf16 = shipped, mxfp8, mxfp4)"
)


def load_config(model: str | None):
    """A preset name or a model directory (default: the embedded k3-docs)."""
    from p2pk3.model.config import PRESETS, K3Config

    if model in PRESETS:
        return PRESETS[model], model, None
    from .common import model_dir

    d = model_dir(model)
    return K3Config.from_pretrained(d), None, str(d.resolve())


@main.command("plan")
@click.option(
    "--model", default=None, help="preset (kimi-k3, tiny-k3, ...) or model directory; default: the embedded model"
)
@click.option(
    "--hosts",
    "hosts_file",
    type=click.Path(dir_okay=False),
    help="NODES.toml: the hosts' cards as [[nodes]] tables (docs/rack.md)",
)
@click.option(
    "--nodes",
    "nodes_file",
    type=click.Path(dir_okay=False),
    hidden=True,
    help="deprecated alias of --hosts (everywhere else --nodes is a count)",
)
@click.option(
    "--model-dir",
    default=None,
    help="where the nodes read the checkpoint ([model] path; default: --model when it is a directory)",
)
@click.option("--repo", default=None, help="hub repo of the checkpoint ([model] repo, what `p2pk3 download` fetches)")
@click.option(
    "--context", type=click.IntRange(min=1), default=32768, show_default=True, help="tokens of MLA cache per session"
)
@click.option("--sessions", type=click.IntRange(min=1), default=8, show_default=True, help="concurrent sessions held")
@click.option(
    "--prefill-chunk",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="prompt tokens per prefill pass (sizes each card's activation workspace)",
)
@click.option(
    "--overhead-gb", type=click.FloatRange(min=0), default=1.0, show_default=True, help="CUDA context reserve (GiB)"
)
@click.option("--formats", default=None, help=FORMATS_HELP)
@click.option(
    "--standby", type=click.IntRange(min=0), default=0, show_default=True, help="more cards kept as hot spares"
)
@click.option("--name", default="cluster", show_default=True, help="cluster name")
@click.option(
    "--stage-overhead-us",
    type=click.FloatRange(min=0),
    default=80.0,
    show_default=True,
    help="fixed time per stage and token (kernel launches, hop handling), microseconds, in the pace",
)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="write the topology here (default: stdout)")
@click.option("--tables/--no-tables", default=False, help="print every card's memory table")
def plan_cmd(
    model,
    hosts_file,
    nodes_file,
    model_dir,
    repo,
    context,
    sessions,
    prefill_chunk,
    overhead_gb,
    formats,
    standby,
    name,
    stage_overhead_us,
    out,
    tables,
):
    """A topology for a model over a list of hosts, balanced by predicted stage time."""
    from p2pk3.plan import load_nodes, plan_ring
    from p2pk3.quant.formats import parse_formats
    from p2pk3.topology import MemorySpec

    if nodes_file is not None:
        if hosts_file is not None:
            raise UserError("give the hosts file once: --hosts FILE (--nodes FILE is its deprecated alias)")
        click.echo(
            "warning: `plan --nodes FILE` is deprecated (elsewhere --nodes is a count): use --hosts FILE", err=True
        )
        hosts_file = nodes_file
    if hosts_file is None:
        raise click.UsageError("missing --hosts FILE (a NODES.toml of [[nodes]] tables; docs/rack.md)")
    check_writable(out, "--out")
    cfg, preset, path = load_config(model)
    fm = parse_formats(formats)
    cards = load_nodes(hosts_file)
    p = plan_ring(
        cfg,
        cards,
        memory=MemorySpec(sessions=sessions, context=context, prefill_chunk=prefill_chunk, overhead_gb=overhead_gb),
        formats=fm,
        standby=standby,
        stage_overhead_us=stage_overhead_us,
        name=name,
        preset=preset,
        model_path=model_dir or path,
        repo=repo,
        secret_file=SECRET_FILE,
    )
    fdesc = ", ".join(f"{k}={v}" for k, v in p.formats.items()) or "as shipped"
    pace = p.pace_line()
    comment = (
        f"Planned by `p2pk3 plan` from {Path(hosts_file).name}: {len(p.topology.active)} active + "
        f"{len(p.topology.standby)} standby; {sessions} sessions x {context} tokens, prefill chunk "
        f"{prefill_chunk}; weight formats: {fdesc}.\n{pace[0].upper()}{pace[1:]}.\n"
        f"Check it with `p2pk3 topology check FILE --model ...`."
    )
    text = p.topology.dump(out, comment=comment) if out else p.topology.dump(comment=comment)
    click.echo(p.summary(), err=bool(not out))
    if tables:
        for s in p.topology.active:
            click.echo(p.tables[s.id].render(), err=bool(not out))
    if out:
        click.echo(secret_beside(out))
    else:
        click.echo(text)


@topology.command("check")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--model", default=None, help="preset or model directory (default: the file's [model])")
@click.option("--formats", default=None, help=FORMATS_HELP + "; default: the file's [model] formats")
@click.option("--quiet", is_flag=True, help="only problems")
def topology_check(path, model, formats, quiet):
    """Validate a topology file and print each card's memory table (exit 1 naming every problem)."""
    from p2pk3.plan import memory_table
    from p2pk3.quant.formats import parse_formats
    from p2pk3.topology import Topology

    if not Path(path).is_file():
        raise UserError(f"{path}: no such file")
    topo = Topology.load(path)
    if model:
        cfg = load_config(model)[0]
    else:
        try:
            cfg = topo.model_config()
        except Exception as e:
            raise UserError(f"{path}: cannot read the model config ({e}); pass --model PRESET|DIR") from None
    if formats:  # instead of the file's own
        topo.model.formats = parse_formats(formats)
    errors, warnings = topo.check(cfg)
    if not errors and not quiet:  # a layout that fits: its tables, even when the secret is still to be made
        for s in topo.active:
            click.echo(
                memory_table(cfg, topo.slot_plan(s, cfg), topo.memory, s.gpu_memory_gb, topo.model.formats).render()
            )
    if (secret := topo.secret_problem()) is not None:
        errors.append(secret)
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    if errors:
        n = len(errors)
        raise UserError(f"{path}: {n} problem{'s' if n > 1 else ''}: " + "; ".join(errors))
    click.echo(f"{path}: ok ({len(topo.active)} active, {len(topo.standby)} standby slots)")


_PROFILE = "the profile's {}, rtx5090: {}"


@main.command("simulate")
@topology_option()
@click.option(
    "--hardware",
    "hw_path",
    default=None,
    type=click.Path(dir_okay=False),
    show_default="p2pk3/sim/profiles/rtx5090.toml",
    help="hardware profile TOML",
)
@click.option("--model", default=None, help="preset or model directory (default: the file's [model])")
@click.option("--streams", default="1,16", show_default=True, help="concurrent streams, comma-separated")
@click.option("--formats", default=None, help=FORMATS_HELP + "; default: the file's [model] formats")
@click.option(
    "--accept",
    type=click.FloatRange(min=1.0),
    default=None,
    show_default="no speculation",
    help="speculation: tokens accepted per pass",
)
@click.option(
    "--spec-k",
    type=click.IntRange(min=1),
    default=None,
    show_default="ceil(2*(accept-1))",
    help="draft tokens per pass",
)
@click.option(
    "--tp", type=click.IntRange(min=1), default=1, show_default=True, help="cards per stage in tensor parallel"
)
@click.option(
    "--act",
    type=click.Choice(["bf16", "fp8"]),
    default=None,
    show_default=_PROFILE.format("activations.dtype", "bf16"),
    help="activation dtype on the wire",
)
@click.option(
    "--prompt",
    type=click.IntRange(min=1),
    default=None,
    show_default=_PROFILE.format("workload.prompt", 1024),
    help="prompt tokens per stream",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=1),
    default=None,
    show_default=_PROFILE.format("workload.new_tokens", 256),
    help="generated tokens per stream",
)
@click.option(
    "--context",
    type=click.IntRange(min=0),
    default=None,
    show_default=_PROFILE.format("workload.context", 32768),
    help="context at decode (MLA cache read)",
)
@click.option(
    "--micro-batches",
    type=click.IntRange(min=1),
    default=None,
    help="decode micro-batches in flight (default: as the daemon: one per stage; 1: one batch)",
)
@click.option(
    "--prefill-depth",
    type=click.IntRange(min=1),
    default=None,
    help="chunks of one prompt in flight (default: as the daemon: one per stage; 1: one at a time)",
)
@click.option(
    "--cached-prefix",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="prompt tokens the stages' prefix caches hold already (a hit: only the rest is computed)",
)
@click.option("--plot", default=None, type=click.Path(dir_okay=False), help="PNG of throughput vs streams")
@click.option("--json", "as_json", is_flag=True, help="print the figures as JSON")
def simulate_cmd(
    topology_path,
    hw_path,
    model,
    streams,
    formats,
    accept,
    spec_k,
    tp,
    act,
    prompt,
    new_tokens,
    context,
    micro_batches,
    prefill_depth,
    cached_prefix,
    plot,
    as_json,
):
    """Discrete-event model of the ring: tokens/s per stream and in aggregate, TTFT, per-stage time."""
    from p2pk3.quant.formats import parse_formats
    from p2pk3.sim import load_profile, report, simulate_sweep
    from p2pk3.topology import Topology

    check_writable(plot, "--plot")
    if plot:
        try:
            report.require_matplotlib()
        except RuntimeError as e:
            raise UserError(str(e)) from None
    topo = Topology.load(topology_path)
    cfg = load_config(model)[0] if model else topo.model_config()
    topo.validate(cfg)
    hw = load_profile(hw_path)
    try:
        ns = [int(x) for x in streams.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{streams!r}: expected integers like 1,16,64", param_hint="--streams") from None
    if not ns or min(ns) < 1:
        raise click.BadParameter("give at least one stream count >= 1", param_hint="--streams")
    results = simulate_sweep(
        cfg,
        topo,
        hw,
        ns,
        formats=parse_formats(formats) if formats else topo.model.formats,
        accept=accept,
        spec_k=spec_k,
        tp=tp,
        act=act,
        prompt=prompt,
        new_tokens=new_tokens,
        context=context,
        micro_batches=micro_batches,
        prefill_depth=prefill_depth,
        cached_prefix=cached_prefix,
    )
    if plot:
        report.plot(results, plot, title=f"{Path(topology_path).name}: {hw.name[:60]}")
    if as_json:
        click.echo(json.dumps(report.to_json(results, hw), indent=2))
    else:
        click.echo(report.table(results, hw))
        if plot:
            click.echo(f"wrote {plot}")
