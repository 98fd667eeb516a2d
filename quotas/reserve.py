"""Room kept for swapped-out kernels to come back: soft reservations in placement.

A kernel pod swapped out can come back only to its node, and often only to its own card (the
driver restores its state there; a pod cannot change node). While it is swapped out its slice is
free for others, and a new slice that lands in that room makes its resume wait, even where the
new slice could have gone elsewhere (issue 28: with the default placement, resumes waited
169-289 s p95 where a kill waited nothing). So the room a swapped-out kernel will need on its
card(s) counts as used when placement looks for a place (:class:`quotas.placement.CardIndex`:
``find``, ``fit_pinned``, ``has_room``, ``find_whole_within``), and a request takes that room
only where nothing else fits: placement then looks again with the reservations lifted. Quotas
do not count a reservation (the kernel holds no slice); preemption sees the reserved room as held.

The hub keeps the reservations equal to its swapped-out kernels (``GPUAllocator.reserve_for_resumes``);
a kernel asking for its resume drops its own reservation (its request is in the queue, first in
line before any later request).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .placement import CardIndex

T = TypeVar("T")


@dataclass(frozen=True)
class SoftReservation:
    """The room one swapped-out kernel needs on each of its cards to come back."""

    gpu_uuids: tuple[str, ...]
    memory_mib: int
    cores_percent: int
    whole: bool = False


class SoftReservations:
    """The reservations charged on one card index (the index's used memory and cores include
    them, except while :meth:`lifted`)."""

    def __init__(self) -> None:
        self.held: dict[str, SoftReservation] = {}
        self._lifted = False

    def replace(self, ix: CardIndex, wanted: Mapping[str, SoftReservation]) -> None:
        """Make the reservations ``wanted`` (key -> reservation): the others are dropped."""
        for key in [k for k, r in self.held.items() if wanted.get(k) != r]:
            self._charge(ix, self.held.pop(key), -1)
        for key, r in wanted.items():
            if key not in self.held:
                self.held[key] = r
                self._charge(ix, r, 1)

    def moved_to(self, ix: CardIndex) -> SoftReservations:
        """These reservations charged on ``ix`` (a new index of the same ledger: the pool changed)."""
        out = SoftReservations()
        out.replace(ix, self.held)
        return out

    def retry(self, ix: CardIndex, look: Callable[[], T]) -> T:
        """``look()``'s answer; where it finds nothing, its answer with the reservations lifted."""
        hit = look()
        if hit or not self.held or self._lifted:
            return hit
        with self.lifted(ix):
            return look()

    @contextmanager
    def lifted(self, ix: CardIndex) -> Iterator[None]:
        """Within the block, the reserved room counts as free."""
        for r in self.held.values():
            self._charge(ix, r, -1)
        self._lifted = True
        try:
            yield
        finally:
            self._lifted = False
            for r in self.held.values():
                self._charge(ix, r, 1)

    @staticmethod
    def _charge(ix: CardIndex, r: SoftReservation, sign: int) -> None:
        nodes = set()
        for uuid in r.gpu_uuids:
            gi = ix.gi_of.get(uuid)
            if gi is None:
                continue  # a card gone from the pool
            m, c = (ix.cap_m[gi], ix.cap_c[gi]) if r.whole else (r.memory_mib, r.cores_percent)
            ix.used_m[gi] += sign * m
            ix.used_c[gi] += sign * c
            ix.nalloc[gi] += sign  # a whole card is not free while a kernel waits to come back to it
            nodes.add(ix.node_of_gpu[gi])
        for ni in nodes:
            ix._refresh(ni)
