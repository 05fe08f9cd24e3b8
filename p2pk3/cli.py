"""`p2pk3` command line (click). Each command is a thin front end over the engine / node packages."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from p2pk3.engine.reference import default_model_dir

MODEL_HELP = "model directory (HF layout); default: the embedded tiny K3"


def _model_dir(model: str | None) -> Path:
    p = Path(model) if model else default_model_dir()
    if not (p / "config.json").exists():
        raise click.BadParameter(f"{p}: no config.json here (not a model directory)", param_hint="--model")
    return p


def _parse_tokens(s: str) -> list[int]:
    try:
        toks = [int(t) for t in s.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter("tokens must be comma-separated integers, e.g. 1,2,3", param_hint="--tokens") from None
    if len(toks) < 2:
        raise click.BadParameter("need at least 2 tokens to score", param_hint="--tokens")
    return toks


@click.group()
@click.version_option(package_name="p2pk3")
def main() -> None:
    """p2pk3: Kimi K3 on a ring of consumer GPUs."""


@main.command()
@click.option("--model", help=MODEL_HELP)
@click.option("--tokens", required=True, help="comma-separated token ids")
@click.option("--incremental", is_flag=True, help="token by token through the decode path instead of one prefill")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--dump-logits", type=click.Path(dir_okay=False), help="write float32 logits [T, vocab] (numpy .npy)")
@click.option("--nodes", type=int, default=0, help="run through a local ring of N daemons instead of in-process")
@click.option("--stages", type=int, default=1, show_default=True, help="in-process: split into N layer-range stages")
@click.option("--device", default="cpu", show_default=True)
def score(model, tokens, incremental, dtype, dump_logits, nodes, stages, device):
    """Mean NLL and perplexity of a token sequence."""
    import numpy as np

    from p2pk3.engine.reference import Pipeline, nll

    mdir = _model_dir(model)
    toks = _parse_tokens(tokens)
    if nodes:
        from p2pk3.node.local import score_on_ring
        logits = score_on_ring(mdir, toks, nodes=nodes, incremental=incremental, dtype=dtype)
    else:
        pipe = Pipeline.load(mdir, n_stages=stages, dtype=dtype, device=device, max_sessions=1,
                             max_tokens=len(toks) + 64)
        vocab = pipe.cfg.vocab_size
        bad = [t for t in toks if not 0 <= t < vocab]
        if bad:
            raise click.BadParameter(f"token ids {bad[:5]} outside the vocabulary 0..{vocab - 1}", param_hint="--tokens")
        logits = pipe.score(toks, incremental=incremental)
    loss, ppl = nll(logits, toks)
    click.echo(f"tokens: {len(toks)}  mode: {'incremental' if incremental else 'prefill'}  dtype: {dtype}")
    click.echo(f"mean NLL: {loss:.6f}  perplexity: {ppl:.4f}")
    if dump_logits:
        np.save(dump_logits, logits.float().cpu().numpy())
        click.echo(f"logits {tuple(logits.shape)} written to {dump_logits}")


@main.group()
def bench() -> None:
    """Benchmarks (each prints ratios against a baseline measured in the same run)."""


@bench.command("reference")
@click.option("--model", help=MODEL_HELP + " (default here: a random tiny-k3 generated in a temp dir)")
@click.option("--batch", "batches", multiple=True, type=int, default=(1, 8), show_default=True)
@click.option("--steps", type=int, default=32, show_default=True)
@click.option("--prompt-len", type=int, default=32, show_default=True)
def bench_reference(model, batches, steps, prompt_len):
    """Reference decode tokens/s on this machine."""
    from p2pk3.engine.bench import bench_reference_decode
    bench_reference_decode(model, list(batches), steps, prompt_len)


def _topology_model_dir(topo) -> Path:
    if not topo.model.path:
        raise click.UsageError("the topology's [model] has no path (download the model first; see docs/topology.md)")
    p = Path(topo.model.path).expanduser()
    if not p.is_absolute() and topo.source:
        p = Path(topo.source).parent / p
    return _model_dir(str(p))


@main.command()
@click.option("--topology", "topology_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--slot", help="the slot this daemon claims")
@click.option("--standby", is_flag=True, help="run as a spare on a standby slot (holds no layers; fail-over is the next step)")
@click.option("--host", default=None, help="listen address (default: the slot's host, else 0.0.0.0)")
@click.option("--port", type=int, default=None)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--device", default=None, help="torch device (default: cuda if available, else cpu)")
@click.option("--max-sessions", type=int, default=32, show_default=True)
@click.option("--max-tokens", type=int, default=32768, show_default=True, help="MLA cache tokens over all sessions")
@click.option("--discovery/--no-discovery", default=True, show_default=True, help="UDP beacons on the LAN")
@click.option("--advertise-host", default=None, help="address peers should dial (default: --host)")
@click.option("--drop-beacons", is_flag=True, hidden=True, help="fault injection: ignore received beacons")
@click.option("-v", "--verbose", count=True)
def node(topology_path, slot, standby, host, port, dtype, device, max_sessions, max_tokens, discovery,
         advertise_host, drop_beacons, verbose):
    """Run one node daemon of the ring."""
    import asyncio
    import logging
    import signal

    import torch

    from p2pk3.node.claims import ClaimRefused
    from p2pk3.node.daemon import NodeDaemon
    from p2pk3.topology import Topology, TopologyError

    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        topo = Topology.load(topology_path)
        if standby and not slot:
            if not topo.standby:
                raise click.UsageError(f"{topology_path} has no standby slots")
            slot = topo.standby[0].id
        if not slot:
            raise click.UsageError("give --slot ID, or --standby to run as a spare")
        try:
            topo.slot(slot)
        except KeyError:
            known = ", ".join(x.id for x in topo.slots)
            raise click.UsageError(f"unknown slot {slot!r} in {topology_path} (slots: {known})") from None
        if standby and not topo.slot(slot).standby:
            raise click.UsageError(f"slot {slot} is not a standby slot")
        secret = topo.secret()
    except TopologyError as e:
        raise click.ClickException(str(e))
    except KeyError as e:
        raise click.ClickException(f"unknown slot {slot!r} in {topology_path}") from e
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    d = NodeDaemon(topo, slot, model_dir=_topology_model_dir(topo), secret=secret,
                   host=host or topo.slot(slot).host or "0.0.0.0", port=port, dtype=dtype, device=device,
                   max_sessions=max_sessions, max_tokens=max_tokens, discovery=discovery,
                   advertise_host=advertise_host, drop_beacons=drop_beacons)

    async def run_daemon():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await d.start()
        except ClaimRefused as e:
            raise click.ClickException(f"cannot claim slot {slot}: {e}")
        click.echo(f"node {d.node_id}: slot {slot} up on {d.host}:{d.port}", err=True)
        await stop.wait()
        await d.stop()

    _run_async(run_daemon())


def _run_async(coro):
    import asyncio
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


@main.command()
@click.option("--model", help=MODEL_HELP)
@click.option("--nodes", type=int, default=4, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--prompt", default=None, help="generate once for this prompt, print it with the ring's statistics, and stop")
@click.option("--max-tokens", type=int, default=48, show_default=True)
def local(model, nodes, dtype, prompt, max_tokens):
    """Start N daemons on loopback as one ring (Ctrl-C stops them)."""
    import time

    from p2pk3.node.local import LocalRing

    mdir = _model_dir(model)
    ring = LocalRing(mdir, nodes, dtype=dtype)
    click.echo(f"starting {nodes} daemons for {mdir} ...")
    with ring:
        h, p = ring.entry_addr
        click.echo(f"ring up: entry {h}:{p}; topology {ring.topology}; logs in {ring.log_dir}")
        for s in ring.topo.active:
            click.echo(f"  slot {s.id}: layers {s.layers[0]}..{s.layers[1]} at {s.host}:{s.port}")
        if prompt is not None:
            _generate_and_print(ring, mdir, prompt, max_tokens)
            return
        click.echo("Ctrl-C to stop.")
        try:
            while all(pr.poll() is None for pr in ring.procs):
                time.sleep(0.5)
            click.echo("a daemon exited; stopping the ring", err=True)
        except KeyboardInterrupt:
            click.echo("stopping ...")


def _generate_and_print(ring, mdir, prompt, max_tokens, temperature=0.0, seed=None):
    import asyncio

    from p2pk3.engine.sampling import SamplingParams
    from p2pk3.tokenizer import load_tokenizer

    tok = load_tokenizer(mdir)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, stop_ids=tuple(tok.eos_ids))
    click.echo(f"> {prompt}")

    async def go():
        from p2pk3.node.client import Client
        c = await ring.client()
        try:
            reply = await c.generate(ids, params)
        finally:
            c.close()
        stages = []
        for s in ring.topo.active:
            sc = await Client.connect(s.host, s.port, ring.secret)
            try:
                stages.append(await sc.status())
            finally:
                sc.close()
        return reply, stages

    r, stages = asyncio.run(go())
    click.echo(tok.decode([t for t in r.tokens if t not in tok.eos_ids]).strip())
    st = r.stats
    tps = st.get("decode_tokens_per_s")
    click.echo(f"[ring of {len(stages)} nodes: {st['prompt_tokens']} prompt + {st['generated_tokens']} generated tokens; "
               f"time to first token {1000 * (st['ttft_s'] or 0):.0f} ms; "
               f"decode {tps or 0:.1f} tok/s; total {st['total_s']:.2f} s]")
    for s in stages:
        click.echo(f"  stage {s['slot']}: {s['batches']} batches, {s['tokens']} tokens, "
                   f"{1000 * s['busy_s']:.0f} ms compute")


@main.command()
@click.option("--model", help=MODEL_HELP)
@click.option("--prompt", required=True)
@click.option("--nodes", type=int, default=0, help="through a fresh local ring of N daemons (0: in-process)")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0)
@click.option("--top-p", type=float, default=1.0)
@click.option("--seed", type=int, default=None)
@click.option("--raw", is_flag=True, help="no chat template: continue the prompt text")
def generate(model, prompt, nodes, max_tokens, temperature, top_k, top_p, seed, raw):
    """Generate an answer to PROMPT."""
    from p2pk3.engine.reference import Pipeline
    from p2pk3.engine.sampling import SamplingParams
    from p2pk3.tokenizer import load_tokenizer

    mdir = _model_dir(model)
    if nodes:
        from p2pk3.node.local import LocalRing
        with LocalRing(mdir, nodes) as ring:
            _generate_and_print(ring, mdir, prompt, max_tokens, temperature, seed)
        return
    tok = load_tokenizer(mdir)
    ids = tok.encode(prompt) if raw else tok.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens,
                            stop_ids=tuple(tok.eos_ids))
    pipe = Pipeline.load(mdir, 1, max_sessions=1, max_tokens=len(ids) + max_tokens + 64)
    out = pipe.generate([ids], params)[0]
    click.echo(tok.decode([t for t in out if t not in tok.eos_ids]))


@main.group()
def topology() -> None:
    """Topology files."""


@topology.command("init")
@click.option("--model", required=True, help="model directory")
@click.option("--nodes", type=int, required=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--base-port", type=int, default=7400, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="write here (default: stdout)")
def topology_init(model, nodes, host, base_port, out):
    """An even split of the model's layers over N nodes."""
    from p2pk3.model.config import K3Config
    from p2pk3.topology import TopologyError, even_split

    try:
        cfg = K3Config.from_pretrained(model)
        topo = even_split(cfg, nodes, host=host, base_port=base_port, model_path=str(Path(model).resolve()),
                          secret_file="secret")
        for w in topo.validate(cfg):
            click.echo(f"warning: {w}", err=True)
    except (TopologyError, ValueError) as e:
        raise click.ClickException(str(e))
    text = topo.dump()
    if out:
        Path(out).write_text(text)
        click.echo(f"wrote {out}; create the secret next to it: python -c 'import secrets;print(secrets.token_hex(32))' > secret")
    else:
        click.echo(text)


def run() -> None:  # pragma: no cover
    main(prog_name="p2pk3")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
