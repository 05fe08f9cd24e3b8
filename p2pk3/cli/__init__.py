"""`p2pk3` command line (click). Each command is a thin front end over the engine / node packages:
`run.py` (score, generate, bench), `ring.py` (node, local), `topo.py` (topology, secret).

User mistakes end in one clear line and a non-zero exit, never a traceback; `--verbose` (before the
command: `p2pk3 --verbose local ...`) or P2PK3_DEBUG=1 shows the traceback."""
from __future__ import annotations

import os
import sys

import click

from .common import UserError


class _Main(click.Group):
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
    if isinstance(e, (TopologyError, ClaimRefused, ValueError, FileNotFoundError, PermissionError, RuntimeError,
                      TimeoutError, ConnectionError)):
        msg = str(e)
    else:
        msg = f"{type(e).__name__}: {e}"
    return msg + "  (run with --verbose for the traceback)" if not isinstance(e, (ValueError,)) else msg


@click.group(cls=_Main)
@click.version_option(package_name="p2pk3")
@click.option("--verbose", is_flag=True, help="show tracebacks of errors")
@click.pass_context
def main(ctx, verbose) -> None:
    """p2pk3: Kimi K3 on a ring of consumer GPUs."""
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose


from . import chat, dashboard, deploy, plan, ring, run, serve, topo  # noqa: E402,F401  (the commands register themselves on `main`)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
