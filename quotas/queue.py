"""The waiting line in front of the admission core: priority order, backfill, and no starvation.

Queue order is priority (higher first), then arrival. A later request that fits is granted
while an earlier, bigger one waits (backfill, as Kueue's best-effort FIFO), so one large request
does not idle a card for everyone. But backfill alone starves large requests: small slices keep
taking every piece of capacity as it frees. So once the head of a priority class (its first
waiting request) has waited ``reserve_after_seconds`` for capacity, the queue *reserves* capacity
for it, as kube-scheduler nominates a node for a preemptor and Kueue reserves quota for its head:

- the reservation is one node and the cards the head would take there once the allocations on
  them are gone (the node and cards with the fewest allocations in the way; sticky until the
  head is granted or leaves);
- requests behind it (its class and lower) are never placed on the reserved cards, nor where
  they would take the node CPU or host memory the head needs;
- the head still takes any other place that fits first.

Nothing new lands in the head's way, so it is granted at the latest once the allocations that
held its reserved cards (and the node's CPU or memory it lacked) when the reservation was made
have departed — at most that many departures from that node, whatever else arrives. Higher
classes still come first and may take reserved capacity.

Pure like the rest of ``quotas``: the caller passes ``now`` and does the I/O for what
:meth:`AdmissionQueue.pump` decided.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import messages as msg
from .errors import PoolFull
from .incremental import PassMemo, Seen
from .model import Allocation, Decision, GPURequest, Owner
from .moving import (
    HOLD,
    MOVE_GRACE_SECONDS,
    MOVE_RETRY_SECONDS,
    InCell,
    Movable,
    MoveLimiter,
    capable_cards,
    conflicts,
    holds_on,
    move_key,
    request_shape,
)
from .placement import CardIndex
from .policy import RESERVE_AFTER_SECONDS, MovePolicy
from .state import AdmissionState


@dataclass(frozen=True)
class Reservation:
    """Capacity held for the head of a priority class: ``cards`` (uuids) on ``node``, plus the
    node CPU and host memory it asks for. ``blockers``: the allocations in its way when it was
    made (the bound on how many departures it waits for)."""

    node: str
    cards: tuple[str, ...]
    cpu_millicores: int
    host_memory_mib: int
    blockers: frozenset[str]
    made_at: float
    #: further (node, cards) held for it, next best first
    also: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(eq=False)
class Waiting:
    """One request in the queue. ``position``: how many wait ahead of it; ``reason``: why it
    waits (the latest decision's sentence)."""

    request: GPURequest
    priority_value: int
    seq: int
    enqueued_at: float
    position: int | None = None
    reason: str = ""
    #: a moved kernel asking back (see AdmissionQueue.push)
    moved: bool = False
    reservation: Reservation | None = None
    extra: dict = field(default_factory=dict)
    #: slices being moved for it: allocation id -> when the move was decided
    moving: dict[str, float] = field(default_factory=dict)
    #: when the queue last looked for slices to move for it
    moves_looked_at: float = float("-inf")
    #: its last decision, a wait (quotas.incremental): kept while nothing it could use changes
    seen: Seen | None = None


@dataclass(frozen=True)
class Step:
    """What one pump did with one request: granted (``decision.granted``; the state already
    holds the allocation and no longer the victims), rejected, or still waiting. ``moves``:
    slices to swap out so that this (overdue, waiting) request fits; they are still in the
    state — the caller removes each as its swap-out releases it."""

    waiting: Waiting
    decision: Decision
    moves: tuple[Move, ...] = ()


class AdmissionQueue:
    """Waiting requests, in priority then arrival order, with reservations for overdue heads."""

    def __init__(
        self,
        reserve_after_seconds: float | None = RESERVE_AFTER_SECONDS,
        reserve_spots: int = 1,
        hold: bool | None = True,
        moves: MovePolicy | None = None,
        incremental: bool = True,
    ) -> None:
        if reserve_after_seconds is not None and reserve_after_seconds < 0:
            raise ValueError(
                f"reserve_after_seconds must be 0 or more (or None: never reserve), got "
                f"{reserve_after_seconds!r}"
            )
        if isinstance(reserve_spots, bool) or not isinstance(reserve_spots, int) or reserve_spots < 1:
            raise ValueError(f"reserve_spots must be a whole number >= 1, got {reserve_spots!r}")
        self.reserve_after_seconds = reserve_after_seconds
        self.reserve_spots = reserve_spots
        self.hold = hold
        #: decide a waiting request again only when something it could use changed
        self.incremental = incremental
        self.limiter = MoveLimiter(moves or MovePolicy(max_slices=0))
        self._waiting: list[Waiting] = []
        self._seq = itertools.count()

    def push(self, request: GPURequest, priority_value: int, now: float, moved: bool = False) -> Waiting:
        """Put a request in line (the caller has checked it is not rejected). ``moved``: a kernel
        the queue moved to make room for another, asking for its slice back: never held behind an
        overdue head (it still keeps off reserved cards)."""
        w = Waiting(request, priority_value, next(self._seq), now, moved=moved)
        self._waiting.append(w)
        return w

    def requeue(self, waiting: Waiting) -> None:
        """Put back a request that ``pump`` granted but whose grant could not be carried out (the
        caller took it back from the state); it keeps its place in line."""
        waiting.seen = None
        if waiting not in self._waiting:
            self._waiting.append(waiting)

    def discard(self, waiting: Waiting) -> bool:
        """Take a request out of line (it gave up); False if it was not in line."""
        try:
            self._waiting.remove(waiting)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, waiting: object) -> bool:
        return waiting in self._waiting

    def ordered(self) -> list[Waiting]:
        """Waiting requests in queue order (priority, then arrival)."""
        return sorted(self._waiting, key=lambda w: (-w.priority_value, w.seq))

    @classmethod
    def from_policy(cls, policy) -> AdmissionQueue:
        """The queue an admission config's ``queue`` section describes."""
        return cls(policy.reserve_after_seconds, policy.reserve_spots,
                   policy.hold_for_overdue_head, policy.moves)

    def pump(
        self, state: AdmissionState, now: float, movable: Movable | None = None, moves_possible: bool = True,
        in_cell: InCell | None = None,
    ) -> list[Step]:
        """Decide every waiting request in order, applying grants to ``state`` as they happen;
        returns one step per request. Granted and rejected requests leave the queue.
        ``movable``: the edge's say on which allocations it can swap out (see quotas.moving);
        ``moves_possible``: whether the edge can move slices at all (with ``hold`` None, the queue
        holds for an overdue head only where moves are on and possible); ``in_cell``: of those,
        the kernels running a cell now (a live move pauses that cell: a place that needs fewer of
        them is chosen first, see :func:`propose_moves`)."""
        holding = self.hold if self.hold is not None else (moves_possible and self.limiter.policy.max_slices > 0)
        steps: list[Step] = []
        ahead = 0
        heads: set[int] = set()
        holders: list[_Holder] = []  # overdue heads ahead that hold capacity
        looked: set[tuple[int, str]] = set()  # (holder, node) whose holds are in place
        stood: list[Allocation] = []  # those holds: lifted for a moved kernel asking back
        closed = 0
        key = move_key(state, movable)
        keys: dict[str, str] = {}

        def can_move(a: Allocation) -> bool:
            if a.id not in keys:
                k = key(a)
                keys[a.id] = k if k is not None and self.limiter.allowed(k, now) else ""
            return bool(keys[a.id])

        # slices already told to move for a head: never offered to another
        offered = {aid for w in self._waiting for aid in w.moving if aid in state.allocations}
        memo = PassMemo(state) if self.incremental else None
        with _holds(state, memo) as (hold, put):
            for w in self.ordered():
                # a head of its class is decided afresh (it reserves, holds, has slices moved),
                # unless it waits on quota no eviction can give it (then it does none of that)
                if memo is not None and not w.moved and (w.priority_value in heads or (
                        w.seen is not None and w.seen.bound)) and memo.unchanged(w.seen):
                    w.seen = memo.again(w.seen)
                    steps.append(Step(w, w.seen.decision))
                    w.position = ahead
                    ahead += 1
                    heads.add(w.priority_value)
                    continue  # it waits as it did: nothing it could use changed
                version = state.version
                plain = True
                if w.moved and stood:
                    with _lifted(state, stood):  # never held: the held capacity is open to it
                        d = state.decide(w.request, now=now)
                else:
                    d = state.decide(w.request, now=now)
                while d.granted and holders and not w.moved:
                    # where it would start, put in place what the heads ahead hold; look again if
                    # it takes any of that
                    node = d.allocation.node
                    ni = state.index.ni_of.get(node)
                    hit = None
                    for i, h in enumerate(holders):
                        if ni is None or (i, node) in looked:
                            continue
                        looked.add((i, node))
                        holds = holds_on(state, h.request, ni, h.can_move, node in h.reserved_on)
                        if hit is None and conflicts(state, d.allocation, holds):
                            hit = h
                        stood.extend(put(a) for a in holds)
                    if hit is None:
                        break
                    closed += 1
                    plain = False
                    d = state.decide(w.request, now=now) if closed <= MAX_CLOSED_NODES else None
                    if d is None or not d.granted:  # it fits only where a head ahead could run
                        d = Decision("wait", reason=hit.reason, error=PoolFull(hit.reason))
                steps.append(Step(w, d))
                if d.granted or d.kind == "reject":
                    self._waiting.remove(w)
                    if d.granted:
                        state.apply(d)
                    continue
                w.position, w.reason = ahead, d.reason
                ahead += 1
                w.seen = memo.seen(w.request, d, version) if memo is not None and plain and not w.moved else None
                head = w.priority_value not in heads
                heads.add(w.priority_value)
                if not head or not isinstance(d.error, PoolFull):
                    continue  # only a head waiting for capacity (not quota) reserves
                bound = self.reserve_after_seconds
                overdue = bound is not None and now - w.enqueued_at >= bound
                if overdue:
                    if w.reservation is None:
                        w.reservation = reserve(state, w.request, now, self.reserve_spots)
                    if w.reservation is not None and moves_possible:
                        moves = self._moves(state, w, now, can_move, keys, offered, in_cell)
                        if moves:
                            steps[-1] = Step(w, d, moves)
                            offered.update(mv.allocation.id for mv in moves)
                    if holding and (self.hold or self.limiter.budget(now) > 0):
                        r = w.reservation
                        holders.append(_Holder(
                            w.request, msg.held_for(w.request, now - w.enqueued_at), None if self.hold else can_move,
                            frozenset(() if r is None else (r.node, *(n for n, _ in r.also)))))
                if w.reservation is not None:
                    hold(w.reservation)
        return steps

    def _moves(self, state: AdmissionState, w: Waiting, now: float, can_move: Callable[[Allocation], bool],
               keys: dict[str, str], offered: set[str], in_cell: InCell | None = None) -> tuple[Move, ...]:
        """The slices to move for the overdue head ``w`` now (recorded as moving), or (): never
        one ``offered`` to another head (its move is under way or was decided in this pass)."""
        if w.moving:
            if any(aid in state.allocations for aid in w.moving) and \
                    now - max(w.moving.values()) < MOVE_GRACE_SECONDS:
                return ()  # the last moves are still under way
            w.moving.clear()
        budget = self.limiter.budget(now)
        if budget < 1 or now - w.moves_looked_at < MOVE_RETRY_SECONDS:
            return ()
        w.moves_looked_at = now
        proposal = propose_moves(state, w.request, now, budget,
                                 lambda a: a.id not in offered and can_move(a), in_cell)
        if proposal is None:
            return ()
        self.limiter.record((keys[mv.allocation.id] for mv in proposal.moves), now)
        w.moving = {mv.allocation.id: now for mv in proposal.moves}
        return proposal.moves

    def move_failed(self, waiting: Waiting, allocation_id: str) -> None:
        """The caller could not carry out the move of ``allocation_id`` (it stays where it is;
        its session is not proposed again within the policy's interval)."""
        waiting.moving.pop(allocation_id, None)


def reserve(
    state: AdmissionState, request: GPURequest, now: float, spots: int = 1
) -> Reservation | None:
    """The node and cards where ``request`` waits for the fewest allocations to leave, and up
    to ``spots - 1`` next-best ones on other nodes (the first of them to clear wins)."""
    ix = state.index
    m, c, k, whole, cpu, hmem = request_shape(request)
    options: list[tuple] = []
    for ni, candidates in capable_cards(ix, request):
        cards = []
        for gi in candidates:
            if ix.on[gi] and any(aid.startswith(HOLD) for aid in ix.on[gi]):
                continue  # held for a request ahead
            fm = ix.cap_m[gi] - ix.used_m[gi]
            in_way = 0 if (not whole and fm >= m and ix.cap_c[gi] - ix.used_c[gi] >= c) \
                else len(ix.on[gi])
            cards.append((in_way, -fm, gi))
        if len(cards) < k:
            continue
        cards.sort()
        chosen = [gi for _, _, gi in cards[:k]]
        blockers = {aid for gi in chosen if _in_way(ix, gi, m, c, whole) for aid in ix.on[gi]}
        if ix.cpu_free[ni] < cpu or ix.hmem_free[ni] < hmem:
            blockers |= {aid for aid in ix.node_allocs[ni] if not aid.startswith(HOLD)}
        options.append(((len(blockers), sum(f for _, f, _ in cards[:k]), ni), ni, chosen, blockers))
    options.sort(key=lambda o: o[0])

    def uuids(cards: list[int]) -> tuple[str, ...]:
        return tuple(ix.gpus[gi].uuid for gi in cards)

    if not options:
        return None
    _, ni, chosen, blockers = options[0]

    return Reservation(
        node=ix.node_names[ni],
        cards=uuids(chosen),
        cpu_millicores=cpu,
        host_memory_mib=hmem,
        blockers=frozenset(blockers),
        made_at=now,
        also=tuple((ix.node_names[o[1]], uuids(o[2])) for o in options[1:spots]),
    )


#: places a move proposal tries out (fewest moves first)
TRIES = 10


@dataclass(frozen=True)
class Move:
    """One slice to move: ``allocation`` as it is, ``to`` the same slice at a place with room."""

    allocation: Allocation
    to: Allocation
    #: its kernel is running a cell (``in_cell``): a live move, the cell pauses until it is back
    in_cell: bool = False


@dataclass(frozen=True)
class MoveProposal:
    """Slices whose moving would let a waiting request start now on ``cards`` of ``node``."""

    node: str
    cards: tuple[str, ...]
    moves: tuple[Move, ...]


def propose_moves(
    state: AdmissionState, request: GPURequest, now: float, up_to: int = 8,
    can_move: Callable[[Allocation], bool] | None = None, in_cell: InCell | None = None,
) -> MoveProposal | None:
    """The fewest single-card slices (at most ``up_to``) that, each placed now where it has
    room, clear a place where ``request`` (waiting for capacity) then fits: its cards, and its
    node's CPU and host memory. None if there is no such set. A proposal for an admin (the
    issue of "waiting only on fragmentation"); nothing is moved and ``state`` is left as it
    was. Whole-card and multi-card allocations are never moved, nor those ``can_move`` refuses.
    ``in_cell``: the kernels running a cell (a live move pauses it): a place that moves fewer of
    them comes first, then one with fewer moves; their moves are ``Move.in_cell``."""
    ix = state.index
    m, c, k, whole, cpu, hmem = request_shape(request)
    allocs = state.allocations
    options = []
    # the TRIES best places (fewest moves, then node) are all that is tried: once TRIES are
    # known, a node (later in order) whose cards need at least as many moves as the worst of
    # them is not weighed (nor its slices walked)
    best: list[int] = []  # scores of the TRIES best places so far, as a max-heap (negated)
    busy = (lambda a: False) if in_cell is None else in_cell
    per = up_to + 1  # a place's score: kernels in a cell it moves, then moves (score >= moves)
    for ni, candidates in capable_cards(ix, request):
        if len(best) >= TRIES and _fewest_moves(ix, candidates, m, c, k, whole) >= -best[0]:
            continue
        cards = []
        for gi in candidates:
            if whole and len(ix.on[gi]) > up_to:
                continue  # more slices than may move
            movable = [allocs.get(aid) for aid in ix.on[gi]]
            if any(a is None or a.whole or len(a.gpu_uuids) != 1
                   or (can_move is not None and not can_move(a)) for a in movable):
                continue  # held for someone, claimed elsewhere, whole or multi-card
            fm, fc = ix.cap_m[gi] - ix.used_m[gi], ix.cap_c[gi] - ix.used_c[gi]
            out = []
            for a in sorted(movable, key=lambda a: (-a.memory_mib, a.id)):
                if not whole and fm >= m and fc >= c:
                    break
                out.append(a)
                fm, fc = fm + a.memory_mib, fc + a.cores_percent
            busy_out = sum(1 for a in out if busy(a))
            cards.append((busy_out, len(out), sum(a.memory_mib for a in out), gi, out))  # fewest, least
        if len(cards) < k:
            continue
        cards.sort(key=lambda x: x[:4])
        chosen = cards[:k]
        moves = [a for *_, out in chosen for a in out]
        taken = {a.id for a in moves}
        free_cpu = ix.cpu_free[ni] + sum(a.cpu_millicores for a in moves)
        free_hmem = ix.hmem_free[ni] + sum(a.host_memory_mib for a in moves)
        rest = () if free_cpu >= cpu and free_hmem >= hmem else sorted(
            (a for a in ix.node_allocs[ni].values()
             if a.id not in taken and not a.whole and len(a.gpu_uuids) == 1 and a.id in allocs
             and (can_move is None or can_move(a))),
            key=lambda a: (busy(a), -a.cpu_millicores, -a.host_memory_mib, a.id),
        )
        for a in rest:
            if free_cpu >= cpu and free_hmem >= hmem:
                break
            moves.append(a)
            free_cpu, free_hmem = free_cpu + a.cpu_millicores, free_hmem + a.host_memory_mib
        if moves and len(moves) <= up_to and free_cpu >= cpu and free_hmem >= hmem:
            score = per * sum(1 for a in moves if busy(a)) + len(moves)
            options.append((score, ni, [gi for *_, gi, _ in chosen], moves))
            heapq.heappush(best, -score)
            if len(best) > TRIES:
                heapq.heappop(best)
            if len(best) >= TRIES and -best[0] == 1:
                break  # enough places that one move clears (none clears with fewer)
    options.sort(key=lambda o: o[:2])
    for _, ni, cards, moves in options[:TRIES]:
        found = _try_moves(state, request, now, ni, cards, moves)
        if found is not None:
            found = tuple(dataclasses.replace(mv, in_cell=True) if busy(mv.allocation) else mv for mv in found)
            return MoveProposal(ix.node_names[ni], tuple(ix.gpus[gi].uuid for gi in cards), found)
    return None


def _fewest_moves(ix: CardIndex, cards: list[int], m: int, c: int, k: int, whole: bool) -> int:
    """A lower bound on the slices :func:`propose_moves` moves to clear ``k`` of ``cards``:
    each allocation on a card a whole request takes; one for each slice card without room."""
    if whole:
        on = ix.on
        return sum(sorted(len(on[gi]) for gi in cards)[:k]) if len(cards) >= k else 1 << 30
    cap_m, cap_c, used_m, used_c = ix.cap_m, ix.cap_c, ix.used_m, ix.used_c
    ready = sum(1 for gi in cards if cap_m[gi] - used_m[gi] >= m and cap_c[gi] - used_c[gi] >= c)
    return max(1, k - ready)


def _try_moves(
    state: AdmissionState, request: GPURequest, now: float, ni: int, cards: list[int],
    moves: list[Allocation],
) -> tuple[Move, ...] | None:
    """Place ``moves`` elsewhere with ``cards`` (and the node's CPU and memory for ``request``)
    held, then see whether ``request`` is granted; the state is restored either way."""
    ix = state.index
    hold = Allocation(
        id=f"{HOLD}move", owner=Owner(HOLD), node=ix.node_names[ni],
        gpu_uuids=tuple(ix.gpus[gi].uuid for gi in cards), memory_mib=0, cores_percent=0,
        priority_class="", whole=True, cpu_millicores=request.cpu_millicores,
        host_memory_mib=request.host_memory_mib,
    )
    with state.mix_kept(), state.tried():  # re-adding allocations must not teach the mix
        return _tried(state, request, now, hold, moves)


def _tried(state: AdmissionState, request: GPURequest, now: float, hold: Allocation,
           moves: list[Allocation]) -> tuple[Move, ...] | None:
    ix = state.index
    no = (False,) * ix.n_pred
    placed: list[Move] = []
    ok = True
    for a in moves:
        state.remove(a.id)
    ix.apply(hold, no, 1)
    try:
        for a in sorted(moves, key=lambda a: (-a.memory_mib, a.id)):
            d = state.decide(GPURequest(
                a.owner, a.memory_mib, a.cores_percent, model=ix.gpus[ix.gi_of[a.gpu_uuids[0]]].model,
                priority_class=a.priority_class or None, request_id=a.id, kind=a.kind,
                cpu_millicores=a.cpu_millicores, host_memory_mib=a.host_memory_mib,
            ), now=now, preempt=False)  # only a grant will do: no victim search
            if d.kind != "grant":
                ok = False
                break
            to = dataclasses.replace(d.allocation, created_at=a.created_at)
            state.add(to)
            placed.append(Move(a, to))
        ix.apply(hold, no, -1)
        ok = ok and state.decide(request, now=now, preempt=False).kind == "grant"
    finally:
        if ix.on[ix.gi_of[hold.gpu_uuids[0]]].get(hold.id) is not None:
            ix.apply(hold, no, -1)
        for mv in placed:
            state.remove(mv.to.id)
        for a in moves:
            state.add(a)
    return tuple(placed) if ok else None


def _in_way(ix: CardIndex, gi: int, m: int, c: int, whole: bool) -> bool:
    if whole:
        return bool(ix.on[gi])
    return ix.cap_m[gi] - ix.used_m[gi] < m or ix.cap_c[gi] - ix.used_c[gi] < c


#: at most this many held nodes are closed off in one pump for the requests behind an overdue
#: head to look elsewhere (beyond it, a request that would start on a held node just waits)
MAX_CLOSED_NODES = 32

@contextmanager
def _lifted(state: AdmissionState, holds: Iterable[Allocation | None]) -> Iterator[None]:
    """Within the block, the stand-ins ``holds`` are out of the card index (put back after)."""
    ix = state.index
    no = (False,) * ix.n_pred
    lifted = [a for a in holds if a is not None]
    for a in lifted:
        ix.apply(a, no, -1)
    try:
        yield
    finally:
        for a in lifted:
            ix.apply(a, no, 1)


@contextmanager
def _holds(state: AdmissionState, memo: PassMemo | None = None) -> Iterator:
    """Within the block, ``hold(reservation)`` keeps its cards and node CPU/memory from every
    later decision, ``put(stand_in)`` what an overdue head holds (quotas.moving.holds_on); all
    holds are gone afterwards (the state is the ledger again)."""
    ix = state.index
    placed: list[Allocation] = []
    no = (False,) * ix.n_pred  # never a preemption victim

    def put(a: Allocation) -> Allocation:
        a = dataclasses.replace(a, id=f"{HOLD}{len(placed)}")
        ix.apply(a, no, 1)
        placed.append(a)
        if memo is not None:
            memo.placed(a)
        return a

    def hold(r: Reservation) -> None:
        for node, cards in ((r.node, r.cards), *r.also):
            uuids = tuple(u for u in cards if u in ix.gi_of)
            if not uuids and node not in ix.ni_of:
                continue  # the inventory changed under it
            put(Allocation(
                id=HOLD, owner=Owner(HOLD), node=node, gpu_uuids=uuids,
                memory_mib=0, cores_percent=0, priority_class="", whole=True,
                cpu_millicores=r.cpu_millicores, host_memory_mib=r.host_memory_mib,
            ))

    try:
        yield hold, put
    finally:
        for a in reversed(placed):
            ix.apply(a, no, -1)


@dataclass(frozen=True)
class _Holder:
    """An overdue head that holds capacity in this pass: ``can_move`` None holds every node it
    could use (``queue.hold: true``), else only what moves could free (quotas.moving.holds_on)."""

    request: GPURequest
    reason: str
    can_move: Callable[[Allocation], bool] | None
    reserved_on: frozenset[str]
