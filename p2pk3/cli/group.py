"""The `p2pk3` click group: one-line errors (usage errors name the command's --help; tracebacks only with
--verbose or P2PK3_DEBUG=1). The commands register themselves on `main` from their modules (p2pk3/cli/)."""

from __future__ import annotations

import os
import sys

import click

from .common import UserError


class _Main(click.Group):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """As click's, but a usage error is one line that names the command's --help (click prints four)."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except _NO_ARGS_IS_HELP as e:  # a group without its subcommand: its help, as click shows it
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            cmd = e.ctx.command_path if e.ctx is not None else "p2pk3"
            click.echo(f"Error: {_shorten(e.format_message())}  ({cmd} --help)", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:  # our own errors: said whole (they name the file, the figure, the fix)
            click.echo(f"Error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # our own errors: one line unless asked for the traceback
            if ctx.obj and ctx.obj.get("verbose") or os.environ.get("P2PK3_DEBUG"):
                raise
            raise UserError(_one_line(e)) from None


def _one_line(e: Exception) -> str:
    from p2pk3.node.claims import ClaimRefused
    from p2pk3.topology import TopologyError

    if isinstance(
        e,
        (
            TopologyError,
            ClaimRefused,
            ValueError,
            FileNotFoundError,
            PermissionError,
            RuntimeError,
            TimeoutError,
            ConnectionError,
        ),
    ):
        msg = str(e)
    else:
        msg = f"{type(e).__name__}: {e}"
    return msg + "  (run with --verbose for the traceback)" if not isinstance(e, (ValueError,)) else msg


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())
MAX_ERROR = 300  # characters of a usage error line (click echoes the bad value, however long)


def _shorten(msg: str) -> str:
    """One line of at most MAX_ERROR characters: the first line of a longer text, cut in the middle."""
    lines = [x.strip() for x in msg.strip().splitlines() if x.strip()]
    line = lines[0] if lines else msg.strip()
    if len(lines) > 1:
        line += f" … {lines[-1]}"
    if len(line) > MAX_ERROR:
        half = (MAX_ERROR - 5) // 2
        line = f"{line[:half]} … {line[-half:]}"
    return line


@click.group(cls=_Main)
@click.version_option(package_name="p2pk3")
@click.option("--verbose", is_flag=True, help="show tracebacks of errors")
@click.pass_context
def main(ctx, verbose) -> None:
    """p2pk3: Kimi K3 on a ring of consumer GPUs."""
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose
