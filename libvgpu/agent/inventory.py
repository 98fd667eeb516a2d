"""The node's GPUs as the Kubernetes pool reads them: the ``elastic-gpu.jupyter.org/gpus`` annotation.

A JSON list of GPU objects in :func:`quotas.load_pool`'s format, documented keys only::

    [{"uuid": "GPU-8f3c...", "model": "H100-80GB", "memory_mib": 81559, "sm_count": 132,
      "mode": "shared", "mig_profiles": [], "index": 0, "memory_oversub": 1.0, "cores_oversub": 1.0}]

A card in MIG mode is published with ``mode: "mig"`` and one profile name per MIG instance
(``["3g.40gb", "3g.40gb"]``); admission never places slices on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quotas import ConfigError, load_pool

from .nvml import GPUInfo

OVERRIDE_KEYS = ("mode", "memory_oversub", "cores_oversub", "model")


def gpu_objects(
    gpus: Sequence[GPUInfo],
    *,
    default_mode: str = "shared",
    memory_oversub: float = 1.0,
    cores_oversub: float = 1.0,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict]:
    """GPU objects for the annotation. ``overrides`` is keyed by GPU uuid or index (as a string)
    and may set ``mode``, ``memory_oversub``, ``cores_oversub`` and ``model``."""
    out: list[dict] = []
    overrides = overrides or {}
    for gpu in gpus:
        item: dict[str, Any] = {
            "uuid": gpu.uuid,
            "model": gpu.model,
            "memory_mib": gpu.memory_mib,
            "sm_count": gpu.sm_count,
            "mode": default_mode,
            "mig_profiles": [],
            "index": gpu.index,
            "memory_oversub": float(memory_oversub),
            "cores_oversub": float(cores_oversub),
        }
        for key in (str(gpu.index), gpu.uuid):
            item.update(dict(overrides.get(key) or {}))
        if gpu.mig_enabled:  # the hardware decides, whatever the config says
            item["mode"] = "mig"
            item["mig_profiles"] = [m.profile for m in gpu.mig_instances]
        out.append(item)
    return out


def validate(node_name: str, gpus: list[dict]) -> None:
    """Raise :class:`quotas.ConfigError` (naming the key) unless the pool would accept ``gpus``."""
    load_pool([{"name": node_name, "gpus": gpus}])


def check_overrides(overrides: Mapping[str, Any], where: str = "NodeAgent.gpu_overrides") -> None:
    """Refuse keys the annotation cannot carry, before anything is published."""
    for key, body in overrides.items():
        if not isinstance(body, Mapping):
            raise ConfigError(f"must be a mapping of {', '.join(OVERRIDE_KEYS)}, got {body!r}", f"{where}.{key}")
        unknown = sorted(set(body) - set(OVERRIDE_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(unknown)} (allowed: {', '.join(OVERRIDE_KEYS)})", f"{where}.{key}"
            )
