"""Victims for node CPU and host memory: the part of :class:`quotas.preemption.VictimSearch`
that takes further victims on a node when only its CPU or host memory is short."""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

from .model import Allocation

#: no plan on the node can work
NEVER = 1 << 30


def _fewest(charges: list[int], need: int) -> int:
    """The fewest of ``charges`` that add up to ``need`` (the largest first); NEVER if all cannot."""
    if need <= 0:
        return 0
    if charges and max(charges) >= need:
        return 1  # (the common case: no sort)
    for n, charge in enumerate(sorted(charges, reverse=True), 1):
        need -= charge
        if need <= 0:
            return n
    return NEVER

if TYPE_CHECKING:
    from .preemption import Trial, VictimKey


class NodeVictims:
    """Mixed into :class:`quotas.preemption.VictimSearch`."""

    # ---- node CPU and host memory ---------------------------------------------------------

    def _may_evict(self, aid: str) -> bool:
        key = self.st._key.get(aid)  # None: not in the ledger (a queue's hold)
        return key is not None and (key[0] == 0 or (self.pc.preempt and key[1] < self.pc.value))

    def _node_victims(self, ni: int, t: Trial) -> list[Allocation]:
        """Eligible allocations on node ``ni`` holding CPU or host memory, not yet in ``t``,
        in preference order."""
        keys = self.st._key
        found = [
            a for aid, a in self.ix.node_allocs[ni].items()
            if aid not in t.ids and (a.cpu_millicores or a.host_memory_mib) and self._may_evict(aid)
        ]
        found.sort(key=lambda a: keys[a.id])
        return found

    def _frees_node(self, allocation: Allocation) -> bool:
        """Would removing ``allocation`` alone give its node the CPU and host memory the request
        lacks there?"""
        a = self.ask
        if not (a.cpu or a.hmem) or not (allocation.cpu_millicores or allocation.host_memory_mib):
            return False
        ix = self.ix
        ni = ix.node_index(allocation)
        if ni is None or ix.node_fits(ni, a.cpu, a.hmem):
            return False
        return (ix.cpu_free[ni] + allocation.cpu_millicores >= a.cpu
                and ix.hmem_free[ni] + allocation.host_memory_mib >= a.hmem)

    def _node_single_victims(self) -> list[str]:
        """Eligible allocations whose removal alone gives a short node the CPU and memory."""
        a, ix = self.ask, self.ix
        if not (a.cpu or a.hmem):
            return []
        found = []
        if a.whole:
            room = ix.empty.get(a.group, {})
        else:
            max_m, max_c = ix.max_m.get(a.group, {}), ix.max_c.get(a.group, {})
        cpu_free, hmem_free = ix.cpu_free, ix.hmem_free
        for ni in range(len(ix.node_names)):
            if cpu_free[ni] >= a.cpu and hmem_free[ni] >= a.hmem:
                continue  # (what node_fits says: the node has room)
            # only where the cards already fit: there CPU or memory is all that is short
            if (room.get(ni, 0) < a.k) if a.whole else (max_m.get(ni, 0) < a.m or max_c.get(ni, 0) < a.c):
                continue
            for aid, v in ix.node_allocs[ni].items():
                if self._may_evict(aid) and self._frees_node(v):
                    found.append(aid)
        return found

    def _quota_candidates(self) -> list[Allocation]:
        """Eligible allocations of the widest level in deficit, in preference order."""
        if self._quota_cands is None and not self.pc.preempt:
            self._quota_cands = []  # it may evict only borrowed ones, which no quota counts
        if self._quota_cands is None:
            widest = max((lv for lv, _, _ in self.deficits), key=lambda lv: -len(lv.key))
            allocs = self.st._allocs
            self._quota_cands = [allocs[k[3]] for k in self._owned_eligible(widest.key)]
        return self._quota_cands

    def _owned_eligible(self, level: tuple[str, ...]) -> list[VictimKey]:
        """Victim keys of the allocations that count against quota level ``level`` (not
        borrowed) and have a lower priority value than the class (which must preempt), in
        preference order: one slice of the level's order."""
        if not self.pc.preempt:
            return []
        order = self.st._level_order.get(level, [])
        return order[bisect_left(order, (1,)):bisect_left(order, (1, self.pc.value))]

    def _quota_fixable(self) -> bool:
        """Could evicting every eligible allocation of the levels in deficit fix them? (Only
        the quota given back counts here: no trial of the cards they free.) The quota's
        candidates are those of the widest level in deficit that count against quotas and have
        a lower priority value: each limited level gets back what they charge it, read from the
        state's sums per level and value instead of walking them."""
        t = self._trial()
        if self.pc.preempt:  # (a class that does not preempt has none: _quota_candidates)
            widest = max((lv for lv, _, _ in self.deficits), key=lambda lv: -len(lv.key))
            n = len(widest.key)
            for i, lv in enumerate(self.levels):  # the requester's levels, nested in each other
                t.back[i] = self.st.own_below(lv.key if len(lv.key) >= n else widest.key, self.pc.value)
        return self._quota_ok(t, self.low)

    def _victims_at_least(self, ni: int) -> int:
        """A lower bound on the victims any plan on node ``ni`` takes (NEVER: none works): the
        cards it must clear (k less those that hold the request now), each needing at least as
        many victims as its largest evictable charges take to make room there, where a victim
        holding several of the node's cards counts on each (the widest count first)."""
        ix, a = self.ix, self.ask
        # the index's eligibility of each allocation for this class (what _may_evict answers:
        # a queue's stand-ins are never eligible), and its evictable sums per card
        elig, p = ix.elig, self.p
        em, ec, en, em1, ec1 = ix.em[p], ix.ec[p], ix.en[p], ix.em1[p], ix.ec1[p]
        needs: list[int] = []
        ready = 0
        for gi in (ix.wgpus if a.whole else ix.sgpus)[ni].get(a.group, ()):
            on = ix.on[gi]
            if a.whole:
                if not ix.nalloc[gi]:
                    ready += 1
                elif en[gi] == ix.nalloc[gi]:  # every allocation on it may be evicted
                    needs.append(len(on))
                continue
            need_m = a.m - ix.cap_m[gi] + ix.used_m[gi]
            need_c = a.c - ix.cap_c[gi] + ix.used_c[gi]
            if need_m <= 0 and need_c <= 0:
                ready += 1
                continue
            if em[gi] < need_m or ec[gi] < need_c:
                continue  # even all it may evict here would not make room
            if em1[gi] >= need_m and ec1[gi] >= need_c:
                needs.append(1)  # its largest evictable charges make room: what _fewest says
                continue
            mine = [charge for aid, charge in on.items() if elig[aid][p]]
            n = max(_fewest([cm for cm, _ in mine], need_m), _fewest([cc for _, cc in mine], need_c))
            if n < NEVER:
                needs.append(n)
        short = a.k - ready
        if short <= 0:
            return 0
        if len(needs) < short:
            return NEVER
        needs.sort()
        cover = sum(needs[:short])
        if ix.span_max[ni] == 1:  # each victim clears one card: ``cover`` of them, if there are
            there = sum(1 for aid in ix.node_allocs[ni] if elig[aid][p])
            return cover if there >= cover else NEVER
        spans = sorted((len(v.gpu_uuids) for aid, v in ix.node_allocs[ni].items() if elig[aid][p]),
                       reverse=True)
        for n, span in enumerate(spans, 1):
            cover -= span
            if cover <= 0:
                return n
        return NEVER
