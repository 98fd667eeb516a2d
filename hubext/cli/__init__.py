"""The ``elastic-gpu`` command line: init, up, status, quota (single-machine mode).

``elastic-gpu up`` is what a new user runs (``./dev up``): it writes an editable config on the
first run (``elastic-gpu init``), then starts JupyterHub with the real configurable-http-proxy,
the local GPU spawner, the broker and the culler, says which login mode it runs and why, and
prints the URL. ``status`` and ``quota`` show the pool and the use per workspace, from the hub's
JSON API or, when the hub is down, from the SQLite ledger it left.

Modules: ``commands`` (the parser and the commands), ``config`` (init and the config template),
``accounts`` (who runs what, who may read the hub's files), ``supervise`` (``up``), ``client``
(the hub's API, where the hub is), ``offline`` (the ledger), ``render`` (tables and bars),
``proxy`` (configurable-http-proxy: finding it, the ports, one left behind).
"""

from __future__ import annotations

import sys

from .base import CLIError
from .commands import build_parser

__all__ = ["CLIError", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except CLIError as e:
        print(f"elastic-gpu {args.command}: error: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        return 130
