"""The hub's swap requests on kernel pods, carried out by the node agent: looked for every
swap_interval_seconds and at once when the pod watch sees one, each done with the driver's
checkpoint API on the pod's host processes (:mod:`libvgpu.agent.swap`), its answer annotated on
the pod.

A mixin of :class:`libvgpu.agent.app.NodeAgent` (``checkpoint``, ``cards`` and ``_swap_wake`` come
from ``run``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from libvgpu import contract as L

from . import swap
from .kube import KubeError


class SwapRequests:
    """The hub's requests to swap a kernel pod out or in."""

    async def _swap_loop(self) -> None:
        """Carry out the hub's swap requests as soon as the watch sees one, else every
        swap_interval_seconds (a broken watch only slows it down)."""
        while True:
            try:
                await asyncio.wait_for(self._swap_wake.wait(), self.swap_interval_seconds)
            except asyncio.TimeoutError:
                pass
            self._swap_wake.clear()
            try:
                await self._swap()
            except KubeError as e:
                self.log.warning("swap: %s (retrying)", e)
            except Exception:
                self.log.exception("swap failed (retrying)")

    async def _swap(self) -> None:
        pods = list((await self._node_pods(force=True)).values())
        regions = Path(self.host_lib_dir) / "regions"
        keep = {(p.annotations or {}).get(L.A_KERNEL_ID, "") for p in pods if swap.keeps_marker(p.annotations)}
        try:
            swept = await asyncio.to_thread(swap.sweep_markers, regions, keep)
        except OSError as e:
            self.log.warning("Swap markers in %s not swept: %s", regions, e)
        else:
            if swept:
                self.log.info("Swap markers of kernels no longer swapped out here removed: %s", ", ".join(swept))
        for pod in pods:
            todo = swap.pending(pod.annotations)
            if todo is None:
                continue
            request, generation = todo
            if isinstance(request, str):
                status = {"generation": generation, "ok": False, "message": request}
            else:
                pids = swap.pod_processes(pod.uid, self.proc_root)
                elsewhere = sum(swap.swapped_mib(p.annotations) for p in pods if p.uid != pod.uid)
                kernel = (pod.annotations or {}).get(L.A_KERNEL_ID, "")
                try:
                    if request.action == "suspend":  # before the lock: a cell starting now asks the hub first
                        await asyncio.to_thread(swap.set_marker, regions, kernel, True)
                    minors = {g.uuid: g.index if g.minor is None else g.minor for g in self.gpus}
                    status = await asyncio.to_thread(
                        swap.perform,
                        request,
                        pids,
                        self.checkpoint,
                        self._used_mib,
                        elsewhere,
                        swap.node_memory_mib(),
                        self.cards,
                        minors,
                    )
                    if status["ok"] == (request.action == "resume"):
                        await asyncio.to_thread(swap.set_marker, regions, kernel, False)
                except OSError as e:  # the marker: a suspend is not tried without it
                    status = {"generation": generation, "action": request.action, "ok": False, "processes": [],
                              "message": f"the kernel's swap marker in {regions} could not be written ({e})",
                              "host_mib": 0, "stuck": False}  # fmt: skip
                self.log.info(
                    "%s of pod %s (processes %s): %s", request.action, pod.key,
                    ",".join(map(str, status["processes"])) or "none with CUDA state",
                    "done" if status["ok"] else status["message"],
                )  # fmt: skip
            await self.kube.annotate_pod(pod.namespace, pod.name, L.A_SWAP_STATUS, json.dumps(status))

    def _used_mib(self, pids: list[int]) -> int:
        wanted = set(pids)
        used = sum(p.used_bytes for ps in self._processes(self.gpus).values() for p in ps if p.pid in wanted)
        return used >> 20
