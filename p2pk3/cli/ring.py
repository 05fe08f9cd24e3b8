"""Commands that run daemons: `node` (one daemon of a ring), `local` (a whole ring on loopback)."""

from __future__ import annotations

from pathlib import Path

import click

from .group import main
from .common import DTYPES, MODEL_HELP, UserError, build_prompt, model_dir, plural, run_async, topology_model_dir
from .options import (
    prefix_cache_args,
    prefix_cache_options,
    queue_args,
    queue_options,
    sampling_options,
    speculation_options,
    topology_option,
)


class _Schedule(click.ParamType):
    """`auto` (None: one per active slot) or an integer >= 1 (--micro-batches, --prefill-depth)."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int) or str(value).lower() == "auto":
            return None if value is None or str(value).lower() == "auto" else value
        if not str(value).isdigit() or int(value) < 1:
            self.fail(f"expected auto or an integer >= 1, got {value!r}", param, ctx)
        return int(value)


SCHEDULE = _Schedule()


def _schedule_args(micro_batches, prefill_depth) -> list[str]:
    """The two schedule options as `p2pk3 node` arguments (for the daemons `p2pk3 local` starts)."""
    return [
        a
        for flag, v in (("--micro-batches", micro_batches), ("--prefill-depth", prefill_depth))
        if v is not None
        for a in (flag, str(v))
    ]


def _stop_on_signals(stop):
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop)


@main.command()
@topology_option()
@click.option("--slot", help="the slot this daemon claims")
@click.option(
    "--standby",
    is_flag=True,
    help="run as a hot spare (takes over a dead slot); without --slot it joins the spare pool on any free port",
)
@click.option(
    "--rejoin-as-standby",
    is_flag=True,
    help="when --slot is held by another node now (a spare took it over), join the spare pool instead of failing",
)
@click.option("--host", default=None, help="listen address (default: the slot's host, else 0.0.0.0)")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="listen port (default: the slot's port in the topology; 0: any free port)",
)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--device", default=None, help="torch device (default: cuda if available, else cpu)")
@click.option(
    "--max-sessions",
    type=click.IntRange(min=1),
    default=None,
    help="sessions held at once  [default: the topology's [memory] sessions, else 32]",
)
@click.option(
    "--cache-tokens",
    type=click.IntRange(min=64),
    default=None,
    help="MLA cache tokens over all sessions  [default: [memory] sessions x context, else 32768]",
)
@click.option("--discovery/--no-discovery", default=True, show_default=True, help="UDP beacons on the LAN")
@click.option("--advertise-host", default=None, help="address peers should dial (default: --host)")
@click.option(
    "--heartbeat",
    type=click.FloatRange(min=0.05),
    default=0.5,
    show_default=True,
    help="failure detector ping period, seconds",
)
@click.option(
    "--dead-after",
    type=click.FloatRange(min=0.2),
    default=2.5,
    show_default=True,
    help="a peer that has not answered for this many seconds is dead (at least 2 heartbeats)",
)
@click.option(
    "--degraded-factor",
    type=click.FloatRange(min=1.0, min_open=True),
    default=3.0,
    show_default=True,
    help="a stage this many times slower per token than expected is degraded (the entry hands it to a standby; "
    "its windows are judged against 1 + 0.75 x (F - 1), for their noise)",
)
@click.option(
    "--degraded-after",
    type=click.FloatRange(min=0.0),
    default=10.0,
    show_default=True,
    help="seconds a stage must stay that slow before it is marked degraded",
)
@click.option(
    "--sim-profile",
    default=None,
    help="hardware profile (p2pk3/sim/profiles) whose predicted stage times are the expected ones",
)
@click.option("--drop-beacons", is_flag=True, hidden=True, help="fault injection: received beacons are lost")
@click.option(
    "--fault-signals",
    is_flag=True,
    hidden=True,
    help="fault injection (tools/chaos.py): SIGUSR1 black-holes every frame this node sends, SIGUSR2 ends it",
)
@click.option(
    "--micro-batches",
    type=SCHEDULE,
    default="auto",
    show_default=True,
    help="decode micro-batches the entry keeps in flight (auto: one per active slot; 1: one batch)",
)
@click.option(
    "--prefill-depth",
    type=SCHEDULE,
    default="auto",
    show_default=True,
    help="chunks of one prompt in flight at once (auto: one per active slot; 1: one at a time)",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="serve Prometheus metrics on http://HOST:PORT/metrics (off by default)",
)
@click.option(
    "--compile/--no-compile",
    "compile_decode",
    default=None,
    help="compiled decode step (CUDA graphs on a GPU); default: on for CUDA, off on the CPU",
)
@queue_options()
@prefix_cache_options
@click.option("-v", "--verbose", count=True)
def node(
    topology_path,
    slot,
    standby,
    rejoin_as_standby,
    host,
    port,
    dtype,
    device,
    max_sessions,
    cache_tokens,
    discovery,
    advertise_host,
    heartbeat,
    dead_after,
    degraded_factor,
    degraded_after,
    sim_profile,
    drop_beacons,
    fault_signals,
    verbose,
    metrics_port,
    compile_decode,
    micro_batches,
    prefill_depth,
    max_queue,
    queue_timeout,
    prefix_cache,
):
    """Run one node daemon of the ring."""
    import asyncio
    import logging

    import torch

    from dataclasses import replace

    from p2pk3.node.claims import ClaimRefused
    from p2pk3.node.daemon import NodeDaemon
    from p2pk3.node.options import NodeOptions
    from p2pk3.topology import Topology

    from .run import _check_device

    if dead_after < 2 * heartbeat:
        raise click.BadParameter(
            f"{dead_after:g} s is less than two heartbeats ({heartbeat:g} s each): every peer would "
            f"look dead between two pings; give at least {2 * heartbeat:g}",
            param_hint="--dead-after",
        )
    logging.basicConfig(
        level=logging.DEBUG if verbose > 1 else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    topo = Topology.load(topology_path)
    if not slot and not standby:
        raise click.UsageError("give --slot ID, or --standby to run as a spare")
    known = [x.id for x in topo.slots]
    if slot and slot not in known:
        raise click.BadParameter(
            f"unknown slot {slot!r} in {topology_path} (slots: {', '.join(known)})", param_hint="--slot"
        )
    if standby and slot and not topo.slot(slot).standby:
        raise click.BadParameter(f"slot {slot} is not a standby slot", param_hint="--slot")
    if rejoin_as_standby and not slot:
        raise click.UsageError("--rejoin-as-standby is for a node started with --slot ID")
    secret = topo.secret()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_device(device)
    opts = NodeOptions(
        host=host or (topo.slot(slot).host if slot else None) or "0.0.0.0",
        port=port,
        dtype=dtype,
        device=device,
        max_sessions=max_sessions,
        cache_tokens=cache_tokens,
        discovery=discovery,
        advertise_host=advertise_host,
        heartbeat_s=heartbeat,
        dead_after_s=dead_after,
        drop_beacons=drop_beacons,
        degraded_factor=degraded_factor,
        degraded_after_s=degraded_after,
        sim_profile=sim_profile,
        compile=compile_decode,
        micro_batches=micro_batches,
        prefill_depth=prefill_depth,
        max_queue=max_queue,
        **({"queue_timeout_s": queue_timeout} if queue_timeout is not None else {}),
        **prefix_cache,
    )
    mdir = topology_model_dir(topo)

    async def run_daemon():
        d = NodeDaemon(topo, slot, model_dir=mdir, secret=secret, options=opts)
        _stop_on_signals(lambda: asyncio.ensure_future(d.stop("signal")))
        if fault_signals:
            from p2pk3.transport.faults import cut_off_on_signals

            cut_off_on_signals()
        try:
            await d.start()
        except ClaimRefused as e:
            if not rejoin_as_standby:
                raise UserError(
                    f"cannot claim slot {slot}: {e}. If a spare took the slot over, this node can be a spare "
                    f"now: `p2pk3 node --topology {topology_path} --standby` (or add --rejoin-as-standby, "
                    f"as the systemd units do, to do that by itself)"
                ) from None
            click.echo(f"node {d.node_id}: cannot claim slot {slot} ({e}); joining the spare pool instead", err=True)
            pool = replace(opts, port=opts.port if opts.port is not None else (topo.slot(slot).port or 0))
            d = NodeDaemon(topo, None, model_dir=mdir, secret=secret, options=pool)
            _stop_on_signals(lambda: asyncio.ensure_future(d.stop("signal")))
            await _start_or_explain(d, "the spare pool")
        except OSError as e:
            _explain_os_error(e, d, f"slot {slot}" if slot else "the spare pool")
        what = f"slot {d.slot_id}" if not d.pool else "spare pool"
        click.echo(f"node {d.node_id}: {what} up on {d.host}:{d.port} ({d.role})", err=True)
        if metrics_port is not None:
            from p2pk3.node.metrics import start_metrics

            try:
                m = start_metrics(d, metrics_port, host=d.host)
            except OSError as e:
                await d.stop("metrics port unavailable")
                raise UserError(f"--metrics-port {metrics_port}: {e.strerror or e}") from None
            click.echo(f"node {d.node_id}: metrics on http://{d.host}:{m.port}/metrics", err=True)
        await d.stopped.wait()
        click.echo(f"node {d.node_id}: stopped ({d.stop_reason})", err=True)

    run_async(run_daemon())


@main.command()
@click.option("--model", help=MODEL_HELP)
@click.option("--nodes", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--standby",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="hot spares that take over a node that dies",
)
@click.option(
    "--state",
    "state_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="write the ring's state (JSON: topology, secret, entry, nodes with pid/slot/role) here, "
    "rewritten atomically when a takeover changes it",
)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option(
    "--prompt", default=None, help="generate once for this prompt, print it with the ring's statistics, and stop"
)
@click.option(
    "--chat",
    "open_chat",
    is_flag=True,
    help="open the chat REPL on the ring (without a terminal: one scripted exchange with the ring's "
    "statistics), then stop",
)
@sampling_options
@speculation_options
@click.option(
    "--api",
    "api_addr",
    default=None,
    metavar="HOST:PORT",
    help="also serve the OpenAI-compatible API there (p2pk3 serve beside the ring)",
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="with --api: the bearer key clients must send",
)
@click.option(
    "--micro-batches",
    type=SCHEDULE,
    default="auto",
    show_default=True,
    help="decode micro-batches the entry keeps in flight (auto: one per node, at most this host's cores; 1: one batch)",
)
@click.option(
    "--prefill-depth",
    type=SCHEDULE,
    default="auto",
    show_default=True,
    help="chunks of one prompt in flight at once (auto: one per node, at most this host's cores; 1: one at a time)",
)
@queue_options()
@prefix_cache_options
def local(
    model,
    nodes,
    standby,
    state_file,
    dtype,
    prompt,
    open_chat,
    api_addr,
    api_key_file,
    sampling,
    micro_batches,
    prefill_depth,
    max_queue,
    queue_timeout,
    prefix_cache,
):
    """Start N daemons (and S standbys) on loopback as one ring; Ctrl-C, SIGTERM or SIGHUP stops them.
    A node that goes down, the standby that takes its slot over, and the ring's recovery are said here.

    To watch the ring survive a failure, start it with a spare and a state file, then kill a stage:

    \b
      p2pk3 local --nodes 4 --standby 1 --state /tmp/ring.json &
      until [ -s /tmp/ring.json ]; do sleep 1; done     # written once the ring is up
      kill -9 $(jq '[.nodes[] | select(.role == "stage" and .started_on == .slot)][0].pid' /tmp/ring.json)
      jq .nodes /tmp/ring.json                          # the spare now serves that slot
    """
    import signal
    import sys
    import time

    from p2pk3.model.config import K3Config
    from p2pk3.node.local import LocalRing, claim_state_file, ring_events, write_state

    from .common import check_writable

    if api_key_file and not api_addr:
        raise click.UsageError("--api-key-file protects the API of --api HOST:PORT: give --api too (or drop the key)")
    mdir = model_dir(model)
    check_writable(state_file, "--state")
    api_host, api_port = _host_port(api_addr, "--api") if api_addr else (None, None)
    L = K3Config.from_pretrained(mdir).num_hidden_layers
    if nodes > L:
        raise click.BadParameter(
            f"{nodes} nodes but the model has only {L} layers (one node per layer at most)", param_hint="--nodes"
        )
    if api_addr:
        _check_port_free(api_host, api_port, "--api")
    if state_file:
        try:
            claim_state_file(state_file)  # refuses a state file that a running ring owns; removes a stale one
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--state") from None
    ring = LocalRing(
        mdir,
        nodes,
        dtype=dtype,
        standby=standby,
        extra_args=_schedule_args(micro_batches, prefill_depth)
        + queue_args(max_queue, queue_timeout)
        + prefix_cache_args(prefix_cache),
    )
    spares = f" and {plural(standby, 'standby', 'standbys')}" if standby else ""
    click.echo(f"starting {plural(nodes, 'daemon')}{spares} for {mdir} ...")

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    api, wrote_state = None, False
    try:
        with ring:
            h, p = ring.entry_addr
            click.echo(f"ring up: entry {h}:{p}; topology {ring.topology}; logs in {ring.log_dir}")
            if api_addr:
                from p2pk3.api import start_api_in_background

                try:
                    api = start_api_in_background(ring.topology, api_host, api_port, api_key_file)
                except (RuntimeError, TimeoutError) as e:
                    raise UserError(
                        f"--api {api_addr}: the API did not start: {str(e).splitlines()[0]} "
                        f"(log {ring.workdir / 'api.log'})"
                    ) from None
                click.echo(f"OpenAI-compatible API at {api.url} (log {api.log_path})")
            for s in ring.topo.slots:
                what = "standby" if s.standby else f"layers {s.layers[0]}..{s.layers[1]}"
                click.echo(f"  slot {s.id}: {what} at {s.host}:{s.port}")
            if open_chat and prompt is None and sys.stdin.isatty():
                from p2pk3.frontends.prompt import PromptBuilder
                from p2pk3.frontends.repl import banner, run_chat

                run_chat(
                    ring.client,
                    PromptBuilder.from_pretrained(mdir),
                    sampling,
                    banner=banner(f"{mdir.name} on the ring"),
                )
                return
            if open_chat and prompt is None:  # no terminal: one scripted exchange
                prompt = SCRIPTED_QUESTION
            if prompt is not None:
                _generate_and_print(ring, mdir, prompt, sampling)
                return
            click.echo("Ctrl-C to stop." + (f" State in {state_file}." if state_file else ""))
            last = None
            while True:
                doc = run_async(ring.state())
                doc["api"] = api.url if api is not None else None
                for line in ring_events(last, doc, ring.topo):
                    click.echo(line)
                if state_file and doc != last:
                    write_state(state_file, doc)
                    wrote_state = True
                last = doc
                if len(ring.exited()) == len(ring.procs):
                    raise UserError(f"every daemon exited; logs in {ring.log_dir}")
                time.sleep(0.5)
    except KeyboardInterrupt:
        click.echo("stopping ...")
    finally:
        if api is not None:
            api.stop()
        if wrote_state:
            Path(state_file).unlink(missing_ok=True)  # the ring it described is gone
        for s, h in old.items():
            signal.signal(s, h)
        if ring.failed or ring.exited():
            ring.failed = True
            click.echo(f"logs kept in {ring.log_dir}", err=True)


async def _start_or_explain(d, what: str) -> None:
    try:
        await d.start()
    except OSError as e:
        _explain_os_error(e, d, what)


def _explain_os_error(e: OSError, d, what: str):
    if e.errno == 98:
        hint = "" if d.pool or not d.slot.standby else "; another spare can join the pool: drop --slot"
        raise UserError(
            f"{what}: port {d.port} on {d.host} is already in use (another node or program "
            f"holds it; see `ss -ltnp | grep {d.port}`){hint}"
        ) from None
    raise e


def _check_port_free(host: str, port: int, param: str) -> None:
    """Fail before starting anything when HOST:PORT cannot be listened on."""
    import errno
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        why = (
            (
                f"port {port} on {host} is already in use (another `p2pk3 local --api` or `serve`? "
                f"see `ss -ltnp | grep {port}`)"
            )
            if e.errno == errno.EADDRINUSE
            else f"cannot listen on {host}:{port}: {e.strerror or e}"
        )
        raise click.BadParameter(why, param_hint=param) from None


SCRIPTED_QUESTION = "What does the with statement do?"


def _host_port(text: str, param: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"expected HOST:PORT with a port in 1..65535, got {text!r}", param_hint=param)
    return host or "127.0.0.1", int(port)


def _generate_and_print(ring, mdir, prompt, sampling):
    """The answer streams as it is generated (as in `chat`); Ctrl-C stops it and keeps what came."""
    import sys

    from p2pk3.node.local import probe

    prompts, p = build_prompt(mdir, prompt, sampling)
    ids, params = p.ids, p.params
    click.echo(f"> {prompt}")
    dec, stops, got = prompts.tok.stream_decoder(), set(params.stop_ids), []

    def on_token(t: int) -> None:
        got.append(t)
        if t not in stops:
            sys.stdout.write(dec.push(t))
            sys.stdout.flush()

    async def go():
        import asyncio

        c = await ring.client()
        try:
            reply = await c.generate(ids, params, on_token=on_token)
        finally:
            c.close()
        stages = await asyncio.gather(*(probe(ring.address(s.id), ring.secret) for s in ring.topo.active))
        return reply, [s for s in stages if s]

    try:
        r, stages = run_async(go())
    except KeyboardInterrupt:
        click.echo(dec.flush() + f" ^C\n[stopped after {plural(len(got), 'token')}]")
        raise
    click.echo(dec.flush())
    st = r.stats
    tps = st.get("decode_tokens_per_s")
    click.echo(
        f"[ring of {len(stages)} nodes: {st.get('prompt_tokens', len(ids))} prompt + {len(r.tokens)} generated "
        f"tokens; time to first token {1000 * (st.get('ttft_s') or 0):.0f} ms; "
        f"decode {tps or 0:.1f} tok/s; total {st.get('total_s', 0):.2f} s]"
    )
    for s in stages:
        click.echo(
            f"  stage {s['slot']}: {s['batches']} batches, {s['tokens']} tokens, {1000 * s['busy_s']:.0f} ms compute"
        )
