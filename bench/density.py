"""Density: how many GPUs a notebook population needs with whole cards, with fractional slices,
and with fractional slices whose kernels are culled when idle.

    python bench/density.py [--seed 1] [--users 150] [--days 5] [--idle-timeout 600]

A seeded generator writes a notebook trace: on each working day each user opens 0-3 sessions
(starts between 08:00 and 17:00, log-normal lengths of about 2.5 h, 30 min to 9 h), each of one
size class (1/8, 1/4, 1/2 of a card or a whole card), with short GPU bursts (log-normal, about
90 s) separated by log-normal thinking gaps, so that the median session keeps its GPU busy
about 20 % of the time (the trace's median is printed). The same trace is replayed by the
replay engine of ``elastic-gpu simulate`` (:mod:`hubext.metering.replay`, through the real
admission core, 8 GPUs per node) under three scenarios:

- ``whole_card``: every session holds a whole card from start to end;
- ``fractional``: every session holds a slice of its size class from start to end;
- ``kernels_culled``: the same slices, released after ``--idle-timeout`` seconds without a
  burst and asked for again at the next burst (a culled kernel restarted on demand).

For each, the figure is the smallest pool whose 95th percentile wait is at most 30 s for every
size class. These three come from the simulate engine's own first-come queue (no reservation,
holding or moves), as ``elastic-gpu simulate`` answers.

**Through the hub's queue** (``bench/hubqueue.py``: ``quotas.AdmissionQueue`` with the
admission defaults the hub loads, pumped as ``GPUAllocator`` pumps it), a mix of users: a share
``--server-share`` (0.5) of the users run notebook servers that hold their slice for the whole
session (never moved); the others run GPU kernels swapped out after ``--idle-timeout`` idle and
asking again at their next burst, which the queue may move for an overdue request. Printed:

- ``queue`` lines: the p95 wait per size class under each queue configuration (first-come;
  reservation only; ``hold: true`` + moves, the rule the default was before issue 25; the
  default), side by side at the same pool sizes (the smallest pool first-come needs, and 3
  cards fewer), the share of requests that waited over 30 s, moves an hour, and the issue's two
  criteria: the largest class's p95 <= 3 x max(smallest class's p95, 30 s), and no class more
  than 30 s worse than first-come; and, as a reference, first-come and the default on the ideal
  pool of as many cards (``ideal_pool``: one machine with all their memory and compute, where
  nothing can fragment, so every wait there is for capacity, not for a place): where a class
  still waits over 30 s there, the cards are short of capacity, and the wait one class is
  spared another pays;
- ``needed`` lines: the smallest pool per queue configuration (p95 <= 30 s in every class);
- ``swap`` lines: the smallest pool with the default queue (``--reserve-after 60,20``: with each
  of these ``queue.reserve_after_seconds`` in turn, side by side) per idle timeout (``--timeouts``),
  against the no-fragmentation pool (``ideal``: the smallest ideal pool, one machine with one card
  of all the cards' memory and compute so that nothing can fragment, through the same queue with
  the same criterion; ``shares_p95``: the sum of the shares held, rounded up, at its 95th
  percentile over time, the reference before issue 25's swap work: a different criterion) and
  the whole-card pool (every session a whole card throughout); ``bursts_resumed``: the share of
  the kernels' bursts that start with a resume (their kernel was swapped out); ``moves_per_h``:
  kernels moved off a card for an overdue request, an hour, on the pool found;
  ``live_moves_per_h``: those moved in a burst (a cell: resumed at once, elsewhere), and
  ``live_pause_p50`` / ``p95``: how long such a burst paused (its wait to be granted again); where that pool
  is larger than the ideal one, ``at_ideal_size``: the p95 wait per size class on as many cards
  as the ideal pool needs (which class the missing card is for).

The ``trace`` line gives the trace's shape, on which every ratio depends: sessions open at once
(95th percentile over time: about what whole cards need), the share of session time that is
busy (bursts), and sessions per user and working day.

The last line is ``density whole_card_gpus=<n> fractional_gpus=<n>
kernels_culled_gpus=<n> ratio=<whole_card / kernels_culled>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hubext.metering.replay import Scenario, Session, cards_held, run_scenario  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: bench/culler.py must not shadow culler
import hubqueue  # noqa: E402

HOUR = 3600.0
#: size classes (a share of one card) and their weights in the population
SIZES = ((1 / 8, 30), (1 / 4, 35), (1 / 2, 20), (1.0, 15))
PROFILES = tuple(size for size, _ in SIZES)
CARD_MIB = 80 * 1024


def notebook_trace(seed: int, users: int = 150, days: int = 5) -> list[Session]:
    """Sessions of hours with short GPU bursts (module docstring); the same seed, the same trace."""
    rng = random.Random(seed)
    sizes, weights = zip(*SIZES, strict=True)
    sessions = []
    for user in range(users):
        size = rng.choices(sizes, weights)[0]  # a user keeps to one size class
        for day in range(days):
            for n in range(rng.choices((0, 1, 2, 3), (15, 45, 30, 10))[0]):
                start = day * 24 * HOUR + rng.uniform(8 * HOUR, 17 * HOUR)
                duration = min(9 * HOUR, max(0.5 * HOUR, rng.lognormvariate(math.log(2.5 * HOUR), 0.6)))
                # this session's thinking gaps: a median of ~5 min, so ~20 % busy at the median
                gap_median = rng.lognormvariate(math.log(300.0), 0.5)
                bursts, t = [], rng.uniform(0, 600)
                while t < duration:
                    length = min(duration - t, rng.lognormvariate(math.log(90.0), 0.5))
                    bursts.append((t, length))
                    t += length + rng.lognormvariate(math.log(gap_median), 0.8)
                sessions.append(Session(f"u{user}-d{day}-{n}", start, duration, size, 1, tuple(bursts), f"u{user}"))
    sessions.sort(key=lambda s: s.arrival)
    return sessions


def utilisation(session: Session) -> float:
    return sum(length for _, length in session.bursts or ()) / session.duration


def trace_shape(sessions: list[Session], users: int, days: int) -> str:
    """Sessions open at once (p95 over time), the busy share of session time, sessions a user-day."""
    changes: dict[float, float] = {}
    for s in sessions:
        changes[s.arrival] = changes.get(s.arrival, 0.0) + 1
        changes[s.arrival + s.duration] = changes.get(s.arrival + s.duration, 0.0) - 1
    busy = sum(length for s in sessions for _, length in s.bursts or ()) / sum(s.duration for s in sessions)
    return (
        f"concurrent_sessions_p95={cards_held(changes, 95)} busy_share={busy:.3f} "
        f"sessions_per_user_day={len(sessions) / max(1, users * days):.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="the trace generator's seed (default 1)")
    parser.add_argument("--users", type=int, default=150, help="notebook users (default 150)")
    parser.add_argument("--days", type=int, default=5, help="working days of the trace (default 5)")
    parser.add_argument(
        "--idle-timeout", type=float, default=600.0, help="kernels_culled: seconds idle before a cull (default 600)"
    )
    parser.add_argument("--max-wait", type=float, default=30.0, help="the p95 wait allowed per size class (s)")
    parser.add_argument(
        "--server-share",
        type=float,
        default=0.5,
        help="hub queue runs: the share of users running notebook servers (default 0.5)",
    )
    parser.add_argument(
        "--timeouts",
        default="60,120,300,600",
        help="hub queue runs: the idle timeouts (s) of the swap lines (default 60,120,300,600)",
    )
    parser.add_argument(
        "--reserve-after",
        default=None,
        help="swap lines: the queue's reserve_after_seconds, or several side by side (60,20; default: the default)",
    )
    parser.add_argument("--no-queue", action="store_true", help="skip the runs through the hub's queue")
    args = parser.parse_args(argv)
    sessions = notebook_trace(args.seed, args.users, args.days)
    if not args.no_queue:
        hub_queue_runs(sessions, args)
    print(
        f"trace seed={args.seed} users={args.users} days={args.days} sessions={len(sessions)} "
        f"median_hours={statistics.median(s.duration for s in sessions) / HOUR:.2f} "
        f"median_utilisation={statistics.median(utilisation(s) for s in sessions):.3f} "
        f"bursts={sum(len(s.bursts or ()) for s in sessions)} {trace_shape(sessions, args.users, args.days)}"
    )
    scenarios = {
        "whole_card": Scenario(name="whole_card", profiles=(1.0,)),
        "fractional": Scenario(name="fractional", profiles=PROFILES),
        "kernels_culled": Scenario(name="kernels_culled", profiles=PROFILES, idle_timeout_seconds=args.idle_timeout),
    }
    gpus = {}
    for key, scenario in scenarios.items():
        started = time.perf_counter()
        result = run_scenario(
            sessions, scenario, model="H100-80GB", memory_mib=CARD_MIB, max_wait_seconds=args.max_wait
        )
        gpus[key] = result.gpus
        waits = " ".join(f"{k}={v:.0f}s" for k, v in result.class_waits.items())
        print(
            f"{key}: gpus={result.gpus} requests={result.requests} p95_wait_by_class: {waits} "
            f"tried={len(result.tried)} seconds={time.perf_counter() - started:.1f}"
        )
    ratio = gpus["whole_card"] / gpus["kernels_culled"] if gpus["kernels_culled"] else math.inf
    print(
        f"density whole_card_gpus={gpus['whole_card']} fractional_gpus={gpus['fractional']} "
        f"kernels_culled_gpus={gpus['kernels_culled']} ratio={ratio:.2f}"
    )


def uses_of(sessions: list[Session], server_share: float, seed: int) -> list[hubqueue.Use]:
    """The trace's sessions as notebook servers (a ``server_share`` of the users, drawn with the
    seed) or GPU kernels."""
    rng = random.Random(seed * 7919 + 1)
    server: dict[str, bool] = {}
    return [
        hubqueue.Use(
            s.id,
            s.user,
            s.arrival,
            s.duration,
            s.share,
            not server.setdefault(s.user, rng.random() < server_share),
            tuple(sorted(s.bursts or ())),
        )
        for s in sessions
    ]


def resumed(uses: list[hubqueue.Use], idle_timeout: float) -> float:
    """The share of the kernels' bursts that start with a resume (the kernel was swapped out)."""
    kernels = [u for u in uses if u.kernel]
    resumes = sum(len(hubqueue.periods(u, idle_timeout)) - 1 for u in kernels)
    return resumes / max(1, sum(len(u.bursts) for u in kernels))


def hub_queue_runs(sessions: list[Session], args: argparse.Namespace) -> None:
    uses = uses_of(sessions, args.server_share, args.seed)
    timeout, limit = args.idle_timeout, args.max_wait
    servers = sum(1 for u in uses if not u.kernel)
    print(
        f"hub queue: {servers} notebook-server sessions, {len(uses) - servers} kernel sessions "
        f"(idle timeout {timeout:.0f} s); p95 wait per size class in s"
    )
    needed: dict[str, int] = {}
    for name, queue in hubqueue.QUEUES.items():
        started = time.perf_counter()
        needed[name], _ = hubqueue.smallest_pool(uses, queue, timeout, limit, hubqueue.concurrency_bound(uses, timeout))
        print(f"needed queue={name!r}: gpus={needed[name]} seconds={time.perf_counter() - started:.1f}")
    base = needed["first-come"]
    for gpus in (base - 3, base):
        runs = {name: hubqueue.run(uses, gpus, queue, timeout) for name, queue in hubqueue.QUEUES.items()}
        first = runs["first-come"]
        for name, r in runs.items():
            p95 = {k: r.p95(k) for k in sorted(r.waits)}
            waits = " ".join(f"{k}={v:.0f}" for k, v in p95.items())
            every = [w for ws in r.waits.values() for w in ws]
            late = sum(1 for w in every if w > 30) / max(1, len(every))
            fair = max(p95.values()) <= 3 * max(min(p95.values()), 30)
            worse = max(p95[k] - first.p95(k) for k in p95)
            print(
                f"queue gpus={gpus} queue={name!r}: {waits} waited_over_30s={100 * late:.1f}% "
                f"moves_per_h={r.moves / max(r.hours, 1e-9):.2f} largest<=3x={'yes' if fair else 'no'} "
                f"worst_vs_first_come=+{worse:.0f}s"
            )
        for name in ("first-come", "default"):  # the same cards, unfragmentable
            r = hubqueue.run(uses, gpus, hubqueue.QUEUES[name], timeout, pooled=True)
            waits = " ".join(f"{k}={r.p95(k):.0f}" for k in sorted(r.waits))
            print(f"queue gpus={gpus} queue={name!r} ideal_pool: {waits} worst={r.worst():.0f}s")
    whole = [dataclasses.replace(u, share=1.0, kernel=False) for u in uses]
    whole_gpus, _ = hubqueue.smallest_pool(
        whole, hubqueue.QUEUES["default"], timeout, limit, hubqueue.concurrency_bound(whole, timeout)
    )
    bounds = [None] if args.reserve_after is None else [float(x) for x in args.reserve_after.split(",")]
    for t, bound in ((float(x), b) for x in args.timeouts.split(",") for b in bounds):
        swap_queue = dict(hubqueue.QUEUES["default"])
        if bound is not None:
            swap_queue["reserve_after_seconds"] = bound
        shares = hubqueue.concurrency_bound(uses, t)
        gpus, found = hubqueue.smallest_pool(uses, swap_queue, t, limit, shares)
        ideal, _ = hubqueue.smallest_pool(uses, swap_queue, t, limit, max(1, shares - 2), pooled=True)
        label = "" if bound is None else f" reserve_after={bound:g}s"
        short = ""  # where the product needs more: its waits on as many cards as the ideal pool
        if gpus > ideal:
            r = hubqueue.run(uses, ideal, swap_queue, t)
            short = f" at_ideal_size: {' '.join(f'{k}={r.p95(k):.0f}s' for k in sorted(r.waits))}"
        print(
            f"swap idle_timeout={t:.0f}s{label}: gpus={gpus} ideal={ideal} over_ideal={100 * (gpus / ideal - 1):.0f}% "
            f"shares_p95={shares} whole_cards={whole_gpus} fewer_than_whole={whole_gpus / gpus:.1f}x "
            f"bursts_resumed={100 * resumed(uses, t):.0f}% moves_per_h={found.moves / max(found.hours, 1e-9):.2f}"
            f" live_moves_per_h={found.live_moves / max(found.hours, 1e-9):.2f} live_pause_p50="
            f"{hubqueue.percentile(found.pauses, 50):.0f}s p95={hubqueue.percentile(found.pauses, 95):.0f}s{short}"
        )


if __name__ == "__main__":
    main()
