"""GPU activity from the shim's own record, for broker records that do not carry it.

The shim (libvgpu) keeps, per container (a GPU kernel's process tree), an *activity file*: the
time of the last kernel launch and the memory in use per GPU (``struct vgpu_activity`` in
``libvgpu/src/vgpu.h``). In single-machine mode the broker's record names that file
(``activity_file``); the culler reads it here. A file that does not exist yet means the kernel
never initialised CUDA: known, and idle since it started.

``libvgpu.regions`` is the project's reader of the shim's files; when it offers
``read_activity(path)`` it is used. Otherwise the layout is read here, guarded by the magic,
version and kind, so a layout change yields "unknown" (never culled) rather than wrong numbers.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MAGIC = b"LIBVGPU\0"
VERSION = 1
KIND_ACTIVITY = 3
MAX_DEV = 16
_HEAD = struct.Struct("<8sIIQQ")  # magic, version, kind, size, created_ns
_BODY = struct.Struct(f"<QQQQ{MAX_DEV}Q")  # container_id, last_launch_ns, launches, updated_ns, used[]
_BODY_OFFSET = 32


def read_activity_file(path: str) -> dict[str, Any] | None:
    """{"last_launch": epoch s | None, "memory_used_mib": int} from a shim activity file; None when
    the file is unreadable or not in the layout this culler knows."""
    p = Path(path)
    if not p.exists():
        return {"last_launch": None, "memory_used_mib": 0}
    try:
        with p.open("rb") as f:
            raw = f.read(_BODY_OFFSET + _BODY.size)
    except OSError:
        return None
    if len(raw) < _BODY_OFFSET + _BODY.size:
        return None
    magic, version, kind, _size, _created = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION or kind != KIND_ACTIVITY:
        return None
    _cid, last_launch_ns, _launches, _updated, *used = _BODY.unpack_from(raw, _BODY_OFFSET)
    return {
        "last_launch": last_launch_ns / 1e9 if last_launch_ns else None,
        "memory_used_mib": sum(used) // (1024 * 1024),
    }


def regions_activity(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """GPU activity for a broker record without it, or None when nothing tells."""
    path = record.get("activity_file")
    if not isinstance(path, str) or not path:
        return None
    try:
        from libvgpu import regions  # the shim's Python side
    except ImportError:
        regions = None
    read = getattr(regions, "read_activity", None) if regions is not None else None
    if read is None:
        return read_activity_file(path)
    try:
        activity = read(path)
    except FileNotFoundError:
        return {"last_launch": None, "memory_used_mib": 0}
    except (OSError, ValueError):
        return None
    if activity is None:
        return None
    if isinstance(activity, Mapping):
        last, used = activity.get("last_launch"), activity.get("memory_used_mib")
    else:  # a dataclass or named tuple
        last, used = getattr(activity, "last_launch", None), getattr(activity, "memory_used_mib", None)
    return {"last_launch": last, "memory_used_mib": used}
