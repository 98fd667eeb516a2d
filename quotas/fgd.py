"""Fragmentation-aware placement (``placement: fgd``): the part of :class:`quotas.placement.CardIndex`
that scores where a request makes the pool's expected fragmentation grow least."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .mix import Mix


class FGDScoring:
    """Mixed into :class:`quotas.placement.CardIndex` (it reads the index's card and node lists)."""

    mix: Mix
    #: node -> GPU shape (memory, cores, GPUs, whole) -> (cards it fits, their free fraction);
    #: under None the node's free capacity in cards (:meth:`_fgd_free`)
    fgd_bases: dict[int, dict]
    #: node -> GPU group -> its slice cards as (free memory, free cores, index, card), sorted
    fgd_sorted: dict[int, dict[str, list[tuple[int, int, int, int]]]]
    #: (the mix's types, CPU and host memory it asks per card) for :meth:`_fgd_stranded`
    fgd_per_card: tuple[list, float, float] = ([], 0.0, 0.0)

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
        if self.fgd_gpus and not whole and k == 1:
            for rank, ni in enumerate(nodes):
                hit = self.fgd_best_card(ni, m, c, group, cpu, hmem, types)
                if hit is None:
                    continue
                key = (round(hit[0], 9), rank)
                if best is None or key < best[:2]:
                    best = (key[0], rank, ni, [hit[1]])
        else:
            best = self._fgd_bounded(nodes, m, c, k, whole, group, cpu, hmem, types)
        if best is not None:
            return best[2], best[3]
        # none of the weighed nodes has room after all: the first of the others that has
        for ni in self._candidates(m, c, k, whole, group, cpu, hmem, True):
            if ni not in seen:
                cards = self._cards(ni, m, c, k, whole, group, cpu, hmem)
                if cards:
                    return ni, cards
        return None

    def _fgd_bounded(
        self, nodes: list[int], m: int, c: int, k: int, whole: bool, group: str, cpu: int, hmem: int,
        types: list[tuple[tuple, float]],
    ) -> tuple[float, int, int, list[int]] | None:
        """The weighed node (and its cards) whose fragmentation grows least, ties to the first
        weighed: (growth, rank, node, cards). Branch and bound: a cheap lower bound of each
        node's growth (:meth:`_fgd_bound`) orders the nodes, and a node is scored only while
        its bound could still beat the best so far; the choice is the one scoring every node
        makes (``tests/quotas/test_quotas_fast_placement.py`` checks it)."""
        bound, fit = self._fgd_bound(m, c, whole, cpu, hmem, types), self._fgd_fit
        rows = []
        for rank, ni in enumerate(nodes):
            cards = fit(ni, m, c, k, whole, group, cpu, hmem)
            if cards:
                # less a margin far above float noise, so that rounding never lifts it past the score
                rows.append((round(bound(ni, cards) - 1e-12, 9), rank, ni, cards))
        rows.sort()  # (bound, rank) pairs are distinct: the cards are never compared
        best: tuple[float, int, int, list[int]] | None = None
        for low, rank, ni, cards in rows:
            if best is not None and (low, rank) > best[:2]:
                break  # this node's score is at least its bound: no later one can win
            delta = round(self._fgd_delta(ni, cards, m, c, whole, cpu, hmem, types), 9)
            if best is None or (delta, rank) < best[:2]:
                best = (delta, rank, ni, cards)
        return best

    def _fgd_fit(
        self, ni: int, m: int, c: int, k: int, whole: bool, group: str, cpu: int, hmem: int
    ) -> list[int] | None:
        """:meth:`CardIndex.fit_node`'s cards, for slices under card binpack from the node's
        cards kept sorted until they change (``CardIndex._refresh`` drops them)."""
        if whole or not self.binpack_gpus:
            return self.fit_node(ni, m, c, k, whole, group, None, cpu, hmem)
        if self.cpu_free[ni] < cpu or self.hmem_free[ni] < hmem:
            return None
        try:
            table = self.fgd_sorted[ni][group]
        except KeyError:
            cap_m, cap_c, used_m, used_c, gpus = self.cap_m, self.cap_c, self.used_m, self.used_c, self.gpus
            table = self.fgd_sorted.setdefault(ni, {})[group] = sorted(
                (cap_m[gi] - used_m[gi], cap_c[gi] - used_c[gi], gpus[gi].index, gi)
                for gi in self.sgpus[ni].get(group, ())
            )
        cards = []
        for row in table[bisect_left(table, (m,)) :]:
            if row[1] >= c:
                cards.append(row[3])
                if len(cards) == k:
                    return cards
        return None

    def _fgd_bound(
        self, m: int, c: int, whole: bool, cpu: int, hmem: int, types: list[tuple[tuple, float]]
    ) -> Callable[[int, list[int]], float]:
        """(node, the cards the request takes there) -> a lower bound of the node's growth of
        fragmentation, card by card. A card's free capacity changes by ``frac2 - frac``; of what
        is usable, a one-GPU type whose CPU and host memory the node has, and that fits the
        card, loses the card's change (it still fits after) or all of the card (it no longer
        does); other types lose nothing or more (a multi-GPU type may lose the whole node). The
        change in what the node's CPU and memory cannot serve (:meth:`_fgd_stranded`) is added
        exactly. Memoized by the card's state: many cards are alike."""
        memo: dict[tuple, tuple[float, float]] = {}
        cpu_free, hmem_free = self.cpu_free, self.hmem_free
        cap_m, cap_c, slice_ok, whole_ok = self.cap_m, self.cap_c, self.slice_ok, self.whole_ok
        used_m, used_c, nalloc = self.used_m, self.used_c, self.nalloc
        need_cpu = max(t[4] for t, _ in types)
        need_hmem = max(t[5] for t, _ in types)

        self._fgd_stranded(0.0, 0, 0, types)  # the mix's CPU and memory per card, kept
        _, cpu_per_card, hmem_per_card = self.fgd_per_card
        # per unit of CPU and memory: the cards they serve (0: the mix asks none)
        by_cpu = 1 / cpu_per_card if cpu_per_card else 0.0
        by_hmem = 1 / hmem_per_card if hmem_per_card else 0.0
        bases, node_free = self.fgd_bases, self._fgd_free

        def card(gi: int, ok: bool | tuple[bool, ...]) -> tuple[float, float]:
            fm, fc, n = cap_m[gi] - used_m[gi], cap_c[gi] - used_c[gi], nalloc[gi]
            sok, empty = slice_ok[gi], n == 0 and whole_ok[gi]
            key = (cap_m[gi], cap_c[gi], sok, empty, fm, fc, ok)
            low = memo.get(key)
            if low is None:
                fm2, fc2 = (fm - cap_m[gi], fc - cap_c[gi]) if whole else (fm - m, fc - c)
                frac, frac2 = self._frac(gi, fm, fc, n), self._frac(gi, fm2, fc2, n + 1)
                lost = 0.0
                for i, (t, p) in enumerate(types):
                    if t[2] != 1 or not (ok is True or ok[i]):
                        continue
                    if t[3]:
                        if empty:
                            lost += p * frac
                    elif sok and fm >= t[0] and fc >= t[1]:
                        lost += p * (frac - frac2 if fm2 >= t[0] and fc2 >= t[1] else frac)
                low = memo[key] = (frac2 - frac + lost, frac2 - frac)
            return low

        def bound(ni: int, cards: list[int]) -> float:
            cpu0, hmem0 = cpu_free[ni], hmem_free[ni]
            ok: bool | tuple[bool, ...] = (
                True
                if cpu0 >= need_cpu and hmem0 >= need_hmem
                else tuple(cpu0 >= t[4] and hmem0 >= t[5] for t, _ in types)
            )
            low = taken = 0.0
            for gi in cards:
                a, b = card(gi, ok)
                low += a
                taken += b
            # the change in what the node's CPU and memory cannot serve (:meth:`_fgd_stranded`)
            # is exact; with UNKNOWN CPU or memory it is none
            free = bases.get(ni, {}).get(None)
            if free is None:
                free = node_free(ni)
            if by_cpu or by_hmem:
                after = free + taken
                cpu1, hmem1 = cpu0 - cpu, hmem0 - hmem
                low += max(
                    0.0, after - cpu1 * by_cpu if by_cpu else 0.0, after - hmem1 * by_hmem if by_hmem else 0.0
                ) - max(0.0, free - cpu0 * by_cpu if by_cpu else 0.0, free - hmem0 * by_hmem if by_hmem else 0.0)
            return low

        return bound

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
        # fragmentation = free - usable: it grows by the change in free minus the change in usable,
        # and by the change in free capacity the node's CPU and memory cannot serve
        stranded = self._fgd_stranded
        free = self._fgd_free(ni)
        grown = stranded(free + total, cpu0 - cpu, hmem0 - hmem, types) - stranded(free, cpu0, hmem0, types)
        return total - gain + grown

    def _fgd_free(self, ni: int) -> float:
        """The node's free capacity in cards (kept with its fgd base, until its cards change)."""
        per_shape = self.fgd_bases.setdefault(ni, {})
        free = per_shape.get(None)
        if free is None:
            free = per_shape[None] = sum(self._frac(gi, *self._card_state(gi)) for gi in self.node_gpus[ni])
        return free

    def _fgd_stranded(self, free: float, cpu: int, hmem: int, types: list[tuple[tuple, float]]) -> float:
        """Free capacity (in cards) a node's CPU or host memory cannot serve if the mix's
        requests come in their proportions: the mix asks so much CPU and memory per card, and a
        node with less per free card leaves the rest of its cards idle, however the requests
        are shaped. Zero where the mix asks no CPU and no memory."""
        if self.fgd_per_card[0] is not types:
            cards = sum(p * (t[2] if t[3] else t[2] * t[1] / 100) for t, p in types)
            self.fgd_per_card = (
                types,
                sum(p * t[4] for t, p in types) / cards if cards else 0.0,
                sum(p * t[5] for t, p in types) / cards if cards else 0.0,
            )
        _, cpu_per_card, hmem_per_card = self.fgd_per_card
        left = 0.0
        if cpu_per_card:
            left = max(left, free - cpu / cpu_per_card)
        if hmem_per_card:
            left = max(left, free - hmem / hmem_per_card)
        return left
