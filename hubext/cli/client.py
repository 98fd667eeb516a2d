"""The CLI's side of the hub's JSON API, and where the hub of a config dir is.

``elastic-gpu up`` records the hub's URL, port and pids in ``data/hub.json`` and keeps the file
when the hub stops (``running: false``), so ``status`` and ``quota`` know the hub's real port
without a flag. The CLI token goes only to a hub that this config dir's ``up`` started and whose
process still runs (or to the ``--url`` the user names): never to whatever else answers on a port.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..local.processes import process_alive
from .base import HUB_STATE_FILE, TOKEN_FILE, CLIError


def http_get(url: str, token: str = "", timeout: float = 5) -> tuple[int, Any]:
    """(status, JSON body or text) of a GET; raises OSError when nothing answers."""
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, body.decode(errors="replace")


def read_token(data: Path) -> str:
    try:
        return (data / TOKEN_FILE).read_text().strip()
    except OSError:
        return ""


def read_hub_state(data: Path) -> dict[str, Any]:
    """What ``up`` recorded about the hub of this config dir ({} when no ``up`` ever ran it)."""
    try:
        state = json.loads((data / HUB_STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def write_hub_state(data: Path, state: dict[str, Any]) -> None:
    tmp = data / f".{HUB_STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.chmod(tmp, 0o644)  # no secret in it; `status` run by another account reads the URL
    os.replace(tmp, data / HUB_STATE_FILE)


def hub_running(state: dict[str, Any]) -> bool:
    """Whether the JupyterHub process ``up`` recorded still runs (the same process, not a recycled pid)."""
    pid = state.get("hub_pid")
    return bool(state.get("running")) and isinstance(pid, int) and process_alive(pid, state.get("hub_started"))


def hub_url(state: dict[str, Any], default: str) -> str:
    return str(state.get("url") or default)


def fetch_view(
    config_dir: Path, what: str, *, url: str = "", token: str = "", offline: bool = False
) -> tuple[dict[str, Any], str]:
    """The pool or quota view and a line saying where it came from (the hub's API or the ledger)."""
    from .offline import offline_view

    data = config_dir / "data"
    state = read_hub_state(data)
    if offline:
        reason = "--offline"
    elif not url and not state:
        reason = f"no hub was started with this config dir yet ({data / HUB_STATE_FILE} is missing)"
    elif not url and not hub_running(state):
        reason = f"the hub at {hub_url(state, '?')} is not running"
    else:
        target = (url or hub_url(state, "")).rstrip("/")
        token = token or os.environ.get("JUPYTERHUB_API_TOKEN") or read_token(data)
        try:
            status, body = http_get(f"{target}/hub/api/gpu/{what}", token)
        except OSError as e:
            reason = f"the hub at {target} is not reachable ({getattr(e, 'reason', e)})"
        else:
            if status == 200 and isinstance(body, dict):
                return body, f"live, from the hub at {target}"
            if status in (401, 403):
                raise CLIError(
                    f"the hub at {target} refused the token ({status}): it needs the read:servers scope. "
                    f"Pass --token, or use the config dir's token (--config-dir)."
                )
            reason = f"the hub at {target} answered {status}"
    return offline_view(config_dir, what), f"from the ledger {data} ({reason}; as the hub last left it)"
