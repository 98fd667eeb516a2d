"""Wire Elastic GPU into a JupyterHub config, in one call, for both modes.

In ``jupyterhub_config.py``::

    from hubext.hubconfig import configure_hub
    configure_hub(c, mode="kubernetes", admission_config_file="/etc/elastic-gpu/config.yaml")

It registers the broker and admin handlers under /hub, the custom scopes that let a user's
server call the broker for its own user only, the spawner, the allocator's pool backend and
(optionally) the culler as a hub-managed service. Everything it sets is a normal traitlet, so
settings made after the call win.
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any

MODES = ("local", "kubernetes")


def configure_hub(
    c: Any,
    *,
    mode: str = "local",
    admission_config_file: str = "",
    simulate_gpus: str = "",
    data_dir: str = "",
    culler: bool = True,
    culler_args: list[str] | None = None,
) -> None:
    """Set the traits that make a hub an Elastic GPU hub (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"configure_hub: mode must be one of {', '.join(MODES)}, got {mode!r}")
    from hubext import broker
    from hubext.admin import ADMIN_HANDLERS

    broker.configure(c)  # handlers, custom scopes, users' and server tokens' kernel scope, start-up
    c.JupyterHub.extra_handlers = list(c.JupyterHub.extra_handlers) + list(ADMIN_HANDLERS)
    CUSTOM_SCOPES = broker.CUSTOM_SCOPES
    if admission_config_file:
        c.GPUAllocator.admission_config_file = admission_config_file
    if mode == "local":
        c.JupyterHub.spawner_class = "hubext.local_spawner.LocalGPUSpawner"
        c.GPUAllocator.pool_backend_class = "hubext.local_pool.LocalPool"
        if simulate_gpus:
            c.LocalPool.simulate_gpus = simulate_gpus
        if data_dir:
            c.LocalPool.data_dir = data_dir
    else:
        c.JupyterHub.spawner_class = "hubext.kube_spawner.ElasticGPUSpawner"
        c.GPUAllocator.pool_backend_class = "hubext.kube_pool.KubernetesPool"
    if culler:
        token = os.environ.get("ELASTIC_GPU_CULLER_TOKEN") or secrets.token_hex(24)
        c.JupyterHub.services = list(c.JupyterHub.get("services", [])) + [
            {
                "name": "gpu-culler",
                "api_token": token,
                "command": [sys.executable, "-m", "culler", *(culler_args or [])],
            }
        ]
        c.JupyterHub.load_roles = list(c.JupyterHub.get("load_roles", [])) + [
            {
                "name": "gpu-culler",
                "services": ["gpu-culler"],
                "scopes": [
                    "list:users",
                    "read:users:activity",
                    "read:servers",
                    "access:servers",
                    "admin:servers",
                    *CUSTOM_SCOPES,
                ],
            }
        ]
