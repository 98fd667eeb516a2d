"""Incremental queue passes: a waiting request is decided again only when something it could use
changed since its last decision.

:meth:`quotas.queue.AdmissionQueue.pump` decides requests in queue order on every event (an
arrival, a grant, a release). Deciding each one is a full placement search (and a victim search
where preemption is possible): with 1,000 waiting that is most of a second per event
(``bench/admission.py``). But a request that waited at its last decision still waits unless one
of these happened since:

- an allocation left (or a stand-in the queue held at its last decision is not held now) on a
  node where the request could run, counting everything its class may evict as gone (cards, CPU
  and host memory) — more room, or fewer victims needed there; except for a slice that waits on
  a quota level no eviction can give it room in (``QuotaExceeded.quota_bound``: its class does
  not borrow, and evicting all it may evict in the level falls short), which room cannot help;
- an allocation of its workspace left while one of its quota levels was short for it (for a
  quota-bound wait: one that counts against a level that was short, unless others still hold
  allocations in those levels and it was borrowed, which gives back no quota, or the request's
  class does not preempt and the same levels are still short for it), or one arrived that
  leaves its quota levels short of another resource than before (it may wait for its quota
  now: another sentence; for a whole-card request, short for cards of the pool's largest size),
  or that its class may evict while it was short of quota (a class that does not preempt may
  evict only borrowed allocations, which no quota counts), or any for a whole-card request
  short of quota then (its charge depends on the cards found);
- room kept for a swapped-out kernel (``quotas/reserve.py``) on such a node was given up (that
  room counts as free for "could run": placement takes it where nothing else fits);
- the inventory changed, or too many changes passed to tell (``AdmissionState.changes_since``).

Everything else only takes room or leaves its chances as they were, so its decision would be the
same wait. An allocation arriving never helps it: what it takes was free before, and were it a
victim, evicting it gives back only that (and, in its workspace, only the quota it took). Such a
request keeps its last decision and its reason (the sentence may quote figures from that
decision). Heads of a priority class (they reserve, hold and have slices moved; but not a
quota-bound one, which does none of that), moved kernels asking back, pinned requests and a wait
that came from the capacity overdue heads hold are always decided afresh.

The victim search weighs at most ``preemption.max_candidate_nodes`` candidate nodes (placement
order): where more are candidates, a release elsewhere can reorder them and bring a node into
that bound where victims work, which the full pass would then find and this one not until an
event touches that node. Up to that bound the two passes decide the same
(``tests/quotas/test_quotas_incremental.py`` checks it on random pools and queues).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .errors import QuotaExceeded
from .model import Allocation, Decision, GPURequest, Owner
from .placement import ANY
from .state import AdmissionState
from .tree import level_keys

#: a stand-in as the card index sees it: (node, cards, memory, cores, whole, CPU, host memory)
HoldKey = tuple[str, tuple[str, ...], int, int, bool, int, int]


@dataclass(slots=True)
class Seen:
    """A request's last decision (a wait) and what it was decided with (one per waiting
    request: :meth:`PassMemo.again` updates it in place, on every pass that keeps it)."""

    decision: Decision
    version: int  # AdmissionState.version then
    holds: list[HoldKey]  # the stand-ins placed in that pass ...
    held: int  # ... of which the first ``held`` were in place at its turn
    shape: tuple[int, int, int, bool]  # memory, cores, cards, whole
    group: str
    predicate: int
    workspace: str
    #: quota levels (keys) short for it at its last decision, or None where none was
    short: frozenset[tuple[str, ...]] | None
    cpu: int
    hmem: int
    #: the room kept for swapped-out kernels then (quotas/reserve.py)
    soft: frozenset
    #: it waits on quota no eviction can give it (QuotaExceeded.quota_bound): only a release
    #: within a level in ``short`` (or an arrival in its workspace) can change its decision
    bound: bool = False
    #: its owner, what it charges its quota levels (a whole card counted as the pool's
    #: largest) and (level key, resource) short for that at its last decision
    owner: Owner | None = None
    asked: tuple[int, int, int] = (0, 0, 0)
    deficits: frozenset = frozenset()


class PassMemo:
    """One pump's view of what changed for each waiting request since its last decision."""

    def __init__(self, state: AdmissionState) -> None:
        self.state = state
        self.holds: list[HoldKey] = []
        self._freed: dict[tuple[int, int, int], set[str]] = {}
        # placement looks again with the room kept for swapped-out kernels lifted where nothing
        # fits: that room counts as free here
        ix = state.index
        self.soft = frozenset(ix.soft.held.items())
        self._soft_m: dict[int, int] = {}
        self._soft_c: dict[int, int] = {}
        self._soft_n: dict[int, int] = {}
        for r in ix.soft.held.values():
            for u in r.gpu_uuids:
                gi = ix.gi_of.get(u)
                if gi is not None:
                    self._soft_m[gi] = self._soft_m.get(gi, 0) + (ix.cap_m[gi] if r.whole else r.memory_mib)
                    self._soft_c[gi] = self._soft_c.get(gi, 0) + (ix.cap_c[gi] if r.whole else r.cores_percent)
                    self._soft_n[gi] = self._soft_n.get(gi, 0) + 1

    def placed(self, a: Allocation) -> None:
        """The pump put stand-in ``a`` in the card index (it stays until the pass ends)."""
        self.holds.append((a.node, a.gpu_uuids, a.memory_mib, a.cores_percent, a.whole,
                           a.cpu_millicores, a.host_memory_mib))

    def seen(self, request: GPURequest, d: Decision, version: int) -> Seen | None:
        """What to keep of ``request``'s wait ``d``, decided at ``version`` with the stand-ins
        placed so far (None: decide it afresh next time)."""
        if request.pinned_uuids:
            return None
        whole = request.whole
        shape = (0 if whole else request.memory_mib, 0 if whole else request.cores_percent,
                 request.count, whole)
        st = self.state
        pc = st.config.policy.priority_class(request.priority_class)
        k = request.count
        if whole:
            asked = (k * max(st.index.cap_m, default=0), 100 * k, k)
        else:
            asked = (request.memory_mib * k, request.cores_percent * k, k)
        deficits = st.deficits(request.owner, asked)
        short = frozenset(key for key, _ in deficits) or None
        return Seen(d, version, self.holds, len(self.holds), shape,
                    request.model.lower() if request.model else ANY,
                    st.predicate_of(pc.name), request.owner.workspace, short,
                    request.cpu_millicores, request.host_memory_mib, self.soft,
                    short is not None and isinstance(d.error, QuotaExceeded) and d.error.quota_bound,
                    request.owner, asked, deficits)

    def again(self, seen: Seen) -> Seen:
        """``seen`` as if decided now (:meth:`unchanged` said it would wait as it did)."""
        seen.version, seen.holds, seen.held, seen.soft = self.state.version, self.holds, len(self.holds), self.soft
        return seen

    def unchanged(self, seen: Seen | None) -> bool:
        """Whether the request ``seen`` describes would wait again now, as decided then."""
        if seen is None:
            return False
        st = self.state
        changes = st.changes_since(seen.version)
        if changes is None:
            return False
        ix = st.index
        deficits = None
        for sign, a, elig in changes:
            if a.owner.workspace == seen.workspace:
                if sign < 0 and seen.short is not None and (not seen.bound or _within(a, seen.short)):
                    if not (seen.bound and self._still_bound(seen, a) and self._others_hold(seen)):
                        return False  # its quota levels may have room now
                if sign > 0:
                    # (a class that does not preempt may evict only borrowed allocations, which
                    # no quota counts: never a victim for its quota)
                    if seen.short is not None and (seen.shape[3] or (elig[seen.predicate] and seen.predicate)):
                        return False  # a whole card's charge varies; a victim for its quota
                    if deficits is None:
                        deficits = st.deficits(seen.owner, seen.asked)
                        if deficits != seen.deficits:
                            return False  # short of quota now (or of more): another sentence
            if sign > 0 or seen.bound:
                continue  # it only takes room, or room is not what it waits for
            ni = ix.node_index(a)
            if ni is not None and self._could_run(ni, seen):
                return False
        if seen.bound:
            return True  # neither room given up for swapped-out kernels nor by heads matters to it
        for _, r in seen.soft - self.soft:  # room no longer kept for a swapped-out kernel
            for u in r.gpu_uuids:
                gi = ix.gi_of.get(u)
                if gi is not None and self._could_run(ix.node_of_gpu[gi], seen):
                    return False
        for node in self._released(seen):
            ni = ix.ni_of.get(node)
            if ni is not None and self._could_run(ni, seen):
                return False
        return True

    def _still_bound(self, seen: Seen, released: Allocation) -> bool:
        """Whether a quota-bound wait stays bound to the same levels after ``released`` left:
        a borrowed allocation gives back no quota; and a class that may evict nothing its quota
        counts (it does not preempt) waits as long as the same levels are short for it."""
        if released.borrowed:
            return True
        return seen.predicate == 0 and self.state.deficits(seen.owner, seen.asked) == seen.deficits

    def _others_hold(self, seen: Seen) -> bool:
        """Whether others than its owner still hold allocations in each quota level short for
        it: then a borrowed allocation's release (which gives back no quota) leaves a wait on
        quota as it was, and its sentence still says that others hold the level."""
        st = self.state
        return all(st.others_hold(seen.owner, key) for key in seen.short or ())

    def _released(self, seen: Seen) -> set[str]:
        """Nodes of the stand-ins in place at its last turn that are not in place now."""
        key = (id(seen.holds), seen.held, len(self.holds))
        nodes = self._freed.get(key)
        if nodes is None:
            missing = Counter(seen.holds[:seen.held]) - Counter(self.holds)
            nodes = {h[0] for h in missing}
            self._freed[key] = nodes
        return nodes

    def _could_run(self, ni: int, seen: Seen) -> bool:
        """Could the request fit on node ``ni`` now if everything its class may evict there were
        gone?"""
        ix = self.state.index
        m, c, k, whole = seen.shape
        p = seen.predicate
        if seen.cpu or seen.hmem:
            cpu, hmem = ix.cpu_free[ni], ix.hmem_free[ni]
            elig = ix.elig
            for aid, a in ix.node_allocs[ni].items():
                if elig[aid][p]:
                    cpu += a.cpu_millicores
                    hmem += a.host_memory_mib
            if cpu < seen.cpu or hmem < seen.hmem:
                return False
        if whole:
            nalloc, en, soft = ix.nalloc, ix.en[p], self._soft_n
            cards = ix.wgpus[ni].get(seen.group, ())
            return sum(1 for gi in cards if nalloc[gi] - soft.get(gi, 0) == en[gi]) >= k
        cap_m, cap_c, used_m, used_c = ix.cap_m, ix.cap_c, ix.used_m, ix.used_c
        em, ec, sm, sc = ix.em[p], ix.ec[p], self._soft_m, self._soft_c
        n = 0
        for gi in ix.sgpus[ni].get(seen.group, ()):
            if cap_m[gi] - used_m[gi] + em[gi] + sm.get(gi, 0) >= m and \
                    cap_c[gi] - used_c[gi] + ec[gi] + sc.get(gi, 0) >= c:
                n += 1
                if n >= k:
                    return True
        return False


def _within(a: Allocation, levels: frozenset[tuple[str, ...]] | None) -> bool:
    """Whether ``a`` counts against one of the quota levels (keys) ``levels``."""
    return levels is not None and not levels.isdisjoint(level_keys(a.owner))
