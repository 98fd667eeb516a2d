"""The replay engine: sessions replayed through the admission core on a planned pool, and the
smallest pool whose waits stay short (pure, no clock). ``elastic-gpu simulate``, the capacity
API and ``bench/density.py`` all run it.

A :class:`Session` is one notebook's or kernel's use of GPUs: when it arrived, how long it
lasted, the share of a card it asked for (per GPU), how many GPUs, and, where known, its GPU
*bursts* (when it really launched work). A :class:`Scenario` says how the planned platform
serves it:

- ``profiles``: the slice sizes offered (fractions of a card); a session gets the smallest
  profile that holds its share (a whole card when none does). Empty: the share as asked.
- ``idle_timeout_seconds``: the culler's timeout. A session with a burst timeline then holds
  its slice from its start until ``idle_timeout`` after its last burst, and asks again (and
  may wait) at its next burst; a session without one holds its slice throughout.
- ``placement``: the admission placement policy (binpack, spread or fgd, for nodes and cards).
- ``gpus``: a fixed pool size (the answer is the waits there), or None: find the smallest.

Each holding period becomes a request decided by :class:`quotas.AdmissionState` (the code the
hub admits with: placement on cards and nodes, fragmentation) on ``gpus`` cards of one model,
``gpus_per_node`` per node, with no quotas and no preemption (the pool is what is planned).
A request that does not fit waits in arrival order (later ones that fit go first, as the
allocator's best-effort FIFO) and holds, once granted, for its recorded duration. Waits are
kept per *size class* (the granted size); a pool is enough when the p-th percentile wait of
every class is at most ``max_wait_seconds``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction

from quotas import GPU, AdmissionState, GPURequest, Node, Owner, Placement, Pool, load_config

from .capacity import CapacityPlan, plan_capacity
from .record import UsageRecord
from .report import ReportError


@dataclass(frozen=True)
class Session:
    """One session's use of GPUs (times in seconds; ``bursts``: (offset from arrival, length))."""

    id: str
    arrival: float
    duration: float
    share: float
    count: int = 1
    bursts: tuple[tuple[float, float], ...] | None = None
    user: str = ""

    def holds(self, idle_timeout: float | None) -> list[tuple[float, float]]:
        """(offset, length) of the periods it holds its slice under an idle timeout (see the module
        docstring): from its start (a kernel is started when the notebook opens) until the
        timeout after its last burst; again from each burst that comes after a cull."""
        if idle_timeout is None or self.bursts is None:
            return [(0.0, self.duration)]
        holds: list[tuple[float, float]] = []
        start, until = 0.0, min(self.duration, idle_timeout)
        for offset, length in sorted(self.bursts):
            if offset >= self.duration:
                break
            if offset > until:  # culled before this burst: released, asked again at the burst
                holds.append((start, until - start))
                start = offset
            until = max(until, min(self.duration, offset + length + idle_timeout))
        holds.append((start, until - start))
        return [(s, d) for s, d in holds if d > 0]


def size_label(size: float) -> str:
    """A size class's name: ``whole``, or a fraction of a card such as ``1/4``."""
    if size >= 1 - 1e-9:
        return "whole"
    frac = Fraction(size).limit_denominator(64)
    return str(frac) if abs(float(frac) - size) < 1e-6 else f"{size:.3f}"


def slice_profiles(slice_fraction: float) -> tuple[float, ...]:
    """The sizes a slice size X offers: X, 2X, ... and a whole card."""
    k = math.ceil(1 / slice_fraction - 1e-9)
    return tuple(sorted({min(1.0, i * slice_fraction) for i in range(1, k + 1)} | {1.0}))


@dataclass(frozen=True)
class Scenario:
    """How the planned platform serves the sessions (module docstring)."""

    name: str = "as recorded"
    profiles: tuple[float, ...] = ()
    idle_timeout_seconds: float | None = None
    placement: Placement = field(default_factory=Placement)
    gpus: int | None = None
    gpus_per_node: int = 8

    def size_of(self, share: float) -> float:
        if not self.profiles:
            return min(1.0, max(share, 1e-3))
        return next((p for p in sorted(self.profiles) if p >= share - 1e-9), 1.0)

    def describe(self) -> str:
        sizes = ", ".join(size_label(p) for p in sorted(self.profiles)) if self.profiles else "as asked"
        parts = [f"sizes {sizes}"]
        parts.append(
            f"idle timeout {self.idle_timeout_seconds:g} s"
            if self.idle_timeout_seconds is not None
            else "no idle timeout"
        )
        parts.append(f"placement {self.placement.node}/{self.placement.gpu}")
        parts.append(f"{self.gpus} GPUs" if self.gpus is not None else "smallest pool")
        parts.append(f"{self.gpus_per_node} per node")
        return ", ".join(parts)


@dataclass(frozen=True)
class Request:
    arrival: float
    id: str
    duration: float
    count: int
    size: float

    @property
    def label(self) -> str:
        return size_label(self.size)


def requests_of(sessions: Iterable[Session], scenario: Scenario) -> list[Request]:
    """The requests the sessions make under the scenario, in arrival order."""
    out = []
    for s in sessions:
        size = scenario.size_of(s.share)
        for i, (offset, length) in enumerate(s.holds(scenario.idle_timeout_seconds)):
            out.append(Request(s.arrival + offset, f"{s.id}#{i}", length, s.count, size))
    out.sort(key=lambda r: (r.arrival, r.id))
    return out


@dataclass
class ReplayResult:
    gpus: int
    requests: int
    #: per size class: the waits (s) of the requests that started
    waits: dict[str, list[float]] = field(default_factory=dict)
    #: per size class: requests still waiting at the end, or never placeable
    unserved: dict[str, int] = field(default_factory=dict)
    #: the replay stopped as soon as the answer was known to be "too small"
    stopped_early: bool = False

    def wait_percentile(self, percentile: float, label: str | None = None) -> float:
        """The wait (s) that ``percentile`` % of requests (of one class) stayed within; unserved
        ones count as infinite."""
        labels = [label] if label is not None else sorted(set(self.waits) | set(self.unserved))
        waits = sorted(w for name in labels for w in self.waits.get(name, []))
        waits += [math.inf] * sum(self.unserved.get(name, 0) for name in labels)
        if not waits:
            return 0.0
        return waits[max(0, math.ceil(len(waits) * percentile / 100) - 1)]

    def class_percentiles(self, percentile: float) -> dict[str, float]:
        return {name: self.wait_percentile(percentile, name) for name in sorted(set(self.waits) | set(self.unserved))}

    def worst_class(self, percentile: float) -> float:
        """The largest per-class percentile wait: the criterion of "enough GPUs"."""
        return max(self.class_percentiles(percentile).values(), default=0.0)


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
    requests: Sequence[Request],
    scenario: Scenario,
    *,
    gpus: int,
    model: str,
    memory_mib: int,
    max_wait_seconds: float | None = None,
    percentile: float = 95.0,
) -> ReplayResult:
    """Replay ``requests`` (from :func:`requests_of`) on ``gpus`` cards. With ``max_wait_seconds``
    it stops as soon as some class has more late requests than the percentile allows (the pool is
    known to be too small; the waits are then incomplete)."""
    placement = {"node": scenario.placement.node, "gpu": scenario.placement.gpu}
    state = AdmissionState(
        load_config({"placement": placement}), _pool(gpus, model, memory_mib, scenario.gpus_per_node)
    )
    result = ReplayResult(gpus=gpus, requests=len(requests))
    totals: dict[str, int] = {}
    for r in requests:
        totals[r.label] = totals.get(r.label, 0) + 1
    allowed = {k: n - math.ceil(n * percentile / 100) for k, n in totals.items()}
    late: dict[str, int] = dict.fromkeys(totals, 0)
    releases: list[tuple[float, str]] = []
    waiting: list[list] = []  # [arrived, request, GPURequest, counted late]

    def too_late(label: str) -> bool:
        late[label] += 1
        return max_wait_seconds is not None and late[label] > allowed[label]

    def try_grant(entry: list, t: float) -> str:
        arrived, request, ask, _ = entry
        decision = state.decide(ask, now=t)
        if decision.granted:
            state.add(decision.allocation)
            heapq.heappush(releases, (t + request.duration, decision.allocation.id))
            result.waits.setdefault(request.label, []).append(t - arrived)
            return "granted"
        return "reject" if decision.kind == "reject" else "wait"

    i = 0
    while i < len(requests) or (waiting and releases):
        t_arrive = requests[i].arrival if i < len(requests) else math.inf
        t = min(t_arrive, releases[0][0] if releases else math.inf)
        released = False
        while releases and releases[0][0] <= t:
            state.remove(heapq.heappop(releases)[1])
            released = True
        if released:  # capacity freed: the waiting ones, in arrival order
            still = []
            for entry in waiting:
                outcome = try_grant(entry, t)
                label, waited = entry[1].label, t - entry[0]
                overdue = max_wait_seconds is not None and waited > max_wait_seconds
                if outcome == "wait":
                    still.append(entry)
                elif outcome == "reject":
                    result.unserved[label] = result.unserved.get(label, 0) + 1
                if (overdue or outcome == "reject") and not entry[3]:
                    entry[3] = True
                    if too_late(label):
                        result.stopped_early = True
                        return result
            waiting = still
        while i < len(requests) and requests[i].arrival <= t:
            r = requests[i]
            i += 1
            whole = r.size >= 1.0
            ask = GPURequest(
                owner=Owner(user="planned"),
                memory_mib=0 if whole else max(1, int(r.size * memory_mib)),
                cores_percent=0 if whole else max(1, int(r.size * 100 + 1e-9)),
                count=r.count,
                whole=whole,
                request_id=r.id,
            )
            entry = [t, r, ask, False]
            outcome = try_grant(entry, t)
            if outcome == "wait":
                waiting.append(entry)
            elif outcome == "reject":
                result.unserved[r.label] = result.unserved.get(r.label, 0) + 1
                if too_late(r.label):
                    result.stopped_early = True
                    return result
    for entry in waiting:
        label = entry[1].label
        result.unserved[label] = result.unserved.get(label, 0) + 1
    return result


def _concurrency_bound(requests: Sequence[Request], percentile: float) -> int:
    """Cards that hold the demand ``percentile`` % of the time if slices never fragmented."""
    changes: dict[float, float] = {}
    for r in requests:
        changes[r.arrival] = changes.get(r.arrival, 0.0) + r.size * r.count
        changes[r.arrival + r.duration] = changes.get(r.arrival + r.duration, 0.0) - r.size * r.count
    return cards_held(changes, percentile)


def cards_held(changes: dict[float, float], percentile: float) -> int:
    """Whole cards that hold a demand ``percentile`` % of the time, the demand given as its
    changes (time -> cards added, negative where they leave; the sum of the shares, rounded up)."""
    if not changes:
        return 0
    times = sorted(changes)
    durations: dict[int, float] = {}
    level = 0.0
    for t0, t1 in zip(times, times[1:], strict=False):
        level += changes[t0]
        gpus = math.ceil(level - 1e-9)
        durations[gpus] = durations.get(gpus, 0.0) + (t1 - t0)
    total, covered = sum(durations.values()), 0.0
    for gpus in sorted(durations):
        covered += durations[gpus]
        if covered >= total * percentile / 100 - 1e-9:
            return gpus
    return max(durations, default=0)


@dataclass
class ScenarioResult:
    """One scenario's answer: GPUs (needed, or the fixed pool) and the waits there."""

    scenario: Scenario
    gpus: int | None  # None: no pool up to the search's limit is enough
    max_wait_seconds: float
    percentile: float
    requests: int
    sessions: int
    concurrency_bound: int
    #: GPUs tried -> the worst class's percentile wait there (inf: too small, replay stopped early)
    tried: dict[int, float]
    #: per size class: the percentile wait at ``gpus``
    class_waits: dict[str, float]
    #: sessions with a burst timeline (the idle timeout applies to those only)
    with_bursts: int = 0

    @property
    def wait(self) -> float:
        return max(self.class_waits.values(), default=0.0)

    def sentence(self) -> str:
        p = f"p{self.percentile:g}"
        classes = "; ".join(f"{k}: {_seconds(v)}" for k, v in self.class_waits.items())
        head = f"{self.scenario.name} ({self.scenario.describe()})"
        if self.scenario.gpus is not None:
            ok = "within" if self.wait <= self.max_wait_seconds else "over"
            text = (
                f"{head}: with {self.gpus} GPUs the {p} wait is {_seconds(self.wait)} ({classes}), "
                f"{ok} {self.max_wait_seconds:g} s"
            )
        elif self.gpus is None:
            text = f"{head}: no pool up to {max(self.tried)} GPUs keeps the {p} wait within {self.max_wait_seconds:g} s"
        else:
            text = (
                f"{head}: {self.gpus} GPUs keep the {p} wait within {self.max_wait_seconds:g} s for every size "
                f"class ({classes}); the concurrency bound was {self.concurrency_bound}"
            )
        if self.scenario.idle_timeout_seconds is not None and self.with_bursts < self.sessions:
            text += (
                f"; the idle timeout applies to the {self.with_bursts} of {self.sessions} sessions with a burst "
                "timeline, the others hold their slice throughout"
            )
        return text + "."

    def to_dict(self) -> dict:
        s = self.scenario
        return {
            "scenario": s.name,
            "profiles": [size_label(p) for p in sorted(s.profiles)],
            "idle_timeout_seconds": s.idle_timeout_seconds,
            "placement": {"node": s.placement.node, "gpu": s.placement.gpu},
            "gpus_per_node": s.gpus_per_node,
            "fixed_gpus": s.gpus,
            "gpus": self.gpus,
            "wait_seconds": _finite(self.wait),
            "class_wait_seconds": {k: _finite(v) for k, v in self.class_waits.items()},
            "percentile": self.percentile,
            "max_wait_seconds": self.max_wait_seconds,
            "requests": self.requests,
            "sessions": self.sessions,
            "sessions_with_bursts": self.with_bursts,
            "concurrency_bound": self.concurrency_bound,
            "tried": {str(k): _finite(v) for k, v in sorted(self.tried.items())},
            "answer": self.sentence(),
        }


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _seconds(v: float) -> str:
    return "never served" if not math.isfinite(v) else f"{v:.0f} s"


def run_scenario(
    sessions: Sequence[Session],
    scenario: Scenario,
    *,
    model: str,
    memory_mib: int,
    max_wait_seconds: float = 30.0,
    percentile: float = 95.0,
) -> ScenarioResult:
    """The scenario's waits at its fixed pool size, or the smallest pool whose per-class
    ``percentile`` wait is at most ``max_wait_seconds`` (a galloping then binary search from the
    concurrency bound; the wait is taken to fall as GPUs are added)."""
    if scenario.gpus_per_node < 1:
        raise ReportError(f"GPUs per node must be at least 1; got {scenario.gpus_per_node}.")
    if scenario.gpus is not None and scenario.gpus < 1:
        raise ReportError(f"a pool needs at least 1 GPU; got {scenario.gpus}.")
    requests = requests_of(sessions, scenario)
    if not requests:
        raise ReportError("there are no sessions to replay (in this period, for this model).")
    bound = _concurrency_bound(requests, percentile)
    tried: dict[int, float] = {}
    results: dict[int, ReplayResult] = {}

    def fits(n: int) -> bool:
        res = replay(
            requests,
            scenario,
            gpus=n,
            model=model,
            memory_mib=memory_mib,
            max_wait_seconds=max_wait_seconds,
            percentile=percentile,
        )
        results[n] = res
        tried[n] = math.inf if res.stopped_early else res.worst_class(percentile)
        return tried[n] <= max_wait_seconds

    base = dict(
        scenario=scenario,
        max_wait_seconds=max_wait_seconds,
        percentile=percentile,
        requests=len(requests),
        sessions=len(sessions),
        concurrency_bound=bound,
        with_bursts=sum(1 for s in sessions if s.bursts is not None),
    )
    if scenario.gpus is not None:
        full = replay(requests, scenario, gpus=scenario.gpus, model=model, memory_mib=memory_mib, percentile=percentile)
        tried[scenario.gpus] = full.worst_class(percentile)
        return ScenarioResult(gpus=scenario.gpus, tried=tried, class_waits=full.class_percentiles(percentile), **base)
    # every request on whole cards at once, plus a node: where nothing waits for a slice
    limit = sum(r.count for r in requests if r.duration > 0)
    limit = min(limit, _concurrency_bound([replace(r, size=1.0) for r in requests], 100.0)) + scenario.gpus_per_node
    limit = max(limit, bound)
    n = max(1, bound)
    if fits(n):
        lo, hi = 0, n  # search down: waiting up to max_wait may need fewer than the bound
    else:
        lo, step = n, 1
        hi = None
        while hi is None:
            n = min(limit, lo + step)
            if fits(n):
                hi = n
            elif n >= limit:
                return ScenarioResult(gpus=None, tried=tried, class_waits={}, **base)
            else:
                lo, step = n, step * 2
    while hi - lo > 1:  # lo too small (or 0), hi enough
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return ScenarioResult(gpus=hi, tried=tried, class_waits=results[hi].class_percentiles(percentile), **base)


# ---- recorded usage ------------------------------------------------------------------------------


def sessions_from_records(
    records: Iterable[UsageRecord], start: float, end: float, *, now: float | None = None, model: str = ""
) -> list[Session]:
    """The records of ``model`` that overlap [start, end) as sessions: a record held when the
    period starts arrives then; its busy periods (``busy_periods``) are its bursts."""
    now = end if now is None else now
    out = []
    for r in records:
        if model and r.gpu_model != model:
            continue
        arrival = max(start, r.granted_at)
        stop = min(end, r.end(now))
        if arrival >= end or stop <= arrival:
            continue
        bursts = None
        if r.busy_periods is not None:
            shift = arrival - r.granted_at
            bursts = tuple(
                (max(0.0, b0 - shift), b1 - max(b0, shift)) for b0, b1 in parse_periods(r.busy_periods) if b1 > shift
            )
        out.append(Session(r.id, arrival, stop - arrival, r.share, r.count, bursts, r.user))
    return out


def parse_periods(text: str) -> list[tuple[float, float]]:
    """``"0-30,90-150"`` (seconds from the grant) as [(0, 30), (90, 150)]."""
    out = []
    for part in text.split(","):
        if part.strip():
            a, _, b = part.partition("-")
            out.append((float(a), float(b)))
    return out


def model_of(records: Sequence[UsageRecord], model: str = "") -> tuple[str, int]:
    """The one GPU model of the records (or ``model``) and its card memory; ReportError otherwise."""
    chosen = [r for r in records if not model or r.gpu_model == model]
    if not chosen:
        raise ReportError("no recorded sessions in this period (for this model): nothing to replay.")
    models = {r.gpu_model for r in chosen}
    if len(models) > 1:
        raise ReportError(
            f"the sessions used {len(models)} GPU models ({', '.join(sorted(models))}); "
            "choose one (--model, or model= in the API)."
        )
    name = models.pop()
    memory = max((r.gpu_memory_mib for r in chosen), default=0)
    if memory <= 0:
        raise ReportError(f"the memory of a {name} card is not recorded; cannot size its slices.")
    return name, memory


@dataclass
class ReplayPlan:
    """The capacity API's answer: the smallest pool at a slice size (one scenario)."""

    result: ScenarioResult
    model: str
    slice_fraction: float
    lower_bound: CapacityPlan

    @property
    def gpus_needed(self) -> int | None:
        return self.result.gpus

    @property
    def tried(self) -> dict[int, float]:
        return self.result.tried

    def sentence(self) -> str:
        r = self.result
        if r.gpus is None:
            return (
                f"Replayed through admission, no pool up to {max(r.tried)} {self.model} GPUs keeps the "
                f"p{r.percentile:g} wait within {r.max_wait_seconds:g} s."
            )
        return (
            f"Replayed through admission ({r.scenario.gpus_per_node} GPUs per node), {r.gpus} {self.model} GPUs "
            f"keep the p{r.percentile:g} wait within {r.max_wait_seconds:g} s "
            f"(the concurrency bound was {self.lower_bound.gpus_needed_percentile})."
        )

    def to_dict(self) -> dict:
        r = self.result
        return {
            "gpus_needed": r.gpus,
            "max_wait_seconds": r.max_wait_seconds,
            "percentile": r.percentile,
            "gpus_per_node": r.scenario.gpus_per_node,
            "model": self.model,
            "slice_fraction": self.slice_fraction,
            "tried": {str(k): _finite(v) for k, v in sorted(r.tried.items())},
            "class_wait_seconds": {k: _finite(v) for k, v in r.class_waits.items()},
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
    """The smallest pool of the records' model at slice size ``slice_fraction``."""
    now = end if now is None else now
    records = [r for r in records if min(end, r.end(now)) > max(start, r.granted_at)]
    model, memory = model_of(records, model)
    sessions = sessions_from_records(records, start, end, now=now, model=model)
    scenario = Scenario(name=f"slices of {size_label(slice_fraction)}", profiles=slice_profiles(slice_fraction))
    scenario = replace(scenario, gpus_per_node=gpus_per_node)
    result = run_scenario(
        sessions, scenario, model=model, memory_mib=memory, max_wait_seconds=max_wait_seconds, percentile=percentile
    )
    lower = plan_capacity(records, start, end, slice_fraction, now=now, percentile=percentile, model=model)
    return ReplayPlan(result, model, slice_fraction, lower)
