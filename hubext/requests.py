"""GPU requests, one module for notebook profiles and kernel sizes.

A notebook profile (KubeSpawner's ``profile_list`` format) may carry a ``gpu`` section, and each
``profile_options`` choice may carry one too (the choice's keys win)::

    {"display_name": "1/4 H100 — 20 GiB, 25 %", "slug": "h100-quarter",
     "allowed_groups": ["vision"],               # optional: who sees the profile
     "gpu": {"memory_mib": 20480, "cores_percent": 25, "count": 1,
             "model": "H100-80GB", "priority_class": "default"}}

A GPU kernel size (``GPUBroker.kernel_sizes``) is the same section with a name. A profile with
no ``gpu`` section is a CPU notebook. Memory and cores are per GPU. The spawners
(``hubext/gpu_spawner.py``) and the broker (``hubext/broker/``) both turn a checked section into
the admission core's :class:`quotas.GPURequest` here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from quotas import GPURequest, Owner

GPU_KEYS = {
    "memory_mib": int,
    "cores_percent": int,
    "count": int,
    "model": str,
    "priority_class": str,
    "whole": bool,
    "mig_profile": str,
}


def validate_gpu_section(section: Any, where: str) -> dict[str, Any]:
    """Check an admin's ``gpu`` section; raise ValueError naming ``where`` and the bad key."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{where}.gpu must be a mapping of {sorted(GPU_KEYS)}, got {section!r}")
    unknown = sorted(set(section) - set(GPU_KEYS))
    if unknown:
        raise ValueError(
            f"{where}.gpu has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(GPU_KEYS))}"
        )
    for key, value in section.items():
        kind = GPU_KEYS[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise ValueError(f"{where}.gpu.{key} must be {kind.__name__}, got {value!r}")
    return dict(section)


def profile_gpu_section(profile: Mapping[str, Any], user_options: Mapping[str, Any]) -> dict | None:
    """The GPU section of the chosen profile + option choices, or None for a CPU profile."""
    slug = profile.get("slug", profile.get("display_name", "?"))
    section: dict[str, Any] = {}
    if profile.get("gpu") is not None:
        section.update(validate_gpu_section(profile["gpu"], f"profile '{slug}'"))
    for option_name, option in (profile.get("profile_options") or {}).items():
        choices = option.get("choices") or {}
        choice = user_options.get(option_name)
        if choice is None:
            choice = next((k for k, c in choices.items() if c.get("default")), None)
            if choice is None and choices:
                choice = next(iter(choices))
        if choice is None or choice not in choices:
            continue
        chosen = choices[choice].get("gpu")
        if chosen is not None:
            section.update(
                validate_gpu_section(chosen, f"profile '{slug}' option '{option_name}' choice '{choice}'")
            )
    return section or None


def request_from_section(
    section: Mapping[str, Any],
    owner: Owner,
    request_id: str,
    kind: str,
    cpu_millicores: int = 0,
    host_memory_mib: int = 0,
) -> GPURequest:
    """The admission request for a validated ``gpu`` section (a profile's or a kernel size's),
    with the node CPU and host memory the server or kernel asks for (0: none)."""
    return GPURequest(
        owner=owner,
        memory_mib=section.get("memory_mib", 0),
        cores_percent=section.get("cores_percent", 100 if section.get("whole") else 0),
        count=section.get("count", 1),
        model=section.get("model"),
        priority_class=section.get("priority_class"),
        whole=section.get("whole", False),
        request_id=request_id,
        kind=kind,
        cpu_millicores=cpu_millicores,
        host_memory_mib=host_memory_mib,
    )


def node_resources(spawner: Any) -> tuple[int, int]:
    """(CPU millicores, host memory MiB) a spawner's server asks of its node, as Kubernetes
    counts it: the guarantee, else the limit (a limit alone is also the request); 0 if unset."""
    cpu = getattr(spawner, "cpu_guarantee", None) or getattr(spawner, "cpu_limit", None) or 0
    mem = getattr(spawner, "mem_guarantee", None) or getattr(spawner, "mem_limit", None) or 0
    return math.ceil(float(cpu) * 1000), math.ceil(int(mem) / (1024 * 1024))
