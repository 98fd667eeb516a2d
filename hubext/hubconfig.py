"""Wire Elastic GPU into a JupyterHub config, in one call, for both modes.

In ``jupyterhub_config.py``::

    from hubext.hubconfig import configure_hub
    configure_hub(c, mode="kubernetes", admission_config_file="/etc/elastic-gpu/config.yaml")

It registers the broker and admin handlers under /hub, the custom scopes that let a user's
server call the broker for its own user only, the spawner, the allocator's pool backend and
(optionally) the culler as a hub-managed service, and (``metering=True``) the GPU usage meter
and its API (docs/metering.md). The culler reaches users' servers through
the proxy: ``proxy_url``, else $ELASTIC_GPU_PUBLIC_URL (``elastic-gpu up`` sets it), else
``http://<JupyterHub.ip>:<JupyterHub.port>``. Everything it sets is a normal traitlet, so
settings made after the call win.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from jupyterhub.utils import random_port

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
    culler_port: int = 0,
    proxy_url: str = "",
    metering: bool = True,
) -> None:
    """Set the traits that make a hub an Elastic GPU hub (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"configure_hub: mode must be one of {', '.join(MODES)}, got {mode!r}")
    from hubext import broker
    from hubext.admin import ADMIN_HANDLERS, TEMPLATES
    from hubext.pages import login_facts, size_formatter, user_gpu

    broker.configure(c)  # handlers, custom scopes, users' and server tokens' kernel scope, start-up
    c.JupyterHub.extra_handlers = list(c.JupyterHub.extra_handlers) + list(ADMIN_HANDLERS)
    # /hub/home and the spawn page show the user's slices and what is left of their quota
    c.JupyterHub.template_paths = [str(TEMPLATES), *c.JupyterHub.get("template_paths", [])]
    c.JupyterHub.template_vars = {
        **dict(c.JupyterHub.get("template_vars", {})),
        "elastic_gpu": user_gpu,
        "elastic_gpu_login": login_facts,  # the login page: simulated GPUs, who the admins are
        "gpu_size": size_formatter,  # sizes on the pages as in every sentence (quotas.messages.mib)
    }
    if metering:  # usage store, /hub/api/gpu/usage and /hub/api/gpu/capacity (docs/metering.md)
        from hubext.metering import handlers as metering_handlers

        metering_handlers.configure(c)
    if admission_config_file:
        c.GPUAllocator.admission_config_file = admission_config_file
    if mode == "local":
        c.JupyterHub.spawner_class = "hubext.local.spawner.LocalGPUSpawner"
        c.GPUAllocator.pool_backend_class = "local"
        if simulate_gpus:
            c.LocalPool.simulate_gpus = simulate_gpus
        if data_dir:
            c.LocalPool.data_dir = data_dir
    else:
        c.JupyterHub.spawner_class = "hubext.kubernetes.spawner.ElasticGPUSpawner"
        c.GPUAllocator.pool_backend_class = "kubernetes"
    if culler:
        import culler as culler_service

        token = os.environ.get("ELASTIC_GPU_CULLER_TOKEN") or secrets.token_hex(24)
        if not proxy_url:
            ip = c.JupyterHub.get("ip", "") or "127.0.0.1"
            proxy_url = os.environ.get("ELASTIC_GPU_PUBLIC_URL") or f"http://{ip}:{c.JupyterHub.get('port', 8000)}"
        c.JupyterHub.services = list(c.JupyterHub.get("services", [])) + [
            culler_service.service_spec(
                name="gpu-culler",
                api_token=token,
                port=culler_port or random_port(),
                proxy_url=proxy_url,
                args=culler_args,
            )
        ]
        c.JupyterHub.load_roles = list(c.JupyterHub.get("load_roles", [])) + [
            culler_service.service_role("gpu-culler", list(broker.CUSTOM_SCOPES))
        ]
