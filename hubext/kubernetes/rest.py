"""One Kubernetes API call read as JSON, for the calls made without the client's models.

``kubernetes_asyncio`` raises ``ApiException`` on an error status only when it preloads the
response; the pool's list calls do not (a cluster-wide pod list is large, and its JSON is
read directly), so an error such as a 403 from RBAC would otherwise come back as a ``Status``
body and read as an empty list. :func:`call_json` raises it as the preloading client would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client.rest import ApiException


async def call_json(method: Callable[..., Any], *args: Any, timeout: float, **kwargs: Any) -> dict[str, Any]:
    """``method(*args, **kwargs)`` without preloading, within ``timeout`` seconds: the decoded
    body, or ApiException (status, and the API server's message as reason) on an error status."""
    response = await asyncio.wait_for(method(*args, _preload_content=False, **kwargs), timeout)
    body = await response.read()
    if response.status >= 300:
        try:
            reason = json.loads(body).get("message") or response.reason
        except (ValueError, AttributeError):
            reason = response.reason
        raise ApiException(status=response.status, reason=reason)
    return json.loads(body)
