"""Each GPU pod's GPU activity, published on the pod for the culler.

The shim records per container the time of its last kernel launch and the memory it holds, in
the node regions on the host. In Kubernetes mode the hub cannot read those, so the agent
publishes them on the pod as the annotation ``elastic-gpu.jupyter.org/gpu-activity``
(:data:`libvgpu.contract.A_GPU_ACTIVITY`)::

    {"burst_gpu_seconds": 0.0, "last_launch": 1718000000.123, "memory_used_mib": 300, "updated_at": 1718000004.5}

``last_launch`` is the latest launch over the pod's GPUs (null: no process of the pod launched
a kernel yet), ``memory_used_mib`` the memory in use summed over its GPUs, ``updated_at`` when
the agent wrote it; ``burst_gpu_seconds``, for an elastic slice only, the card-seconds it used
above its request so far as the agent measured them from NVML's per-process samples
(:mod:`libvgpu.burst`; never from the pod's own files), which metering bills. The broker copies
them into its kernel records.

A pod gets the annotation only when the agent knows: the native backend, and the shim's entry
of the pod was found on one of its GPUs, or that GPU's node region exists (so a missing entry
means no process of the pod initialised CUDA there yet). Other pods get none: unknown.

So that the API server is not hammered, a pod is patched at once only when its value changed
meaningfully (first value, a first launch, a launch more than ``interval`` after the published
one, memory moved by ``memory_step_mib`` or to/from zero); smaller changes wait until
``interval`` seconds have passed since the pod's last patch. Unchanged values are not patched.
A pod being deleted (``deletionTimestamp``) gets a changed value at once: its annotation is the
last word on its burst, which metering bills after the hub heard the release (issue 27).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from libvgpu.regions import NodeGPU

from .pods import PodInfo
from .usage import MIB, AllocationUsage, live_allocations


@dataclass(frozen=True)
class PodActivity:
    """What the annotation says (``updated_at`` is added when it is written)."""

    last_launch: float | None  # unix seconds
    memory_used_mib: int
    #: card-seconds an elastic slice used above its request so far, measured by the agent (None: not elastic)
    burst_gpu_seconds: float | None = None

    def annotation(self, now: float) -> str:
        """The annotation value: compact JSON, keys sorted."""
        burst = {} if self.burst_gpu_seconds is None else {"burst_gpu_seconds": round(self.burst_gpu_seconds, 3)}
        return json.dumps(
            {
                "last_launch": None if self.last_launch is None else round(self.last_launch, 3),
                "memory_used_mib": self.memory_used_mib,
                "updated_at": round(now, 3),
                **burst,
            },
            sort_keys=True,
            separators=(",", ":"),
        )


def pod_activity(
    pods: Sequence[PodInfo],
    usage: Sequence[AllocationUsage],
    regions: Mapping[str, NodeGPU],
    burst: Mapping[str, float] | None = None,
    now: float | None = None,
) -> dict[str, tuple[PodInfo, PodActivity]]:
    """Pod uid -> (pod, its activity) for the live GPU pods whose activity is known;
    ``burst``: allocation id -> the card-seconds the agent measured above its request."""
    by_allocation = {p.allocation.id: p for p in live_allocations(pods)}  # type: ignore[union-attr]
    rows: dict[str, list[AllocationUsage]] = {}
    for u in usage:
        if u.allocation_id in by_allocation:
            rows.setdefault(u.allocation_id, []).append(u)
    out: dict[str, tuple[PodInfo, PodActivity]] = {}
    for alloc_id, us in rows.items():
        if not any(u.source == "shim" or u.gpu_uuid in regions for u in us):
            continue  # no region of its GPUs was read: unknown
        pod = by_allocation[alloc_id]
        launches = [u.last_activity for u in us if u.last_activity]
        out[pod.uid] = (
            pod,
            PodActivity(
                # a shim stamps a launch it will make at wake (a limiter's sleep) ahead of time
                # (vgpu_compute_will_launch): what is published happened, so never past now
                last_launch=min(max(launches), now if now is not None else time.time()) if launches else None,
                memory_used_mib=sum(u.used_bytes for u in us) // MIB,
                burst_gpu_seconds=(burst or {}).get(alloc_id, 0.0) if pod.allocation.elastic else None,  # type: ignore[union-attr]
            ),
        )
    return out


def needs_patch(
    published: PodActivity | None,
    current: PodActivity,
    seconds_since_patch: float,
    *,
    interval_seconds: float,
    memory_step_mib: int,
) -> bool:
    """Whether ``current`` should be written over ``published`` now (see the module's text)."""
    if published is None:
        return True
    if current == published:
        return False
    if seconds_since_patch >= interval_seconds:
        return True
    old, new = published.last_launch, current.last_launch
    if new is not None and (old is None or new - old > interval_seconds):
        return True
    before, after = published.memory_used_mib, current.memory_used_mib
    return (before == 0) != (after == 0) or abs(after - before) >= memory_step_mib


#: patch(namespace, name, annotation value); raises on failure
Patch = Callable[[str, str, str], Awaitable[None]]


@dataclass
class _Published:
    activity: PodActivity
    at: float  # monotonic


class ActivityPublisher:
    """Keeps what was published per pod, patches what needs it, logs a failing pod once."""

    def __init__(
        self,
        patch: Patch,
        log: logging.Logger | logging.LoggerAdapter,
        *,
        interval_seconds: float = 30.0,
        memory_step_mib: int = 256,
    ) -> None:
        self.patch = patch
        self.log = log
        self.interval_seconds = interval_seconds
        self.memory_step_mib = memory_step_mib
        self.published: dict[str, _Published] = {}
        self.failing: dict[str, float] = {}  # pod uid -> when its last patch failed (monotonic; logged once)
        self.patches = 0

    async def publish(self, current: Mapping[str, tuple[PodInfo, PodActivity]]) -> int:
        """Patch the pods that need it; returns how many were patched. Never raises."""
        for uid in set(self.published) - set(current):  # gone, finished, or unknown now
            self.published.pop(uid, None)
            self.failing.pop(uid, None)
        done = 0
        for uid, (pod, activity) in current.items():
            before = self.published.get(uid)
            if before is not None and before.activity.last_launch is not None:
                # a launch the shim no longer shows (its process exited) still happened
                last = max(before.activity.last_launch, activity.last_launch or 0.0)
                activity = replace(activity, last_launch=last)
            now = time.monotonic()
            if uid in self.failing and now - self.failing[uid] < self.interval_seconds:
                continue  # a failing pod is retried once per interval
            if not needs_patch(
                before.activity if before else None,
                activity,
                # a pod being deleted: its last value now, the annotation cannot change after it
                now - before.at if before and not pod.deleting else float("inf"),
                interval_seconds=self.interval_seconds,
                memory_step_mib=self.memory_step_mib,
            ):
                continue
            try:
                await self.patch(pod.namespace, pod.name, activity.annotation(time.time()))
            except Exception as e:  # KubeError, and anything else: never stop the refresh loop
                if uid not in self.failing:
                    self.log.warning("GPU activity of pod %s not published: %s (retrying quietly)", pod.key, e)
                self.failing[uid] = now
                continue
            if self.failing.pop(uid, None) is not None:
                self.log.info("GPU activity of pod %s published again", pod.key)
            self.published[uid] = _Published(activity, now)
            self.patches += 1
            done += 1
        return done
