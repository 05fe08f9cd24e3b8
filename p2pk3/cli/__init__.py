"""`p2pk3` command line (click). Each command is a thin front end over the engine / node packages:
`run.py` (score, generate, bench), `ring.py` (node, local), `topo.py` (topology, secret).

User mistakes end in one clear line and a non-zero exit, never a traceback; `--verbose` (before the
command: `p2pk3 --verbose local ...`) or P2PK3_DEBUG=1 shows the traceback."""

from __future__ import annotations

import sys

from .group import main
from . import chat, dashboard, deploy, plan, ring, run, serve, topo  # noqa: F401  (the commands register themselves on `main`)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
