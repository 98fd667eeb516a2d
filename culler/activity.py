"""GPU activity from the shim's own records, for broker records that do not carry it.

The broker is expected to include each kernel's GPU activity (``last_launch``,
``memory_used_mib``) in ``GET /hub/api/gpu/kernels``. When a record comes without it but names
the kernel's activity record (``activity_file``, the path the shim's limits file gives it), the
culler reads that record itself through ``libvgpu.regions``, when that module offers
``read_activity(path)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def regions_activity(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """{"last_launch": epoch s | None, "memory_used_mib": int} for ``record``, or None when unknown."""
    path = record.get("activity_file") or record.get("region")
    if not isinstance(path, str) or not path:
        return None
    try:
        from libvgpu import regions  # the shim's Python side; optional here
    except ImportError:
        return None
    read = getattr(regions, "read_activity", None)
    if read is None:
        return None
    try:
        activity = read(path)
    except (OSError, ValueError):
        return None
    if activity is None:
        return None
    if isinstance(activity, Mapping):
        last, used = activity.get("last_launch"), activity.get("memory_used_mib")
    else:  # a dataclass / named tuple
        last, used = getattr(activity, "last_launch", None), getattr(activity, "memory_used_mib", None)
    return {"last_launch": last, "memory_used_mib": used}
