"""`p2pk3 dashboard`: a live view of the cluster (the data: p2pk3/frontends/cluster_view.py)."""

from __future__ import annotations

import json
import logging

import click

from .group import main
from .options import state_option, topology_of_state, topology_option
from .common import run_async

STATE_STYLE = {
    "up": "green",
    "loading": "yellow",
    "degraded": "bold yellow",
    "standby": "cyan",
    "moved": "dim",
    "dead": "bold red",
    "unreachable": "red",
}


def _num(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _memory(m: dict | None) -> str:
    if not m or m.get("used") is None:
        return "-"
    gib = 1 << 30
    total = f"/{m['total'] / gib:.1f}" if m.get("total") else ""
    return f"{m['used'] / gib:.2f}{total} GiB"


def _cache(b: dict | None) -> str:
    """The prefix cache's bytes: device, and + host when the host tier holds some."""
    if not b or b.get("device") is None:
        return "-"
    mib = 1 << 20
    host = f"+{b['host'] / mib:.1f}h" if b.get("host") else ""
    return f"{b['device'] / mib:.1f}{host} MiB"


def render(snap: dict):
    """The rich table of one snapshot."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t, tot = snap["slots"], snap["totals"]
    spares = f" + {tot['standby']} standby" if tot["standby"] else ""
    q = snap.get("queue")
    queued = f" · queue {q['queued']}/{q['max_queue']} ({q['refused']} refused)" if q else ""
    title = (
        f"{snap['cluster']}: {tot['serving']}/{tot['active']} slots serving{spares} · "
        f"{_num(tot['tokens_per_s'])} tokens/s · "
        f"{_num(tot['live_sessions'], '{}')} live sessions{queued} · entry {snap['entry'] or 'none'}"
        + (f" · prefix hits {100 * tot['prefix_hit_rate']:.0f}%" if tot.get("prefix_hit_rate") is not None else "")
    )
    notes = [f"{r['slot']}: {r['reason']}" for r in t if r["state"] not in ("up", "standby")]
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        caption="\n".join(notes) or None,
        caption_justify="left",
    )
    for col, right in (
        ("slot", False),
        ("node", False),
        ("state", False),
        ("layers", False),
        ("sess", True),
        ("queue", True),
        ("batch/s", True),
        ("tok/s", True),
        ("ms/batch", True),
        ("busy", True),
        ("hop ms", True),
        ("memory", True),
        ("hit", True),
        ("cache", True),
    ):
        table.add_column(
            col, justify="right" if right else "left", no_wrap=True, overflow="ellipsis", min_width=min(len(col), 6)
        )
    for r in t:
        state = Text(r["state"], style=STATE_STYLE.get(r["state"], ""))
        layers = f"{r['layers'][0]}..{r['layers'][1]}" if r["layers"] else "-"
        table.add_row(
            r["slot"] + (" (spare)" if r["standby_slot"] else ""),
            r["node"] or "-",
            state,
            layers,
            _num(r["sessions"], "{}"),
            _num(r["queue"], "{}"),
            _num(r["batches_per_s"]),
            _num(r["tokens_per_s"]),
            _num(r["compute_ms"], "{:.2f}"),
            _num(100 * r["busy"] if r.get("busy") is not None else None, "{:.0f}%"),
            _num(r["hop_ms"], "{:.2f}"),
            _memory(r["memory"]),
            _num(100 * r["prefix_hit_rate"] if r.get("prefix_hit_rate") is not None else None, "{:.0f}%"),
            _cache(r.get("prefix_bytes")),
        )
    return table


@main.command()
@topology_option(required=False)
@state_option()
@click.option("--once", is_flag=True, help="print one frame and exit")
@click.option("--json", "as_json", is_flag=True, help="print one snapshot as a JSON document and exit")
@click.option(
    "--follow", is_flag=True, help="with --json: one JSON document per line every --interval (JSON lines) until Ctrl-C"
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="seconds between polls (rates are deltas between two polls)",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="a node that does not answer a status probe within this many seconds is unreachable",
)
def dashboard(topology_path, state_file, once, as_json, follow, interval, timeout):
    """Live view of the ring: each slot's node, state, layers, sessions, queue, rates, latencies, memory.
    `--once` prints one frame, `--json` one JSON document (`--json --follow`: JSON lines)."""
    import asyncio

    from rich.console import Console
    from rich.live import Live

    from p2pk3.frontends.cluster_view import ClusterView
    from p2pk3.topology import Topology

    logging.getLogger("p2pk3").addHandler(logging.NullHandler())  # unreachable nodes are shown, not logged
    if bool(topology_path) == bool(state_file):
        raise click.UsageError("give --topology FILE, or --state FILE of a running `p2pk3 local`")
    if state_file:
        topology_path = topology_of_state(state_file)
    if follow and not as_json:
        raise click.UsageError("--follow is for --json (the table is live already)")
    once = once or (as_json and not follow)
    topo = Topology.load(topology_path)
    view = ClusterView(topo, topo.secret(), timeout=timeout)
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 160))

    def show(snap):
        if as_json:
            click.echo(json.dumps(snap))
        else:
            console.print(render(snap))

    async def go():
        snap = await view.poll()
        if once:  # a second poll, so that the frame has rates
            await asyncio.sleep(min(interval, 1.0))
            show(await view.poll())
            return
        if as_json:  # --follow
            while True:
                show(snap)
                await asyncio.sleep(interval)
                snap = await view.poll()
        with Live(render(snap), console=console, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(interval)
                live.update(render(await view.poll()))

    try:
        run_async(go())
    except KeyboardInterrupt:
        pass
