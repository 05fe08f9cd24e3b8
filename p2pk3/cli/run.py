"""Commands that run the model once: `score`, `generate`, `bench reference`."""

from __future__ import annotations

import click

from .group import main
from .common import DTYPES, MODEL_HELP, UserError, build_prompt, check_writable, model_dir, run_async
from .options import sampling_options, speculation_options


def _parse_tokens(s: str) -> list[int]:
    try:
        toks = [int(t) for t in s.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter("tokens must be comma-separated integers, e.g. 1,2,3", param_hint="--tokens") from None
    if len(toks) < 2:
        raise click.BadParameter("need at least 2 tokens to score", param_hint="--tokens")
    return toks


def _parse_formats(ctx, param, value):
    """--formats attention=mxfp8,shared_experts=mxfp4 -> {class: format} (p2pk3.quant.formats)."""
    if not value:
        return None
    from p2pk3.quant.formats import FormatError, parse_formats

    try:
        return parse_formats(value)
    except FormatError as e:
        raise click.BadParameter(str(e), param_hint="--formats") from None


def formats_option(f):
    return click.option(
        "--formats",
        callback=_parse_formats,
        default=None,
        metavar="CLASS=FMT,...",
        help="in-process: re-quantize weight classes at load, e.g. attention=mxfp8,shared_experts=mxfp4 "
        "(classes attention, shared_experts, dense, lm_head, latent; formats bf16, mxfp8, mxfp4)",
    )(f)


def _no_ring_formats(nodes, formats):
    if nodes and formats:
        raise click.BadParameter(
            "--formats is for in-process runs; a ring takes them from its topology ([model] formats)",
            param_hint="--formats",
        )


@main.command()
@click.option("--model", help=MODEL_HELP)
@click.option("--tokens", required=True, help="comma-separated token ids")
@click.option("--incremental", is_flag=True, help="token by token through the decode path instead of one prefill")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--dump-logits", type=click.Path(dir_okay=False), help="write float32 logits [T, vocab] (numpy .npy)")
@click.option(
    "--nodes", type=click.IntRange(min=0), default=0, help="run through a local ring of N daemons instead of in-process"
)
@click.option(
    "--stages",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="in-process: split into N layer-range stages",
)
@click.option("--device", default="cpu", show_default=True)
@formats_option
def score(model, tokens, incremental, dtype, dump_logits, nodes, stages, device, formats):
    """Mean NLL and perplexity of a token sequence."""
    import numpy as np

    from p2pk3.engine.reference import Pipeline, nll
    from p2pk3.model.config import K3Config

    mdir = model_dir(model)
    toks = _parse_tokens(tokens)
    check_writable(dump_logits, "--dump-logits")
    cfg = K3Config.from_pretrained(mdir)
    bad = [t for t in toks if not 0 <= t < cfg.vocab_size]
    if bad:
        raise click.BadParameter(
            f"token ids {bad[:5]} outside the vocabulary 0..{cfg.vocab_size - 1}", param_hint="--tokens"
        )
    n = nodes or stages
    if n > cfg.num_hidden_layers:
        raise click.BadParameter(
            f"{n} stages but the model has only {cfg.num_hidden_layers} layers",
            param_hint="--nodes" if nodes else "--stages",
        )
    _check_device(device)
    _no_ring_formats(nodes, formats)
    if nodes:
        from p2pk3.node.local import score_on_ring

        logits = score_on_ring(mdir, toks, nodes=nodes, incremental=incremental, dtype=dtype)
    else:
        pipe = Pipeline.load(
            mdir,
            n_stages=stages,
            dtype=dtype,
            device=device,
            max_sessions=1,
            max_tokens=len(toks) + 64,
            formats=formats,
        )
        logits = pipe.score(toks, incremental=incremental)
    loss, ppl = nll(logits, toks)
    click.echo(f"tokens: {len(toks)}  mode: {'incremental' if incremental else 'prefill'}  dtype: {dtype}")
    click.echo(f"mean NLL: {loss:.6f}  perplexity: {ppl:.4f}")
    if dump_logits:
        np.save(dump_logits, logits.float().cpu().numpy())
        click.echo(f"logits {tuple(logits.shape)} written to {dump_logits}")


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise click.BadParameter(
            f"{device!r} is not a torch device (cpu, cuda, cuda:1, ...)", param_hint="--device"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("CUDA is not available on this machine (use --device cpu)", param_hint="--device")


@main.command()
@click.option("--model", help=MODEL_HELP)
@click.option("--prompt", required=True)
@click.option(
    "--nodes", type=click.IntRange(min=0), default=0, help="through a fresh local ring of N daemons (0: in-process)"
)
@sampling_options
@click.option("--raw", is_flag=True, help="no chat template: continue the prompt text (after the model's BOS token)")
@speculation_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object: token ids, text and statistics")
@formats_option
def generate(model, prompt, nodes, raw, as_json, formats, sampling):
    """Generate an answer to PROMPT (in-process, or through a local ring with --nodes)."""
    import time

    mdir = model_dir(model)
    _no_ring_formats(nodes, formats)
    prompts, p = build_prompt(mdir, prompt, sampling, raw=raw)
    ids, params = p.ids, p.params
    t0 = time.perf_counter()
    if nodes:
        from p2pk3.model.config import K3Config

        if nodes > K3Config.from_pretrained(mdir).num_hidden_layers:
            raise click.BadParameter("more nodes than the model has layers", param_hint="--nodes")
        from p2pk3.node.local import LocalRing

        with LocalRing(mdir, nodes) as ring:
            reply = run_async(_ring_generate(ring, ids, params))
        out, stats = reply.tokens, dict(reply.stats)
        if reply.stage_stats.get("spec"):
            stats["entry_stage"] = reply.stage_stats["spec"]
    else:
        from p2pk3.engine.reference import Pipeline

        pipe = Pipeline.load(mdir, 1, max_sessions=1, max_tokens=len(ids) + params.max_tokens + 64, formats=formats)
        out = pipe.generate([ids], params, draft_policy="adaptive")[0] if params.max_tokens else []
        stats = {
            "prompt_tokens": len(ids),
            "generated_tokens": len(out),
            **(pipe.last_stats[0] if params.speculating and params.max_tokens else {}),
        }
    text = prompts.answer_text(out)
    if as_json:
        import json

        stats["wall_s"] = round(time.perf_counter() - t0, 4)
        click.echo(
            json.dumps(
                {
                    "tokens": [int(t) for t in out],
                    "text": text,
                    "speculate": params.speculate,
                    "draft_tokens": params.draft_tokens,
                    "stats": stats,
                }
            )
        )
    else:
        click.echo(text)


async def _ring_generate(ring, ids, params):
    c = await ring.client()
    try:
        return await c.generate(ids, params)
    finally:
        c.close()


@main.group()
def bench() -> None:
    """Benchmarks (each prints ratios against a baseline measured in the same run)."""


@bench.command("reference")
@click.option("--model", help="model directory (default: a random tiny-k3 generated in a temp dir)")
@click.option(
    "--batch",
    "batches",
    multiple=True,
    type=click.IntRange(min=1),
    default=(1, 8),
    show_default=True,
    help="batch sizes; batch 1 is always measured as the baseline",
)
@click.option("--steps", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True)
def bench_reference(model, batches, steps, prompt_len):
    """Reference decode tokens/s on this machine."""
    from p2pk3.engine.bench import bench_reference_decode

    if model is not None:
        model = str(model_dir(model))
    batches = sorted(set(batches) | {1})
    bench_reference_decode(model, batches, steps, prompt_len)


__all__ = ["score", "generate", "bench", "UserError"]
