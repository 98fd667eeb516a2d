"""The hub side: spawners, the GPU broker API, pool backends and the admin page.

``c.JupyterHub.spawner_class = "hubext.ElasticGPUSpawner"`` (Kubernetes) or
``"hubext.LocalGPUSpawner"`` (single machine). Imports are lazy so that importing a light
piece (labels, the CLI) does not pull in KubeSpawner.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "ElasticGPUSpawner": "hubext.kube_spawner",
    "LocalGPUSpawner": "hubext.local_spawner",
    "GPUAllocator": "hubext.allocator",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hubext' has no attribute {name!r}")
