"""What never changes about a node, with nodes alike grouped: for "could this ever fit?".

A pool of 5,000 nodes has a handful of kinds of node (so many cards of a model, of that size and
oversubscription). The answers about what could ever fit (which nodes could ever hold a request,
the most cards of one node that could, the least memory whole cards can have) only depend on
the kind, so :class:`NodeClasses` answers them per kind instead of walking every node and card
(issue 25: a decision at 5,000 nodes). :class:`quotas.placement.CardIndex` asks it.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .placement import CardIndex


def _front(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The points no other has at least as much of in both (CPU, host memory)."""
    front: list[tuple[int, int]] = []
    for cpu, hmem in sorted(set(points), reverse=True):
        if not front or hmem > front[-1][1]:
            front.append((cpu, hmem))
    return front


class NodeClasses:
    """Per GPU model group: the kinds of node by their cards' static capacity, each with its
    nodes (ascending). Built once per pool (an inventory change builds a new card index)."""

    def __init__(self, ix: CardIndex) -> None:
        slices: dict[str, dict[tuple[tuple[int, int], ...], list[int]]] = {}
        whole: dict[str, dict[tuple[int, ...], list[int]]] = {}
        for ni in range(len(ix.node_names)):
            for g, cards in ix.sgpus[ni].items():
                caps = tuple(sorted((ix.cap_m[gi], ix.cap_c[gi]) for gi in cards))
                slices.setdefault(g, {}).setdefault(caps, []).append(ni)
            for g, cards in ix.wgpus[ni].items():
                sizes = tuple(sorted(ix.gpus[gi].memory_mib for gi in cards))
                whole.setdefault(g, {}).setdefault(sizes, []).append(ni)
        #: group -> [(sorted (memory, cores) capacities of its slice cards, nodes)]
        self.slices = {g: list(kinds.items()) for g, kinds in slices.items()}
        #: group -> [(sorted memory of its whole-able cards, nodes, their (CPU, memory) front)]
        self.whole = {
            g: [(sizes, nodes, _front([(ix.cpu_static[ni], ix.hmem_static[ni]) for ni in nodes]))
                for sizes, nodes in kinds.items()]
            for g, kinds in whole.items()
        }

    @staticmethod
    def _slice_cards(caps: tuple[tuple[int, int], ...], m: int, c: int) -> int:
        return sum(1 for cm, cc in caps if cm >= m and cc >= c)

    def capable_nodes(self, m: int, c: int, k: int, whole: bool, group: str) -> list[int]:
        """Nodes with k cards of ``group`` that could ever hold the request, ascending."""
        if whole:
            parts = [nodes for sizes, nodes, _ in self.whole.get(group, ()) if len(sizes) >= k]
        else:
            parts = [nodes for caps, nodes in self.slices.get(group, ())
                     if self._slice_cards(caps, m, c) >= k]
        if len(parts) == 1:
            return list(parts[0])
        return sorted(chain.from_iterable(parts))

    def most_slice_cards(self, group: str, m: int, c: int) -> int:
        """The most cards of ``group`` on one node that could ever hold an (m, c) slice."""
        return max((self._slice_cards(caps, m, c) for caps, _ in self.slices.get(group, ())), default=0)

    def min_whole_memory(self, group: str, k: int, cpu: int, hmem: int) -> int:
        """The least memory k whole cards of ``group`` on one node can have, on nodes that could
        ever give ``cpu`` and ``hmem``; 0 if no node has k such cards."""
        return min((sum(sizes[:k]) for sizes, _, front in self.whole.get(group, ())
                    if len(sizes) >= k and any(fc >= cpu and fh >= hmem for fc, fh in front)),
                   default=0)
