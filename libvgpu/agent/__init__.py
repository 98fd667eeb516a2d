"""The elastic-gpu node agent (``python -m libvgpu.agent``), a DaemonSet on every GPU node.

* :mod:`.nvml` — the node's GPUs through NVML (inventory, samples, processes, Xid events);
* :mod:`.inventory` — the ``elastic-gpu.jupyter.org/gpus`` annotation the Kubernetes pool reads;
* :mod:`.install` — libvgpu.so, ld.so.preload and the node regions directory on the host;
* :mod:`.pods` — host process -> pod (cgroup) -> allocation (pod labels/annotations);
* :mod:`.usage` — per-allocation usage from the shim's node regions;
* :mod:`.metrics` — the Prometheus metrics (names in docs/helm.md);
* :mod:`.app` — the application and its loop; the enforcement backstop is :mod:`libvgpu.backstop`.

Documentation: docs/node-agent.md.
"""

from __future__ import annotations

__all__ = ["NodeAgent", "main"]


def __getattr__(name: str):  # lazy: importing a piece (e.g. .nvml) does not start the app's imports
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module 'libvgpu.agent' has no attribute {name!r}")
