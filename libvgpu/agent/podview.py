"""The node agent's view of this node's GPU pods and processes: the pods (listed at most every
pod_refresh_seconds, at once for a process of a pod not seen yet), which pod each host pid
belongs to (its cgroup), the pods of other workloads, the GPU processes NVML lists, and the node
regions with their priority table.

A mixin of :class:`libvgpu.agent.app.NodeAgent` (its settings, ``nvml``, ``kube``, ``gpus``, and
the pod state ``run`` makes: ``_pods``, ``_pods_at``, ``_pods_lock``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from libvgpu.priorities import write_priority_table
from libvgpu.regions import NodeGPU, read_node_regions

from . import inventory
from .kube import KubeError
from .nvml import GPUInfo, GPUProcess
from .pods import PodInfo, pod_info, process_cgroup


class PodView:
    """This node's GPU pods, the pod of each host process, the GPU processes, the node regions."""

    async def _node_pods(self, *, force: bool = False) -> dict[str, PodInfo]:
        async with self._pods_lock:
            if force or time.monotonic() - self._pods_at >= self.pod_refresh_seconds:
                if self.pod_namespace:
                    items = []
                    for namespace in dict.fromkeys([self.pod_namespace, *self.extra_pod_namespaces]):
                        items += await self.kube.node_pods(namespace)
                else:
                    items = await self.kube.node_pods("")
                self._pods = {p.uid: p for p in (pod_info(i) for i in items)}
                self._pods_at = time.monotonic()
            return self._pods

    async def _pods_of(self, pids: Sequence[int]) -> dict[int, PodInfo | None]:
        """Host pid -> its pod (None: not one of this node's pods we know)."""
        uids = {pid: process_cgroup(pid, self.proc_root) for pid in pids}
        pods = await self._node_pods()
        if any(c is not None and c.pod_uid not in pods for c in uids.values()):
            since = time.monotonic() - self._pods_at
            if since >= min(self.pod_refresh_seconds, self.backstop.interval_seconds):
                pods = await self._node_pods(force=True)
        return {pid: (pods.get(c.pod_uid) if c else None) for pid, c in uids.items()}

    async def _other_pods(self, pod_of_pid: dict[int, PodInfo | None]) -> dict[int, str]:
        """Host pid -> "namespace/name" of the pod of another workload it runs in (its cgroup
        names a pod that is not one of ours), or "uid <uid>" when the agent may not list it."""
        foreign = {}
        for pid, pod in pod_of_pid.items():
            cgroup = process_cgroup(pid, self.proc_root) if pod is None else None
            if cgroup is not None:
                foreign[pid] = cgroup.pod_uid
        if not foreign:
            return {}
        try:
            names = await self.kube.pods_on_node()
        except KubeError as e:
            if not self._warned_pod_names:
                self._warned_pod_names = True
                self.log.warning("Cannot name the pods of other workloads on this node: %s", e)
            names = {}
        return {pid: names.get(uid, f"uid {uid}") for pid, uid in foreign.items()}

    def _shared_cards(self) -> list[GPUInfo]:
        modes = {
            o["uuid"]: o["mode"]
            for o in inventory.gpu_objects(self.gpus, default_mode=self.default_mode, overrides=self.gpu_overrides)
        }
        return [g for g in self.gpus if modes.get(g.uuid) == "shared"]

    def _processes(self, gpus: Sequence[GPUInfo]) -> dict[str, list[GPUProcess]]:
        out: dict[str, list[GPUProcess]] = {}
        for g in gpus:
            if g.mig_enabled:
                continue
            try:
                out[g.uuid] = self.nvml.processes(g.uuid)
            except self.nvml.nv.NVMLError as e:
                self.log.debug("No process list for GPU %s: %s", g.uuid, e)
        return out

    def _write_priorities(self, pods: Sequence[PodInfo]) -> None:
        """The node regions' priority table: the shim believes an entry's priority only if
        this table (which containers cannot write) gives its allocation the same."""
        if self.backend != "native":
            return
        running = [
            p
            for p in pods
            if p.allocation is not None and p.priority is not None and p.phase not in ("Succeeded", "Failed")
        ]
        table = {p.allocation.id: p.priority for p in running}
        gpus = {p.allocation.id: p.allocation.gpu_uuids for p in running}
        try:
            if write_priority_table(Path(self.host_lib_dir) / "regions", table, gpus):
                self.log.info("Priority table of the node regions: %d allocation(s)", len(table))
        except OSError as e:
            self.log.warning("Priority table not written: %s (priorities are not applied)", e)

    def _read_regions(self) -> dict[str, NodeGPU]:
        if self.backend != "native":
            return {}
        return read_node_regions(Path(self.host_lib_dir) / "regions")
