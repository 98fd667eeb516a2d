"""Fragmentation-aware placement (``placement: fgd``): the part of :class:`quotas.placement.CardIndex`
that scores where a request makes the pool's expected fragmentation grow least."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .mix import Mix


class FGDScoring:
    """Mixed into :class:`quotas.placement.CardIndex` (it reads the index's card and node lists)."""

    mix: Mix
    #: node -> GPU shape (memory, cores, GPUs, whole) -> (cards it fits, their free fraction)
    fgd_bases: dict[int, dict[tuple, tuple[int, float]]]

    # ---- fragmentation-aware placement (FGD) ----------------------------------------------
    #
    # Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with
    # Fragmentation Gradient Descent" (USENIX ATC '23). The fragmentation of a node for one
    # kind of request is the free GPU capacity that kind cannot use there: on cards too small
    # for it, or all of the node's free capacity when the node lacks the cards, the CPU or the
    # host memory for it. Weighted by the expected mix of requests, that is what a placement
    # should grow least. Capacity is counted in fractions of a card's memory.

    #: FGD weighs at most this many nodes in binpack order, plus this many of the emptiest
    fgd_tight_nodes = 24
    fgd_empty_nodes = 4

    def _find_fgd(
        self, m: int, c: int, k: int, whole: bool, group: str, cpu: int, hmem: int
    ) -> tuple[int, list[int]] | None:
        types = self.mix.types() or [((m, c, k, whole, cpu, hmem), 1.0)]
        seen: set[int] = set()
        nodes: list[int] = []
        for tight_first, budget in ((True, self.fgd_tight_nodes), (False, self.fgd_empty_nodes)):
            for ni in self._candidates(m, c, k, whole, group, cpu, hmem, tight_first):
                if budget == 0:
                    break
                if ni in seen:
                    continue
                seen.add(ni)
                nodes.append(ni)
                budget -= 1
        best: tuple[float, int, int, list[int]] | None = None
        for rank, ni in enumerate(nodes):
            if self.fgd_gpus and not whole and k == 1:
                hit = self.fgd_best_card(ni, m, c, group, cpu, hmem, types)
                if hit is None:
                    continue
                delta, gi = hit
                cards = [gi]
            else:
                cards = self.fit_node(ni, m, c, k, whole, group, None, cpu, hmem)
                if not cards:
                    continue
                delta = self._fgd_delta(ni, cards, m, c, whole, cpu, hmem, types)
            key = (round(delta, 9), rank)
            if best is None or key < best[:2]:
                best = (key[0], rank, ni, cards)
        if best is not None:
            return best[2], best[3]
        # none of the weighed nodes has room after all: the first of the others that has
        for ni in self._candidates(m, c, k, whole, group, cpu, hmem, True):
            if ni not in seen:
                cards = self._cards(ni, m, c, k, whole, group, cpu, hmem)
                if cards:
                    return ni, cards
        return None

    def fgd_best_card(
        self, ni: int, m: int, c: int, group: str, cpu: int, hmem: int,
        types: list[tuple[tuple, float]] | None = None,
    ) -> tuple[float, int] | None:
        """(growth of fragmentation, card) of the best card of node ``ni`` for one slice."""
        if not self.node_fits(ni, cpu, hmem):
            return None
        if types is None:
            types = self.mix.types() or [((m, c, 1, False, cpu, hmem), 1.0)]
        best: tuple[float, int, int] | None = None
        cap_m, used_m, cap_c, used_c = self.cap_m, self.used_m, self.cap_c, self.used_c
        base = None
        seen: set[tuple[int, int, int, int, bool]] = set()
        for gi in self.sgpus[ni].get(group, ()):
            fm = cap_m[gi] - used_m[gi]
            if fm < m or cap_c[gi] - used_c[gi] < c:
                continue
            same = (cap_m[gi], cap_c[gi], fm, used_c[gi], self.nalloc[gi] == 0)
            if same in seen:
                continue  # a card like one weighed already (lower numbered): the same score
            seen.add(same)
            if base is None:
                base = self._fgd_base(ni, types)
            delta = self._fgd_change(ni, base, [gi], m, c, False, cpu, hmem, types)
            key = (round(delta, 9), fm, gi)
            if best is None or key < best:
                best = key
        return (best[0], best[2]) if best else None

    def _fgd_delta(
        self, ni: int, cards: list[int], m: int, c: int, whole: bool, cpu: int, hmem: int,
        types: list[tuple[tuple, float]],
    ) -> float:
        return self._fgd_change(ni, self._fgd_base(ni, types), cards, m, c, whole, cpu, hmem,
                                types)

    def _card_state(self, gi: int) -> tuple[int, int, int]:
        return self.cap_m[gi] - self.used_m[gi], self.cap_c[gi] - self.used_c[gi], self.nalloc[gi]

    def _frac(self, gi: int, fm: int, fc: int, n: int) -> float:
        """The free part of a card, in cards: the smaller of its free memory and free compute
        (a card whose compute is given out is used up, however much memory it has left)."""
        if self.slice_ok[gi]:
            if not self.cap_m[gi] or not self.cap_c[gi]:
                return 0.0
            return max(0.0, min(fm / self.cap_m[gi], fc / self.cap_c[gi]))
        return 1.0 if n == 0 and self.whole_ok[gi] else 0.0

    def _fgd_base(self, ni: int, types: list[tuple[tuple, float]]) -> list[tuple[int, float]]:
        """Per type: (cards it fits, free fraction on those cards). Kept per node and GPU shape
        until the node's cards change (``CardIndex._refresh`` drops the node's): the expected
        mix changes its shapes with nearly every grant, a node's cards only when it is placed
        on or left."""
        per_shape = self.fgd_bases.get(ni)
        if per_shape is None or len(per_shape) > 64:
            per_shape = self.fgd_bases[ni] = {}
        base = []
        cards = None
        for t, _ in types:
            key = t[:4]
            hit = per_shape.get(key)
            if hit is None:
                if cards is None:  # (free memory, free cores, allocations, its fraction) per card
                    cards = [(gi, *self._card_state(gi)) for gi in self.node_gpus[ni]]
                    cards = [(gi, fm, fc, n, self._frac(gi, fm, fc, n)) for gi, fm, fc, n in cards]
                n_fit, total = 0, 0.0
                if key[3]:  # whole
                    whole_ok = self.whole_ok
                    for gi, _, _, n, frac in cards:
                        if n == 0 and whole_ok[gi]:
                            n_fit += 1
                            total += frac
                else:
                    slice_ok, m, c = self.slice_ok, key[0], key[1]
                    for gi, fm, fc, _, frac in cards:
                        if slice_ok[gi] and fm >= m and fc >= c:
                            n_fit += 1
                            total += frac
                hit = per_shape[key] = (n_fit, total)
            base.append(hit)
        return base

    def _fgd_change(
        self, ni: int, base: list[tuple[int, float]], cards: list[int], m: int, c: int, whole: bool,
        cpu: int, hmem: int, types: list[tuple[tuple, float]],
    ) -> float:
        """How much the node's expected fragmentation grows if the request takes ``cards``."""
        after = [list(b) for b in base]
        total = 0.0
        slice_ok, whole_ok = self.slice_ok, self.whole_ok
        for gi in cards:
            fm, fc, n = self._card_state(gi)
            if whole:
                fm2, fc2 = fm - self.cap_m[gi], fc - self.cap_c[gi]
            else:
                fm2, fc2 = fm - m, fc - c
            frac, frac2 = self._frac(gi, fm, fc, n), self._frac(gi, fm2, fc2, n + 1)
            total += frac2 - frac
            sok, empty_ok = slice_ok[gi], n == 0 and whole_ok[gi]
            for i, (t, _) in enumerate(types):
                if t[3]:  # whole: fits an empty card before, never after (the request is on it)
                    if empty_ok:
                        a = after[i]
                        a[0] -= 1
                        a[1] -= frac
                    continue
                if not sok:
                    continue
                tm, tc = t[0], t[1]
                if fm >= tm and fc >= tc:
                    a = after[i]
                    a[0] -= 1
                    a[1] -= frac
                if fm2 >= tm and fc2 >= tc:
                    a = after[i]
                    a[0] += 1
                    a[1] += frac2
        cpu0, hmem0 = self.cpu_free[ni], self.hmem_free[ni]
        gain = 0.0
        for i, (t, p) in enumerate(types):
            usable = base[i][1] if (base[i][0] >= t[2] and cpu0 >= t[4] and hmem0 >= t[5]) else 0.0
            usable2 = (
                after[i][1]
                if after[i][0] >= t[2] and cpu0 - cpu >= t[4] and hmem0 - hmem >= t[5]
                else 0.0
            )
            gain += p * (usable2 - usable)
        # fragmentation = free - usable: it grows by the change in free minus the change in usable
        return total - gain
