"""The node agent's watches: of its Node (the uninstall hook's request) and, one stream per
namespace, of its GPU pods (the hub's swap requests and elastic pods being deleted). Each only
wakes a job that also runs on a timer, so a broken watch slows the agent down, never stops it.

A mixin of :class:`libvgpu.agent.app.NodeAgent`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from libvgpu import contract as L

from . import swap
from .pods import pod_info


class Watches:
    """Watches that wake the agent's jobs."""

    #: the swap loop's and the deleted pods' publication's wake-ups (None: the job does not run)
    _swap_wake: asyncio.Event | None = None
    _deletion_wake: asyncio.Event | None = None

    async def _watch_uninstall(self) -> None:
        """Wake the inventory publication (which withdraws) as soon as the uninstall hook
        annotates this node: `helm uninstall` waits for the answer. A broken watch only slows it
        down to the inventory read every inventory_interval_seconds."""

        def asked(node: Any) -> bool:
            value = (node.metadata.annotations or {}).get(L.NODE_UNINSTALL_ANNOTATION, "")
            return bool(value) and not value.startswith("done") and self.publish_inventory

        await self._wake_on(
            self.kube.watch_node, [(asked, self._inventory_wake)],
            f"Watch of node {self.node_name} broke (%s); the uninstall annotation is read every "
            f"{self.inventory_interval_seconds:g} s meanwhile",
            min(30.0, self.inventory_interval_seconds),
        )  # fmt: skip

    async def _wake_on(
        self,
        watch: Callable[[], AsyncIterator[Any]],
        wakes: Sequence[tuple[Callable[[Any], bool], asyncio.Event]],
        broke: str,
        retry_seconds: float,
    ) -> None:
        """Set each ``(wanted, wake)`` pair's event whenever ``watch()`` yields an object its
        ``wanted`` accepts; a broken watch is logged (``broke``, with the error for its %s) and
        started again after ``retry_seconds``."""
        while True:
            try:
                async for obj in watch():
                    for wanted, wake in wakes:
                        if wanted(obj):
                            wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.warning(broke, e)
                await asyncio.sleep(retry_seconds)

    async def _watch_pods(self, namespace: str) -> None:
        """One watch of this node's GPU pods in ``namespace`` for every job it wakes: the swap
        loop (``_swap_wake``) when a pod carries a request not answered yet, ``_publish_deletions``
        (``_deletion_wake``) when an elastic pod gets a deletionTimestamp."""

        def deleting_elastic(pod: Any) -> bool:
            info = pod_info(pod)
            return info.deleting and info.allocation is not None and info.allocation.elastic

        wakes, meanwhile, retry = [], [], 30.0
        if self._swap_wake is not None:
            wakes.append((lambda pod: swap.pending(pod_info(pod).annotations) is not None, self._swap_wake))
            meanwhile.append(f"swap requests are looked for every {self.swap_interval_seconds:g} s")
            retry = min(retry, 5 * self.swap_interval_seconds)
        if self._deletion_wake is not None:
            wakes.append((deleting_elastic, self._deletion_wake))
            meanwhile.append(f"a deleted elastic pod's last burst is published at the next pod list "
                             f"({self.pod_refresh_seconds:g} s)")  # fmt: skip
        await self._wake_on(
            lambda: self.kube.watch_node_pods(namespace),
            wakes,
            f"Watch of this node's pods{f' in {namespace}' if namespace else ''} broke (%s); "
            f"{' and '.join(meanwhile)} meanwhile",
            retry,
        )
