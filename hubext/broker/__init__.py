"""The GPU broker: GPU kernels for users' servers, with admission by the hub's one allocator.

- ``core``: :class:`GPUBroker` (create, watch, restart, delete, reconcile kernels);
- ``handlers``: the REST API under ``/hub/api/gpu/`` and :func:`configure` for a hub config;
- ``sizes``: the admin's kernel sizes, validated, and :class:`BrokerError`.
"""

from __future__ import annotations

from .core import GPUBroker, start_with_hub
from .handlers import (
    ADMIN_SCOPE,
    BROKER_HANDLERS,
    CUSTOM_SCOPES,
    KERNELS_SCOPE,
    SERVER_TOKEN_SCOPES,
    USER_SCOPES,
    configure,
    grant_user_scopes,
)
from .sizes import BrokerError, validate_sizes

__all__ = [
    "ADMIN_SCOPE",
    "BROKER_HANDLERS",
    "CUSTOM_SCOPES",
    "KERNELS_SCOPE",
    "SERVER_TOKEN_SCOPES",
    "USER_SCOPES",
    "BrokerError",
    "GPUBroker",
    "configure",
    "grant_user_scopes",
    "start_with_hub",
    "validate_sizes",
]
