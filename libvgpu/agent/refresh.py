"""The node agent's periodic refresh: the metrics snapshot (NVML samples, node regions, pods),
the priority table, each GPU pod's activity and burst-memory wait published on the pod, the
looks at NVML that meter each elastic slice's burst, and a deleted elastic pod's last burst
published before it goes.

A mixin of :class:`libvgpu.agent.app.NodeAgent`, beside :class:`~libvgpu.agent.podview.PodView`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from libvgpu import contract as L
from libvgpu.burst import BurstCounter, Owners, Sample, elastic_slices, pids_seen, requests_on
from libvgpu.elastic import reclaims_in

from .activity import pod_activity
from .kube import KubeError
from .metrics import Snapshot
from .nvml import BurstLooks, GPUInfo
from .usage import allocation_usage, live_allocations


class Refresh:
    """The metrics snapshot, burst looks, and the activity and reclaim annotations of the GPU pods."""

    async def _refresh(self) -> None:
        samples = {}
        for g in self.gpus:
            try:
                samples[g.uuid] = self.nvml.sample(g.uuid)
            except self.nvml.nv.NVMLError as e:
                self.log.warning("GPU %s: no sample (%s)", g.uuid, e)
        processes = self._processes(self.gpus)
        try:
            pod_of_pid = await self._pods_of([p.pid for ps in processes.values() for p in ps])
        except KubeError as e:
            self.log.warning("Pods of node %s not listed: %s (usage per allocation may be stale)", self.node_name, e)
            pod_of_pid = {}
        pods = list(self._pods.values())
        self._write_priorities(pods)
        self._regions = self._read_regions()
        usage = allocation_usage(pods, self._regions, processes, pod_of_pid)
        self.metrics.update(
            Snapshot(
                gpus=list(self.gpus),
                samples=samples,
                allocations=usage,
                xid_supported={g.uuid: self.xid.supported for g in self.gpus},
                out_of_service=dict(self._out_of_service),
            )
        )
        if self.publish_activity and self.backend == "native":
            await self.activity.publish(pod_activity(pods, usage, self._regions, self.burst.totals))
        if self.backend == "native":
            await self.reclaims.publish(pods, reclaims_in(self._regions))

    def _start_burst(self) -> None:
        """Counting burst from zero: the running totals, the pids' last slices, the cards' looks."""
        self.burst, self._burst_owners, self._burst_nvml = BurstCounter(), Owners(), BurstLooks(self.nvml, self.log)

    async def _sample_burst(self) -> None:
        """One look at the shared cards that hold elastic slices: NVML's samples and memory per
        process, each process's pod from its cgroup (the kernel's word), into ``self.burst``."""
        elastic = elastic_slices(p.allocation for p in live_allocations(list(self._pods.values())))  # type: ignore[misc]
        self.burst.forget(a.id for a in elastic)
        cards = [g for g in self.gpus if not g.mig_enabled and any(g.uuid in a.gpu_uuids for a in elastic)]
        if not cards:
            return
        looks = await asyncio.to_thread(self._burst_looks, cards)
        pids = sorted(pids_seen((samples, memory) for samples, memory, _ in looks.values()))
        pod_of_pid = await self._pods_of(pids) if pids else {}
        linked = {pid: pod.allocation.id for pid, pod in pod_of_pid.items() if pod is not None and pod.allocation}
        alive = lambda pid: (Path(self.proc_root) / str(pid)).exists()  # noqa: E731
        owner = self._burst_owners.resolve(linked, pids, alive, time.time())
        for g in cards:
            if g.uuid in looks:
                samples, memory, now = looks[g.uuid]
                self.burst.observe(g.uuid, samples, memory, owner, requests_on(g.uuid, elastic, g.memory_mib), now)

    def _burst_looks(self, cards: Sequence[GPUInfo]) -> dict[str, tuple[list[Sample], dict[int, int], float]]:
        """Per card: NVML's per-process samples since the last look, memory per process, when."""
        out = {}
        for g in cards:
            now = time.time()
            seen = self._burst_nvml.look(g.uuid, self.burst.since_us(g.uuid, now))
            if seen is not None:
                out[g.uuid] = (*seen, now)
        return out

    async def _publish_deletions(self) -> None:
        """An elastic pod being deleted: list the pods, look at the cards, publish its activity now
        (its annotation is the burst metering bills, and cannot change once the pod is gone)."""
        while True:
            await self._deletion_wake.wait()
            self._deletion_wake.clear()
            try:
                await self._node_pods(force=True)
                if self.burst_sample_seconds > 0:
                    await self._sample_burst()
                await self._refresh()
            except KubeError as e:
                self.log.warning("last activity of deleted pods: %s", e)
            except Exception:
                self.log.exception("last activity of deleted pods failed")

    async def _annotate_activity(self, namespace: str, name: str, value: str) -> None:
        await self.kube.annotate_pod(namespace, name, L.A_GPU_ACTIVITY, value)

    async def _annotate_reclaim(self, namespace: str, name: str, value: str | None) -> None:
        await self.kube.annotate_pod(namespace, name, L.A_GPU_RECLAIM, value)
