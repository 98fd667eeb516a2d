"""Admission at cluster scale: latency of one decision with 1,000 nodes x 8 GPUs and 20,000 live
allocations.

    python bench/admission.py [--nodes 1000] [--allocations 20000] [--decisions 2000] [--seed 42] [--placement fgd]
                              [--waiting 50] [--fill-placement binpack] [--no-queue]

The pool mixes H100-80GB, A100-40GB and oversubscribed L40S-48GB nodes plus some whole-card
nodes; 24 workspaces with quotas; priority classes high (preempts), default, low (borrows) and
lowest; every node has 128 CPUs and 1 TiB of host memory (8 CPUs and 32 GiB of it requested by
other pods) and every request asks for CPU and host memory too. The live allocations are placed
by the admission core itself (``--placement``, default: the config's default), so cards are as
full as a busy cluster's. Then it times ``decide()`` for a varied stream of requests (small
and large slices, multi-GPU, whole cards, model filters, every class, so grants, preemptions,
waits and rejects all occur); grants are applied and an old allocation stops after each, so the
state keeps changing and stays near its size. Only ``decide()`` is timed (wall clock, and the
CPU time of the process per kind of decision: what a decision costs on a busy machine; issue
25's target is on the CPU p99 of every kind: 5 ms at 1,000 nodes, 25 ms at 5,000). The
``queue`` lines time one pass of the queue (``AdmissionQueue.pump``, what every arrival and
release costs) with ``--waiting`` requests behind an overdue head.

The last line is ``admission p50_ms=<n> p99_ms=<n> decisions_per_s=<n>``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quotas import (  # noqa: E402
    GPU,
    AdmissionState,
    Allocation,
    GPURequest,
    Mode,
    Node,
    Owner,
    Pool,
    load_config,
)
from quotas.queue import AdmissionQueue, propose_moves  # noqa: E402

GIB = 1024
CLASSES = {
    "high": {"value": 1000, "preempt": True},
    "default": {"value": 100, "movable": True},
    "low": {"value": 10, "borrow": True, "movable": True},
    "lowest": {"value": 1, "movable": True},
}


def make_pool(n_nodes: int) -> Pool:
    nodes = []
    for ni in range(n_nodes):
        share = ni / n_nodes
        if share < 0.6:
            model, gib, oversub, mode = "H100-80GB", 80, 1.0, Mode.SHARED
        elif share < 0.85:
            model, gib, oversub, mode = "A100-40GB", 40, 1.0, Mode.SHARED
        elif share < 0.95:
            model, gib, oversub, mode = "L40S-48GB", 48, 1.5, Mode.SHARED
        else:
            model, gib, oversub, mode = "H100-80GB", 80, 1.0, Mode.WHOLE
        gpus = tuple(
            GPU(uuid=f"GPU-{ni:04d}-{gi}", model=model, memory_mib=gib * GIB, sm_count=132,
                memory_oversub=oversub, mode=mode, index=gi)
            for gi in range(8)
        )
        # CPU and host memory as on a typical 8-GPU server, part of it taken by other pods
        nodes.append(Node(f"node-{ni:04d}", gpus, cpu_millicores=128_000, host_memory_mib=1024 * GIB,
                          cpu_requested_millicores=8_000, host_memory_requested_mib=32 * GIB))
    return Pool(tuple(nodes))


def make_config(n_workspaces: int = 24, placement: str | None = None, queue: dict | None = None):
    workspaces = {}
    for w in range(n_workspaces):
        namespaces = {
            f"ns{n}": {"limits": {"memory_mib": 40_000 * GIB}, "user_limits": {"gpus": 64}}
            for n in range(3)
        }
        workspaces[f"ws{w}"] = {
            # a few workspaces are tight, so quota waits, borrowing and reclaim happen
            "limits": {"memory_mib": (2_000 if w % 6 == 0 else 60_000) * GIB},
            "namespaces": namespaces,
        }
    data = {"priority_classes": CLASSES, "workspaces": workspaces, "queue": queue or {}}
    if placement:
        data["placement"] = {"node": placement, "gpu": placement}
    return load_config(data)


def random_owner(rng: random.Random) -> Owner:
    return Owner(f"user{rng.randrange(400)}", f"ns{rng.randrange(3)}", f"ws{rng.randrange(24)}")


def live_request(rng: random.Random, i: int) -> GPURequest:
    count = rng.choices([1, 2, 4], [90, 8, 2])[0]
    return GPURequest(
        owner=random_owner(rng),
        memory_mib=rng.choice([4, 8, 10, 12, 16, 20]) * GIB,
        cores_percent=rng.choice([10, 15, 20, 25, 30]),
        count=count,
        priority_class=rng.choices(["default", "low", "lowest", "high"], [50, 30, 15, 5])[0],
        whole=rng.random() < 0.01,
        request_id=f"live-{i}",
        kind="kernel",
        cpu_millicores=rng.choice([1_000, 2_000, 4_000]),
        host_memory_mib=rng.choice([4, 8, 16]) * GIB,
    )


def probe_request(rng: random.Random, i: int) -> GPURequest:
    return GPURequest(
        owner=random_owner(rng),
        memory_mib=rng.choice([2, 5, 10, 16, 20, 30, 40, 60, 80]) * GIB,
        cores_percent=rng.choice([5, 10, 25, 50, 75, 100]),
        count=rng.choices([1, 2, 4, 8, 9], [80, 10, 5, 4, 1])[0],
        model=rng.choices([None, "H100-80GB", "a100-40gb", "L40S-48GB", "B200-192GB"],
                          [70, 15, 8, 6, 1])[0],
        priority_class=rng.choices(["default", "low", "lowest", "high", "urgent"],
                                   [45, 25, 10, 19, 1])[0],
        whole=rng.random() < 0.05,
        request_id=f"probe-{i}",
        kind="kernel",
        cpu_millicores=rng.choice([0, 2_000, 8_000, 32_000]),
        host_memory_mib=rng.choice([0, 16, 64, 256]) * GIB,
    )


def time_pumps(state: AdmissionState, rng: random.Random, now: float, pumps: int = 40,
               behind: int = 50) -> tuple[list[float], list[float], list[float], int, int]:
    """Time ``AdmissionQueue.pump`` (the product's queue with its default rules) with a whole
    H100 request overdue at the head and ``behind`` requests of its class and lower behind it:
    reserving, holding and looking for slices to move for it at this scale. Moves are carried
    out (the slices leave the state); grants stay. Returns (seconds per pump, CPU seconds per
    pump, seconds per look for slices to move for the head alone — ``propose_moves``, which a
    pump runs at most every 5 s per head —, grants, moves)."""
    for g in state.usage()["gpus"]:  # a 10 GiB kernel on every empty H100: none is free whole
        if g["model"] == "H100-80GB" and not g["allocations"] and not g["whole"]:
            state.add(Allocation(f"spot-{g['uuid']}", random_owner(rng), g["node"], (g["uuid"],), 10 * GIB,
                                 10, "default", kind="kernel", created_at=now))
    queue = AdmissionQueue.from_policy(state.config.policy)
    times: list[float] = []  # the head first in line, then the others
    cpu: list[float] = []  # the same pumps in CPU time of this process
    looks: list[float] = []
    grants = moves = 0
    for p in range(pumps):
        if not any(w.request.request_id.startswith("head-") for w in queue.ordered()):
            queue = AdmissionQueue.from_policy(state.config.policy)  # (its limiter starts afresh)
            queue.push(GPURequest(Owner("head", "ns0", "ws1"), 80 * GIB, 100, model="H100-80GB", whole=True,
                                  request_id=f"head-{p}", kind="kernel", cpu_millicores=8_000,
                                  host_memory_mib=64 * GIB), 100, now - 120)
        while len(queue) < behind + 1:
            r = probe_request(rng, 10_000 + p * 100 + len(queue))
            if r.priority_class not in ("high", "urgent"):
                queue.push(r, state.config.policy.value_of(r.priority_class), now)
        head = next(w.request for w in queue.ordered() if w.request.request_id.startswith("head-"))
        t = time.perf_counter()
        propose_moves(state, head, now)
        looks.append(time.perf_counter() - t)
        c = time.process_time()
        t = time.perf_counter()
        steps = queue.pump(state, now)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        for step in steps:
            grants += step.decision.granted
            for mv in step.moves:
                state.remove(mv.allocation.id)
                moves += 1
        now += 1.0
    return times, cpu, looks, grants, moves


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values)) - 1))
    return sorted_values[i]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--allocations", type=int, default=20_000)
    parser.add_argument("--decisions", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--waiting", type=int, default=50,
                        help="queue lines: requests waiting behind the overdue head (default 50)")
    parser.add_argument("--placement", choices=["binpack", "spread", "fgd"], default=None,
                        help="placement for nodes and cards (default: the admission config's default)")
    parser.add_argument("--fill-placement", choices=["binpack", "spread", "fgd"], default=None,
                        help="placement that places the live allocations (default: --placement); binpack "
                             "fills 5,000 nodes in a fraction of fgd's time")
    parser.add_argument("--no-queue", action="store_true", help="leave out the queue lines")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    pool = make_pool(args.nodes)
    config = make_config(placement=args.placement)
    t0 = time.perf_counter()
    state = AdmissionState(make_config(placement=args.fill_placement or args.placement), pool)
    placed = tries = 0
    while placed < args.allocations and tries < args.allocations * 3:
        d = state.decide(live_request(rng, tries), now=float(tries))
        tries += 1
        if d.kind == "grant":
            state.apply(d)
            placed += 1
    fill_s = time.perf_counter() - t0
    allocations = list(state.allocations.values())
    t0 = time.perf_counter()
    state = AdmissionState(config, pool, allocations)
    rebuild_s = time.perf_counter() - t0
    usage = state.usage()
    used = sum(g["memory_used_mib"] for g in usage["gpus"])
    total = sum(g["memory_capacity_mib"] for g in usage["gpus"])
    print(f"placement: {config.placement.node}/{config.placement.gpu}; "
          f"pool: {len(pool.nodes)} nodes, {len(pool.all_gpus())} GPUs; "
          f"{len(state.allocations)} live allocations ({used / total:.0%} of GPU memory in use)")
    print(f"setup: placed them with decide()+apply() in {fill_s:.1f} s"
          f"{f' (placement {args.fill_placement})' if args.fill_placement else ''}; "
          f"a state rebuilt from the ledger in {rebuild_s:.2f} s")

    latencies: list[float] = []
    cpu_times: list[float] = []  # CPU time of this process: what a decision costs on a busy machine
    by_kind: dict[str, list[float]] = {}
    cpu_by_kind: dict[str, list[float]] = {}
    kinds: Counter[str] = Counter()
    victims = 0
    live_ids = [a.id for a in sorted(state.allocations.values(), key=lambda a: a.created_at)]
    now = float(tries)
    churn = 0.0
    for i in range(args.decisions):
        request = probe_request(rng, i)
        c = time.process_time()
        t = time.perf_counter()
        d = state.decide(request, now=now)
        dt = time.perf_counter() - t
        cpu_times.append(time.process_time() - c)
        cpu_by_kind.setdefault(d.kind, []).append(cpu_times[-1])
        latencies.append(dt)
        by_kind.setdefault(d.kind, []).append(dt)
        kinds[d.kind] += 1
        victims += len(d.victims)
        t = time.perf_counter()
        if d.granted:
            state.apply(d)
            live_ids.append(d.allocation.id)
            # an older allocation stops, so the pool stays about as full
            while live_ids:
                if state.remove(live_ids.pop(rng.randrange(len(live_ids)))) is not None:
                    break
        churn += time.perf_counter() - t
        now += 1.0

    total_s = sum(latencies)
    latencies.sort()
    p50, p99 = percentile(latencies, 50) * 1000, percentile(latencies, 99) * 1000
    print(f"decisions: {args.decisions} ({', '.join(f'{k} {n}' for k, n in kinds.most_common())}; "
          f"{victims} victims in all)")
    for kind, values in sorted(by_kind.items()):
        values.sort()
        cpu = sorted(cpu_by_kind[kind])
        print(f"  {kind:8s} p50 {percentile(values, 50) * 1000:.3f} ms  "
              f"p99 {percentile(values, 99) * 1000:.3f} ms  max {values[-1] * 1000:.3f} ms  "
              f"CPU p99 {percentile(cpu, 99) * 1000:.3f} ms")
    print(f"bookkeeping (apply + remove) per decision: {churn / args.decisions * 1000:.3f} ms")
    print(f"max decision {latencies[-1] * 1000:.3f} ms; target p99 < 5 ms: "
          f"{'met' if p99 < 5 else 'NOT met'}")
    cpu_times.sort()
    cpu_p99 = percentile(cpu_times, 99) * 1000
    print(f"CPU time per decision (excludes waiting for a core on a shared machine): "
          f"p50 {percentile(cpu_times, 50) * 1000:.3f} ms, p99 {cpu_p99:.3f} ms")
    # issue 25: every decision, preemption included, p99 <= 5 ms of CPU at 1,000 nodes x 8 GPUs
    # and <= 25 ms at 5,000 (between them, the bound of the nearer scale)
    target = 5.0 if args.nodes <= 1000 else 25.0
    worst = max(percentile(sorted(v), 99) * 1000 for v in cpu_by_kind.values())
    print(f"issue 25's target at this scale, CPU p99 <= {target:g} ms for every kind of decision: "
          f"{'met' if worst <= target else 'NOT met'} (worst kind {worst:.3f} ms)")
    ledger = list(state.allocations.values())
    for label, queue in () if args.no_queue else (
            ("reserve only (hold off, no moves)", {"hold": False, "moves": None}),
            ("the default (reserve, hold, look for slices to move)", {})):
        pumps, pump_cpu, looks, grants, moves = time_pumps(
            AdmissionState(make_config(placement=args.placement, queue=queue), pool, ledger),
            random.Random(args.seed), now, pumps=20 if args.waiting > 200 else 40, behind=args.waiting)
        pumps.sort()
        pump_cpu.sort()
        looks.sort()
        print(f"queue, {label}: {len(pumps)} pumps of {args.waiting + 1} waiting requests behind an overdue whole H100 "
              f"request, no H100 free: p50 {percentile(pumps, 50) * 1000:.1f} ms, p99 "
              f"{percentile(pumps, 99) * 1000:.1f} ms, max "
              f"{pumps[-1] * 1000:.1f} ms, CPU p50 {percentile(pump_cpu, 50) * 1000:.1f} ms, CPU p99 "
              f"{percentile(pump_cpu, 99) * 1000:.1f} ms ({grants} grants, {moves} slices moved); a look for slices "
              f"to move alone: p50 {percentile(looks, 50) * 1000:.1f} ms, max {looks[-1] * 1000:.1f} ms")
    print(f"admission p50_ms={p50:.3f} p99_ms={p99:.3f} decisions_per_s={args.decisions / total_s:.0f} "
          f"cpu_p99_ms={cpu_p99:.3f}")


if __name__ == "__main__":
    main()
