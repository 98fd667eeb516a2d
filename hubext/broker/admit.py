"""Admission of a GPU kernel's slice: at once, or waiting in the GPU queue where its server sees its place.

A kernel's first start that waits in the queue is listed (``GPUBroker.starting``, the kernels API)
with its place (``queue``: requests ahead, and why it waits), so the user's JupyterLab can say
that it waits and where while the start request is still open.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quotas import Allocation, GPURequest

from ..kernels import KernelRecord

if TYPE_CHECKING:
    from ..allocator import GPUAllocator


class AdmitMixin:
    """Admission of :class:`~hubext.broker.core.GPUBroker`'s kernels."""

    allocator: GPUAllocator
    max_queue_seconds: float
    starting: dict[str, KernelRecord]

    async def _admit(
        self, request: GPURequest, server_name: str = "", record: KernelRecord | None = None
    ) -> Allocation:
        """Admission for a kernel, asked of the allocator once: with no queueing allowed, a request
        that does not fit now is refused with the admission sentence alone. ``record``: a kernel's
        first start, listed in ``starting`` with its place while it waits (called by ``create``)."""
        if self.max_queue_seconds <= 0:
            return await self.allocator.allocate(request, queue=False, server_name=server_name)
        if record is None:
            return await self.allocator.allocate(request, timeout=self.max_queue_seconds, server_name=server_name)

        def progress(reason: str, position: int | None) -> None:
            record.queue = {"position": position, "waiting_reason": reason}

        self.starting[record.id] = record
        try:
            return await self.allocator.allocate(
                request, progress=progress, timeout=self.max_queue_seconds, server_name=server_name
            )
        finally:
            self.starting.pop(record.id, None)
            record.queue = {}
