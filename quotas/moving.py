"""Holding capacity for an overdue head, and moving slices to make room for it.

Two rules of the queue (:class:`quotas.queue.AdmissionQueue`), both for the **overdue head** of a
priority class: its first waiting request, waiting for capacity (``PoolFull``, not its quota),
that has waited ``queue.reserve_after_seconds``.

*Holding* (``queue.hold``). While an overdue head waits, requests behind it — its class and
lower — do not take capacity held for it; such a request is placed elsewhere if it fits, or
waits ("goes first"). Higher classes come before the head in queue order and are not held.
What is held (:func:`holds_on`, put in place lazily, on the nodes where later requests of the
pass would start):

- by default (``with-moves``: where moves are on and the caller's edge can move slices,
  ``pump(moves_possible=...)``), only capacity a move could free for the head: on a node where
  it fits once the movable slices there are gone, the cards those moves would clear for it and
  the node CPU and host memory the moves would not give back. Never a card that notebook
  servers or unmovable kernels keep from it: holding that would make everyone wait for nothing
  (issue 25: p95 wait 0 s -> 46 min with notebook servers);
- with ``hold: true``, every node where the head could ever be placed (:func:`held_nodes`):
  the rule as it was, for admins who want it.

Holding only turns grants into waits, so it never puts more on a card or a node than a
decision without it would.

*Moving* (``queue.moves``). When the overdue head holds a reservation and
:func:`quotas.queue.propose_moves` finds the fewest single-card slices whose moving clears a
place for it, and every one of them is *movable* and not already told to move for another
head (in this pass or still under way: one slice is offered to one head), the pump returns them
with the head's step
(``Step.moves``) for the caller to carry out: swap each kernel out (its slice goes back to the
pool, the kernel keeps its state and asks admission again on its next cell, wherever there is
room). A slice is movable when it is a GPU kernel's (``kind == "kernel"``), on one card, of a
priority class with ``movable: true``, the caller's edge can swap it out (``movable`` callback:
the session's key, or None), and that session was not moved within
``queue.moves.same_session_after_seconds``; at most ``queue.moves.per_hour`` slices move in an
hour and ``queue.moves.max_slices`` for one head. Until the moved slices have left the state
(or :data:`MOVE_GRACE_SECONDS` passed), no further move is proposed for that head, and the
queue looks for moves for one head at most every :data:`MOVE_RETRY_SECONDS`.

Pure: the caller passes ``now`` and does the swapping.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator

from .model import Allocation, GPURequest, Owner
from .placement import ANY, CardIndex
from .policy import MovePolicy
from .state import AdmissionState

#: the caller's edge: the key of the session an allocation belongs to, if it can swap it out
#: (the same key across the session's successive allocations), or None
Movable = Callable[[Allocation], "str | None"]

#: the caller's edge: whether the kernel holding an allocation is running a cell now (it moves
#: live: its cell pauses until it is back), so a place that needs fewer of those is preferred
InCell = Callable[[Allocation], bool]

#: seconds the queue waits for moved slices to leave the state before it may move others
MOVE_GRACE_SECONDS = 120.0

#: seconds between two looks for slices to move for the same head (a look walks the pool)
MOVE_RETRY_SECONDS = 5.0


class MoveLimiter:
    """What moved when: the pool-wide hourly budget and each session's last move."""

    def __init__(self, policy: MovePolicy) -> None:
        self.policy = policy
        self._times: deque[float] = deque()
        self._last: dict[str, float] = {}

    def budget(self, now: float) -> int:
        """Slices that may still move in the hour up to ``now``."""
        while self._times and now - self._times[0] >= 3600:
            self._times.popleft()
        return max(0, min(self.policy.max_slices, self.policy.per_hour - len(self._times)))

    def allowed(self, key: str, now: float) -> bool:
        """The session ``key`` was not moved within ``same_session_after_seconds``."""
        last = self._last.get(key)
        return last is None or now - last >= self.policy.same_session_after_seconds

    def record(self, keys: Iterable[str], now: float) -> None:
        for key in keys:
            self._times.append(now)
            self._last[key] = now
        if len(self._last) > 4 * max(self.policy.per_hour, 1):  # forget sessions past the interval
            after = self.policy.same_session_after_seconds
            self._last = {k: t for k, t in self._last.items() if now - t < after}


def move_key(state: AdmissionState, movable: Movable | None) -> Callable[[Allocation], str | None]:
    """The session key of an allocation the policy lets move (kind, cards, class, edge), else None."""
    policy = state.config.policy

    def key(a: Allocation) -> str | None:
        if a.kind != "kernel" or a.whole or len(a.gpu_uuids) != 1:
            return None
        pc = policy.priority_classes.get(a.priority_class) or policy.priority_classes.get(
            policy.default_priority_class)
        if pc is None or not pc.movable:
            return None
        return a.id if movable is None else movable(a)

    return key


def request_shape(request: GPURequest) -> tuple[int, int, int, bool, int, int]:
    """(memory MiB and cores % per card — 0 for whole cards —, count, whole, CPU, host MiB)."""
    whole = request.whole
    return (0 if whole else request.memory_mib, 0 if whole else request.cores_percent,
            request.count, whole, request.cpu_millicores, request.host_memory_mib)


def node_cards(ix: CardIndex, ni: int, request: GPURequest) -> list[int]:
    """The cards of node ``ni`` big enough for one of ``request``'s slices (its model, its pins),
    or [] when the node could never take it (too few such cards, too little CPU or host memory
    when empty)."""
    group = request.model.lower() if request.model else ANY
    m, c, k, whole, cpu, hmem = request_shape(request)
    if ix.cpu_static[ni] < cpu or ix.hmem_static[ni] < hmem:
        return []
    pins = {ix.gi_of[u] for u in request.pinned_uuids if u in ix.gi_of}
    cards = [gi for gi in (ix.wgpus if whole else ix.sgpus)[ni].get(group, ())
             if (whole or (ix.cap_m[gi] >= m and ix.cap_c[gi] >= c)) and (not pins or gi in pins)]
    return cards if len(cards) >= k else []


def capable_cards(ix: CardIndex, request: GPURequest) -> Iterator[tuple[int, list[int]]]:
    """Each node that could ever take ``request`` (its model's cards, CPU and host memory
    enough when empty) with its cards big enough for one of the request's slices."""
    group = request.model.lower() if request.model else ANY
    m, c, k, whole, _, _ = request_shape(request)
    for ni in ix.capable_nodes(m, c, k, whole, group):
        cards = node_cards(ix, ni, request)
        if cards:
            yield ni, cards


def held_nodes(state: AdmissionState, request: GPURequest) -> set[str]:
    """The nodes where ``request`` could ever be placed (its model's cards big enough and enough
    of them, the CPU and host memory it asks for when empty): what ``queue.hold: true`` holds."""
    ix = state.index
    return {ix.node_names[ni] for ni, _ in capable_cards(ix, request)}


#: id prefix of the stand-in allocations that hold capacity during a pump
HOLD = "\0hold:"


def _stand_in(node: str, uuids: tuple[str, ...], memory_mib: int = 0, cores_percent: int = 0,
              whole: bool = True, cpu: int = 0, hmem: int = 0) -> Allocation:
    return Allocation(id=HOLD, owner=Owner(HOLD), node=node, gpu_uuids=uuids, memory_mib=memory_mib,
                      cores_percent=cores_percent, priority_class="", whole=whole,
                      cpu_millicores=cpu, host_memory_mib=hmem)


def holds_on(state: AdmissionState, head: GPURequest, ni: int, can_move: Callable[[Allocation], bool] | None,
             cpu_held: bool = False) -> list[Allocation]:
    """What an overdue ``head`` holds on node ``ni`` (stand-ins for the pass; [] for none).

    ``can_move`` None (``queue.hold: true``): every card of a node the head could ever use.
    Otherwise only capacity a move could free for it: on a node where the head fits once the
    slices ``can_move`` allows are gone, each card those moves would clear for it (for a slice,
    what its movable slices do not already cover: the head's memory and cores less theirs; for
    a whole card, all of it), and the node CPU and host memory the moves would not give back
    (none when ``cpu_held``: its reservation there holds them already). Cards that notebook
    servers or unmovable kernels keep from it are never held: no move would free them."""
    ix = state.index
    cards = node_cards(ix, ni, head)
    node = ix.node_names[ni]
    if not cards:
        return []
    if can_move is None:
        return [_stand_in(node, tuple(ix.gpus[gi].uuid for gi in ix.node_gpus[ni]))]
    m, c, k, whole, cpu, hmem = request_shape(head)
    allocs = state.allocations
    held, clear = [], 0
    for gi in cards:
        on = ix.on[gi]
        if any(aid.startswith(HOLD) for aid in on):
            clear += 1  # held already (a reservation)
            continue
        moving_m = moving_c = 0
        fixed = False
        for aid in on:
            a = allocs.get(aid)
            if a is not None and can_move(a):
                moving_m, moving_c = moving_m + a.memory_mib, moving_c + a.cores_percent
            else:
                fixed = True
        uuid = (ix.gpus[gi].uuid,)
        if whole:
            if not fixed:
                clear += 1
                held.append(_stand_in(node, uuid))
            continue
        if ix.cap_m[gi] - ix.used_m[gi] + moving_m < m or ix.cap_c[gi] - ix.used_c[gi] + moving_c < c:
            continue  # what stays there leaves no room for it
        clear += 1
        if moving_m < m or moving_c < c:
            held.append(_stand_in(node, uuid, max(0, m - moving_m), max(0, c - moving_c), whole=False))
    if clear < k:
        return []
    back = [a for a in ix.node_allocs[ni].values() if a.id in allocs and can_move(a)]
    back_cpu = sum(a.cpu_millicores for a in back)
    back_hmem = sum(a.host_memory_mib for a in back)
    if ix.cpu_free[ni] + back_cpu < cpu or ix.hmem_free[ni] + back_hmem < hmem:
        return []
    if not cpu_held and (cpu > back_cpu or hmem > back_hmem):
        held.append(_stand_in(node, (), whole=False, cpu=max(0, cpu - back_cpu), hmem=max(0, hmem - back_hmem)))
    return held


def conflicts(state: AdmissionState, allocation: Allocation, holds: Iterable[Allocation]) -> bool:
    """Would ``allocation`` (decided without ``holds``, not yet added) take what they hold?"""
    ix = state.index
    ni = ix.node_index(allocation)
    for h in holds:
        if not h.gpu_uuids:
            if ni is not None and (ix.cpu_free[ni] - allocation.cpu_millicores < h.cpu_millicores
                                   or ix.hmem_free[ni] - allocation.host_memory_mib < h.host_memory_mib):
                return True
            continue
        if not set(h.gpu_uuids) & set(allocation.gpu_uuids):
            continue
        if h.whole:
            return True
        gi = ix.gi_of[h.gpu_uuids[0]]  # a slice's hold is on one card
        am, ac = ix.charge_on(allocation, gi)
        if ix.cap_m[gi] - ix.used_m[gi] - am < h.memory_mib or ix.cap_c[gi] - ix.used_c[gi] - ac < h.cores_percent:
            return True
    return False
