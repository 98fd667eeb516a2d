"""Carrying out the queue's moves: swapping out movable GPU kernels so that an overdue request fits.

The admission queue (``quotas.queue``, pure) decides that some slices should move for the
overdue head of a priority class (``Step.moves``, see quotas/moving.py); the allocator asks its
:class:`SliceMover` (the GPU broker, which can swap kernels out) to swap each out. The kernel
keeps its state in host memory and its process runs on; its slice goes back to the pool (the
release is recorded with cause ``swapped`` and the reason "moved to make room for ..."), the
waiting request is granted in the pump that release triggers, and the kernel asks admission
again before its next cell runs, wherever there is room then. A kernel running a cell is moved
only where no place needs fewer of those (``SliceMover.cells_running``); its move is *live*: the
mover asks for its slice back at once, its cell paused on the locked GPU until it is back.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING

from quotas.messages import moved_for
from quotas.queue import Move, Waiting

if TYPE_CHECKING:
    from .allocator import GPUAllocator


class SliceMover(ABC):
    """What can move a slice elsewhere without losing its holder's state (the GPU broker)."""

    @abstractmethod
    def can_move(self) -> bool:
        """Whether this mover can move any slice at all (its mode swaps kernels out and brings
        them back on other cards); where it cannot, the queue does not hold capacity for an
        overdue request either (``queue.hold: with-moves``, the default).

        Called by ``GPUAllocator._pump_once``, under its lock, once per pass over the queue."""

    @abstractmethod
    def movable_sessions(self) -> Mapping[str, str]:
        """Allocation id -> the key of its session (the same across the session's successive
        allocations), for every allocation this mover could swap out now.

        Called by ``GPUAllocator._pump_once``, under its lock, once per pass over the queue."""

    def cells_running(self, movable: Mapping[str, str]) -> set[str]:
        """Of ``movable`` (what :meth:`movable_sessions` answered in this pass), the allocation ids
        whose holder runs a cell now (a move pauses that cell until the holder is back: the queue
        prefers the others). Default: none.

        Called by ``GPUAllocator._pump_once``, under its lock, once per pass over the queue."""
        return set()

    @abstractmethod
    async def move_out(self, allocation_id: str, why: str) -> None:
        """Swap out the holder of ``allocation_id`` (its slice is released through the
        allocator; a holder running a cell is resumed at once, elsewhere); raise with a sentence
        when it cannot be (the holder then keeps its slice).

        Called by :func:`carry_out`, outside the allocator's lock."""


def move_reason(waiting: Waiting, now: float) -> str:
    """Why a slice moves: the request it makes room for and how long that waited."""
    return moved_for(waiting.request, now - waiting.enqueued_at)


async def carry_out(allocator: GPUAllocator, waiting: Waiting, moves: tuple[Move, ...]) -> None:
    """Swap out each moved slice's holder (concurrently); a move that fails is reported to the
    queue (its session is not proposed again within the policy's interval) and logged."""
    mover = allocator.mover
    why = move_reason(waiting, time.time())

    async def one(move: Move) -> None:
        a = move.allocation
        allocator.log.warning(
            "GPU move: %s (%s, %s on %s%s) %s",
            a.id,
            a.owner.user,
            a.kind,
            ",".join(a.gpu_uuids),
            ", in a cell" if move.in_cell else "",
            why,
        )
        try:
            await mover.move_out(a.id, why)
        except Exception as e:  # the holder keeps its slice; the queue tries others
            allocator.log.warning("GPU move of %s (%s) not done: %s", a.id, a.owner.user, getattr(e, "message", e))
            allocator.move_failed(waiting, a.id)

    await asyncio.gather(*(one(m) for m in moves))
