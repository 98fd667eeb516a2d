"""Where a request goes: per-card capacity and the indexes that make a placement fast.

Cards and nodes are numbered once per pool; per-card usage lives in flat lists. For each GPU
model ("group", plus ``""`` for any model) the index keeps, per node, the sum of free memory on
its slice cards (a sorted list: binpack walks it upwards from the first node that could hold
the request, spread downwards), the largest free memory and cores on one card (a cheap filter),
and the number of empty cards that can be handed out whole (a sorted list too).

For preemption it keeps, per *eligibility predicate* (which allocations a priority class may
evict), the memory and cores those allocations hold on each card, so "could this node fit the
request if every allocation I may evict were gone?" is answered without walking allocations.

Capacity of a card for slices is ``floor(memory_mib * memory_oversub)`` MiB and
``floor(100 * cores_oversub)`` %. A whole allocation charges the card's entire capacity, so no
slice can join it, and it only goes on a card with no allocation at all. Cards in ``mig`` mode
are never placed on; cards in ``whole`` mode only take whole requests.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Iterator, Sequence

from .evictable import EvictableIndex
from .fgd import FGDScoring
from .mix import Mix
from .model import GPU, Allocation, Mode, Pool
from .policy import Placement
from .reserve import SoftReservations
from .shapes import NodeClasses

#: group key matching any model
ANY = ""
#: CPU or host memory of a node the edge gave no number for: never the reason a request waits
UNKNOWN = 1 << 62

# freed capacity on cards by a set of would-be victims: card -> [memory, cores, allocations]
Freed = dict[int, list[int]]


def capacity(amount: float) -> int:
    """floor() that forgives float noise: 100 * 0.29 -> 29, 100 * 1.1 -> 110."""
    return math.floor(amount + 1e-9)


class CardIndex(FGDScoring, EvictableIndex):
    """Capacity of every card of a pool, with incremental summaries. Pure bookkeeping."""

    def __init__(self, pool: Pool, placement: Placement, n_predicates: int) -> None:
        self.pool = pool
        # fgd weighs candidate nodes found in binpack order
        self.binpack_nodes = placement.node != "spread"
        self.binpack_gpus = placement.gpu != "spread"
        self.fgd_nodes = placement.node == "fgd"
        self.fgd_gpus = placement.gpu == "fgd"
        #: the expected mix of requests FGD keeps room for (fed by AdmissionState.add)
        self.mix = Mix()
        #: room kept for swapped-out kernels' resumes, taken only where nothing else fits (reserve.py)
        self.soft = SoftReservations()
        self.fgd_bases = {}
        self.gpus: list[GPU] = []
        self.gi_of: dict[str, int] = {}
        self.node_of_gpu: list[int] = []
        self.node_names: list[str] = []
        self.ni_of: dict[str, int] = {}
        self.node_gpus: list[list[int]] = []
        # static card facts
        self.cap_m: list[int] = []
        self.cap_c: list[int] = []
        self.slice_ok: list[bool] = []
        self.whole_ok: list[bool] = []
        self.group: list[str] = []
        #: display name of each group (first spelling seen)
        self.model_names: dict[str, str] = {}
        #: per node: group -> cards taking slices / whole requests
        self.sgpus: list[dict[str, list[int]]] = []
        self.wgpus: list[dict[str, list[int]]] = []
        #: per node: CPU (millicores) and host memory (MiB) left for the ledger's allocations
        #: with none of them placed (allocatable minus what others request; UNKNOWN if the
        #: edge gave no number), and what is left now
        self.cpu_static: list[int] = []
        self.hmem_static: list[int] = []
        for node in pool.nodes:
            ni = len(self.node_names)
            self.ni_of[node.name] = ni
            self.cpu_static.append(UNKNOWN if node.cpu_millicores is None
                                   else node.cpu_millicores - node.cpu_requested_millicores)
            self.hmem_static.append(UNKNOWN if node.host_memory_mib is None
                                    else node.host_memory_mib - node.host_memory_requested_mib)
            self.node_names.append(node.name)
            self.node_gpus.append([])
            sg: dict[str, list[int]] = {}
            wg: dict[str, list[int]] = {}
            for gpu in node.gpus:
                gi = len(self.gpus)
                self.gpus.append(gpu)
                self.gi_of[gpu.uuid] = gi
                self.node_of_gpu.append(ni)
                self.node_gpus[ni].append(gi)
                self.cap_m.append(capacity(gpu.memory_mib * gpu.memory_oversub))
                self.cap_c.append(capacity(100 * gpu.cores_oversub))
                mode = Mode(gpu.mode)
                self.slice_ok.append(mode is Mode.SHARED)
                self.whole_ok.append(mode in (Mode.SHARED, Mode.WHOLE))
                group = gpu.model.lower()
                self.group.append(group)
                self.model_names.setdefault(group, gpu.model)
                for g in (group, ANY):
                    if mode is Mode.SHARED:
                        sg.setdefault(g, []).append(gi)
                    if mode in (Mode.SHARED, Mode.WHOLE):
                        wg.setdefault(g, []).append(gi)
            self.sgpus.append(sg)
            self.wgpus.append(wg)
        n_gpus, n_nodes = len(self.gpus), len(self.node_names)
        self.fgd_sorted = [None] * n_nodes
        # dynamic card state
        self.cpu_free = list(self.cpu_static)
        self.hmem_free = list(self.hmem_static)
        # what claimants outside the ledger hold (GPU.held_*): never free, never a victim
        self.used_m = [0] * n_gpus
        self.used_c = [0] * n_gpus
        self.nalloc = [0] * n_gpus
        for gi, g in enumerate(self.gpus):
            if g.held_whole or g.held_memory_mib > 0 or g.held_cores_percent > 0:
                self.used_m[gi] = self.cap_m[gi] if g.held_whole else min(self.cap_m[gi], g.held_memory_mib)
                self.used_c[gi] = self.cap_c[gi] if g.held_whole else min(self.cap_c[gi], g.held_cores_percent)
                self.nalloc[gi] = 1
        #: per card: allocation id -> (memory, cores) it charges on that card
        self.on: list[dict[str, tuple[int, int]]] = [{} for _ in range(n_gpus)]
        #: per node: allocations holding one of its cards
        self.node_allocs: list[dict[str, Allocation]] = [{} for _ in range(n_nodes)]
        #: per node: the most cards one of those allocations holds (what one victim frees at most)
        self.span_max = [0] * n_nodes
        # per-group node summaries
        groups = set(self.model_names) | {ANY}
        self.free_sum: dict[str, dict[int, int]] = {g: {} for g in groups}
        self.order: dict[str, list[tuple[int, int]]] = {g: [] for g in groups}
        self.max_m: dict[str, dict[int, int]] = {g: {} for g in groups}
        self.max_c: dict[str, dict[int, int]] = {g: {} for g in groups}
        #: per group and node: free memory and free cores of its slice cards, largest first
        #: (k cards of a node can hold (m, c) only if its k-th largest of each is enough)
        self.kth_m: dict[str, dict[int, list[int]]] = {g: {} for g in groups}
        self.kth_c: dict[str, dict[int, list[int]]] = {g: {} for g in groups}
        self.empty: dict[str, dict[int, int]] = {g: {} for g in groups}
        self.worder: dict[str, list[tuple[int, int]]] = {g: [] for g in groups}
        # per-predicate evictable charges per card, and per-node summaries
        self.n_pred = n_predicates
        self.em = [[0] * n_gpus for _ in range(n_predicates)]
        self.ec = [[0] * n_gpus for _ in range(n_predicates)]
        self.en = [[0] * n_gpus for _ in range(n_predicates)]
        self.pmax_m = [[0] * n_nodes for _ in range(n_predicates)]
        self.pmax_c = [[0] * n_nodes for _ in range(n_predicates)]
        self.pempty = [[0] * n_nodes for _ in range(n_predicates)]
        # the largest single evictable charge per card, and per-node summaries of what one
        # victim could free (to find single-victim preemptions without walking everything)
        self.elig: dict[str, Sequence[bool]] = {}
        self.em1 = [[0] * n_gpus for _ in range(n_predicates)]
        self.ec1 = [[0] * n_gpus for _ in range(n_predicates)]
        self.p1max_m = [[0] * n_nodes for _ in range(n_predicates)]
        self.p1max_c = [[0] * n_nodes for _ in range(n_predicates)]
        self.pempty1 = [[0] * n_nodes for _ in range(n_predicates)]
        #: per predicate and node, over its slice cards, largest first: free memory and cores
        #: with every evictable allocation gone, and with the largest single one gone
        self.pkth: list[list[tuple[list[int], list[int], list[int], list[int]]]] = [
            [([], [], [], [])] * n_nodes for _ in range(n_predicates)]
        self._static_shape()
        for ni in range(n_nodes):
            self._refresh(ni, initial=True)
        for order in (*self.order.values(), *self.worder.values()):
            order.sort()

    # ---- static facts (for "can this ever fit?") ------------------------------------------

    def _static_shape(self) -> None:
        self.max_cap_m: dict[str, int] = {}
        self.max_cap_c: dict[str, int] = {}
        #: the most memory one card of a group has (no oversubscription): what a limit may reach
        self.max_card_m: dict[str, int] = {}
        self.min_cap_m: dict[str, int] = {}
        self.min_cap_c: dict[str, int] = {}
        self.max_slice_cards: dict[str, int] = {}
        self.max_whole_cards: dict[str, int] = {}
        for ni in range(len(self.node_names)):
            for g, gl in self.sgpus[ni].items():
                self.max_slice_cards[g] = max(self.max_slice_cards.get(g, 0), len(gl))
                for gi in gl:
                    self.max_cap_m[g] = max(self.max_cap_m.get(g, 0), self.cap_m[gi])
                    self.max_card_m[g] = max(self.max_card_m.get(g, 0), self.gpus[gi].memory_mib)
                    self.max_cap_c[g] = max(self.max_cap_c.get(g, 0), self.cap_c[gi])
                    self.min_cap_m[g] = min(self.min_cap_m.get(g, self.cap_m[gi]), self.cap_m[gi])
                    self.min_cap_c[g] = min(self.min_cap_c.get(g, self.cap_c[gi]), self.cap_c[gi])
            for g, gl in self.wgpus[ni].items():
                self.max_whole_cards[g] = max(self.max_whole_cards.get(g, 0), len(gl))
        self.classes = NodeClasses(self)
        self._shape_memo: dict[tuple[str, int, int], int] = {}
        self._whole_memo: dict[tuple[str, int, int, int], int] = {}
        self._node_memo: dict[tuple, list[int]] = {}

    def min_whole_memory(self, group: str, k: int, cpu: int = 0, hmem: int = 0) -> int:
        """The least memory k whole cards of ``group`` on one node can have (what the quota
        charges at least), on nodes that could ever give ``cpu`` and ``hmem``; 0 if no node has
        k such cards."""
        key = (group, k, cpu, hmem)
        hit = self._whole_memo.get(key)
        if hit is None:
            if len(self._whole_memo) > 4096:
                self._whole_memo.clear()
            hit = self._whole_memo[key] = self.classes.min_whole_memory(group, k, cpu, hmem)
        return hit

    def capable_nodes(self, m: int, c: int, k: int, whole: bool, group: str) -> list[int]:
        """Nodes with k cards of ``group`` that could ever hold the request (memoized)."""
        key = (group, m, c, k, whole)
        hit = self._node_memo.get(key)
        if hit is None:
            if len(self._node_memo) > 4096:
                self._node_memo.clear()
            hit = self._node_memo[key] = self.classes.capable_nodes(m, c, k, whole, group)
        return hit

    def most_slice_cards(self, group: str, m: int, c: int) -> int:
        """The most cards of ``group`` on one node that could ever hold an (m, c) slice."""
        if m <= self.min_cap_m.get(group, 0) and c <= self.min_cap_c.get(group, 0):
            return self.max_slice_cards.get(group, 0)
        key = (group, m, c)
        hit = self._shape_memo.get(key)
        if hit is None:
            if len(self._shape_memo) > 4096:
                self._shape_memo.clear()
            hit = self._shape_memo[key] = self.classes.most_slice_cards(group, m, c)
        return hit

    # ---- bookkeeping ----------------------------------------------------------------------

    def charge_on(self, allocation: Allocation, gi: int) -> tuple[int, int]:
        if allocation.whole:
            return self.cap_m[gi], self.cap_c[gi]
        return allocation.memory_mib, allocation.cores_percent

    def apply(
        self, allocation: Allocation, eligible: Sequence[bool], sign: int, refresh: bool = True
    ) -> None:
        """Add (sign=1) or remove (sign=-1) an allocation's charges on the cards it holds and
        the CPU and host memory it holds on its node."""
        nodes = set()
        ni = self.node_index(allocation)
        if ni is not None and (allocation.cpu_millicores or allocation.host_memory_mib):
            self.cpu_free[ni] -= sign * allocation.cpu_millicores
            self.hmem_free[ni] -= sign * allocation.host_memory_mib
        if sign > 0:
            self.elig[allocation.id] = eligible
        for uuid in allocation.gpu_uuids:
            gi = self.gi_of.get(uuid)
            if gi is None:
                continue  # a card no longer in the pool: the quota still counts it
            if sign > 0:
                cm, cc = self.charge_on(allocation, gi)
                self.on[gi][allocation.id] = (cm, cc)
            else:
                cm, cc = self.on[gi].pop(allocation.id)
            self.used_m[gi] += sign * cm
            self.used_c[gi] += sign * cc
            self.nalloc[gi] += sign
            for p in range(self.n_pred):
                if eligible[p]:
                    self.em[p][gi] += sign * cm
                    self.ec[p][gi] += sign * cc
                    self.en[p][gi] += sign
                    best_m = best_c = 0
                    for aid, (am, ac) in self.on[gi].items():
                        if self.elig[aid][p]:
                            best_m = max(best_m, am)
                            best_c = max(best_c, ac)
                    self.em1[p][gi] = best_m
                    self.ec1[p][gi] = best_c
            ni = self.node_of_gpu[gi]
            nodes.add(ni)
            if sign > 0:
                self.node_allocs[ni][allocation.id] = allocation
            else:
                self.node_allocs[ni].pop(allocation.id, None)
        if sign < 0:
            self.elig.pop(allocation.id, None)
        span = len(allocation.gpu_uuids)
        for ni in nodes:
            if sign > 0:
                self.span_max[ni] = max(self.span_max[ni], span)
            elif span >= self.span_max[ni]:
                self.span_max[ni] = max((len(a.gpu_uuids) for a in self.node_allocs[ni].values()), default=0)
        if refresh:
            for ni in nodes:
                self._refresh(ni)

    def node_index(self, allocation: Allocation) -> int | None:
        """The node an allocation holds (by its cards, else by its node name), or None."""
        for uuid in allocation.gpu_uuids:
            gi = self.gi_of.get(uuid)
            if gi is not None:
                return self.node_of_gpu[gi]
        return self.ni_of.get(allocation.node)

    def node_fits(self, ni: int, cpu: int, hmem: int, freed: Freed | None = None) -> bool:
        """Does node ``ni`` have ``cpu`` millicores and ``hmem`` MiB of host memory left (after
        ``freed``'s victims leave)? A hold may leave less than nothing: then nothing fits."""
        fc, fh = self.cpu_free[ni], self.hmem_free[ni]
        if freed:
            back = freed.get(-1 - ni)
            if back:
                fc += back[0]
                fh += back[1]
        return fc >= cpu and fh >= hmem

    def refresh_all(self) -> None:
        for ni in range(len(self.node_names)):
            self._refresh(ni)

    def _refresh(self, ni: int, initial: bool = False) -> None:
        self.fgd_bases.pop(ni, None)
        self.fgd_sorted[ni] = None
        cap_m, cap_c, used_m, used_c, nalloc = (
            self.cap_m, self.cap_c, self.used_m, self.used_c, self.nalloc
        )
        for g, gl in self.sgpus[ni].items():
            total = best_m = best_c = 0
            for gi in gl:
                fm = cap_m[gi] - used_m[gi]
                fc = cap_c[gi] - used_c[gi]
                if fm > 0:
                    total += fm
                best_m = max(best_m, fm)
                best_c = max(best_c, fc)
            self.max_m[g][ni] = best_m
            self.max_c[g][ni] = best_c
            self.kth_m[g][ni] = sorted((cap_m[gi] - used_m[gi] for gi in gl), reverse=True)
            self.kth_c[g][ni] = sorted((cap_c[gi] - used_c[gi] for gi in gl), reverse=True)
            self._resort(self.order[g], self.free_sum[g], ni, total, initial)
        for g, gl in self.wgpus[ni].items():
            n_empty = sum(1 for gi in gl if nalloc[gi] == 0)
            self._resort(self.worder[g], self.empty[g], ni, n_empty, initial)
        slice_cards = self.sgpus[ni].get(ANY, ())
        whole_cards = self.wgpus[ni].get(ANY, ())
        for p in range(self.n_pred):
            em, ec, en, em1, ec1 = self.em[p], self.ec[p], self.en[p], self.em1[p], self.ec1[p]
            best_m = best_c = one_m = one_c = 0
            for gi in slice_cards:
                fm, fc = cap_m[gi] - used_m[gi], cap_c[gi] - used_c[gi]
                best_m = max(best_m, fm + em[gi])
                best_c = max(best_c, fc + ec[gi])
                one_m = max(one_m, fm + em1[gi])
                one_c = max(one_c, fc + ec1[gi])
            self.pkth[p][ni] = (
                sorted((cap_m[gi] - used_m[gi] + em[gi] for gi in slice_cards), reverse=True),
                sorted((cap_c[gi] - used_c[gi] + ec[gi] for gi in slice_cards), reverse=True),
                sorted((cap_m[gi] - used_m[gi] + em1[gi] for gi in slice_cards), reverse=True),
                sorted((cap_c[gi] - used_c[gi] + ec1[gi] for gi in slice_cards), reverse=True),
            )
            self.pmax_m[p][ni] = best_m
            self.pmax_c[p][ni] = best_c
            self.p1max_m[p][ni] = one_m
            self.p1max_c[p][ni] = one_c
            self.pempty[p][ni] = sum(1 for gi in whole_cards if nalloc[gi] == en[gi])
            self.pempty1[p][ni] = sum(
                1 for gi in whole_cards if nalloc[gi] == 1 and en[gi] == 1
            )

    @staticmethod
    def _resort(
        order: list[tuple[int, int]], values: dict[int, int], ni: int, value: int, initial: bool
    ) -> None:
        old = values.get(ni)
        if old == value:
            return
        if old is not None:
            i = bisect_left(order, (old, ni))
            del order[i]
        values[ni] = value
        if initial:
            order.append((value, ni))  # sorted once, after every node is in
        else:
            insort(order, (value, ni))

    # ---- placement ------------------------------------------------------------------------

    def fit_node(
        self,
        ni: int,
        m: int,
        c: int,
        k: int,
        whole: bool,
        group: str,
        freed: Freed | None = None,
        cpu: int = 0,
        hmem: int = 0,
    ) -> list[int] | None:
        """The k cards of node ``ni`` the request takes (policy order), or None (also when
        the node lacks the CPU or host memory)."""
        if not self.node_fits(ni, cpu, hmem, freed):
            return None
        if whole:
            cards = self.wgpus[ni].get(group)
            if not cards:
                return None
            nalloc = self.nalloc
            if freed:
                free = [gi for gi in cards if nalloc[gi] == freed.get(gi, (0, 0, 0))[2]]
            else:
                free = [gi for gi in cards if nalloc[gi] == 0]
            if len(free) < k:
                return None
            gpus = self.gpus
            # the smallest cards first (the quota counts their memory), then dedicated
            # whole-mode cards, then the lowest index
            free.sort(key=lambda gi: (gpus[gi].memory_mib, gpus[gi].mode != Mode.WHOLE,
                                      gpus[gi].index, gi))
            return free[:k]
        cards = self.sgpus[ni].get(group)
        if not cards:
            return None
        if not freed and not self.may_hold(ni, m, c, k, group):
            return None  # fewer than k of its cards have that much memory, or compute, free
        cap_m, cap_c, used_m, used_c = self.cap_m, self.cap_c, self.used_m, self.used_c
        fits = []
        short = len(cards) - k  # cards that may lack room before k cannot fit any more
        for gi in cards:
            fm = cap_m[gi] - used_m[gi]
            fc = cap_c[gi] - used_c[gi]
            if freed:
                back = freed.get(gi)
                if back:
                    fm += back[0]
                    fc += back[1]
            if fm >= m and fc >= c:
                fits.append((fm, fc, self.gpus[gi].index, gi))
            elif short == 0:
                return None
            else:
                short -= 1
        if len(fits) < k:
            return None
        if self.binpack_gpus:
            fits.sort()
        else:
            fits.sort(key=lambda t: (-t[0], -t[1], t[2], t[3]))
        return [t[3] for t in fits[:k]]

    def may_hold(self, ni: int, m: int, c: int, k: int, group: str) -> bool:
        """Could k slice cards of ``group`` on node ``ni`` hold (m, c) each now? (False: surely
        not; True: perhaps, :meth:`fit_node` knows.)"""
        free_m = self.kth_m[group].get(ni)
        return (free_m is not None and len(free_m) >= k and free_m[k - 1] >= m
                and self.kth_c[group][ni][k - 1] >= c)

    def find(
        self, m: int, c: int, k: int, whole: bool, group: str, cpu: int = 0, hmem: int = 0
    ) -> tuple[int, list[int]] | None:
        """Best node and cards for the request with the pool as it is, by the placement policy
        (outside the room kept for swapped-out kernels where it can: :mod:`quotas.reserve`)."""
        return self.soft.retry(self, lambda: self._find(m, c, k, whole, group, cpu, hmem))

    def _find(
        self, m: int, c: int, k: int, whole: bool, group: str, cpu: int = 0, hmem: int = 0
    ) -> tuple[int, list[int]] | None:
        if self.fgd_nodes:
            return self._find_fgd(m, c, k, whole, group, cpu, hmem)
        for ni in self._candidates(m, c, k, whole, group, cpu, hmem, self.binpack_nodes):
            cards = self._cards(ni, m, c, k, whole, group, cpu, hmem)
            if cards:
                return ni, cards
        return None

    def has_room(self, m: int, c: int, k: int, whole: bool, group: str, cpu: int = 0, hmem: int = 0) -> bool:
        """Is there a node with room for the request now? (What :meth:`find` answers None to or
        not, without scoring the places: the first that fits, in binpack order.)"""
        return self.soft.retry(self, lambda: any(self.fit_node(ni, m, c, k, whole, group, None, cpu, hmem)
                   for ni in self._candidates(m, c, k, whole, group, cpu, hmem, True)))

    def fit_pinned(
        self, uuids: tuple[str, ...], m: int, c: int, whole: bool, cpu: int = 0, hmem: int = 0, k: int = 0
    ) -> tuple[int, list[int]] | None:
        """``k`` of ``uuids``' cards that have room for the request now (the first ones in ``uuids``'
        order), with their node, else None (a pinned request: see ``GPURequest.pinned_uuids``; the
        caller checked they exist on one node)."""
        return self.soft.retry(self, lambda: self._fit_pinned(uuids, m, c, whole, cpu, hmem, k))

    def _fit_pinned(
        self, uuids: tuple[str, ...], m: int, c: int, whole: bool, cpu: int, hmem: int, k: int
    ) -> tuple[int, list[int]] | None:
        cards = [self.gi_of[u] for u in uuids]
        ni = self.node_of_gpu[cards[0]]
        if not self.node_fits(ni, cpu, hmem):
            return None
        room = [
            gi for gi in cards
            if (not self.nalloc[gi] and self.whole_ok[gi] if whole
                else self.cap_m[gi] - self.used_m[gi] >= m and self.cap_c[gi] - self.used_c[gi] >= c)
        ]
        k = k or len(cards)
        return (ni, room[:k]) if len(room) >= k else None

    def _cards(
        self, ni: int, m: int, c: int, k: int, whole: bool, group: str, cpu: int, hmem: int
    ) -> list[int] | None:
        if self.fgd_gpus and not whole and k == 1:
            best = self.fgd_best_card(ni, m, c, group, cpu, hmem)
            return [best[1]] if best else None
        return self.fit_node(ni, m, c, k, whole, group, None, cpu, hmem)

    def _candidates(
        self, m: int, c: int, k: int, whole: bool, group: str, cpu: int, hmem: int,
        tight_first: bool,
    ) -> Iterator[int]:
        """Nodes that pass the cheap filters (enough free memory in sum, a large enough card,
        CPU and host memory), tightest first (binpack) or emptiest first (spread)."""
        walk = self._walk(m, k, whole, group)
        if walk is None:
            return
        order, start, max_m, max_c = walk
        cpu_free, hmem_free = self.cpu_free, self.hmem_free
        # walked by position, not by a copy of the order's tail (a copy costs the whole tail
        # where the first few nodes answer)
        for i in range(start, len(order)) if tight_first else range(len(order) - 1, start - 1, -1):
            ni = order[i][1]
            if (max_m is None or (max_m[ni] >= m and max_c[ni] >= c)) and cpu_free[ni] >= cpu and hmem_free[ni] >= hmem:
                yield ni

    def _walk(self, m: int, k: int, whole: bool, group: str) -> tuple[list, int, list | None, list | None] | None:
        """What :meth:`_candidates` walks: the nodes' order (whole cards: by their free whole
        cards; slices: by their free memory), the position of the first with enough in sum, and
        per node the free memory and cores of its largest slice card (None for whole cards); None
        where no node has such cards."""
        if whole:
            order = self.worder.get(group)
            return (order, bisect_left(order, (k, -1)), None, None) if order else None
        order = self.order.get(group)
        return (order, bisect_left(order, (m * k, -1)), self.max_m[group], self.max_c[group]) if order else None

    def find_whole_within(
        self, k: int, group: str, max_memory: int, cpu: int = 0, hmem: int = 0
    ) -> tuple[int, list[int]] | None:
        """Like :meth:`find` for whole cards, but only cards whose memory adds up to at most
        ``max_memory`` (the quota headroom), in placement order."""
        return self.soft.retry(self, lambda: self._find_whole_within(k, group, max_memory, cpu, hmem))

    def _find_whole_within(
        self, k: int, group: str, max_memory: int, cpu: int, hmem: int
    ) -> tuple[int, list[int]] | None:
        if self.min_whole_memory(group, k, cpu, hmem) > max_memory:
            return None  # no node's k smallest cards are that small (fit_node takes those first)
        for ni in self._candidates(0, 0, k, True, group, cpu, hmem, self.binpack_nodes):
            cards = self.fit_node(ni, 0, 0, k, True, group, None, cpu, hmem)
            if cards and sum(self.gpus[gi].memory_mib for gi in cards) <= max_memory:
                return ni, cards
        return None

    def node_rank(self, ni: int, group: str, whole: bool) -> tuple[int, int]:
        """Sort key of a node in placement order (smaller = preferred)."""
        value = (self.empty if whole else self.free_sum)[group].get(ni, 0)
        return (value, ni) if self.binpack_nodes else (-value, ni)

    def most_free_card(self, group: str) -> tuple[int, int]:
        """(memory, cores) free on the card with the most free memory, for messages."""
        best = (0, 0)
        max_m = self.max_m.get(group, {})
        if not max_m:
            return best
        ni = max(max_m, key=max_m.__getitem__)
        for gi in self.sgpus[ni].get(group, ()):
            free = (self.cap_m[gi] - self.used_m[gi], self.cap_c[gi] - self.used_c[gi])
            best = max(best, free)
        return best

    def most_empty_cards(self, group: str) -> int:
        worder = self.worder.get(group)
        return worder[-1][0] if worder else 0
