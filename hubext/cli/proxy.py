"""Finding configurable-http-proxy (the real proxy JupyterHub starts) for ``elastic-gpu up``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import base
from .base import CLIError


def find_proxy() -> str:
    """configurable-http-proxy from $ELASTIC_GPU_PROXY, the project's node_modules, the current directory's, or PATH."""
    candidates = [
        os.environ.get("ELASTIC_GPU_PROXY", ""),
        str(base.REPO / "node_modules" / ".bin" / "configurable-http-proxy"),
        str(Path.cwd() / "node_modules" / ".bin" / "configurable-http-proxy"),
        shutil.which("configurable-http-proxy") or "",
    ]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            if not shutil.which("node"):
                raise CLIError(
                    f"found {path} but not `node` (Node.js) to run it; install Node.js 18 or newer "
                    "(e.g. apt-get install nodejs) and run again"
                )
            return path
    raise CLIError(
        "configurable-http-proxy is not installed. Install it with `npm install configurable-http-proxy` "
        "in the project folder (./dev up does this), or put it on PATH, or set ELASTIC_GPU_PROXY to its path"
    )
