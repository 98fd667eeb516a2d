"""AdmissionState: the pool, the live allocations and the quota usage, indexed for fast decisions.

The allocator keeps one. :meth:`AdmissionState.decide` is pure (it does not change the state);
the caller records what it did with :meth:`add` / :meth:`remove` (or :meth:`apply`).
"""

from __future__ import annotations

import uuid
from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType

from . import messages as msg
from .checks import RequestChecks
from .errors import InvalidRequest, PoolFull, QuotaExceeded
from .model import Allocation, Decision, GPURequest, Owner, Pool
from .placement import CardIndex
from .policy import AdmissionConfig, PriorityClass
from .preemption import Ask, VictimKey, VictimSearch, victim_key
from .tree import RESOURCES, Level, QuotaLedger, level_keys
from .usage import UsageReport

#: changes kept for :meth:`AdmissionState.changes_since` (the oldest half goes beyond it)
CHANGES_KEPT = 4096


class AdmissionState(RequestChecks, UsageReport):
    """Pure, in-memory, incrementally indexed admission state."""

    def __init__(
        self, config: AdmissionConfig, pool: Pool, allocations: Iterable[Allocation] = ()
    ) -> None:
        self.config = config
        policy = config.policy
        # eligibility predicates: 0 = borrowed only; then one per value a preempting class has
        values = sorted({pc.value for pc in policy.priority_classes.values() if pc.preempt})
        self._thresholds: list[int | None] = [None, *values]
        self._predicate: dict[str, int] = {
            name: (self._thresholds.index(pc.value) if pc.preempt else 0)
            for name, pc in policy.priority_classes.items()
        }
        self._levels_cache: dict[Owner, tuple[Level, Level, Level]] = {}
        self._allocs: dict[str, Allocation] = {}
        self._pool = pool
        #: every add and remove since version ``_changes_from`` (what the queue asks what changed)
        self._changes: list[tuple[int, Allocation, tuple[bool, ...]]] = []
        self._changes_from = 0
        self._reset_indexes()
        for allocation in allocations:
            self._add(allocation, refresh=False)
        self._index.refresh_all()
        self._forget_changes()

    def _reset_indexes(self) -> None:
        mix = getattr(self, "_mix", None)
        self._index = CardIndex(self._pool, self.config.policy.placement, len(self._thresholds))
        if mix is not None:  # the recent requests outlive an inventory change
            self._index.mix = mix
        self._mix = self._index.mix
        #: the pool's memory and compute capacity (summed once per inventory)
        self._capacity = (sum(self._index.cap_m), sum(self._index.cap_c))
        self._ledger = QuotaLedger()
        #: per quota level key: what its allocations that count against quotas (not borrowed)
        #: charge, by priority value (what a preempting class could evict there for its quota)
        self._own_by_value: dict[tuple[str, ...], dict[int, list[int]]] = {}
        #: ... and how many of them charge each amount, per resource (the most one charges)
        self._own_amounts: dict[tuple[str, ...], dict[int, list[Counter[int]]]] = {}
        self._charges: dict[str, tuple[int, int, int]] = {}
        self._eligible: dict[str, tuple[bool, ...]] = {}
        self._key: dict[str, VictimKey] = {}
        #: per owner (workspace, namespace, user): allocations by kind (for wait sentences)
        self._kinds: dict[tuple[str, str, str], Counter[str]] = {}
        self._order: list[VictimKey] = []
        #: victim order per quota level key (workspace, namespace and user) of the allocation's owner
        self._level_order: dict[tuple[str, ...], list[VictimKey]] = {}
        #: victim order per GPU model (lower case) of the cards an allocation holds
        self._group_order: dict[str, list[VictimKey]] = {}

    # ---- the ledger -----------------------------------------------------------------------

    @property
    def allocations(self) -> Mapping[str, Allocation]:
        return MappingProxyType(self._allocs)

    @property
    def pool(self) -> Pool:
        return self._pool

    @property
    def index(self) -> CardIndex:
        """The card index decisions read (the queue's walks of the pool read it too and only
        ever put their stand-ins in it for the length of a pass; change the ledger through
        :meth:`add` / :meth:`remove`)."""
        return self._index

    @contextmanager
    def mix_kept(self) -> Iterator[None]:
        """Within the block, allocations added and removed again (a move tried out) do not teach
        the expected mix of requests (fgd's target): it is as it was before the block."""
        kept = self._mix.snapshot()
        try:
            yield
        finally:
            self._mix.restore(kept)

    def add(self, allocation: Allocation) -> None:
        """Record a live allocation (a grant, or one found in the ledger at start-up). Recording
        an id again replaces the old record. Allocations on cards not in the pool still count
        against quotas."""
        self._add(allocation, refresh=True)

    def _add(self, allocation: Allocation, refresh: bool) -> None:
        if allocation.id in self._allocs:
            self._remove(allocation.id, refresh)
        value = self.config.policy.value_of(allocation.priority_class)
        eligible = tuple(
            allocation.borrowed or (t is not None and value < t) for t in self._thresholds
        )
        charge = self._charge(allocation)
        key = victim_key(allocation, value)
        self._allocs[allocation.id] = allocation
        self._charges[allocation.id] = charge
        self._eligible[allocation.id] = eligible
        self._key[allocation.id] = key
        insort(self._order, key)
        for level in level_keys(allocation.owner):
            insort(self._level_order.setdefault(level, []), key)
        for group in self._groups(allocation):
            insort(self._group_order.setdefault(group, []), key)
        self._ledger.apply(allocation.id, allocation.owner, charge, allocation.borrowed, 1)
        if not allocation.borrowed:
            self._count_own(allocation.owner, value, charge, 1)
        o = allocation.owner
        self._kinds.setdefault((o.workspace, o.namespace, o.user), Counter())[allocation.kind] += 1
        self._index.apply(allocation, eligible, 1, refresh)
        self._changed(1, allocation, eligible)
        n = len(allocation.gpu_uuids)
        if allocation.whole:
            shape = (0, 0, n, True, allocation.cpu_millicores, allocation.host_memory_mib)
        else:
            shape = (allocation.memory_mib, allocation.cores_percent, n, False,
                     allocation.cpu_millicores, allocation.host_memory_mib)
        self._mix.add(shape)

    def remove(self, allocation_id: str) -> Allocation | None:
        """Forget an allocation; returns it, or None if it was not recorded."""
        return self._remove(allocation_id, True)

    def _remove(self, allocation_id: str, refresh: bool) -> Allocation | None:
        allocation = self._allocs.pop(allocation_id, None)
        if allocation is None:
            return None
        key = self._key.pop(allocation_id)
        orders = [self._order, *(self._level_order[level] for level in level_keys(allocation.owner))]
        orders.extend(self._group_order[g] for g in self._groups(allocation))
        for order in orders:
            del order[bisect_left(order, key)]
        charge = self._charges.pop(allocation_id)
        eligible = self._eligible.pop(allocation_id)
        self._ledger.apply(allocation_id, allocation.owner, charge, allocation.borrowed, -1)
        if not allocation.borrowed:
            self._count_own(allocation.owner, key[1], charge, -1)
        o = allocation.owner
        kinds = self._kinds[(o.workspace, o.namespace, o.user)]
        kinds[allocation.kind] -= 1
        if not kinds[allocation.kind]:
            del kinds[allocation.kind]
            if not kinds:
                del self._kinds[(o.workspace, o.namespace, o.user)]
        self._index.apply(allocation, eligible, -1, refresh)
        self._changed(-1, allocation, eligible)
        return allocation

    def _count_own(self, owner: Owner, value: int, charge: tuple[int, int, int], sign: int) -> None:
        for key in level_keys(owner):
            row = self._own_by_value.setdefault(key, {}).setdefault(value, [0, 0, 0])
            amounts = self._own_amounts.setdefault(key, {}).setdefault(
                value, [Counter(), Counter(), Counter()])
            for r in range(3):
                row[r] += sign * charge[r]
                amounts[r][charge[r]] += sign
                if not amounts[r][charge[r]]:
                    del amounts[r][charge[r]]

    def own_below(self, key: tuple[str, ...], value: int) -> list[int]:
        """What allocations of a priority value below ``value`` charge quota level ``key``
        (memory MiB, cores %, vGPUs; borrowed ones do not count against a quota)."""
        total = [0, 0, 0]
        for v, row in self._own_by_value.get(key, {}).items():
            if v < value:
                for r in range(3):
                    total[r] += row[r]
        return total

    def own_most_below(self, key: tuple[str, ...], value: int) -> list[int]:
        """The most one allocation of a priority value below ``value`` charges quota level
        ``key``, per resource (each resource on its own: an upper bound for one allocation)."""
        most = [0, 0, 0]
        for v, amounts in self._own_amounts.get(key, {}).items():
            if v < value:
                for r in range(3):
                    if amounts[r]:
                        most[r] = max(most[r], max(amounts[r]))
        return most

    def _changed(self, sign: int, allocation: Allocation, eligible: tuple[bool, ...]) -> None:
        self._changes.append((sign, allocation, eligible))
        if len(self._changes) > CHANGES_KEPT:  # those who still ask that far back decide afresh
            drop = len(self._changes) // 2
            self._changes_from += drop
            del self._changes[:drop]

    def apply(self, decision: Decision) -> Allocation | None:
        """Carry out a granted decision on this state: drop its victims, record its allocation."""
        if not decision.granted or decision.allocation is None:
            return None
        for victim in decision.victims:
            self.remove(victim.id)
        self.add(decision.allocation)
        return decision.allocation

    def set_pool(self, pool: Pool) -> None:
        """Replace the inventory (nodes came or went); allocations (and the room kept for
        swapped-out kernels, ``quotas/reserve.py``) are kept."""
        self._pool = pool
        allocations, soft = list(self._allocs.values()), self._index.soft
        self._allocs = {}
        self._reset_indexes()
        for allocation in allocations:
            self._add(allocation, refresh=False)
        self._index.refresh_all()
        self._index.soft = soft.moved_to(self._index)
        self._forget_changes()

    # ---- what changed (quotas.incremental asks) --------------------------------------------

    @property
    def version(self) -> int:
        """Grows by one with every allocation added or removed."""
        return self._changes_from + len(self._changes)

    def changes_since(self, version: int) -> list[tuple[int, Allocation, tuple[bool, ...]]] | None:
        """(+1 added / -1 removed, allocation, its eligibility per predicate) for every change
        after ``version``, oldest first; None if they are no longer known (forgotten, or the
        inventory changed: then anything may have changed)."""
        if version < self._changes_from:
            return None
        return self._changes[version - self._changes_from:]

    def predicate_of(self, priority_class: str) -> int:
        """The eligibility predicate (index into a change's eligibility) of a class's victims."""
        return self._predicate[priority_class]

    @contextmanager
    def tried(self) -> Iterator[None]:
        """Within the block, allocations are removed and added back as they were (a move tried
        out): afterwards they are no change (:meth:`changes_since` does not list them)."""
        start, kept = self._changes_from, len(self._changes)
        try:
            yield
        finally:
            if self._changes_from == start:
                del self._changes[kept:]

    def _forget_changes(self) -> None:
        self._changes_from = self.version
        self._changes = []

    def _groups(self, allocation: Allocation) -> set[str]:
        ix = self._index
        return {ix.group[gi] for gi in (ix.gi_of.get(u) for u in allocation.gpu_uuids)
                if gi is not None}

    def _charge(self, allocation: Allocation) -> tuple[int, int, int]:
        """What an allocation counts against quotas: (memory MiB, cores %, vGPUs). A whole
        card counts its full memory and 100 %."""
        n = len(allocation.gpu_uuids)
        if not allocation.whole:
            return allocation.memory_mib * n, allocation.cores_percent * n, n
        memory = 0
        for u in allocation.gpu_uuids:
            gpu = self._pool.gpu(u)
            memory += gpu.memory_mib if gpu is not None else allocation.memory_mib
        return memory, 100 * n, n

    # ---- validation -----------------------------------------------------------------------

    def levels(self, owner: Owner) -> tuple[Level, Level, Level]:
        hit = self._levels_cache.get(owner)
        if hit is None:
            hit = self._levels_cache[owner] = self.config.quotas.levels(owner)
        return hit

    def validate(self, request: GPURequest) -> None:
        """Raise InvalidRequest if the request is malformed or can never fit this pool."""
        self._check(request)

    def _check(self, request: GPURequest) -> tuple[PriorityClass, str, tuple[Level, ...]]:
        checked = self._check_shape(request)
        if request.pinned_uuids:
            self._check_pins(request, checked[1])
        return checked

    # ---- the decision ---------------------------------------------------------------------

    def decide(self, request: GPURequest, now: float = 0.0, *, preempt: bool = True) -> Decision:
        """Grant, grant after preempting, wait or reject ``request``. Does not change the state.
        ``preempt=False``: never look for victims (a caller that only asks whether it is granted
        as things are: a grant is the same, a preemption is a wait)."""
        try:
            pc, group, levels = self._check(request)
        except InvalidRequest as e:
            return Decision("reject", reason=e.message, error=e)
        ix = self._index
        whole = request.whole
        m = 0 if whole else request.memory_mib
        c = 0 if whole else request.cores_percent
        k = request.count
        kind = msg.what(request)

        def asked_for(cards: list[int] | None) -> tuple[int, int, int]:
            if not whole:
                return m * k, c * k, k
            if cards is None:  # the least it can cost
                return ix.min_whole_memory(group, k, request.cpu_millicores, request.host_memory_mib), 100 * k, k
            return sum(ix.gpus[gi].memory_mib for gi in cards), 100 * k, k

        # a request above a level's whole quota can never fit
        low = asked_for(None)
        for level in levels:
            for r, res in enumerate(RESOURCES):
                limit = level.limits.get(res)
                if limit is not None and low[r] > limit:
                    error = QuotaExceeded(
                        msg.quota_never(level, res, limit, low[r], kind),
                        level=level.label, resource=res, used=self._ledger.own(level.key, res),
                        limit=limit, asked=low[r],
                    )
                    return Decision("reject", reason=error.message, error=error)

        cpu, hmem = request.cpu_millicores, request.host_memory_mib
        pinned = request.pinned_uuids
        base = ix.fit_pinned(pinned, m, c, whole, cpu, hmem, k) if pinned else ix.find(m, c, k, whole, group, cpu, hmem)
        asked = asked_for(base[1] if base else None)
        over = self._first_deficit(levels, asked)
        if whole and base is not None and not pinned and over is not None and over[1] == "memory_mib":
            # whole cards differ in size: smaller ones elsewhere may fit the memory quota
            headroom = self._headroom(levels, "memory_mib")
            smaller = ix.find_whole_within(k, group, headroom, cpu, hmem)
            if smaller is not None:
                base = smaller
                asked = asked_for(base[1])
                over = self._first_deficit(levels, asked)
        if base is not None and over is None:
            return self._grant(request, pc, base, False, now)
        if base is not None and pc.borrow:
            level, res, used, limit = over
            return self._grant(
                request, pc, base, True, now,
                reason=msg.borrowed(level, res, used, limit),
            )
        # a slice's quota charge is fixed: short of quota, only evictions could help it
        quota_bound = not whole
        if preempt and self._has_candidates(pc) and not pinned:
            # A whole card's quota charge is its size: when the quota refuses the card placement
            # found, evicting may free a smaller card, so the search weighs every node's cards
            # instead of that placement (it waited with a victim's smaller card in reach).
            search_base = None if whole and over is not None else base
            search = VictimSearch(
                self, Ask(m, c, k, whole, group, cpu, hmem), pc, self._predicate[pc.name], levels,
                asked_for, search_base,
            )
            solution = search.run()
            if solution is not None:
                grant = self._grant(request, pc, (solution.node, solution.cards), False, now)
                victims = tuple(solution.victims)
                return Decision(
                    "preempt", allocation=grant.allocation, victims=victims,
                    reason=self._preempt_reason(pc, victims),
                )
            quota_bound = quota_bound and search.quota_hopeless
        return self._wait(request, pc, group, over, kind, quota_bound)

    def _has_candidates(self, pc: PriorityClass) -> bool:
        if not self._order:
            return False
        first = self._order[0]
        return first[0] == 0 or (pc.preempt and first[1] < pc.value)

    def _headroom(self, levels: Iterable[Level], res: str) -> int:
        room = None
        for level in levels:
            limit = level.limits.get(res)
            if limit is not None:
                left = limit - self._ledger.own(level.key, res)
                room = left if room is None else min(room, left)
        return room if room is not None else 1 << 62

    def deficits(self, owner: Owner, asked: tuple[int, int, int]) -> frozenset[tuple[tuple[str, ...], str]]:
        """(level key, resource) of each of ``owner``'s quota levels that lacks room for ``asked``
        (memory MiB, cores %, vGPUs) now."""
        own = self._ledger.own
        return frozenset(
            (lv.key, res) for lv in self.levels(owner) for r, res in enumerate(RESOURCES)
            if (limit := lv.limits.get(res)) is not None and own(lv.key, res) + asked[r] > limit
        )

    def _first_deficit(
        self, levels: Iterable[Level], asked: tuple[int, int, int]
    ) -> tuple[Level, str, int, int] | None:
        for level in levels:
            for r, res in enumerate(RESOURCES):
                limit = level.limits.get(res)
                if limit is None:
                    continue
                used = self._ledger.own(level.key, res)
                if used + asked[r] > limit:
                    return level, res, used, limit
        return None

    def _grant(
        self,
        request: GPURequest,
        pc: PriorityClass,
        where: tuple[int, list[int]],
        borrowed: bool,
        now: float,
        reason: str = "",
    ) -> Decision:
        ix = self._index
        ni, cards = where
        memory_limit = cores_limit = 0
        if request.whole:
            memory = min(ix.gpus[gi].memory_mib for gi in cards)
            cores = 100
        else:
            memory, cores = request.memory_mib, request.cores_percent
            if request.memory_limit_mib > memory:  # no further than the smallest granted card
                memory_limit = max(memory, min(request.memory_limit_mib, *(ix.gpus[gi].memory_mib for gi in cards)))
            if request.cores_limit_percent > cores:
                cores_limit = request.cores_limit_percent
        allocation = Allocation(
            id=request.request_id or f"alloc-{uuid.uuid4().hex[:12]}",
            owner=request.owner,
            node=ix.node_names[ni],
            gpu_uuids=tuple(ix.gpus[gi].uuid for gi in cards),
            memory_mib=memory,
            cores_percent=cores,
            priority_class=pc.name,
            whole=request.whole,
            borrowed=borrowed,
            kind=request.kind,
            created_at=now,
            cpu_millicores=request.cpu_millicores,
            host_memory_mib=request.host_memory_mib,
            memory_limit_mib=memory_limit if memory_limit > memory else 0,
            cores_limit_percent=cores_limit,
        )
        return Decision("grant", allocation=allocation, reason=reason)

    def _preempt_reason(self, pc: PriorityClass, victims: tuple[Allocation, ...]) -> str:
        return msg.preempted(
            [(v.id, v.owner.user, "borrowed capacity" if v.borrowed else f"priority class '{v.priority_class}'")
             for v in victims],
            pc.name,
        )

    def _wait(
        self,
        request: GPURequest,
        pc: PriorityClass,
        group: str,
        over: tuple[Level, str, int, int] | None,
        kind: str,
        quota_bound: bool = False,
    ) -> Decision:
        ix = self._index
        k = request.count
        if over is not None and not pc.borrow and not self._no_tighter_than_pool(over):
            level, res, used, limit = over
            asked = self._asked_total(request, group, res)
            mine, others = self._holders(request, level.key)
            error: QuotaExceeded | PoolFull = QuotaExceeded(
                msg.quota_wait(level, res, used, limit, asked, kind, mine, others),
                level=level.label, resource=res, used=used, limit=limit, asked=asked,
            )
            error.own_only = bool(mine) and not others
            error.quota_bound = quota_bound
            return Decision("wait", reason=error.message, error=error)
        if over is not None and not pc.borrow:
            over = None  # a quota as large as the pool: the pool is what is full
        mine, others = self._holders(request, None)
        model = ix.model_names.get(group)
        m = 0 if request.whole else request.memory_mib
        c = 0 if request.whole else request.cores_percent
        own = mine if mine and not others else ""
        if request.pinned_uuids:
            node = ix.node_names[ix.node_of_gpu[ix.gi_of[request.pinned_uuids[0]]]]
            text = msg.pinned_full(request, node, kind, own)
        elif (request.cpu_millicores or request.host_memory_mib) and ix.has_room(m, c, k, request.whole, group):
            text = msg.node_short(request, kind)
            others = True  # the node's CPU and memory are also held by what is not a GPU slice
        elif request.whole:
            text = msg.no_whole_cards(request, model, ix.most_empty_cards(group), kind, own)
        elif k == 1:
            text = msg.no_card(request, model, *ix.most_free_card(group), kind, own)
        else:
            text = msg.no_cards(request, model, kind, own)
        if over is not None:  # a borrowing class over its quota: it may only use idle capacity
            level, res, used, limit = over
            text = msg.borrowing_waits(level, res, used, limit, pc.name, text)
        error = PoolFull(text)
        error.own_only = bool(mine) and not others
        return Decision("wait", reason=text, error=error)

    def _no_tighter_than_pool(self, over: tuple[Level, str, int, int]) -> bool:
        """Whether a quota level's limit is at least the whole pool's capacity (as `elastic-gpu
        init` writes the workspace's): then it is only "full" when the pool is, and the pool is
        what the user must be told about."""
        level, res, _, limit = over
        if level.kind == "user" or res == "gpus":
            return False
        return limit >= self._capacity[0 if res == "memory_mib" else 1]

    def _holders(self, request: GPURequest, key: tuple[str, ...] | None) -> tuple[str, bool]:
        """What the requester holds (:func:`messages.holdings`) and whether anyone else holds
        slices, within quota level ``key`` (None: the whole pool)."""
        # counted, not walked: a wait is decided in O(1) at 20,000 allocations (bench/admission.py)
        o = request.owner
        kinds = self._kinds.get((o.workspace, o.namespace, o.user)) or Counter()
        kernels = kinds["kernel"]
        notebooks = sum(kinds.values()) - kernels
        # the requester's allocations lie within each of its levels, so anything more is others'
        total = len(self._allocs) if key is None else self._ledger.usage(key).allocations
        others = total > kernels + notebooks
        if key is None and not others:  # cards held by claimants outside this ledger (other hubs)
            others = any(g.held_whole or g.held_memory_mib or g.held_cores_percent for g in self._index.gpus)
        return msg.holdings(kernels, notebooks), others

    def others_hold(self, owner: Owner, key: tuple[str, ...]) -> bool:
        """Whether anyone but ``owner`` holds allocations within quota level ``key`` (one of
        ``owner``'s levels), as a wait's sentence counts them (:meth:`_holders`)."""
        kinds = self._kinds.get((owner.workspace, owner.namespace, owner.user))
        return self._ledger.usage(key).allocations > (sum(kinds.values()) if kinds else 0)

    def _asked_total(self, request: GPURequest, group: str, res: str) -> int:
        k = request.count
        if res == "gpus":
            return k
        if request.whole:
            if res == "cores_percent":
                return 100 * k
            return self._index.min_whole_memory(group, k)
        return (request.memory_mib if res == "memory_mib" else request.cores_percent) * k
