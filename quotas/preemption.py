"""Who yields: the smallest set of allocations whose removal lets a request in.

Rules:

- Only *eligible* allocations are victims: borrowed ones (any priority: a request that ends up
  within its own quota may always reclaim borrowed capacity) and, if the request's class may
  preempt, allocations of a strictly lower priority value. Never a non-borrowed allocation of
  equal or higher priority. A request that would itself be borrowing never preempts.
- The victims must make the request fit: the card capacity on one node AND every quota level.
  Borrowed allocations run beyond their quota, so they do not count against it: evicting them
  frees capacity only; a quota in deficit is fixed by evicting its own lower-priority ones.
- Preference: fewest victims; then the victims with the lowest "worst" key, where a victim's key
  is (not borrowed, priority value, newest first). Borrowed allocations are thus the first to go.

Search:

1. The best single victim, exactly: walk eligible allocations in preference order and stop at
   the first that works; if that walk runs long (``scan_budget``), ask the card index for the
   allocations that alone would make a card usable and take the best of those.
2. Otherwise several victims, per candidate node in placement order: for each usable card the
   fewest, least valuable eligible allocations that clear it (greedy in preference order, then
   the superfluous ones given back); the k cheapest cards; plus the quota's own victims when a
   level is short. The search weighs ``settle_after`` (32) candidate nodes, or more until one
   works, up to ``Policy.max_preemption_nodes`` (100), as kube-scheduler bounds its preemption
   candidates; the chosen set is then reprieved once more, so no victim is superfluous.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from .model import Allocation
from .node_victims import NodeVictims
from .policy import PriorityClass
from .reprieve import Reprieve
from .tree import RESOURCES, Level

if TYPE_CHECKING:  # pragma: no cover
    from .state import AdmissionState

VictimKey = tuple[int, int, float, str]


def victim_key(allocation: Allocation, value: int) -> VictimKey:
    """Preference order of victims: borrowed first, lowest priority, newest."""
    return (0 if allocation.borrowed else 1, value, -allocation.created_at, allocation.id)


@dataclass
class Ask:
    """The request as placement sees it."""

    m: int
    c: int
    k: int
    whole: bool
    group: str
    cpu: int = 0
    hmem: int = 0


@dataclass
class Solution:
    victims: list[Allocation]
    node: int
    cards: list[int]


class Trial:
    """Would-be victims with running totals: capacity freed per card (card -> [memory, cores,
    allocations]) and quota given back per limited level ([memory, cores, vGPUs])."""

    __slots__ = ("ids", "freed", "back")

    def __init__(self, n_levels: int) -> None:
        #: id -> victim, in the order they were added (taking one back is O(1))
        self.ids: dict[str, Allocation] = {}
        self.freed: dict[int, list[int]] = {}
        self.back = [[0, 0, 0] for _ in range(n_levels)]

    @property
    def victims(self) -> list[Allocation]:
        return list(self.ids.values())

    def __len__(self) -> int:
        return len(self.ids)


class VictimSearch(NodeVictims, Reprieve):
    #: single-victim search: allocations walked in preference order before switching to the
    #: card index (which finds the same answer; the walk is faster when answers abound)
    scan_budget = 256
    #: the same for a request of several cards: one victim rarely frees enough of them on its
    #: node, and the walk counts the usable cards of each candidate's node; the index skips
    #: whole nodes by its bounds
    scan_budget_cards = 0
    #: several victims: weigh this many candidate nodes (in placement order), or more, up to
    #: Policy.max_preemption_nodes, until one of them works
    settle_after = 32

    def __init__(
        self,
        state: AdmissionState,
        ask: Ask,
        pc: PriorityClass,
        predicate: int,
        levels: Sequence[Level],
        asked_for: Callable[[list[int] | None], tuple[int, int, int]],
        base: tuple[int, list[int]] | None,
    ) -> None:
        self.st = state
        self.ix = state.index
        self.ask = ask
        self.pc = pc
        self.p = predicate
        self.levels = [lv for lv in levels if not lv.limits.unlimited]
        self.limits = [tuple(lv.limits.get(r) for r in RESOURCES) for lv in self.levels]
        self.used = [
            tuple(state._ledger.own(lv.key, r) for r in RESOURCES) for lv in self.levels
        ]
        self.asked_for = asked_for
        self.base = base
        # the smallest possible ask (exact for slices; a lower bound for whole cards)
        self.low = asked_for(base[1] if base else None)
        self.deficits: list[tuple[Level, int, int]] = []  # (level, resource index, need)
        for i, lv in enumerate(self.levels):
            for r in range(3):
                limit = self.limits[i][r]
                if limit is not None and self.used[i][r] + self.low[r] > limit:
                    self.deficits.append((lv, r, self.used[i][r] + self.low[r] - limit))
        self._quota_cands: list[Allocation] | None = None
        #: set by run(): a quota level is short and evicting everything the class may evict
        #: in it would not give the request room (only a change in its quota levels can)
        self.quota_hopeless = False
        self._member_of: dict[str, tuple[int, ...]] = {}
        self._ready: dict[int, int] = {}

    # ---- helpers --------------------------------------------------------------------------

    def _eligible(self, order: Sequence[VictimKey]) -> Iterator[Allocation]:
        """Allocations of ``order`` the class may evict, in preference order."""
        allocs = self.st._allocs
        preempt, value = self.pc.preempt, self.pc.value
        for key in order:
            if key[0] == 1 and (not preempt or key[1] >= value):
                return
            yield allocs[key[3]]

    @staticmethod
    def _belongs(allocation: Allocation, key: tuple[str, ...]) -> bool:
        o = allocation.owner
        return o.workspace == key[0] and (
            len(key) < 2 or (o.namespace == key[1] and (len(key) < 3 or o.user == key[2]))
        )

    def _trial(self, victims: Sequence[Allocation] = ()) -> Trial:
        t = Trial(len(self.levels))
        for a in victims:
            self._change(t, a, 1)
        return t

    def _change(self, t: Trial, allocation: Allocation, sign: int) -> None:
        """Add (1) or take back (-1) a would-be victim."""
        on, gi_of = self.ix.on, self.ix.gi_of
        for uuid in allocation.gpu_uuids:
            gi = gi_of.get(uuid)
            if gi is None:
                continue
            cm, cc = on[gi][allocation.id]
            f = t.freed.get(gi)
            if f is None:
                f = t.freed[gi] = [0, 0, 0]
            f[0] += sign * cm
            f[1] += sign * cc
            f[2] += sign
        if allocation.cpu_millicores or allocation.host_memory_mib:
            ni = self.ix.node_index(allocation)
            if ni is not None:  # node CPU and host memory it gives back, under key -1 - node
                f = t.freed.get(-1 - ni)
                if f is None:
                    f = t.freed[-1 - ni] = [0, 0, 0]
                f[0] += sign * allocation.cpu_millicores
                f[1] += sign * allocation.host_memory_mib
        members = self._members(allocation)
        if members:
            charge = self.st._charges[allocation.id]
            for i in members:
                b = t.back[i]
                b[0] += sign * charge[0]
                b[1] += sign * charge[1]
                b[2] += sign * charge[2]
        if sign > 0:
            t.ids[allocation.id] = allocation
        else:
            t.ids.pop(allocation.id, None)

    def _members(self, allocation: Allocation) -> tuple[int, ...]:
        """The limited levels whose quota ``allocation`` counts against (memoized per search)."""
        hit = self._member_of.get(allocation.id)
        if hit is None:
            hit = self._member_of[allocation.id] = () if allocation.borrowed else tuple(
                i for i, lv in enumerate(self.levels) if self._belongs(allocation, lv.key))
        return hit

    def _quota_ok(self, t: Trial, asked: tuple[int, int, int]) -> bool:
        for i, limits in enumerate(self.limits):
            used, back = self.used[i], t.back[i]
            for r in range(3):
                limit = limits[r]
                if limit is not None and used[r] + asked[r] - back[r] > limit:
                    return False
        return True

    def _quota_helps(self, t: Trial, allocation: Allocation, asked: tuple[int, int, int]) -> bool:
        """Does ``allocation`` give back something a level is still short of?"""
        if allocation.borrowed:
            return False  # borrowed usage is not counted against the quota
        charge = self.st._charges[allocation.id]
        for i in self._members(allocation):
            limits, used, back = self.limits[i], self.used[i], t.back[i]
            if any(
                limits[r] is not None and charge[r] > 0 and used[r] + asked[r] - back[r] > limits[r]
                for r in range(3)
            ):
                return True
        return False

    def _feasible(self, ni: int | None, t: Trial) -> list[int] | None:
        """Cards the request would get on node ``ni`` (None: the base placement) with the
        trial's victims gone, if capacity and every quota level allow."""
        if ni is None:
            assert self.base is not None
            cards = self.base[1]
        else:
            a = self.ask
            cards = self.ix.fit_node(ni, a.m, a.c, a.k, a.whole, a.group, t.freed, a.cpu, a.hmem)
            if cards is None:
                return None
        if self.levels and (self.deficits or self.ask.whole):
            if not self._quota_ok(t, self.asked_for(cards)):
                return None
        return cards

    def _node_of(self, allocation: Allocation) -> int | None:
        for uuid in allocation.gpu_uuids:
            gi = self.ix.gi_of.get(uuid)
            if gi is not None:
                return self.ix.node_of_gpu[gi]
        return None

    def _frees_a_card(
        self, allocation: Allocation, freed: dict[int, list[int]] | None, strict: bool = False
    ) -> bool:
        """Would removing ``allocation`` (after ``freed``) make one more of its cards usable
        (``strict``), or at least bring one closer?"""
        ix, a = self.ix, self.ask
        for uuid in allocation.gpu_uuids:
            gi = ix.gi_of.get(uuid)
            if gi is None:
                continue
            if ix.group[gi] != a.group and a.group:
                continue
            back = freed.get(gi) if freed else None
            if a.whole:
                if not ix.whole_ok[gi]:
                    continue
                left = ix.nalloc[gi] - (back[2] if back else 0)
                if left == 1 or (left > 1 and not strict):
                    return True
                continue
            if not ix.slice_ok[gi]:
                continue
            fm = ix.cap_m[gi] - ix.used_m[gi] + (back[0] if back else 0)
            fc = ix.cap_c[gi] - ix.used_c[gi] + (back[1] if back else 0)
            if fm >= a.m and fc >= a.c:
                continue  # this card fits already
            cm, cc = ix.on[gi][allocation.id]
            if fm + cm >= a.m and fc + cc >= a.c:
                return True
            if not strict and (cm > 0 and fm < a.m or cc > 0 and fc < a.c):
                return True  # gets the card closer; may take more victims
        return False

    # ---- the search -----------------------------------------------------------------------

    def run(self) -> Solution | None:
        if self.deficits and not self._quota_fixable():
            self.quota_hopeless = True
            return None
        return self._single() or self._several()

    def _single(self) -> Solution | None:
        candidates: Iterable[Allocation]
        if self.deficits:
            narrowest = min((lv for lv, _, _ in self.deficits), key=lambda lv: -len(lv.key))
            # the one victim must count against the narrowest level and give back each level's
            # whole deficit: none there charges that much (or the class evicts none of them)
            most = self.st.own_most_below(narrowest.key, self.pc.value) if self.pc.preempt else [0, 0, 0]
            if any(most[r] < need for _, r, need in self.deficits):
                return None
            candidates = self._charging(self._owned_eligible(narrowest.key))
            budget = None
        else:
            group = self.ask.group
            # a request of one model that asks CPU or host memory may also take a victim on
            # another model's card: its CPU and memory make the node fit (``_frees_node``)
            by_group = group and not (self.ask.cpu or self.ask.hmem)
            candidates = self._eligible(self.st._group_order.get(group, []) if by_group else self.st._order)
            budget = None if self.base is not None else (
                self.scan_budget if self.ask.k == 1 else self.scan_budget_cards)
        last = None
        for a in candidates:
            if budget is not None:
                if budget == 0:
                    return self._single_indexed(last)
                budget -= 1
                last = self.st._key[a.id]
            if self.base is not None:
                cards = self._feasible(None, self._trial([a]))
                if cards is not None:
                    return Solution([a], self.base[0], cards)
                continue
            if not (self._frees_a_card(a, None, strict=True) or self._frees_node(a)):
                continue
            ni = self._node_of(a)
            if ni is None:
                continue
            if self.ask.k > 1 and self._ready_cards(ni) + len(a.gpu_uuids) < self.ask.k:
                continue  # one victim cannot free enough cards on this node
            cards = self._feasible(ni, self._trial([a]))
            if cards is not None:
                return Solution([a], ni, cards)
        return None

    def _charging(self, keys: list[VictimKey]) -> Iterator[Allocation]:
        """The allocations of ``keys`` that charge every deficit in full, in their order:
        filtered in chunks that double in size (the first often answers; where a deficit is
        more than most charge, the long walk runs at a list comprehension's pace)."""
        charges, allocs = self.st._charges, self.st._allocs
        start, size = 0, 16
        while start < len(keys):
            chunk = keys[start:start + size]
            for _, r, need in self.deficits:
                chunk = [k for k in chunk if charges[k[3]][r] >= need]
            for k in chunk:
                yield allocs[k[3]]
            start, size = start + size, size * 2

    def _single_indexed(self, after: VictimKey | None) -> Solution | None:
        """The best single victim after key ``after``, from the card index (no quota deficit,
        no room anywhere)."""
        a, keys, allocs = self.ask, self.st._key, self.st._allocs
        # (enough: those that cannot leave k cards usable on their node are skipped below anyway)
        ids = set(self.ix.single_victims(self.p, a.m, a.c, a.k, a.whole, a.group, enough=True))
        ids.update(self._node_single_victims())
        if after is not None:
            ids = {i for i in ids if keys[i] > after}
        if not ids:
            return None
        if a.k == 1 and not a.whole and not (a.cpu or a.hmem):
            # each of these alone makes a card fit: the best is simply the smallest key
            first = allocs[min(ids, key=keys.__getitem__)]
            ni = self._node_of(first)
            cards = self._feasible(ni, self._trial([first])) if ni is not None else None
            if cards is not None:
                return Solution([first], ni, cards)
        ix = self.ix
        for key in sorted(keys[i] for i in ids):
            v = allocs[key[3]]
            ni = self._node_of(v)
            if ni is None:
                continue
            if a.k > 1 and self._ready_cards(ni) + len(v.gpu_uuids) < a.k:
                continue
            if (a.cpu or a.hmem) and (ix.cpu_free[ni] + v.cpu_millicores < a.cpu
                                      or ix.hmem_free[ni] + v.host_memory_mib < a.hmem):
                continue  # its node lacks the CPU or host memory even without it
            cards = self._feasible(ni, self._trial([v]))
            if cards is not None:
                return Solution([v], ni, cards)
        return None

    def _ready_cards(self, ni: int) -> int:
        """Cards of node ``ni`` the request could use right now (memoized per search)."""
        hit = self._ready.get(ni)
        if hit is None:
            ix, a = self.ix, self.ask
            if a.whole:
                hit = ix.empty[a.group].get(ni, 0)
            else:
                hit = sum(
                    1 for gi in ix.sgpus[ni].get(a.group, ())
                    if ix.cap_m[gi] - ix.used_m[gi] >= a.m and ix.cap_c[gi] - ix.used_c[gi] >= a.c
                )
            self._ready[ni] = hit
        return hit

    def _quota_only(self) -> list[Allocation] | None:
        """The fewest eligible allocations of the levels in deficit whose eviction fixes the
        quota (greedy in preference order, then the superfluous ones given back)."""
        t = self._trial()
        for v in self._quota_candidates():
            if self._quota_helps(t, v, self.low):
                self._change(t, v, 1)
                if self._quota_ok(t, self.low):
                    for u in list(reversed(t.victims)):
                        self._change(t, u, -1)
                        if not self._quota_ok(t, self.low):
                            self._change(t, u, 1)
                    return list(t.victims)
        return None

    def _several(self) -> Solution | None:
        quota = self._quota_only() if self.deficits else []
        if quota is None:
            return None
        if self.base is not None:
            if not quota:
                return None
            t = self._trial(quota)
            if self._feasible(None, t) is None:
                return None
            return Solution(quota, self.base[0], self._reprieve(None, t))
        a = self.ask
        # in placement order, found as the loop reaches them
        nodes = islice(self.ix.evictable_nodes(self.p, a.m, a.c, a.k, a.whole, a.group),
                       max(1, self.st.config.policy.max_preemption_nodes))
        keys = self.st._key
        widest = (
            max((lv for lv, _, _ in self.deficits), key=lambda lv: -len(lv.key))
            if self.deficits else None
        )
        best: tuple | None = None
        plan: tuple[int, list[Allocation], bool] | None = None
        for rank, ni in enumerate(nodes):
            if rank >= self.settle_after and best is not None:
                break  # weighed enough candidate nodes
            if best is not None and self._victims_at_least(ni) > best[0]:
                continue  # every plan here takes more victims than the best
            # capacity: the k cards of this node that are cheapest to clear ...
            per_card = self._card_costs(ni)
            got = None
            while len(per_card) >= a.k:
                if best is not None and max(len(v) for _, v, _ in per_card[: a.k]) > best[0]:
                    break  # clearing the hardest of its cards alone takes more than the best
                got = self._node_plan(ni, per_card[: a.k], quota, widest)
                if got is not None or not (a.whole and self.levels):
                    break
                # whole cards are charged their size: when the quota refuses these, try the
                # node's smaller cards (a free big card is cheap to clear but never allowed)
                gpus = self.ix.gpus
                biggest = max(gpus[gi].memory_mib for _, _, gi in per_card[: a.k])
                per_card = [p for p in per_card if gpus[p[2]].memory_mib < biggest]
            if got is None:
                continue
            victims, simple = got
            score = (len(victims), tuple(sorted((keys[v.id] for v in victims), reverse=True)),
                     rank)
            if best is None or score < best:
                best, plan = score, (ni, victims, simple)
        if plan is None:
            return None
        ni, victims, simple = plan
        t = self._trial(victims)
        if self._feasible(ni, t) is None:  # pragma: no cover - the parts each fit
            return None
        cards = self._reprieve(ni, t)
        return Solution(list(t.victims), ni, cards)

    def _node_plan(
        self, ni: int, cards: list[tuple[tuple, list[Allocation], int]], quota: list[Allocation],
        widest: Level | None,
    ) -> tuple[list[Allocation], bool] | None:
        """Victims on node ``ni`` that clear ``cards`` (from :meth:`_card_costs`), free the node's
        CPU and host memory and fix the quota, and whether that was the simple case; or None."""
        a = self.ask
        chosen: dict[str, Allocation] = {}
        for _, victims, _ in cards:
            for v in victims:
                chosen[v.id] = v
        if (a.cpu or a.hmem) and not self.ix.node_fits(ni, a.cpu, a.hmem):
            # ... plus what frees the node's CPU and host memory
            t = self._trial(list(chosen.values()))
            for v in self._node_victims(ni, t):
                if self.ix.node_fits(ni, a.cpu, a.hmem, t.freed):
                    break
                chosen[v.id] = v
                self._change(t, v, 1)
            if not self.ix.node_fits(ni, a.cpu, a.hmem, t.freed):
                return None
        # ... plus the quota's own victims. If a capacity victim also counts against a
        # level in deficit, or cards differ in size (whole), work it out in full.
        simple = not a.whole and all(
            len(v.gpu_uuids) == 1
            and (widest is None or v.borrowed or not self._belongs(v, widest.key))
            for v in chosen.values()
        )
        if simple:
            for v in quota:
                chosen[v.id] = v
            return list(chosen.values()), True
        got = self._full(ni, list(chosen.values()))
        return None if got is None else (got, False)

    def _full(self, ni: int, capacity: list[Allocation]) -> list[Allocation] | None:
        """Victims on node ``ni``: the capacity victims, then quota victims while a level is
        short, then every superfluous one given back."""
        a = self.ask
        t = self._trial(capacity)
        cards = self.ix.fit_node(ni, a.m, a.c, a.k, a.whole, a.group, t.freed, a.cpu, a.hmem)
        if cards is None:
            return None
        if self.levels and (self.deficits or a.whole):
            asked = self.asked_for(cards)
            if not self._quota_ok(t, asked):
                if not self.deficits:
                    return None  # only bigger whole cards here; the quota has no room
                for v in self._quota_candidates():
                    if v.id not in t.ids and self._quota_helps(t, v, asked):
                        self._change(t, v, 1)
                        if self._quota_ok(t, asked):
                            break
                if not self._quota_ok(t, asked):
                    return None
        self._reprieve(ni, t)
        return list(t.victims)

    def _card_costs(self, ni: int) -> list[tuple[tuple, list[Allocation], int]]:
        """For each card of node ``ni`` the request could use: the fewest, least valuable
        eligible allocations on it whose removal makes it fit (greedy in preference order,
        then the superfluous ones given back), cheapest cards first: (cost, victims, card)."""
        ix, a = self.ix, self.ask
        keys, allocs = self.st._key, self.st._allocs
        m, c = a.m, a.c
        preempt, value = self.pc.preempt, self.pc.value
        cards = (ix.wgpus if a.whole else ix.sgpus)[ni].get(a.group, ())
        on_all, nalloc = ix.on, ix.nalloc
        cap_m, cap_c, used_m, used_c = ix.cap_m, ix.cap_c, ix.used_m, ix.used_c
        em, ec, en = ix.em[self.p], ix.ec[self.p], ix.en[self.p]
        free: tuple = (0, ())
        result = []
        for gi in cards:
            on = on_all[gi]
            if a.whole:
                if not on:
                    result.append((free, [], gi))
                elif en[gi] == nalloc[gi]:  # every allocation on it may be evicted
                    ks = sorted(keys[aid] for aid in on)
                    result.append(((len(ks), tuple(reversed(ks))), [allocs[k[3]] for k in ks], gi))
                continue
            need_m = m - cap_m[gi] + used_m[gi]
            need_c = c - cap_c[gi] + used_c[gi]
            if need_m <= 0 and need_c <= 0:
                result.append((free, [], gi))
                continue
            if em[gi] < need_m or ec[gi] < need_c:
                continue  # even every allocation it may evict here would not make room
            items = []
            for aid, (cm, cc) in on.items():
                k = keys[aid]
                if k[0] == 0 or (preempt and k[1] < value):
                    items.append((k, cm, cc))
            items.sort()
            n = 0
            for _, cm, cc in items:
                n += 1
                need_m -= cm
                need_c -= cc
                if need_m <= 0 and need_c <= 0:
                    break
            chosen = items[:n]
            if n > 1:  # give back the most valuable ones it can do without
                for item in reversed(items[:n]):
                    if need_m + item[1] <= 0 and need_c + item[2] <= 0:
                        chosen.remove(item)
                        need_m += item[1]
                        need_c += item[2]
            result.append((
                (len(chosen), tuple(item[0] for item in reversed(chosen))),
                [allocs[item[0][3]] for item in chosen],
                gi,
            ))
        result.sort(key=lambda item: item[0])
        return result
