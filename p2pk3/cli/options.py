"""Options shared by several commands, each declared once: `--topology`, the sampling options and the
speculation options (same names, defaults and help everywhere).

    @topology_option()                    # --topology FILE -> topology_path (required=False: optional)
    @sampling_options                     # --max-tokens --temperature --top-k --top-p --seed --min-p and penalties
    @speculation_options                  # --speculate --draft-tokens
    def cmd(topology_path, sampling): ... # sampling: a SamplingOverrides (frontends/prompt.py)

The sampling and speculation options arrive together as one `sampling` argument, a `SamplingOverrides`
whose unset fields (None) take the checkpoint's generation_config defaults when the prompt is built, as
the API does for a request that leaves them out. The ranges are the API's (p2pk3/params.py).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import click

from p2pk3.frontends.prompt import SamplingOverrides
from p2pk3.params import DEFAULT_DRAFT, DEFAULT_MAX_TOKENS, MAX_DRAFT, MAX_SEED, MAX_TEMPERATURE, SPEC_METHODS

__all__ = [
    "topology_option",
    "state_option",
    "topology_of_state",
    "sampling_options",
    "speculation_options",
    "queue_options",
    "queue_args",
    "prefix_cache_options",
    "prefix_cache_args",
    "TOPOLOGY_HELP",
]

TOPOLOGY_HELP = "the cluster's topology file (TOML, docs/topology.md)"
_FROM_MODEL = "the model's generation_config, else "


def topology_option(required: bool = True):
    return click.option(
        "--topology",
        "topology_path",
        required=required,
        type=click.Path(exists=True, dir_okay=False),
        help=TOPOLOGY_HELP,
    )


def state_option():
    """--state FILE: the state file of a running `p2pk3 local --state FILE`, instead of --topology."""
    return click.option(
        "--state",
        "state_file",
        type=click.Path(dir_okay=False),
        default=None,
        help="instead of --topology: the state file of a running `p2pk3 local --state FILE`",
    )


def topology_of_state(state_file: str) -> str:
    """The topology path a `p2pk3 local` state file names; one clear line when there is no ring."""
    import json
    from pathlib import Path

    p = Path(state_file)
    if not p.exists():
        raise click.BadParameter(
            f"{p} does not exist: no ring writes it (start one with `p2pk3 local --state {p} &` "
            f"and wait until it prints 'ring up')",
            param_hint="--state",
        )
    try:
        topo = json.loads(p.read_text())["topology"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise click.BadParameter(
            f"{p} is not the state file of `p2pk3 local` ({type(e).__name__}: {e})", param_hint="--state"
        ) from None
    if not Path(topo).exists():
        raise click.BadParameter(f"{p} names {topo}, which is gone: that ring stopped", param_hint="--state")
    return topo


def _overrides(f, names: tuple[str, ...], options: list):
    """Declare `options` on `f`; their values (named `names`) reach it merged into `sampling`."""

    @functools.wraps(f)
    def wrapper(*args, **kw):
        fields = {n: kw.pop(n) for n in names}
        kw["sampling"] = replace(kw.get("sampling") or SamplingOverrides(), **fields)
        return f(*args, **kw)

    for opt in reversed(options):
        wrapper = opt(wrapper)
    return wrapper


def sampling_options(f):
    """--max-tokens, --temperature, --top-k, --top-p, --seed, --min-p, --repetition-penalty,
    --frequency-penalty, --presence-penalty (unset: the checkpoint's generation_config, else off)."""
    return _overrides(
        f,
        (
            "max_tokens",
            "temperature",
            "top_k",
            "top_p",
            "seed",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ),
        [
            click.option(
                "--max-tokens",
                type=click.IntRange(min=0),
                default=None,
                show_default=f"{_FROM_MODEL}{DEFAULT_MAX_TOKENS}",
                help="most tokens to generate (0: none)",
            ),
            click.option(
                "--temperature",
                type=click.FloatRange(0, MAX_TEMPERATURE),
                default=None,
                show_default=f"{_FROM_MODEL}0",
                help="0 = greedy",
            ),
            click.option(
                "--top-k", type=click.IntRange(min=0), default=None, show_default=f"{_FROM_MODEL}0", help="0 = off"
            ),
            click.option(
                "--top-p",
                type=click.FloatRange(min=0, max=1, min_open=True),
                default=None,
                show_default=f"{_FROM_MODEL}1",
            ),
            click.option("--seed", type=click.IntRange(min=0, max=MAX_SEED), default=None),
            click.option(
                "--min-p",
                type=click.FloatRange(0, 1),
                default=None,
                show_default=f"{_FROM_MODEL}0",
                help="drop tokens below this share of the likeliest one's probability (0 = off)",
            ),
            click.option(
                "--repetition-penalty",
                type=click.FloatRange(min=0, min_open=True),
                default=None,
                show_default=f"{_FROM_MODEL}1",
                help="divide the logits of tokens already in the prompt or the answer by this (1 = off)",
            ),
            click.option(
                "--frequency-penalty",
                type=click.FloatRange(-2, 2),
                default=None,
                show_default="0",
                help="lower each token's logit by this times its count in the answer so far",
            ),
            click.option(
                "--presence-penalty",
                type=click.FloatRange(-2, 2),
                default=None,
                show_default="0",
                help="lower the logit of every token already in the answer by this",
            ),
        ],
    )


def speculation_options(f):
    """--speculate, --draft-tokens."""
    return _overrides(
        f,
        ("speculate", "draft_tokens"),
        [
            click.option(
                "--speculate",
                type=click.Choice(SPEC_METHODS),
                default="off",
                show_default=True,
                help="speculative decoding: draft tokens by prompt lookup (ngram) or a suffix index over recent "
                "prompts and outputs (suffix); the ring verifies them, the output is the same",
            ),
            click.option(
                "--draft-tokens",
                type=click.IntRange(1, MAX_DRAFT),
                default=DEFAULT_DRAFT,
                show_default=True,
                help="with --speculate: the most drafted tokens per pass (the entry adapts below it)",
            ),
        ],
    )


def queue_options(*, tighten: bool = False):
    """--max-queue, --queue-timeout: the entry's admission queue (node/admission.py). On `node` / `local`
    they set the entry's bounds; with `tighten` (`serve`) they bound this front end's requests, never
    beyond the entry's."""
    from p2pk3.node.options import DEFAULT_QUEUE_TIMEOUT_S, QUEUE_FACTOR

    queue_help = (
        "most of this server's requests that may wait at the entry (never more than the entry's own); past it: "
        "busy (HTTP 429 + Retry-After)  [default: the entry's]"
        if tighten
        else "most requests that wait at the entry for a free session; past it: busy (HTTP 429 + Retry-After)  "
        f"[default: {QUEUE_FACTOR} x the session capacity]"
    )
    timeout_help = (
        "seconds this server's requests wait in the entry's queue at most  [default: the entry's]"
        if tighten
        else f"seconds a request waits in the queue at most  [default: {DEFAULT_QUEUE_TIMEOUT_S:g}]"
    )

    def deco(f):
        f = click.option(
            "--queue-timeout", type=click.FloatRange(min=0, min_open=True), default=None, help=timeout_help
        )(f)
        return click.option(
            "--max-queue",
            type=click.IntRange(min=0),
            default=None,
            help=queue_help,
        )(f)

    return deco


def queue_args(max_queue: int | None, queue_timeout: float | None) -> list[str]:
    """The two queue options as `p2pk3 node` arguments (for the daemons `p2pk3 local` starts)."""
    return [
        a
        for flag, v in (("--max-queue", max_queue), ("--queue-timeout", queue_timeout))
        if v is not None
        for a in (flag, f"{v:g}" if isinstance(v, float) else str(v))
    ]
# ------------------------------------------------------------------------------------------ prefix cache
_PREFIX_OPTIONS = (
    ("--prefix-cache-gb", "prefix_cache_gb", click.FloatRange(min=0), None,
     "prefix cache on the device, GiB (0: off)  [default: a quarter of the GPU's free memory; on a CPU a tenth "
     "of the available RAM, at most 4]"),
    ("--host-cache-gb", "host_cache_gb", click.FloatRange(min=0), None,
     "the prefix cache's host-RAM tier, GiB (0: none)  [default: beside a GPU a quarter of the available RAM, "
     "at most 64; on a CPU none]"),
    ("--prefix-block", "prefix_block", click.IntRange(min=1), 64, "tokens per prefix-cache block (the MLA page)"),
    ("--snapshot-every", "snapshot_every", click.IntRange(min=1), 16,
     "a KDA state snapshot every this many blocks of a prompt (and at its end and last boundary)"),
)


def prefix_cache_options(f):
    """--prefix-cache-gb, --host-cache-gb, --prefix-block, --snapshot-every -> one `prefix_cache` dict of
    NodeOptions fields (the unset ones left out)."""
    for flag, dest, kind, default, helptext in reversed(_PREFIX_OPTIONS):
        f = click.option(flag, dest, type=kind, default=None, help=helptext + (f"  [default: {default}]" if default else ""))(f)
    return _overrides_dict(f, tuple(d for _, d, *_ in _PREFIX_OPTIONS), "prefix_cache")


def _overrides_dict(f, names: tuple[str, ...], into: str):
    @functools.wraps(f)
    def wrapper(*args, **kw):
        given = {n: kw.pop(n, None) for n in names}
        kw[into] = {n: v for n, v in given.items() if v is not None}
        return f(*args, **kw)

    return wrapper


def prefix_cache_args(prefix_cache: dict) -> list[str]:
    """The prefix-cache options as `p2pk3 node` arguments (for the daemons `p2pk3 local` starts)."""
    flags = {d: flag for flag, d, *_ in _PREFIX_OPTIONS}
    return [a for d, v in prefix_cache.items() for a in (flags[d], f"{v:g}" if isinstance(v, float) else str(v))]
