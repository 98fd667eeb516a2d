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
    #: node -> GPU shape (memory, cores, GPUs, whole) -> (cards it fits, their free fraction)
    fgd_bases: dict[int, dict]
    #: per node, None or GPU group -> its slice cards, sorted (:meth:`_fgd_table`), and under
    #: None the node's free capacity in cards (:meth:`_fgd_free`). ``CardIndex._refresh`` drops
    #: a node's. A list: the weighed nodes' are looked up on every decision.
    fgd_sorted: list[dict | None]
    #: (the mix's types, CPU and host memory it asks per card) for :meth:`_fgd_stranded`
    fgd_per_card: tuple[list, float, float] = ([], 0.0, 0.0)
    #: (the mix's types, :meth:`_fgd_node_terms` for them)
    fgd_terms: tuple = (None, ())

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
        nodes = self._fgd_weighed(m, c, k, whole, group, cpu, hmem)
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
        seen = set(nodes)
        for ni in self._candidates(m, c, k, whole, group, cpu, hmem, True):
            if ni not in seen:
                cards = self._cards(ni, m, c, k, whole, group, cpu, hmem)
                if cards:
                    return ni, cards
        return None

    def _fgd_weighed(self, m: int, c: int, k: int, whole: bool, group: str, cpu: int, hmem: int) -> list[int]:
        """The nodes fgd weighs, in rank order: the first ``fgd_tight_nodes`` of
        :meth:`CardIndex._candidates` in binpack order, then the first ``fgd_empty_nodes`` of it
        in spread order that are not among them (:meth:`CardIndex._walk`'s order and filters).
        One walk by position: a node before where the tight walk stopped that passes the filters
        is one of the tight ones, so the walk from the emptiest end stops there."""
        nodes: list[int] = []
        walk = self._walk(m, k, whole, group)
        if walk is None:
            return nodes
        order, start, max_m, max_c = walk
        cpu_free, hmem_free = self.cpu_free, self.hmem_free
        tight, empty = self.fgd_tight_nodes, self.fgd_empty_nodes
        i = end = len(order)
        for i in range(start, end):
            if not tight:
                break
            ni = order[i][1]
            if (max_m is None or (max_m[ni] >= m and max_c[ni] >= c)) and cpu_free[ni] >= cpu and hmem_free[ni] >= hmem:
                nodes.append(ni)
                tight -= 1
        else:
            i = end
        for j in range(end - 1, i - 1, -1):
            if not empty:
                break
            ni = order[j][1]
            if (max_m is None or (max_m[ni] >= m and max_c[ni] >= c)) and cpu_free[ni] >= cpu and hmem_free[ni] >= hmem:
                nodes.append(ni)
                empty -= 1
        return nodes

    def _fgd_bounded(
        self, nodes: list[int], m: int, c: int, k: int, whole: bool, group: str, cpu: int, hmem: int,
        types: list[tuple[tuple, float]],
    ) -> tuple[float, int, int, list[int]] | None:
        """The weighed node (and its cards) whose fragmentation grows least, ties to the first
        weighed: (growth, rank, node, cards). Branch and bound: a cheap lower bound of each
        node's growth (:meth:`_fgd_bound`) orders the nodes, and a node is scored only while
        its bound could still beat the best so far; the choice is the one scoring every node
        makes (``tests/quotas/test_quotas_fast_placement.py`` checks it)."""
        as_rows = not whole and self.binpack_gpus
        if not as_rows:
            bound, fit = self._fgd_bound(m, c, whole, cpu, hmem, types), self._fgd_fit
            rows = []
            for rank, ni in enumerate(nodes):
                cards = fit(ni, m, c, k, whole, group, cpu, hmem)
                if cards:
                    # less a margin far above float noise, so that rounding never lifts it past the score
                    rows.append((round(bound(ni, cards) - 1e-12, 9), rank, ni, cards, None))
        else:  # the cards as their table rows
            rows = self._fgd_slice_rows(nodes, m, c, k, group, cpu, hmem, types)
        rows.sort()  # (bound, rank) pairs are distinct: the cards are never compared
        best: tuple[float, int, int, list[int]] | None = None
        for low, rank, ni, cards, exact in rows:
            if best is not None and (low, rank) > best[:2]:
                break  # this node's score is at least its bound: no later one can win
            if as_rows:
                cards = [row[3] for row in cards]
            delta = exact if exact is not None else round(self._fgd_delta(ni, cards, m, c, whole, cpu, hmem, types), 9)
            if best is None or (delta, rank) < best[:2]:
                best = (delta, rank, ni, cards)
        return best

    def _fgd_table(self, ni: int, group: str) -> list[tuple[int, int, int, int, tuple]]:
        """Node ``ni``'s slice cards of ``group`` as (free memory, free cores, index, card, state),
        sorted (card binpack's order), kept until the node's cards change (``CardIndex._refresh``
        drops them). The state (capacity in memory and cores, empty or not, free memory and
        cores) is what the bound of a card depends on (:meth:`_fgd_card_low`)."""
        per_group = self.fgd_sorted[ni]
        table = per_group.get(group) if per_group is not None else None
        if table is None:
            cap_m, cap_c, used_m, used_c, gpus = self.cap_m, self.cap_c, self.used_m, self.used_c, self.gpus
            nalloc = self.nalloc
            rows = []
            for gi in self.sgpus[ni].get(group, ()):
                fm, fc = cap_m[gi] - used_m[gi], cap_c[gi] - used_c[gi]
                rows.append((fm, fc, gpus[gi].index, gi, (cap_m[gi], cap_c[gi], nalloc[gi] == 0, fm, fc)))
            if per_group is None:
                per_group = self.fgd_sorted[ni] = {}
            table = per_group[group] = sorted(rows)
        return table

    def _fgd_fit(
        self, ni: int, m: int, c: int, k: int, whole: bool, group: str, cpu: int, hmem: int
    ) -> list[int] | None:
        """:meth:`CardIndex.fit_node`'s cards, for slices under card binpack from the node's
        cards kept sorted (:meth:`_fgd_table`)."""
        if whole or not self.binpack_gpus:
            return self.fit_node(ni, m, c, k, whole, group, None, cpu, hmem)
        if self.cpu_free[ni] < cpu or self.hmem_free[ni] < hmem:
            return None
        table = self._fgd_table(ni, group)
        cards = []
        for row in table[bisect_left(table, (m,)) :]:
            if row[1] >= c:
                cards.append(row[3])
                if len(cards) == k:
                    return cards
        return None

    def _fgd_card_low(
        self, gi: int, m: int, c: int, whole: bool, ok: bool | tuple[bool, ...], types: list[tuple[tuple, float]]
    ) -> tuple[float, float]:
        """(a lower bound of what taking card ``gi`` adds to its node's fragmentation, the change
        in its free capacity ``frac2 - frac``): the change, plus what the mix's types lose at
        least (:meth:`_fgd_lost`)."""
        fm, fc, n = self._card_state(gi)
        fm2, fc2 = (fm - self.cap_m[gi], fc - self.cap_c[gi]) if whole else (fm - m, fc - c)
        frac, frac2 = self._frac(gi, fm, fc, n), self._frac(gi, fm2, fc2, n + 1)
        empty, ones = n == 0 and self.whole_ok[gi], self._fgd_node_terms(types)[4]
        lost = self._fgd_lost(ones, ok, self.slice_ok[gi], empty, fm, fc, fm2, fc2, frac, frac2)
        return frac2 - frac + lost, frac2 - frac

    @staticmethod
    def _fgd_lost(
        ones: list[tuple[int, int, int, bool, float]], ok: bool | tuple[bool, ...], sok: bool, empty: bool,
        fm: int, fc: int, fm2: int, fc2: int, frac: float, frac2: float,
    ) -> float:
        """What the mix's types lose at least of a card's usable capacity when a request takes it
        (free ``fm``, ``fc`` and fraction ``frac`` before, ``fm2``, ``fc2``, ``frac2`` after): a
        one-GPU type (``ones``: (its place in the mix, memory, cores, whole, share)) whose CPU
        and host memory the node has (``ok``: all, or per type), and that fits the card, loses
        the card's change (it still fits after) or all of the card (it no longer does); other
        types lose nothing or more (a multi-GPU type may lose the whole node)."""
        lost = 0.0
        for i, tm, tc, whole, p in ones:
            if ok is not True and not ok[i]:
                continue
            if whole:
                if empty:
                    lost += p * frac
            elif sok and fm >= tm and fc >= tc:
                lost += p * (frac - frac2 if fm2 >= tm and fc2 >= tc else frac)
        return lost

    def _fgd_node_terms(
        self, types: list[tuple[tuple, float]]
    ) -> tuple[int, int, float, float, list[tuple[int, int, int, bool, float]], list[tuple[int, int, bool]]]:
        """(the most CPU and host memory one of the mix's types asks, the cards a unit of free CPU
        and of free memory serve at the mix's rate, 0 where the mix asks none, the one-GPU types
        for :meth:`_fgd_lost`, the others' memory, cores and whole), kept per mix."""
        if self.fgd_terms[0] is not types:
            self._fgd_stranded(0.0, 0, 0, types)  # the mix's CPU and memory per card, kept
            _, cpu_per_card, hmem_per_card = self.fgd_per_card
            self.fgd_terms = (
                types,
                (
                    max(t[4] for t, _ in types),
                    max(t[5] for t, _ in types),
                    1 / cpu_per_card if cpu_per_card else 0.0,
                    1 / hmem_per_card if hmem_per_card else 0.0,
                    [(i, t[0], t[1], t[3], p) for i, (t, p) in enumerate(types) if t[2] == 1],
                    [(t[0], t[1], t[3]) for t, _ in types if t[2] != 1],
                ),
            )
        return self.fgd_terms[1]

    @staticmethod
    def _fgd_stranded_change(
        free: float, taken: float, cpu0: int, hmem0: int, cpu: int, hmem: int, by_cpu: float, by_hmem: float
    ) -> float:
        """The exact change in what a node's CPU and memory cannot serve (:meth:`_fgd_stranded`)
        when a request takes ``cpu``, ``hmem`` and ``taken`` of its free capacity ``free``."""
        after, cpu1, hmem1 = free + taken, cpu0 - cpu, hmem0 - hmem
        before = max(0.0, free - cpu0 * by_cpu if by_cpu else 0.0, free - hmem0 * by_hmem if by_hmem else 0.0)
        return max(0.0, after - cpu1 * by_cpu if by_cpu else 0.0, after - hmem1 * by_hmem if by_hmem else 0.0) - before

    def _fgd_bound(
        self, m: int, c: int, whole: bool, cpu: int, hmem: int, types: list[tuple[tuple, float]]
    ) -> Callable[[int, list[int]], float]:
        """(node, the cards the request takes there) -> a lower bound of the node's growth of
        fragmentation: the cards' (:meth:`_fgd_card_low`), memoized by the card's state (many
        cards are alike), plus the exact change in what the node's CPU and memory cannot serve
        (:meth:`_fgd_stranded_change`)."""
        memo: dict[tuple, tuple[float, float]] = {}
        cpu_free, hmem_free = self.cpu_free, self.hmem_free
        cap_m, cap_c, slice_ok, whole_ok = self.cap_m, self.cap_c, self.slice_ok, self.whole_ok
        used_m, used_c, nalloc = self.used_m, self.used_c, self.nalloc
        need_cpu, need_hmem, by_cpu, by_hmem, _, _ = self._fgd_node_terms(types)
        node_free, card_low = self._fgd_free, self._fgd_card_low

        def bound(ni: int, cards: list[int]) -> float:
            cpu0, hmem0 = cpu_free[ni], hmem_free[ni]
            ok: bool | tuple[bool, ...] = (
                True
                if cpu0 >= need_cpu and hmem0 >= need_hmem
                else tuple(cpu0 >= t[4] and hmem0 >= t[5] for t, _ in types)
            )
            low = taken = 0.0
            for gi in cards:
                key = (cap_m[gi], cap_c[gi], slice_ok[gi], nalloc[gi] == 0 and whole_ok[gi],
                       cap_m[gi] - used_m[gi], cap_c[gi] - used_c[gi], ok)
                hit = memo.get(key)
                if hit is None:
                    hit = memo[key] = card_low(gi, m, c, whole, ok, types)
                low += hit[0]
                taken += hit[1]
            if by_cpu or by_hmem:  # with UNKNOWN CPU or memory it is none
                low += self._fgd_stranded_change(node_free(ni), taken, cpu0, hmem0, cpu, hmem, by_cpu, by_hmem)
            return low

        return bound

    def _fgd_slice_rows(
        self, nodes: list[int], m: int, c: int, k: int, group: str, cpu: int, hmem: int,
        types: list[tuple[tuple, float]],
    ) -> list[tuple[float, int, int, list, float | None]]:
        """(bound, rank, node, cards, score or None) of each weighed node with room for a slice request under
        card binpack: :meth:`_fgd_fit`'s cards and :meth:`_fgd_bound`'s bound in one pass over
        the nodes' kept tables, the cards' part from the state kept in them (issue 25: this walk
        is most of a decision's cost; ``tests/quotas/test_quotas_fast_placement.py`` holds it to
        the two)."""
        cpu_free, hmem_free, tables = self.cpu_free, self.hmem_free, self.fgd_sorted
        need_cpu, need_hmem, by_cpu, by_hmem, ones, multi = self._fgd_node_terms(types)
        memo: dict[tuple, tuple[float, float]] = {}  # card state (and ok, unless all) -> its part
        change, probe = self._fgd_stranded_change, (m,)
        rows = []
        for rank, ni in enumerate(nodes):
            cpu0, hmem0 = cpu_free[ni], hmem_free[ni]
            if cpu0 < cpu or hmem0 < hmem:
                continue
            per_group = tables[ni]
            table = per_group.get(group) if per_group is not None else None
            if table is None:
                table = self._fgd_table(ni, group)
                per_group = tables[ni]
            i, end, picked = bisect_left(table, probe), len(table), []
            while i < end:
                row = table[i]
                i += 1
                if row[1] >= c:
                    picked.append(row)
                    if len(picked) == k:
                        break
            else:
                continue  # fewer than k of its cards have room
            ok: bool | tuple[bool, ...] = (
                True
                if cpu0 >= need_cpu and hmem0 >= need_hmem
                else tuple(cpu0 >= t[4] and hmem0 >= t[5] for t, _ in types)
            )
            if k == 1:  # the common case, without a loop
                key = row[4] if ok is True else (row[4], ok)
                hit = memo.get(key)
                if hit is None:
                    hit = memo[key] = self._fgd_slice_low(row[4], m, c, ok, ones, multi)
                low, taken = hit[0], hit[1]
            else:
                low = taken = 0.0
                for row in picked:
                    key = row[4] if ok is True else (row[4], ok)
                    hit = memo.get(key)
                    if hit is None:  # a slice card: _fgd_card_low from its kept state
                        hit = memo[key] = self._fgd_slice_low(row[4], m, c, ok, ones, multi)
                    low += hit[0]
                    taken += hit[1]
            if by_cpu or by_hmem:  # _fgd_stranded_change, inline: this runs for every weighed node
                free = per_group.get(None)
                if free is None:
                    free = self._fgd_free(ni)
                cpu1, hmem1 = cpu0 - cpu, hmem0 - hmem
                # none stranded after (nor before: there is as much CPU and memory, and no less
                # free capacity) where the node's CPU and memory left serve all it has free now
                if (by_cpu and free > cpu1 * by_cpu) or (by_hmem and free > hmem1 * by_hmem):
                    low += change(free, taken, cpu0, hmem0, cpu, hmem, by_cpu, by_hmem)
            # the bound is the score where one card is taken that no multi-GPU type of the mix
            # fits, and the node keeps the CPU and memory every type asks: then each type loses
            # exactly what the bound counts (the card's change, or all of it), and the CPU term
            # is exact (``tests/quotas/test_quotas_fast_placement.py`` holds it to the score)
            exact = (
                round(low, 9) if k == 1 and hit[2] and cpu0 - cpu >= need_cpu and hmem0 - hmem >= need_hmem else None
            )
            # less a margin far above float noise, so that rounding never lifts it past the score;
            # the cards of the few nodes scored are listed then (:meth:`_fgd_bounded`)
            rows.append((round(low - 1e-12, 9), rank, ni, picked, exact))
        return rows

    def _fgd_slice_low(
        self, state: tuple[int, int, bool, int, int], m: int, c: int, ok: bool | tuple[bool, ...],
        ones: list[tuple[int, int, int, bool, float]], multi: list[tuple[int, int, bool]],
    ) -> tuple[float, float, bool]:
        """:meth:`_fgd_card_low` of a slice card from its state kept in :meth:`_fgd_table`, and
        whether none of the mix's multi-GPU types (``multi``) fits the card."""
        cm, cc, empty, fm, fc = state
        fm2, fc2 = fm - m, fc - c
        frac, frac2 = self._slice_frac(cm, cc, fm, fc), self._slice_frac(cm, cc, fm2, fc2)
        lost = self._fgd_lost(ones, ok, True, empty, fm, fc, fm2, fc2, frac, frac2)
        alone = not any(empty if whole else fm >= tm and fc >= tc for tm, tc, whole in multi)
        return frac2 - frac + lost, frac2 - frac, alone

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
            return self._slice_frac(self.cap_m[gi], self.cap_c[gi], fm, fc)
        return 1.0 if n == 0 and self.whole_ok[gi] else 0.0

    @staticmethod
    def _slice_frac(cm: int, cc: int, fm: int, fc: int) -> float:
        """:meth:`_frac` of a slice card of capacity ``cm``, ``cc`` with ``fm``, ``fc`` free."""
        return max(0.0, min(fm / cm, fc / cc)) if cm and cc else 0.0

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
        """The node's free capacity in cards (kept beside its tables, until its cards change)."""
        per_group = self.fgd_sorted[ni]
        if per_group is None:
            per_group = self.fgd_sorted[ni] = {}
        free = per_group.get(None)
        if free is None:
            free = per_group[None] = sum(self._frac(gi, *self._card_state(gi)) for gi in self.node_gpus[ni])
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
