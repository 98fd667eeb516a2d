"""Run a part of Elastic GPU as soon as the hub is up (JupyterHub has no start-up hook for them).

Called from the hub's config (``configure_hub``): the broker and the usage meter start here
rather than on their first request, so what the hub must notice after a restart (orphaned
kernels, slices granted while the meter was away) is noticed at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

_background: set[asyncio.Task] = set()


def when_hub_is_up(start: Callable[[Any], Awaitable[None]], hub_start_timeout: float = 600.0) -> None:
    """Call ``await start(app)`` once the JupyterHub application serves (a no-op outside a hub,
    e.g. ``jupyterhub --generate-config``). Waits with ``jupyterhub.utils.exponential_backoff``."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return

    async def wait_and_start() -> None:
        from jupyterhub.app import JupyterHub
        from jupyterhub.utils import exponential_backoff

        def hub_up() -> bool:
            return JupyterHub.initialized() and getattr(JupyterHub.instance(), "http_server", None) is not None

        await exponential_backoff(
            hub_up, "the hub did not start", start_wait=0.1, max_wait=1, timeout=hub_start_timeout
        )
        await start(JupyterHub.instance())

    task = loop.create_task(wait_and_start())
    _background.add(task)
    task.add_done_callback(_background.discard)
