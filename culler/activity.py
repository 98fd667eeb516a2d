"""GPU activity from the shim's own record, for broker records that do not carry it.

The shim (libvgpu) keeps, per container (a GPU kernel's process tree), an *activity file*: the
time of the last kernel launch and the memory in use per GPU. In single-machine mode the
broker's record names that file (``activity_file``) and the culler reads it with
``libvgpu.regions.read_activity``. A file that does not exist yet means no process of the
kernel initialised CUDA: known, and idle since it started. A file the reader does not
understand (another layout version, truncated) means "unknown": such a kernel is never culled
while ``require_gpu_activity`` is on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def regions_activity(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """{"last_launch": epoch s | None, "memory_used_mib": int} for a broker record, or None when unknown."""
    path = record.get("activity_file")
    if not isinstance(path, str) or not path:
        return None
    try:
        from libvgpu.regions import read_activity
    except ImportError:
        return None
    try:
        activity = read_activity(path)
    except FileNotFoundError:
        return {"last_launch": None, "memory_used_mib": 0}
    except (OSError, ValueError):  # libvgpu.regions.RegionError is a ValueError
        return None
    return {"last_launch": activity.last_launch, "memory_used_mib": activity.memory_used_mib}
