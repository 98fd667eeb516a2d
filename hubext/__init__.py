"""The hub side of Elastic GPU, one folder per mode.

- ``contract``: every format that crosses a process boundary (labels, limits file, codecs);
- ``backends``: the pool and kernel-launcher ABCs a mode implements;
- ``allocator``, ``gpu_spawner``, ``kernels``, ``broker/``, ``admin``, ``hubconfig``: shared by both modes;
- ``kubernetes/``: ``c.JupyterHub.spawner_class = "hubext.ElasticGPUSpawner"``;
- ``local/``: ``c.JupyterHub.spawner_class = "hubext.LocalGPUSpawner"`` (single machine);
- ``cli``: the single-machine command ``elastic-gpu``.

Imports are lazy so that importing a light piece (the contract, the CLI) does not pull in KubeSpawner.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "ElasticGPUSpawner": "hubext.kubernetes.spawner",
    "LocalGPUSpawner": "hubext.local.spawner",
    "HubUserGPUSpawner": "hubext.local.spawner",
    "GPUAllocator": "hubext.allocator",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hubext' has no attribute {name!r}")
