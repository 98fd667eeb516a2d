"""What the node agent publishes on its Node: the GPU inventory (rediscovered, republished when it
changes), the node's checkpoint capability, and the cards out of service after a fatal Xid (the
health annotation, with the agent's own recovery of a card that was lost and came back).

A mixin of :class:`libvgpu.agent.app.NodeAgent`: it uses the agent's settings, ``nvml``, ``kube``,
``metrics``, ``gpus`` and the health state ``run`` makes (``_fatal``, ``_out_of_service``,
``_recovery``, ``_health_wake``, ``_loop``).
"""

from __future__ import annotations

import asyncio
import time

from libvgpu import contract as L
from libvgpu import health
from libvgpu.backstop import REASONS
from quotas import ConfigError

from . import inventory
from .kube import KubeError, dump_gpus
from .uninstall import withdraw


class NodePublication:
    """The GPU inventory, the checkpoint capability and card health, on the agent's Node."""

    def _on_xid(self, uuid: str, xid: int) -> None:  # from the Xid thread
        gpu = next((g for g in self.gpus if g.uuid == uuid), None)
        self.metrics.count_xid(gpu, uuid, xid)
        self.log.warning("Xid %d on GPU %s (%s)", xid, gpu.index if gpu else "?", uuid)
        if xid in health.FATAL_XIDS:  # in the loop's thread, where the probes run
            self._loop.call_soon_threadsafe(self._fatal_while_out, uuid, xid)
        if xid in health.FATAL_XIDS and gpu is not None and uuid not in {**self._fatal, **self._out_of_service}:
            self._fatal[uuid] = health.OutOfService(xid, time.time(), gpu.index)
            self.log.error(
                "GPU %d (%s) out of service: Xid %d (%s): no new slices on it until it recovers or an admin clears it "
                "(annotation %s of node %s)",
                gpu.index,
                uuid,
                xid,
                health.FATAL_XIDS[xid],
                L.NODE_GPU_HEALTH_ANNOTATION,
                self.node_name,
            )
            self._loop.call_soon_threadsafe(self._health_wake.set)

    def _fatal_while_out(self, uuid: str, xid: int) -> None:
        if uuid in self._out_of_service and self._recovery.fatal(uuid):
            self.log.warning(
                "GPU %d (%s) stays out of service: Xid %d (%s) restarts its %g s hold-down",
                self._out_of_service[uuid].index,
                uuid,
                xid,
                health.FATAL_XIDS[xid],
                self.recovery_hold_down_seconds,
            )

    async def _publish_health(self) -> None:
        """Add the cards with a new fatal Xid to the node's health annotation and take off those
        that recovered (health.Recovery); an admin clears a card by removing its entry, which the
        agent then forgets (libvgpu/health.py)."""
        text = await self.kube.node_annotation(L.NODE_GPU_HEALTH_ANNOTATION)
        try:
            shown = health.parse(text)
        except ValueError as e:
            self.log.warning(
                "Node %s: annotation %s is not the agent's (%s): rewriting it",
                self.node_name,
                L.NODE_GPU_HEALTH_ANNOTATION,
                e,
            )
            shown = {}
        pending = dict(self._fatal)
        recovered = await self._probe_out_of_service({u: c for u, c in shown.items() if u not in pending})
        wanted = {**pending, **{u: c for u, c in shown.items() if u not in recovered}}  # first Xid and time kept
        if wanted != shown or (text and not shown):
            await self.kube.annotate_node(L.NODE_GPU_HEALTH_ANNOTATION, health.dump(wanted))
        for uuid in pending:
            self._fatal.pop(uuid, None)
        for uuid in {*self._out_of_service, *recovered} - wanted.keys():  # recovered, or cleared by an admin
            self._recovery.forget(uuid)
        self._out_of_service = wanted

    async def _probe_out_of_service(self, cards: dict[str, health.OutOfService]) -> set[str]:
        """Probe each card out of service (health.Recovery); the cards that recovered."""
        recovered = set()
        for uuid, card in cards.items():
            step = self._recovery.probed(uuid, await asyncio.to_thread(self.nvml.answers, uuid), time.time())
            hold = self.recovery_hold_down_seconds
            if step == "lost":
                self.log.warning(
                    "GPU %d (%s) answers NVML nothing (lost after %s): it comes back in service "
                    "once it answers again, reset, for %g s",
                    card.index,
                    uuid,
                    card.meaning(),
                    hold,
                )
            elif step == "answering":
                self.log.info(
                    "GPU %d (%s) answers NVML again (reset after %s): back in service after %g s without a fatal Xid",
                    card.index,
                    uuid,
                    card.meaning(),
                    hold,
                )
            elif step == "recovered":
                recovered.add(uuid)
                self.log.warning(
                    "GPU %d (%s) back in service: it was reset after %s and answered NVML for %g s "
                    "without a fatal Xid (annotation %s of node %s)",
                    card.index,
                    uuid,
                    card.meaning(),
                    hold,
                    L.NODE_GPU_HEALTH_ANNOTATION,
                    self.node_name,
                )
        return recovered

    def gpu_objects(self) -> list[dict]:
        objs = inventory.gpu_objects(
            self.gpus,
            default_mode=self.default_mode,
            memory_oversub=self.memory_oversub,
            cores_oversub=self.cores_oversub,
            overrides=self.gpu_overrides,
        )
        inventory.validate(self.node_name, objs)
        return objs

    async def _publish(self) -> None:
        await self._publish_checkpoint()
        if not self.publish_inventory:
            return
        try:
            objs = self.gpu_objects()
        except ConfigError as e:
            self.log.error("Not publishing the GPU inventory, the pool would refuse it: %s", e)
            return
        text = dump_gpus(objs)
        try:
            label, current = await self.kube.node_inventory()
            if self.kube.uninstall_requested and not self.kube.uninstall_requested.startswith("done"):
                await withdraw(self)  # the chart is being uninstalled
                return
            want_label = "true" if objs else None
            if current == text and label == want_label:
                self._published = text
                return
            await self.kube.publish_inventory(text, bool(objs))
        except KubeError as e:
            self.log.warning("GPU inventory not published yet: %s (retrying)", e)
            return
        changed = "republished" if self._published is not None else "published"
        self._published = text
        self.log.info("GPU inventory %s on node %s: %d GPU(s)", changed, self.node_name, len(objs))

    async def _publish_checkpoint(self) -> None:
        """The node's checkpoint capability (probed at start) on the Node, so the hub promises a
        swap only where it can be done; repaired when someone else changed it."""
        if self._checkpoint_text is None:
            return  # not probed yet
        try:
            if await self.kube.publish_checkpoint(self._checkpoint_text):
                self.log.info("Checkpoint capability published on node %s", self.node_name)
        except KubeError as e:
            self.log.warning("Checkpoint capability not published yet: %s (retrying)", e)

    async def _rediscover(self) -> None:
        gpus = self.nvml.discover()
        if gpus != self.gpus:
            self.log.info("The node's GPUs changed: %d GPU(s) now", len(gpus))
            self.gpus = gpus
            self.metrics.declare_gpus(gpus, REASONS)
        await self._publish()  # also repairs an annotation someone else changed
