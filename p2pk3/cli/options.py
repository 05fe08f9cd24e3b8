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
