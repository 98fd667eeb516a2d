"""Owners waiting for burst memory, published on their pods (Kubernetes, elastic slices).

When a slice asks for memory within its request that other slices' bursts hold, its shim waits
and says so in the card's node region (``libvgpu.elastic``). The hub cannot read a node's
regions on Kubernetes, so the agent publishes each wait on the waiting pod as the annotation
``elastic-gpu.jupyter.org/gpu-reclaim`` (``libvgpu.elastic.reclaim_annotation``) and removes it
when the wait ends; the hub's Kubernetes pool reads it from its pod watch
(``libvgpu.elastic.pod_reclaims``) and the broker takes the burst back from the burster (swaps
its kernel pod out, or stops it where the node cannot checkpoint). A pod is patched only when
its value changes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from libvgpu import contract as L
from libvgpu.elastic import Reclaim, reclaim_annotation

from .pods import PodInfo

#: patch(namespace, name, annotation value or None to remove it); raises on failure
Patch = Callable[[str, str, "str | None"], Awaitable[None]]


class ReclaimPublisher:
    """Keeps each GPU pod's ``gpu-reclaim`` annotation equal to the waits of its allocation."""

    def __init__(self, patch: Patch, log: logging.Logger) -> None:
        self.patch, self.log = patch, log
        self._published: dict[str, str | None] = {}  # pod uid -> what it carries now

    async def publish(self, pods: Sequence[PodInfo], reclaims: Sequence[Reclaim]) -> None:
        waits: dict[str, list[Reclaim]] = {}
        for r in reclaims:
            waits.setdefault(r.owner, []).append(r)
        live = {}
        for pod in pods:
            if pod.allocation is None or pod.phase in ("Succeeded", "Failed"):
                continue
            live[pod.uid] = pod
            mine = waits.get(pod.allocation.id)
            value = reclaim_annotation(mine) if mine else None
            carried = self._published.get(pod.uid, (pod.annotations or {}).get(L.A_GPU_RECLAIM))
            if value == carried:
                continue
            try:
                await self.patch(pod.namespace, pod.name, value)
            except Exception as e:  # noqa: BLE001 - the next refresh tries again
                self.log.warning("GPU reclaim wait of pod %s not published: %s", pod.key, e)
                continue
            self._published[pod.uid] = value
            if value is not None:
                self.log.info("Pod %s waits for burst memory: %s", pod.key, value)
        self._published = {uid: v for uid, v in self._published.items() if uid in live}
