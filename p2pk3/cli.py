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


def run() -> None:  # pragma: no cover
    main(prog_name="p2pk3")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
