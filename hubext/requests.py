"""GPU requests, one module for notebook profiles and kernel sizes.

A notebook profile (KubeSpawner's ``profile_list`` format) may carry a ``gpu`` section, and each
``profile_options`` choice may carry one too (the choice's keys win)::

    {"display_name": "1/4 H100 — 20 GiB, 25 %", "slug": "h100-quarter",
     "allowed_groups": ["vision"],               # optional: who sees the profile
     "gpu": {"memory_mib": 20480, "cores_percent": 25, "count": 1,
             "model": "H100-80GB", "priority_class": "default",
             "memory_limit_mib": 40960, "cores_limit_percent": 100}}  # optional: elastic

``memory_mib`` and ``cores_percent`` are the request: what admission guarantees and quotas
count. ``memory_limit_mib`` and ``cores_limit_percent`` (optional, at least the request, compute
at most 100) let the slice grow into what the card leaves idle; leave them out for a fixed slice.

A GPU kernel size (``GPUBroker.kernel_sizes``) is the same section with a name. A profile with
no ``gpu`` section is a CPU notebook. Memory and cores are per GPU. The spawners
(``hubext/gpu_spawner.py``) and the broker (``hubext/broker/``) both turn a checked section into
the admission core's :class:`quotas.GPURequest` here.
"""

from __future__ import annotations

import itertools
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
    "memory_limit_mib": int,
    "cores_limit_percent": int,
}
LIMIT_KEYS = ("memory_limit_mib", "cores_limit_percent")


def check_limits(section: Mapping[str, Any], where: str) -> None:
    """Check a complete ``gpu`` section's limits against its request (a profile's section merged
    with its option choices); raise ValueError with a sentence naming ``where``."""
    limits = {k: section[k] for k in LIMIT_KEYS if section.get(k)}
    if not limits:
        return
    if section.get("whole") or section.get("mig_profile"):
        raise ValueError(
            f"{where}: a whole GPU or a MIG slice cannot grow, so it takes no "
            f"{' or '.join(sorted(limits))}; remove it or give a memory_mib and cores_percent slice."
        )
    memory, memory_limit = section.get("memory_mib", 0), limits.get("memory_limit_mib", 0)
    if memory_limit and memory_limit < memory:
        raise ValueError(
            f"{where}: memory_limit_mib ({memory_limit}) is below memory_mib ({memory}); a limit is "
            "how far the slice may grow, so it must be at least what it asks for."
        )
    cores, cores_limit = section.get("cores_percent", 0), limits.get("cores_limit_percent", 0)
    if cores_limit and not cores <= cores_limit <= 100:
        raise ValueError(
            f"{where}: cores_limit_percent ({cores_limit}) must be between cores_percent ({cores}) "
            "and 100; a limit is how far the slice may grow, at most the whole card."
        )


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
        if key in LIMIT_KEYS and value < 0:
            raise ValueError(f"{where}.gpu.{key} must be 0 or more, got {value!r}")
    check_limits(section, f"{where}.gpu")
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
    check_limits(section, f"profile '{slug}'")
    return section or None


def check_profile_limits(profile: Mapping[str, Any], where: str) -> None:
    """Check the limits of every section a profile can resolve to (its ``gpu`` section merged with
    each combination of option choices, as :func:`profile_gpu_section` merges them); raise
    ValueError with a sentence naming the profile and the choices."""
    options = [
        [(name, cname, (c or {}).get("gpu") or {}) for cname, c in ((option or {}).get("choices") or {}).items()]
        for name, option in (profile.get("profile_options") or {}).items()
    ]
    for combo in itertools.product(*[o for o in options if o]):
        section = dict(profile.get("gpu") or {})
        for _, _, chosen in combo:
            section.update(chosen)
        picked = ", ".join(f"option '{name}' choice '{cname}'" for name, cname, _ in combo)
        check_limits(section, f"{where}{' with ' + picked if picked else ''}")


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
        memory_limit_mib=section.get("memory_limit_mib", 0),
        cores_limit_percent=section.get("cores_limit_percent", 0),
    )


def node_resources(spawner: Any) -> tuple[int, int]:
    """(CPU millicores, host memory MiB) a spawner's server asks of its node, as Kubernetes
    counts it: the guarantee, else the limit (a limit alone is also the request); 0 if unset."""
    cpu = getattr(spawner, "cpu_guarantee", None) or getattr(spawner, "cpu_limit", None) or 0
    mem = getattr(spawner, "mem_guarantee", None) or getattr(spawner, "mem_limit", None) or 0
    return math.ceil(float(cpu) * 1000), math.ceil(int(mem) / (1024 * 1024))
