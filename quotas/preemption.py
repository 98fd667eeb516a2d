"""Who yields: the smallest set of allocations whose removal lets a request in.

Rules:

- Only *eligible* allocations are victims: borrowed ones (any priority: a request that ends up
  within its own quota may always reclaim borrowed capacity) and, if the request's class may
  preempt, allocations of a strictly lower priority value. Never a non-borrowed allocation of
  equal or higher priority. A request that would itself be borrowing never preempts.
- The victims must make the request fit: the card capacity on one node AND every quota level.
- Preference: fewest victims; then the victims with the lowest "worst" key, where a victim's key
  is (not borrowed, priority value, newest first). Borrowed allocations are thus the first to go.

Search: (1) the best single victim, exactly, by walking eligible allocations in preference
order and stopping at the first that works; (2) otherwise, per candidate node (at most
``Policy.max_preemption_nodes`` of them, in placement order, as kube-scheduler bounds its
candidates), add eligible allocations in preference order while they help, then give back
(reprieve) every victim the request can do without, worst first, so no victim is superfluous.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .model import Allocation
from .policy import PriorityClass
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


@dataclass
class Solution:
    victims: list[Allocation]
    node: int
    cards: list[int]


class VictimSearch:
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
        self.ix = state._index
        self.ask = ask
        self.pc = pc
        self.p = predicate
        self.levels = [lv for lv in levels if not lv.limits.unlimited]
        self.asked_for = asked_for
        self.base = base
        # deficits at the smallest possible ask (exact for slices; a bound for whole cards)
        low = asked_for(base[1] if base else None)
        self.deficits: list[tuple[Level, int, int]] = []  # (level, resource index, need)
        for lv in self.levels:
            for r, res in enumerate(RESOURCES):
                limit = lv.limits.get(res)
                if limit is None:
                    continue
                need = state._ledger.used(lv.key, res) + low[r] - limit
                if need > 0:
                    self.deficits.append((lv, r, need))

    # ---- helpers --------------------------------------------------------------------------

    def _eligible(self, order: Sequence[VictimKey]) -> Iterator[Allocation]:
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

    def _quota_ok(self, removed: Sequence[Allocation], asked: tuple[int, int, int]) -> bool:
        ledger, charges = self.st._ledger, self.st._charges
        for lv in self.levels:
            back = None
            for r, res in enumerate(RESOURCES):
                limit = lv.limits.get(res)
                if limit is None:
                    continue
                used = ledger.used(lv.key, res) + asked[r]
                if used <= limit:
                    continue
                if back is None:
                    back = [0, 0, 0]
                    for a in removed:
                        if self._belongs(a, lv.key):
                            ch = charges[a.id]
                            back[0] += ch[0]
                            back[1] += ch[1]
                            back[2] += ch[2]
                if used - back[r] > limit:
                    return False
        return True

    def _freed(self, removed: Sequence[Allocation]) -> dict[int, list[int]]:
        freed: dict[int, list[int]] = {}
        on = self.ix.on
        gi_of = self.ix.gi_of
        for a in removed:
            for uuid in a.gpu_uuids:
                gi = gi_of.get(uuid)
                if gi is None:
                    continue
                cm, cc = on[gi][a.id]
                f = freed.setdefault(gi, [0, 0, 0])
                f[0] += cm
                f[1] += cc
                f[2] += 1
        return freed

    def _feasible(self, ni: int | None, removed: Sequence[Allocation]) -> list[int] | None:
        """Cards the request would get on node ``ni`` (None: the base placement) with
        ``removed`` gone, if capacity and every quota level allow."""
        if ni is None:
            assert self.base is not None
            cards = self.base[1]
        else:
            a = self.ask
            cards = self.ix.fit_node(ni, a.m, a.c, a.k, a.whole, a.group, self._freed(removed))
            if cards is None:
                return None
        if self.deficits or self.ask.whole:
            if not self._quota_ok(removed, self.asked_for(cards)):
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

    def _fixes_quota(self, allocation: Allocation, removed: Sequence[Allocation]) -> bool:
        """Does ``allocation`` reduce a deficit still open after ``removed``?"""
        charge = self.st._charges[allocation.id]
        for lv, r, need in self.deficits:
            if charge[r] <= 0 or not self._belongs(allocation, lv.key):
                continue
            back = sum(
                self.st._charges[a.id][r] for a in removed if self._belongs(a, lv.key)
            )
            if back < need:
                return True
        return False

    def _quota_candidates(self) -> list[Allocation]:
        """Eligible allocations of the widest level in deficit, in preference order."""
        widest = max((lv for lv, _, _ in self.deficits), key=lambda lv: -len(lv.key))
        order = self.st._ws_order.get(widest.key[0], [])
        return [a for a in self._eligible(order) if self._belongs(a, widest.key)]

    # ---- the search -----------------------------------------------------------------------

    def run(self) -> Solution | None:
        return self._single() or self._several()

    def _single(self) -> Solution | None:
        if self.deficits:
            narrowest = min((lv for lv, _, _ in self.deficits), key=lambda lv: -len(lv.key))
            order = self.st._ws_order.get(narrowest.key[0], [])
        else:
            narrowest = None
            order = self.st._order
        for a in self._eligible(order):
            if narrowest is not None:
                if not self._belongs(a, narrowest.key):
                    continue
                charge = self.st._charges[a.id]
                if any(charge[r] < need for _, r, need in self.deficits):
                    continue
            if self.base is not None:
                cards = self._feasible(None, [a])
                if cards is not None:
                    return Solution([a], self.base[0], cards)
                continue
            if not self._frees_a_card(a, None, strict=True):
                continue
            ni = self._node_of(a)
            if ni is None:
                continue
            cards = self._feasible(ni, [a])
            if cards is not None:
                return Solution([a], ni, cards)
        return None

    def _reprieve(self, ni: int | None, chosen: list[Allocation]) -> tuple[list[Allocation], list[int]]:
        cards = self._feasible(ni, chosen)
        assert cards is not None
        for a in list(reversed(chosen)):
            trial = [v for v in chosen if v is not a]
            got = self._feasible(ni, trial)
            if got is not None:
                chosen, cards = trial, got
        return chosen, cards

    def _several(self) -> Solution | None:
        if self.base is not None:
            if not self.deficits:
                return None
            chosen: list[Allocation] = []
            for a in self._quota_candidates():
                if self._fixes_quota(a, chosen):
                    chosen.append(a)
                    if self._feasible(None, chosen) is not None:
                        chosen, cards = self._reprieve(None, chosen)
                        return Solution(chosen, self.base[0], cards)
            return None
        a = self.ask
        nodes = self.ix.evictable_nodes(self.p, a.m, a.c, a.k, a.whole, a.group)
        if not nodes:
            return None
        nodes.sort(key=lambda ni: self.ix.node_rank(ni, a.group, a.whole))
        nodes = nodes[: max(1, self.st.config.policy.max_preemption_nodes)]
        quota_cands = self._quota_candidates() if self.deficits else []
        keys = self.st._key
        best: tuple | None = None
        best_solution: Solution | None = None
        for rank, ni in enumerate(nodes):
            local = self._local_candidates(ni)
            if quota_cands:
                seen = {v.id for v in local}
                cands = local + [v for v in quota_cands if v.id not in seen]
                cands.sort(key=lambda v: keys[v.id])
            else:
                cands = local
            chosen: list[Allocation] = []
            found = False
            for v in cands:
                helps = self._frees_a_card(v, self._freed(chosen)) or (
                    self.deficits and self._fixes_quota(v, chosen)
                )
                if not helps:
                    continue
                chosen.append(v)
                if best is not None and len(chosen) > best[0]:
                    break  # already worse than the best node
                if self._feasible(ni, chosen) is not None:
                    found = True
                    break
            if not found:
                continue
            chosen, cards = self._reprieve(ni, chosen)
            score = (len(chosen), sorted((keys[v.id] for v in chosen), reverse=True), rank)
            if best is None or score < best:
                best = score
                best_solution = Solution(chosen, ni, cards)
        return best_solution

    def _local_candidates(self, ni: int) -> list[Allocation]:
        keys = self.st._key
        preempt, value = self.pc.preempt, self.pc.value
        local = []
        for a in self.ix.node_allocs[ni].values():
            key = keys[a.id]
            if key[0] == 0 or (preempt and key[1] < value):
                local.append(a)
        local.sort(key=lambda v: keys[v.id])
        return local
