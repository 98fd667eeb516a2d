"""Replay notebook sessions through the hub's own queue: ``quotas.AdmissionQueue`` with the
admission defaults the hub loads (``load_config({})``: priority classes with ``default``
movable, reservation after 20 s, ``queue.hold: with-moves``, moves on), pumped as
``hubext/allocator.py``'s ``GPUAllocator`` pumps it: after every arrival and release, and when a
waiting request becomes overdue. The bench's own code is only the clock and the users.

Two kinds of sessions, as in a hub:

- a **notebook server** with a GPU profile holds its slice from start to end (kind
  ``notebook``: never moved, never culled);
- a **GPU kernel** holds its slice while busy and for ``idle_timeout`` seconds after its last
  burst, then is swapped out (its slice goes back; its state stays), and asks again at its next
  burst (kind ``kernel``: the queue may move it for an overdue head, and passes again every
  ``MOVE_RETRY_SECONDS`` while a request is overdue, as the hub does. A kernel moved between its
  bursts asks again at its next burst, with ``push(moved=True)`` as the broker's resume does; one
  moved *in* a burst (a live move: the broker swaps it out and resumes it at once, its cell
  paused) asks again at once, and its burst goes on after the regrant, as much later as it
  waited: it holds its slice that much longer. The queue is told which kernels are in a burst
  (``pump(in_cell=...)``) and moves those only where no place needs fewer of them.)

A request granted after its period ended still counts its wait. Waits are per size class (share
of a card) and per kind; requests still waiting at the end count with the wait they had.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from hubext.metering.replay import cards_held
from quotas import GPU, AdmissionState, GPURequest, Node, Owner, Pool, load_config
from quotas.moving import MOVE_RETRY_SECONDS
from quotas.queue import AdmissionQueue

#: the queue configurations compared side by side (the ``queue`` section of the admission config)
QUEUES: dict[str, dict] = {
    "first-come": {"reserve_after_seconds": None, "hold": False, "moves": None},
    "reserve only": {"hold": False, "moves": None},
    "hold: true + moves": {"hold": True},
    "default": {},
}


@dataclass(frozen=True)
class Use:
    """One session as the queue sees it: who, what size, kernel or server, and its bursts."""

    id: str
    user: str
    arrival: float
    duration: float
    share: float
    kernel: bool
    bursts: tuple[tuple[float, float], ...]

    @cached_property
    def starts(self) -> list[float]:
        """When each burst starts (s), for bisecting: asked at every move and every pass."""
        return [self.arrival + o for o, _ in self.bursts]


@dataclass
class QueueRun:
    gpus: int
    waits: dict[str, list[float]] = field(default_factory=dict)  # size class -> waits (s)
    kind_waits: dict[str, list[float]] = field(default_factory=dict)
    moves: int = 0
    hours: float = 0.0
    resumes: int = 0
    #: moves of a kernel in a burst, and how long each paused its burst (its wait to be regranted)
    live_moves: int = 0
    pauses: list[float] = field(default_factory=list)

    def p95(self, label: str) -> float:
        return percentile(self.waits.get(label, []), 95)

    def worst(self) -> float:
        return max((self.p95(k) for k in self.waits), default=0.0)


def percentile(values: Sequence[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(len(s) * p / 100) - 1))]


def label_of(share: float) -> str:
    return "whole" if share >= 1 else f"1/{round(1 / share)}"


def periods(use: Use, idle_timeout: float) -> list[tuple[float, float]]:
    """(start, end), absolute, of the periods a kernel holds its slice (a server: its session)."""
    if not use.kernel:
        return [(use.arrival, use.arrival + use.duration)]
    out: list[tuple[float, float]] = []
    start, until = 0.0, min(use.duration, idle_timeout)
    for offset, length in use.bursts:
        if offset >= use.duration:
            break
        if offset > until:
            out.append((start, until))
            start = offset
        until = max(until, min(use.duration, offset + length + idle_timeout))
    out.append((start, until))
    return [(use.arrival + s, use.arrival + e) for s, e in out if e > s]


def pool_of(gpus: int, per_node: int = 8, card_mib: int = 80 * 1024, pooled: bool = False) -> Pool:
    """``gpus`` cards, ``per_node`` to a node; ``pooled``: the ideal pool instead, one machine with
    ONE card of all their memory and compute (bench/placement.py's ideal-pool model: nothing can
    fragment, a request fits wherever the totals have room)."""
    if pooled:
        card = GPU("pool-gpu0", "H100-80GB", card_mib * gpus, cores_oversub=float(gpus))
        return Pool((Node("pool", (card,)),))
    nodes, left, i = [], gpus, 0
    while left > 0:
        n = min(per_node, left)
        nodes.append(Node(f"node{i}", tuple(GPU(f"node{i}-gpu{g}", "H100-80GB", card_mib, index=g) for g in range(n))))
        left, i = left - n, i + 1
    return Pool(tuple(nodes))


def run(
    uses: Sequence[Use],
    gpus: int,
    queue: dict,
    idle_timeout: float,
    card_mib: int = 80 * 1024,
    stop_after: float | None = None,
    pooled: bool = False,
) -> QueueRun:
    """Replay ``uses`` on ``gpus`` cards through the queue configured by ``queue``.
    ``stop_after``: give up (the result has ``gpus`` = -1) once more than 5 % of some size
    class's requests have waited longer than this many seconds (the pool is too small).
    ``pooled``: on the ideal pool (:func:`pool_of`), where a whole card is asked for as a
    card's memory and compute."""
    cfg = load_config({"queue": queue})
    state = AdmissionState(cfg, pool_of(gpus, card_mib=card_mib, pooled=pooled))
    q = AdmissionQueue.from_policy(cfg.policy)
    bound = cfg.policy.reserve_after_seconds
    result = QueueRun(gpus)
    seq = itertools.count()
    events: list[tuple[float, int, str, object]] = []
    totals: dict[str, int] = {}
    for u in uses:
        for start, end in periods(u, idle_timeout):
            heapq.heappush(events, (start, next(seq), "ask", (u, end, False, None)))
            totals[label_of(u.share)] = totals.get(label_of(u.share), 0) + 1
    late: dict[str, int] = dict.fromkeys(totals, 0)
    deadlines: list[tuple[float, str]] = []  # (asked at + stop_after, request id)
    counted: set[str] = set()  # requests already counted late while waiting
    session_of: dict[str, Use] = {}
    ends: dict[str, float] = {}
    asked: dict[str, tuple[Use, float, float, float | None]] = {}  # id -> (use, asked at, end, burst end)
    live: set[str] = set()
    busy_until: dict[str, float] = {}  # a live-moved kernel's burst, later by its pause

    def record(u: Use, waited: float) -> bool:
        label = label_of(u.share)
        result.waits.setdefault(label, []).append(waited)
        result.kind_waits.setdefault("kernel" if u.kernel else "server", []).append(waited)
        return False

    def in_burst(aid: str, t: float) -> bool:
        return bursting(session_of[aid], t) or t < busy_until.get(aid, t)

    def too_late(u: Use) -> bool:
        label = label_of(u.share)
        late[label] += 1
        return late[label] > totals[label] * 0.05

    t = 0.0
    while events:
        t = events[0][0]
        while events and events[0][0] <= t:
            _, _, kind, payload = heapq.heappop(events)
            if kind == "ask":
                u, end, moved, burst_end = payload
                rid = f"{u.id}#{next(seq)}"
                whole = u.share >= 1 and not pooled
                request = GPURequest(
                    Owner(u.user),
                    0 if whole else int(u.share * card_mib),
                    0 if whole else max(1, int(u.share * 100)),
                    whole=whole,
                    request_id=rid,
                    kind="kernel" if u.kernel else "notebook",
                )
                q.push(request, 100, t, moved=moved)
                asked[rid] = (u, t, end, burst_end)
                if stop_after is not None:
                    heapq.heappush(deadlines, (t + stop_after, rid))
                if bound is not None:
                    heapq.heappush(events, (t + bound, next(seq), "wake", None))
            elif kind == "end":
                if payload in live:
                    live.discard(payload)
                    state.remove(payload)
        while deadlines and deadlines[0][0] < t:  # still waiting past the bound: late
            rid = heapq.heappop(deadlines)[1]
            if rid in asked:
                counted.add(rid)
                if too_late(asked[rid][0]):
                    result.gpus = -1
                    return result
        # the broker offers every live kernel and says which run a cell (GPUBroker.cells_running)
        steps = q.pump(
            state,
            t,
            lambda a: session_of[a.id].id if a.id in session_of else None,
            in_cell=lambda a, now=t: in_burst(a.id, now),
        )
        for step in steps:
            rid = step.waiting.request.request_id
            if step.decision.granted:
                u, at, end, burst_end = asked.pop(rid)
                if u.kernel and step.waiting.moved:
                    result.resumes += 1
                session_of[rid] = u
                live.add(rid)
                if burst_end is not None:  # back from a live move: its burst goes on, paused this long
                    result.pauses.append(t - at)
                    end, busy_until[rid] = end + (t - at), burst_end + (t - at)
                ends[rid] = end
                heapq.heappush(events, (max(end, t), next(seq), "end", rid))
                record(u, t - at)
                if stop_after is not None and t - at > stop_after and rid not in counted and too_late(u):
                    result.gpus = -1
                    return result
            elif step.decision.kind == "reject":
                asked.pop(rid, None)
            for mv in step.moves:  # swapped out: its slice goes back
                aid = mv.allocation.id
                if aid not in live:
                    continue
                u, end = session_of[aid], ends[aid]
                if mv.in_cell != in_burst(aid, t):
                    raise AssertionError(f"{aid}: the queue was told in_cell={not mv.in_cell}")
                live.discard(aid)
                state.remove(aid)
                result.moves += 1
                if mv.in_cell:  # a live move: it asks again at once, its burst paused until regranted
                    result.live_moves += 1
                    i = bisect.bisect_right(u.starts, t) - 1
                    burst_end = max(busy_until.pop(aid, 0.0), u.starts[i] + u.bursts[i][1])
                    heapq.heappush(events, (t, next(seq), "ask", (u, end, True, burst_end)))
                    totals[label_of(u.share)] += 1
                else:  # it asks again at its next burst
                    i = bisect.bisect_right(u.starts, t)
                    if i < len(u.starts) and u.starts[i] < end:
                        heapq.heappush(events, (u.starts[i], next(seq), "ask", (u, end, True, None)))
                        totals[label_of(u.share)] += 1
                heapq.heappush(events, (t, next(seq), "wake", None))
        if bound is not None and any(t - at >= bound for _, at, *_ in asked.values()):
            # as the hub does while an overdue request waits: pass again soon (a cell may end)
            heapq.heappush(events, (t + MOVE_RETRY_SECONDS, next(seq), "wake", None))
    for u, at, _, burst_end in asked.values():
        record(u, t - at)
        if burst_end is not None:
            result.pauses.append(t - at)
    result.hours = (t - min((u.arrival for u in uses), default=0.0)) / 3600
    return result


def bursting(u: Use, t: float) -> bool:
    """Whether the session's kernel is in one of its bursts (running a cell) at ``t``."""
    i = bisect.bisect_right(u.starts, t) - 1
    return i >= 0 and t < u.starts[i] + u.bursts[i][1]


def concurrency_bound(uses: Sequence[Use], idle_timeout: float, p: float = 95.0) -> int:
    """Cards that hold the demand ``p`` % of the time if slices never fragmented (the ideal pool:
    the sum of the shares held, rounded up)."""
    changes: dict[float, float] = {}
    for u in uses:
        for s, e in periods(u, idle_timeout):
            changes[s] = changes.get(s, 0.0) + u.share
            changes[e] = changes.get(e, 0.0) - u.share
    return cards_held(changes, p)


def smallest_pool(
    uses: Sequence[Use], queue: dict, idle_timeout: float, max_wait: float = 30.0, start: int = 1, pooled: bool = False
) -> tuple[int, QueueRun]:
    """The fewest cards whose p95 wait is at most ``max_wait`` in every size class (galloping
    up from ``start``, then bisecting; the wait is taken to fall as cards are added);
    ``pooled``: on the ideal pool (:func:`pool_of`)."""

    def ok(n: int) -> QueueRun | None:
        r = run(uses, n, queue, idle_timeout, stop_after=max_wait, pooled=pooled)
        return r if r.gpus > 0 and r.worst() <= max_wait else None

    lo, n, step = 0, max(1, start), 1
    found = ok(n)
    if found is not None:
        hi, best = n, found
        lo = 0
    else:
        lo = n
        while True:
            n = lo + step
            found = ok(n)
            if found is not None:
                hi, best = n, found
                break
            lo, step = n, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = ok(mid)
        if found is not None:
            hi, best = mid, found
        else:
            lo = mid
    return hi, best
