"""Giving victims back: the part of :class:`quotas.preemption.VictimSearch` that drops every
victim a plan can do without, the most valuable first.

A plan for a multi-card request on one node holds tens of victims, and most of them cannot be
given back: without them too few of the node's cards fit, or a quota level is short again.
Each is judged without trying the node again where that is certain: a victim on the node by
what fits with the plan's victims gone (kept for the reprieve, redone only when a victim is
given back) and its own share of each card and of the node's CPU and host memory; a victim on
another node (a quota's) leaves the node's cards as they are, so only the quota levels it
counts against are checked. Only a victim on the node whose cards would still leave ``k`` of
them fitting is tried in full.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model import Allocation

if TYPE_CHECKING:
    from .preemption import Trial

#: what :meth:`Reprieve._verdict` says of a victim
NEEDED, SPARED, TRY = 0, 1, 2


class Reprieve:
    """Mixed into :class:`quotas.preemption.VictimSearch`."""

    def _reprieve(self, ni: int | None, t: Trial) -> list[int]:
        """Give back every victim the request can do without, the most valuable first."""
        cards = self._feasible(ni, t)
        assert cards is not None
        fitting = None if ni is None else self._fitting(ni, t)
        asked: tuple[int, int, int] | None = None
        for a in list(reversed(t.victims)):
            verdict = TRY
            if fitting is not None:
                if asked is None and self.levels and (self.deficits or self.ask.whole):
                    asked = self.asked_for(cards)
                verdict = self._verdict(ni, t, a, fitting, asked)
            if verdict == NEEDED:
                # what taking it back and adding it again leaves: it comes last
                t.ids[a.id] = t.ids.pop(a.id)
                continue
            self._change(t, a, -1)
            if verdict == SPARED:
                continue  # the node's cards are as they were: the same cards, the quota allows
            got = self._feasible(ni, t)
            if got is None:
                self._change(t, a, 1)
            else:
                cards, asked = got, None
                fitting = self._fitting(ni, t)
        return cards

    def _fitting(self, ni: int, t: Trial) -> set[int]:
        """The cards of node ``ni`` the request fits on with ``t``'s victims gone (what
        ``fit_node`` counts)."""
        ix, a, freed = self.ix, self.ask, t.freed
        if a.whole:
            nalloc = ix.nalloc
            return {gi for gi in ix.wgpus[ni].get(a.group, ())
                    if nalloc[gi] == freed.get(gi, (0, 0, 0))[2]}
        cap_m, cap_c, used_m, used_c = ix.cap_m, ix.cap_c, ix.used_m, ix.used_c
        out = set()
        for gi in ix.sgpus[ni].get(a.group, ()):
            back = freed.get(gi, (0, 0, 0))
            if cap_m[gi] - used_m[gi] + back[0] >= a.m and cap_c[gi] - used_c[gi] + back[1] >= a.c:
                out.add(gi)
        return out

    def _verdict(self, ni: int, t: Trial, victim: Allocation, fitting: set[int],
                 asked: tuple[int, int, int] | None) -> int:
        """Given back, would ``victim`` surely leave node ``ni`` without room for the request
        (NEEDED: fewer than k of its cards fitting, too little CPU or host memory, a quota level
        short), surely not (SPARED: it is on another node and its levels allow), or perhaps
        (TRY)? ``asked``: what the request charges on the cards it gets now, if quotas count."""
        ix, a, freed = self.ix, self.ask, t.freed
        node_of_gpu, gi_of = ix.node_of_gpu, ix.gi_of
        here = ix.node_index(victim) == ni
        if not here:
            for uuid in victim.gpu_uuids:
                gi = gi_of.get(uuid)
                if gi is not None and node_of_gpu[gi] == ni:
                    here = True
        if not here:
            # the node's cards, CPU and memory stay as they are: only its quota levels change
            if asked is None:
                return SPARED
            charge = self.st._charges[victim.id]
            for i in self._members(victim):
                limits, used, back = self.limits[i], self.used[i], t.back[i]
                for r in range(3):
                    if limits[r] is not None and used[r] + asked[r] - back[r] + charge[r] > limits[r]:
                        return NEEDED
            return SPARED
        if (a.cpu or a.hmem) and (victim.cpu_millicores or victim.host_memory_mib):
            back = freed.get(-1 - ni, (0, 0, 0))
            if (ix.cpu_free[ni] + back[0] - victim.cpu_millicores < a.cpu
                    or ix.hmem_free[ni] + back[1] - victim.host_memory_mib < a.hmem):
                return NEEDED
        lost = 0
        for uuid in victim.gpu_uuids:
            gi = gi_of.get(uuid)
            if gi is None or gi not in fitting:
                continue
            if a.whole:
                lost += 1  # an allocation back on it: no longer empty
                continue
            cm, cc = ix.on[gi][victim.id]
            back = freed[gi]
            if (ix.cap_m[gi] - ix.used_m[gi] + back[0] - cm < a.m
                    or ix.cap_c[gi] - ix.used_c[gi] + back[1] - cc < a.c):
                lost += 1
        return NEEDED if len(fitting) - lost < a.k else TRY
