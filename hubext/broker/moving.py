"""The GPU broker as the allocator's :class:`hubext.moves.SliceMover`: which kernels the queue may
move, which of them run a cell, and the move itself (a swap-out; a kernel running a cell is
resumed at once, elsewhere: a *live move*, its cell paused on the locked GPU until then)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from ..kernels import KernelRecord
from ..moves import SliceMover
from .sizes import BrokerError


class MoveMixin:
    """Moves of GPU kernels for the queue, for :class:`hubext.broker.GPUBroker` (with ``SwapMixin``)."""

    def can_move(self) -> bool:
        """Kernels can be moved: swapping is on, this mode can checkpoint and a resume may land on
        other cards (``capabilities()``: a kernel that can only come back to its own cards, as a
        Kubernetes pod, would just wait for them)."""
        if self.launcher is None or self.swap_host_memory_percent <= 0:
            return False
        capabilities = self.launcher.capabilities()
        return bool(capabilities.checkpoint and capabilities.move)

    def movable_sessions(self) -> dict[str, str]:
        """Allocation id -> kernel id of every running kernel this broker could move now (see
        :meth:`can_move`), in a cell or not (:meth:`cells_running`). The admission policy then
        says which may move (``movable`` classes)."""
        if not self.can_move():
            return {}
        launcher = self.launcher
        return {
            r.allocation_id: r.id
            for r in self.kernels.values()
            if r.state == "running" and not r.swap and not launcher.resume_pins(r)
        }

    def cells_running(self, movable: Mapping[str, str]) -> set[str]:
        """Of ``movable`` (:meth:`movable_sessions`: allocation id -> kernel id), the allocation ids
        of the kernels running a cell now (``KernelLauncher.in_cell``): a cell running when its
        kernel is swapped out waits on the locked GPU until the kernel is back, so the queue moves
        such a kernel only where no place needs fewer (a live move: :meth:`move_out` resumes it at
        once)."""
        kernels, in_cell = self.kernels, self.launcher.in_cell
        return {a for a, kid in movable.items() if kid in kernels and in_cell(kernels[kid])}

    async def move_out(self, allocation_id: str, why: str) -> None:
        """Swap out the kernel holding ``allocation_id`` for the queue (BrokerError if it cannot be);
        one running a cell is resumed at once, wherever the queue has room (a live move: its cell
        pauses on the locked GPU until then; a cell that ends first joins that resume)."""
        record = next((r for r in self.kernels.values() if r.allocation_id == allocation_id and not r.swap), None)
        if record is None:
            raise BrokerError("No running GPU kernel holds this slice any more.", 409)
        await self.suspend(record, why, move=True)
        if record.swap.get("live"):
            self.log.warning(
                "GPU kernel %s of %s: live move, its cell pauses until it is resumed", record.id, record.user
            )
            self._resume_live(record)

    def resume_paused_cells(self) -> None:
        """At the broker's start: resume each kernel a live move left swapped out whose cell still
        waits on its GPU (the hub that moved it stopped before it was back; no hook asks for it)."""
        for record in list(self.kernels.values()):
            swap = record.swap
            if swap.get("live") and swap.get("state") == "queued":
                swap["state"], swap["position"] = "swapped", None  # its request ended with that hub
            if self._cell_waits(record):
                self.log.warning(
                    "GPU kernel %s of %s: its cell has waited since a live move before the hub restarted; resuming it",
                    record.id,
                    record.user,
                )
                self._resume_live(record)

    def _resume_live(self, record: KernelRecord) -> None:
        """Start (or join) the resume of a kernel whose cell waits on it; no one awaits it, so its
        end is logged here."""
        self._resume_task(record).add_done_callback(lambda task: self._live_resume_ended(record, task))

    def _live_resume_ended(self, record: KernelRecord, task: asyncio.Task) -> None:
        """Log a live move's resume that ended without the kernel back (it was shut down, or its
        cell ended first and its next cell asks again); the error is retrieved here, joined or not."""
        error = None if task.cancelled() else task.exception()
        if error is not None or record.swap:
            self.log.warning(
                "GPU kernel %s of %s: not resumed after its live move: %s",
                record.id,
                record.user,
                getattr(error, "message", error) or "its cell ended first; its next cell asks for its GPU",
            )


SliceMover.register(MoveMixin)
