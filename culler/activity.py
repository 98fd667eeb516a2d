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

import time
from collections.abc import Mapping
from pathlib import Path
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


class GPUTimeCheck:
    """When NVML last saw each slice's processes use the GPU (single machine).

    The activity record is written from inside the user's processes, so a record that keeps
    changing may be a process rewriting it rather than GPU work. Where NVML can tell
    (``nvmlDeviceGetProcessUtilization``: SM time per process), :meth:`sample` is called every
    few seconds and remembers, per allocation, the last time a process of it (found by its
    ``ELASTIC_GPU_ALLOCATION_ID`` in /proc, as the pool finds them) used SM time. Where it
    cannot (no driver, simulated GPUs, a driver without per-process samples, GPUs in pods
    elsewhere) :meth:`last_busy` says None and records are judged on their own.
    """

    def __init__(self, library: str = "") -> None:
        self.library = library
        self._nv: Any = None
        self._failed = False
        self.uuids: set[str] = set()  # the GPUs to sample (those of the running kernels' slices)
        self.started_at: dict[str, float] = {}  # GPU uuid -> when sampling it began
        self.busy_at: dict[str, float] = {}  # allocation id -> last time NVML saw it busy
        self._sampled_at = 0.0

    def _init(self) -> Any:
        if self._nv is None and not self._failed:
            try:
                import ctypes

                import pynvml

                if self.library:
                    pynvml.nvmlLib = ctypes.CDLL(self.library)
                pynvml.nvmlInit()
                self._nv = pynvml
            except Exception:  # noqa: BLE001 - no NVML here: the check says "cannot tell"
                self._failed = True
        return self._nv

    def watch(self, uuids: list[str]) -> None:
        """Sample these GPUs from now on (the GPUs NVML does not know are dropped at the next sample)."""
        self.uuids.update(uuids)

    def sample(self) -> None:
        """One look: which slices' processes used SM time since the last look."""
        nv = self._init()
        if nv is None or not self.uuids:
            return
        from libvgpu.agent.nvml import process_utilization

        now = time.time()
        since = self._sampled_at or now - 1.0
        busy: set[int] = set()
        for uuid in sorted(self.uuids):
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid)
            except nv.NVMLError:  # not a GPU of this machine (simulated): cannot tell
                self.uuids.discard(uuid)
                continue
            try:
                samples = process_utilization(nv, handle, int(since * 1e6))
            except nv.NVMLError_NotFound:
                samples = []  # no process had a sample since then
            except nv.NVMLError:
                self.uuids.discard(uuid)  # no per-process samples on this driver: cannot tell
                self.started_at.pop(uuid, None)
                continue
            self.started_at.setdefault(uuid, now)
            busy.update(int(s.pid) for s in samples if s.smUtil > 0)
        self._sampled_at = now
        if busy:
            for allocation_id in slice_ids(busy):
                self.busy_at[allocation_id] = now

    def last_busy(self, allocation_id: str, uuids: list[str]) -> float | None:
        """The last time NVML saw the allocation's processes busy on ``uuids``, or the time sampling
        began when it never did; None when NVML does not sample every one of those GPUs."""
        if not uuids or not all(u in self.started_at for u in uuids):
            return None
        began = max(self.started_at[u] for u in uuids)
        return max(self.busy_at.get(allocation_id, began), began)


def slice_ids(pids: set[int]) -> set[str]:
    """The allocation ids (``ELASTIC_GPU_ALLOCATION_ID``) in the environments of ``pids``."""
    prefix = b"ELASTIC_GPU_ALLOCATION_ID="
    out = set()
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        for item in environ.split(b"\0"):
            if item.startswith(prefix):
                out.add(item[len(prefix) :].decode(errors="replace"))
    return out
