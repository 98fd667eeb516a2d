"""Capacity planning through the admission core: replay the recorded sessions on a pool of N
GPUs at a slice size, and find the smallest N whose waits stay short (pure, no clock).

Each recorded session of the period arrives when it was granted (a session already held when
the period starts arrives at its start) and holds its GPUs for as long as it did. At slice
size ``X`` its request is, per GPU, ``k = ceil(share / X)`` slices of size X on one card
(``k x X`` of the card's memory and compute; a whole card when that reaches 1). Requests are
decided by :class:`quotas.AdmissionState` (the code the hub admits with: placement on cards
and nodes, fragmentation) on a pool of ``gpus`` cards of the model, ``gpus_per_node`` per
node, without quotas or preemption (the pool is what is planned). A request that does not
fit waits in arrival order (later ones that fit go first, as the allocator's best-effort
FIFO) and starts, for its recorded duration, when capacity frees.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from quotas import GPU, AdmissionState, GPURequest, Node, Owner, Pool, load_config

from .capacity import CapacityPlan, plan_capacity
from .record import UsageRecord
from .report import ReportError


@dataclass
class ReplayResult:
    gpus: int
    sessions: int
    waits: list[float] = field(default_factory=list)  # seconds, of the sessions that started
    unserved: int = 0  # still waiting at the end of the replay, or never placeable

    def wait_percentile(self, percentile: float) -> float:
        """The wait (s) that ``percentile`` % of sessions stayed within (unserved ones count as infinite)."""
        waits = sorted(self.waits) + [math.inf] * self.unserved
        if not waits:
            return 0.0
        index = max(0, math.ceil(len(waits) * percentile / 100) - 1)
        return waits[index]


def _pool(gpus: int, model: str, memory_mib: int, per_node: int) -> Pool:
    nodes, n = [], 0
    while n < gpus:
        count = min(per_node, gpus - n)
        cards = tuple(
            GPU(uuid=f"GPU-plan-{n + i:04d}", model=model, memory_mib=memory_mib, index=i) for i in range(count)
        )
        nodes.append(Node(name=f"plan-node-{len(nodes)}", gpus=cards))
        n += count
    return Pool(nodes=tuple(nodes))


def replay(
    records: Iterable[UsageRecord],
    start: float,
    end: float,
    *,
    gpus: int,
    model: str,
    memory_mib: int,
    slice_fraction: float,
    gpus_per_node: int = 8,
    now: float | None = None,
) -> ReplayResult:
    """Replay the sessions that arrived in [start, end) on ``gpus`` cards (see the module docstring)."""
    now = end if now is None else now
    sessions = []
    for r in records:
        arrival = max(start, r.granted_at)  # a session held when the period starts arrives then
        if arrival >= end or r.end(now) <= arrival:
            continue
        duration = r.end(now) - arrival
        k = max(1, math.ceil(r.share / slice_fraction - 1e-9))
        size = min(1.0, k * slice_fraction)
        sessions.append((arrival, r.id, duration, r.count, size))
    sessions.sort()
    state = AdmissionState(load_config({}), _pool(gpus, model, memory_mib, gpus_per_node))
    result = ReplayResult(gpus=gpus, sessions=len(sessions))
    releases: list[tuple[float, str]] = []  # (time, allocation id)
    waiting: list[tuple[float, GPURequest, float]] = []  # (arrived, request, duration)
    arrivals = iter(sessions)
    upcoming = next(arrivals, None)
    while upcoming is not None or (waiting and releases):
        t_arrive = upcoming[0] if upcoming is not None else math.inf
        t_release = releases[0][0] if releases else math.inf
        t = min(t_arrive, t_release)
        while releases and releases[0][0] <= t:
            state.remove(heapq.heappop(releases)[1])
        while upcoming is not None and upcoming[0] <= t:
            arrived, rid, duration, count, size = upcoming
            whole = size >= 1.0
            request = GPURequest(
                owner=Owner(user="planned"),
                memory_mib=0 if whole else max(1, int(size * memory_mib)),
                cores_percent=0 if whole else max(1, int(size * 100)),
                count=count,
                whole=whole,
                request_id=rid,
            )
            waiting.append((arrived, request, duration))
            upcoming = next(arrivals, None)
        still = []
        for arrived, request, duration in waiting:
            decision = state.decide(request, now=t)
            if decision.granted:
                state.add(decision.allocation)
                heapq.heappush(releases, (t + duration, decision.allocation.id))
                result.waits.append(t - arrived)
            elif decision.kind == "reject":
                result.unserved += 1
            else:
                still.append((arrived, request, duration))
        waiting = still
    result.unserved += len(waiting)
    return result


@dataclass
class ReplayPlan:
    """The smallest pool whose p-th percentile wait is at most ``max_wait_seconds``."""

    gpus_needed: int | None  # None: not found up to ``tried`` GPUs
    max_wait_seconds: float
    percentile: float
    gpus_per_node: int
    model: str
    slice_fraction: float
    tried: dict[int, float]  # GPUs -> the percentile wait (s) there
    lower_bound: CapacityPlan

    def sentence(self) -> str:
        if self.gpus_needed is None:
            return (
                f"Replayed through admission, no pool up to {max(self.tried)} {self.model} GPUs keeps the "
                f"p{self.percentile:g} wait within {self.max_wait_seconds:g} s."
            )
        return (
            f"Replayed through admission ({self.gpus_per_node} GPUs per node), {self.gpus_needed} {self.model} GPUs "
            f"keep the p{self.percentile:g} wait within {self.max_wait_seconds:g} s "
            f"(the concurrency bound was {self.lower_bound.gpus_needed_percentile})."
        )

    def to_dict(self) -> dict:
        return {
            "gpus_needed": self.gpus_needed,
            "max_wait_seconds": self.max_wait_seconds,
            "percentile": self.percentile,
            "gpus_per_node": self.gpus_per_node,
            "model": self.model,
            "slice_fraction": self.slice_fraction,
            "tried": {str(k): (v if math.isfinite(v) else None) for k, v in sorted(self.tried.items())},
            "answer": self.sentence(),
        }


def plan_by_replay(
    records: Iterable[UsageRecord],
    start: float,
    end: float,
    slice_fraction: float,
    *,
    model: str = "",
    max_wait_seconds: float = 30.0,
    percentile: float = 95.0,
    gpus_per_node: int = 8,
    now: float | None = None,
) -> ReplayPlan:
    """Replay with N, N+1, ... GPUs from the concurrency bound N until the wait fits, at most up to
    a whole card for every concurrent session's GPU plus one node (where nothing waits for a slice)."""
    now = end if now is None else now
    records = [
        r for r in records if (not model or r.gpu_model == model) and min(end, r.end(now)) > max(start, r.granted_at)
    ]
    if not records:
        raise ReportError("no recorded sessions in this period (for this model): nothing to replay.")
    if gpus_per_node < 1:
        raise ReportError(f"GPUs per node must be at least 1; got {gpus_per_node}.")
    models = {r.gpu_model for r in records}
    if len(models) > 1:
        raise ReportError(
            f"the sessions used {len(models)} GPU models ({', '.join(sorted(models))}); choose one (model=...)."
        )
    model = models.pop()
    memory = max((r.gpu_memory_mib for r in records), default=0)
    if memory <= 0:
        raise ReportError(f"the memory of a {model} card is not recorded; cannot size its slices.")
    lower = plan_capacity(records, start, end, slice_fraction, now=now, percentile=percentile, model=model)
    whole = plan_capacity(records, start, end, 1.0, now=now, model=model)
    max_gpus = max(whole.gpus_needed_peak, lower.gpus_needed_percentile) + gpus_per_node
    tried: dict[int, float] = {}
    n = max(1, lower.gpus_needed_percentile)
    while n <= max_gpus:
        result = replay(
            records,
            start,
            end,
            gpus=n,
            model=model,
            memory_mib=memory,
            slice_fraction=slice_fraction,
            gpus_per_node=gpus_per_node,
            now=now,
        )
        tried[n] = result.wait_percentile(percentile)
        if tried[n] <= max_wait_seconds:
            break
        n += 1
    found = n if n <= max_gpus else None
    return ReplayPlan(found, max_wait_seconds, percentile, gpus_per_node, model, slice_fraction, tried, lower)
