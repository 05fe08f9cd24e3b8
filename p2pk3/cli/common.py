"""Shared pieces of the commands: model directories, the error type, prompts, the async runner (the
shared options are in options.py)."""

from __future__ import annotations

from pathlib import Path

import click

MODEL_HELP = "model directory (HF layout); default: the embedded k3-docs"
DTYPES = ["float32", "bfloat16"]


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 daemon`, `2 daemons` (`many`: an irregular plural)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


class UserError(click.ClickException):
    """A mistake of the user's, said in one line (exit 1)."""


def model_dir(model: str | None, param: str = "--model") -> Path:
    from p2pk3 import default_model_dir

    p = Path(model) if model else default_model_dir()
    if p.exists() and not p.is_dir():
        raise click.BadParameter(
            f"{p} is a file; give the model's directory (the folder holding config.json)", param_hint=param
        )
    if not p.is_dir():
        raise click.BadParameter(f"{p}: no such directory", param_hint=param)
    if not (p / "config.json").exists():
        raise click.BadParameter(f"{p}: no config.json here (not a model directory)", param_hint=param)
    return p


def topology_model_dir(topo) -> Path:
    if not topo.model.path:
        raise UserError(
            'the topology\'s [model] has no path: set `path = "/models/..."` in its [model] table '
            "(see docs/topology.md)"
        )
    return model_dir(str(topo.resolve(topo.model.path)), "[model] path")


def check_writable(path: str | None, param: str) -> None:
    """Fail before any work when a file cannot be written where asked."""
    if path is None:
        return
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise click.BadParameter(f"folder {parent} does not exist", param_hint=param)


def build_prompt(mdir: Path, prompt: str, sampling, raw: bool = False):
    """(PromptBuilder, Prompt) of a `--prompt` (frontends/prompt.py, the path every front end takes): one user
    message through the checkpoint's chat template, or with `raw` the text after the model's BOS token."""
    from p2pk3.frontends.prompt import PromptBuilder, PromptError

    prompts = PromptBuilder.from_pretrained(mdir)
    try:
        return prompts, (prompts.text(prompt, sampling) if raw else prompts.question(prompt, sampling))
    except PromptError as e:
        raise click.BadParameter(str(e), param_hint=f"--{e.field.replace('_', '-')}") from None


def run_async(coro):
    import asyncio

    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
