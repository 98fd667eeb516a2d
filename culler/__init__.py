"""The idle-GPU culler: a JupyterHub service that reclaims the GPU slices of idle GPU kernels.

It joins two signals per kernel, Jupyter activity from the user's server and GPU activity from
the shim, and never culls a busy kernel. See docs/culler.md.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__version__ = "0.1.0"

#: scopes the culler's service token needs (plus the broker's custom scopes, added by the hub wiring).
#: No ``access:servers``: the culler reaches a user's server only with a token of that user for that
#: one server, which the broker gives it (see docs/security.md); its own token never leaves for a server.
CULLER_SCOPES = ("read:servers", "list:users")


def service_spec(
    *,
    name: str = "gpu-culler",
    api_token: str | None = None,
    port: int | None = None,
    proxy_url: str = "",
    args: list[str] | None = None,
    python: str = sys.executable,
    **config: Any,
) -> dict[str, Any]:
    """A ``c.JupyterHub.services`` entry that runs the culler managed by the hub.

    ``port``: serve /metrics there (the hub proxies /services/<name>/metrics to it).
    ``proxy_url``: where users' servers are reached (the proxy's URL, e.g. ``http://127.0.0.1:8000``).
    Extra keyword arguments become ``--GPUCuller.<key>=<value>`` options, e.g.
    ``idle_timeout_seconds=1800``; they win over ``c.GPUCuller.*`` settings in the hub's config,
    which the service receives too (:func:`hub_settings`).
    """
    command = [python, "-m", "culler"]
    if proxy_url:
        command.append(f"--GPUCuller.proxy_url={proxy_url}")
    for key, value in config.items():
        command.append(f"--GPUCuller.{key}={value!r}" if not isinstance(value, str) else f"--GPUCuller.{key}={value}")
    command.extend(args or [])
    # the hub's own c.GPUCuller settings, read when the hub starts the service (hub_settings)
    spec: dict[str, Any] = {"name": name, "command": command, "environment": {HUB_SETTINGS_ENV: hub_settings}}
    if api_token:
        spec["api_token"] = api_token
    if port:
        spec["url"] = f"http://127.0.0.1:{port}"
    return spec


#: the environment variable through which the hub hands its ``c.GPUCuller`` settings to the culler
HUB_SETTINGS_ENV = "ELASTIC_GPU_CULLER_CONFIG"


def hub_settings(spawner: Any = None) -> str:
    """The running hub's ``GPUCuller`` config section, as JSON (``{}`` outside a hub).

    ``configure_hub`` puts this function in the culler service's ``environment``: JupyterHub
    calls it when it starts the service, after the whole jupyterhub_config.py (and the command
    line) has been read, so ``c.GPUCuller.idle_timeout_seconds = 1800`` written anywhere in the
    hub's config reaches the hub-managed culler. Values that are not plain JSON (a lazy
    ``.append``/``.update``) are left out, with a warning in the hub's log.
    """
    try:
        from jupyterhub.app import JupyterHub
    except ImportError:
        return "{}"
    if not JupyterHub.initialized():
        return "{}"
    app = JupyterHub.instance()
    section = app.config.get("GPUCuller", {})
    out: dict[str, Any] = {}
    for key, value in section.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            app.log.warning(
                "c.GPUCuller.%s is not a plain value (assign it, e.g. c.GPUCuller.%s = {...}); "
                "the hub-managed culler does not get it",
                key,
                key,
            )
            continue
        out[key] = value
    return json.dumps(out)


def service_role(name: str = "gpu-culler", extra_scopes: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A ``c.JupyterHub.load_roles`` entry granting the culler's service what it needs."""
    return {"name": name, "services": [name], "scopes": sorted({*CULLER_SCOPES, *extra_scopes})}


def __getattr__(name: str) -> Any:  # lazy: `import culler` stays cheap for the hub's config
    if name in ("GPUCuller", "main"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
