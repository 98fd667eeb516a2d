"""The node agent's watches: of its Node (the uninstall hook's request) and of its GPU pods (the
hub's swap requests; elastic pods being deleted). Each only wakes a job that also runs on a
timer, so a broken watch slows the agent down, never stops it.

A mixin of :class:`libvgpu.agent.app.NodeAgent`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from libvgpu import contract as L

from . import swap
from .pods import pod_info


class Watches:
    """Watches that wake the agent's jobs."""

    async def _watch_uninstall(self) -> None:
        """Wake the inventory publication (which withdraws) as soon as the uninstall hook
        annotates this node: `helm uninstall` waits for the answer. A broken watch only slows it
        down to the inventory read every inventory_interval_seconds."""

        def asked(node: Any) -> bool:
            value = (node.metadata.annotations or {}).get(L.NODE_UNINSTALL_ANNOTATION, "")
            return bool(value) and not value.startswith("done") and self.publish_inventory

        await self._wake_on(
            self.kube.watch_node, asked, self._inventory_wake,
            f"Watch of node {self.node_name} broke (%s); the uninstall annotation is read every "
            f"{self.inventory_interval_seconds:g} s meanwhile",
            min(30.0, self.inventory_interval_seconds),
        )  # fmt: skip

    async def _wake_on(
        self,
        watch: Callable[[], AsyncIterator[Any]],
        wanted: Callable[[Any], bool],
        wake: asyncio.Event,
        broke: str,
        retry_seconds: float,
    ) -> None:
        """Set ``wake`` whenever ``watch()`` yields an object ``wanted`` accepts; a broken watch is
        logged (``broke``, with the error for its %s) and started again after ``retry_seconds``."""
        while True:
            try:
                async for obj in watch():
                    if wanted(obj):
                        wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.warning(broke, e)
                await asyncio.sleep(retry_seconds)

    async def _watch_deletions(self, namespace: str) -> None:
        """Wake ``_publish_deletions`` when an elastic pod of this node gets a deletionTimestamp."""

        def deleting_elastic(pod: Any) -> bool:
            info = pod_info(pod)
            return info.deleting and info.allocation is not None and info.allocation.elastic

        await self._wake_on(
            lambda: self.kube.watch_node_pods(namespace),
            deleting_elastic,
            self._deletion_wake,
            f"Watch of this node's pods{f' in {namespace}' if namespace else ''} broke (%s); a deleted elastic "
            f"pod's last burst is published at the next pod list ({self.pod_refresh_seconds:g} s)",
            30.0,
        )

    async def _watch_swaps(self, namespace: str) -> None:
        """Wake the swap loop when a pod of this node carries a request not answered yet."""
        await self._wake_on(
            lambda: self.kube.watch_node_pods(namespace),
            lambda pod: swap.pending(pod_info(pod).annotations) is not None,
            self._swap_wake,
            f"Watch of this node's pods{f' in {namespace}' if namespace else ''} broke (%s); swap requests are "
            f"looked for every {self.swap_interval_seconds:g} s meanwhile",
            min(30.0, 5 * self.swap_interval_seconds),
        )  # fmt: skip
