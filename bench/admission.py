"""Admission at cluster scale: latency of one decision with 1,000 nodes x 8 GPUs and 20,000 live
allocations.

    python bench/admission.py [--nodes 1000] [--allocations 20000] [--decisions 2000] [--seed 42] [--placement fgd]
                              [--waiting 50] [--fill-placement binpack|direct] [--no-queue]
                              [--events 20] [--event-waiting 1000] [--queue-memo both|on|off] [--no-passes]
                              [--preempt-tries 1] [--against binpack|spread|fgd|none] [--tries 1]

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
release costs) with ``--waiting`` requests behind an overdue head. The ``queue per event`` lines
keep ``--event-waiting`` requests waiting (behind an overdue whole H100 request, the default queue
rules) and time the pump after each of ``--events`` events — a release of a live allocation or
an arrival, in turn — with the incremental pass (``--queue-memo on``, the product's default:
only requests something changed for are decided again) and with every waiting request decided
on every pump (``off``), on the same ledger and the same events (issue 25: <= 50 ms per event
with 1,000 waiting on 1,000 nodes); beside them the move search for the overdue head
(``propose_moves``, issue 25: <= 50 ms at 5,000 nodes).

Side by side (``--against``, default binpack), every request is decided too on a copy of the same
ledger under the other placement (the copy applies its own grants and loses the same old
allocations), the two interleaved, first one then the other: the ``side by side`` lines give the
CPU p50 and p99 of both per kind of decision, over the requests both decided alike, and their
ratio (issue 25: fragmentation-aware placement at <= 2x binpack's CPU per decision). ``decisions
hash`` digests what the measured placement decided (kind, node, cards, victims), in turn: a
change that only makes decisions cheaper leaves it as it was.

The last line is ``admission p50_ms=<n> p99_ms=<n> decisions_per_s=<n>``.
"""

from __future__ import annotations

import argparse
import hashlib
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


def direct_fill(pool: Pool, config, rng: random.Random, n: int) -> list[Allocation]:
    """``n`` live allocations put straight on a random node with room (slices on shared cards,
    whole cards on empty ones), a workspace over its memory quota borrowing for class ``low`` and
    skipping the others: a busy cluster's ledger in seconds where placing 100,000 allocations
    through ``decide()`` takes most of an hour at 5,000 nodes (only the queue lines use it)."""
    nodes = pool.nodes
    free_m = {g.uuid: int(g.memory_mib * g.memory_oversub) for nd in nodes for g in nd.gpus}
    free_c = {g.uuid: 100 for nd in nodes for g in nd.gpus}
    empty = {g.uuid: True for nd in nodes for g in nd.gpus}
    cpu = {nd.name: nd.cpu_millicores - nd.cpu_requested_millicores for nd in nodes}
    hmem = {nd.name: nd.host_memory_mib - nd.host_memory_requested_mib for nd in nodes}
    ws_used: Counter[str] = Counter()
    ws_limit = {name: ws.limits.get("memory_mib") for name, ws in config.quotas.workspaces.items()}
    out: list[Allocation] = []
    i = 0
    while len(out) < n and i < n * 3:
        r = live_request(rng, i)
        i += 1
        for _ in range(20):
            nd = nodes[rng.randrange(len(nodes))]
            if cpu[nd.name] < r.cpu_millicores or hmem[nd.name] < r.host_memory_mib:
                continue
            if r.whole:
                cards = [g for g in nd.gpus if empty[g.uuid] and g.mode in (Mode.SHARED, Mode.WHOLE)]
            else:
                cards = [g for g in nd.gpus if g.mode == Mode.SHARED and free_m[g.uuid] >= r.memory_mib
                         and free_c[g.uuid] >= r.cores_percent]
            if len(cards) >= r.count:
                break
        else:
            continue
        cards = cards[:r.count]
        charge = sum(g.memory_mib for g in cards) if r.whole else r.memory_mib * r.count
        ws = r.owner.workspace
        limit = ws_limit.get(ws)
        borrowed = limit is not None and ws_used[ws] + charge > limit
        if borrowed and r.priority_class != "low":
            continue
        if not borrowed:
            ws_used[ws] += charge
        for g in cards:
            empty[g.uuid] = False
            free_m[g.uuid] -= g.memory_mib if r.whole else r.memory_mib
            free_c[g.uuid] -= 100 if r.whole else r.cores_percent
        cpu[nd.name] -= r.cpu_millicores
        hmem[nd.name] -= r.host_memory_mib
        out.append(Allocation(
            r.request_id, r.owner, nd.name, tuple(g.uuid for g in cards),
            min(g.memory_mib for g in cards) if r.whole else r.memory_mib, 100 if r.whole else r.cores_percent,
            r.priority_class, whole=r.whole, borrowed=borrowed, kind="kernel", created_at=float(i),
            cpu_millicores=r.cpu_millicores, host_memory_mib=r.host_memory_mib))
    return out


def time_events(state: AdmissionState, rng: random.Random, now: float, waiting: int, events: int,
                incremental: bool) -> tuple[list[float], list[float], list[float], int, int]:
    """The pump after each of ``events`` events with ``waiting`` requests in line behind an
    overdue whole H100 request (a new one whenever it was granted: a head 120 s in line) (the
    product's queue, its default rules; ``incremental`` as
    given): a release of a live allocation and an arrival, in turn. The line is filled and
    pumped first (untimed: the burst that filled it). Returns (CPU seconds per pump, wall seconds
    per pump, CPU seconds of the move search for the head, grants, heads queued in all)."""
    queue = AdmissionQueue.from_policy(state.config.policy)
    queue.incremental = incremental
    for g in state.usage()["gpus"]:  # as in time_pumps: no H100 is free whole
        if g["model"] == "H100-80GB" and not g["allocations"] and not g["whole"]:
            state.add(Allocation(f"spot-{g['uuid']}", random_owner(rng), g["node"], (g["uuid"],), 10 * GIB,
                                 10, "default", kind="kernel", created_at=now))
    n = 0
    heads = 0

    def overdue_head() -> GPURequest:
        """The overdue head in line (a new one, waiting 120 s, once the last was granted)."""
        nonlocal heads
        for w in queue.ordered():
            if w.request.request_id.startswith("head-"):
                return w.request
        heads += 1
        r = GPURequest(Owner("head", "ns0", "ws1"), 80 * GIB, 100, model="H100-80GB", whole=True,
                       request_id=f"head-{heads}", kind="kernel", cpu_millicores=8_000, host_memory_mib=64 * GIB)
        queue.push(r, 100, now - 120)
        return r

    def arrive() -> None:
        nonlocal n
        while True:
            r = probe_request(rng, 500_000 + n)
            n += 1
            if r.priority_class not in ("high", "urgent"):
                queue.push(r, state.config.policy.value_of(r.priority_class), now)
                return

    def pump() -> tuple[float, float, int]:
        c, t = time.process_time(), time.perf_counter()
        steps = queue.pump(state, now)
        cpu, wall = time.process_time() - c, time.perf_counter() - t
        for step in steps:
            for mv in step.moves:
                state.remove(mv.allocation.id)
        return cpu, wall, sum(s.decision.granted for s in steps)

    for _ in range(10):  # the burst, until ``waiting`` wait after a pump
        overdue_head()
        while len(queue) < waiting + 1:
            arrive()
        pump()
        now += 1.0
        if len(queue) >= waiting:
            break
    cpu_s: list[float] = []
    wall_s: list[float] = []
    looks: list[float] = []
    grants = 0
    for e in range(events):
        if e % 2 == 0:
            live = sorted(a for a in state.allocations if not a.startswith("spot-"))
            state.remove(live[rng.randrange(len(live))])
        else:
            arrive()
        head = overdue_head()
        c = time.process_time()
        propose_moves(state, head, now)
        looks.append(time.process_time() - c)
        cpu, wall, granted = pump()
        cpu_s.append(cpu)
        wall_s.append(wall)
        grants += granted
        now += 1.0
    return cpu_s, wall_s, looks, grants, heads


def decide_cpu(state: AdmissionState, request: GPURequest, now: float, tries: int = 1):
    """The decision and the least CPU time it took in ``tries`` tries (the state unchanged)."""
    least, d = float("inf"), None
    for _ in range(max(1, tries)):
        c = time.process_time()
        d = state.decide(request, now=now)
        least = min(least, time.process_time() - c)
    return d, least


def print_side_by_side(mine: str, against: str, pairs: dict[str, list[tuple[float, float]]], tries: int) -> None:
    """CPU per decision under both placements on the same requests (those both decided alike),
    and the ratios (issue 25: fragmentation-aware placement at <= 2x binpack's CPU per decision)."""
    both = sum(len(v) for v in pairs.values())
    print(f"side by side, CPU per decision on the same requests and ledger, node {mine} against {against} "
          f"({both} decided alike by both; time.process_time{f', the least of {tries} tries' if tries > 1 else ''}):")
    ratios = {}
    for kind, values in sorted(pairs.items()) + [("all", [p for v in pairs.values() for p in v])]:
        mine_s, other_s = sorted(a for a, _ in values), sorted(b for _, b in values)
        row = []
        for q in (50, 99):
            a, b = percentile(mine_s, q) * 1000, percentile(other_s, q) * 1000
            ratios[kind, q] = a / b if b else float("inf")
            row.append(f"p{q} {a:.3f} vs {b:.3f} ms ({ratios[kind, q]:.2f}x)")
        print(f"  {kind:8s} {len(values):5d}  " + "  ".join(row))
    worst = max(ratios.get(("grant", 50), 0), ratios.get(("grant", 99), 0))
    print(f"issue 25's <= 2x {against} per decision (a grant's CPU p50 and p99): "
          f"{'met' if worst <= 2 else 'NOT met'} (the larger ratio {worst:.2f}x)")


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
    parser.add_argument("--fill-placement", choices=["binpack", "spread", "fgd", "direct"], default=None,
                        help="placement that places the live allocations (default: --placement); binpack "
                             "fills 5,000 nodes in a fraction of fgd's time; direct: straight on a random "
                             "node with room, without decide() (seconds; see direct_fill)")
    parser.add_argument("--no-queue", action="store_true", help="leave out the queue lines")
    parser.add_argument("--no-passes", action="store_true",
                        help="leave out the queue lines of whole passes (keep the per-event lines)")
    parser.add_argument("--events", type=int, default=20,
                        help="queue per event lines: events timed (default 20; 0 leaves them out)")
    parser.add_argument("--event-waiting", type=int, default=1000,
                        help="queue per event lines: requests kept waiting (default 1000)")
    parser.add_argument("--preempt-tries", type=int, default=1,
                        help="decide each preemption this many times (the state unchanged) and print the "
                             "least CPU time of each too: a figure a shared machine's load inflates less")
    parser.add_argument("--against", choices=["binpack", "spread", "fgd", "none"], default="binpack",
                        help="side by side: decide every request also under this node and card placement, "
                             "on a copy of the same ledger, and print the ratio of CPU per decision (default "
                             "binpack; none leaves it out)")
    parser.add_argument("--tries", type=int, default=1,
                        help="side by side: decide each request this many times under each placement (the "
                             "state unchanged) and take the least CPU time of each: a figure a shared "
                             "machine's load inflates less (later tries find the caches the first filled)")
    parser.add_argument("--queue-memo", choices=["both", "on", "off"], default="both",
                        help="queue per event lines: the incremental pass on, off, or both side by side")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    pool = make_pool(args.nodes)
    config = make_config(placement=args.placement)
    t0 = time.perf_counter()
    direct = args.fill_placement == "direct"
    state = AdmissionState(make_config(placement=None if direct else args.fill_placement or args.placement), pool,
                           direct_fill(pool, config, rng, args.allocations) if direct else ())
    placed = len(state.allocations)
    tries = args.allocations * 3 if direct else 0
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
    print(f"setup: placed them {'directly (direct_fill)' if direct else 'with decide()+apply()'} in {fill_s:.1f} s"
          f"{f' (placement {args.fill_placement})' if args.fill_placement else ''}; "
          f"a state rebuilt from the ledger in {rebuild_s:.2f} s")

    # side by side: the same requests decided on a copy of the ledger under another placement
    other = None if args.against == "none" else AdmissionState(make_config(placement=args.against), pool, allocations)
    pairs: dict[str, list[tuple[float, float]]] = {}  # kind (when both decide alike) -> [(CPU, other's CPU)]
    digest = hashlib.sha256()
    latencies: list[float] = []
    cpu_times: list[float] = []  # CPU time of this process: what a decision costs on a busy machine
    by_kind: dict[str, list[float]] = {}
    cpu_by_kind: dict[str, list[float]] = {}
    kinds: Counter[str] = Counter()
    preempt_least: list[float] = []
    victims = 0
    live_ids = [a.id for a in sorted(state.allocations.values(), key=lambda a: a.created_at)]
    now = float(tries)
    churn = 0.0
    for i in range(args.decisions):
        request = probe_request(rng, i)
        if other is not None and i % 2:  # which of the two decides first alternates
            other_d, other_cpu = decide_cpu(other, request, now, args.tries)
        c = time.process_time()
        t = time.perf_counter()
        d = state.decide(request, now=now)
        dt = time.perf_counter() - t
        cpu_times.append(time.process_time() - c)
        if other is not None and not i % 2:
            other_d, other_cpu = decide_cpu(other, request, now, args.tries)
        mine_cpu = min(cpu_times[-1], decide_cpu(state, request, now, args.tries - 1)[1]) if args.tries > 1 \
            else cpu_times[-1]
        digest.update(repr((d.kind, d.allocation and (d.allocation.node, d.allocation.gpu_uuids),
                            sorted(v.id for v in d.victims))).encode())
        if d.kind == "preempt":
            least = cpu_times[-1]
            for _ in range(args.preempt_tries - 1):
                c = time.process_time()
                state.decide(request, now=now)
                least = min(least, time.process_time() - c)
            preempt_least.append(least)
        cpu_by_kind.setdefault(d.kind, []).append(cpu_times[-1])
        latencies.append(dt)
        by_kind.setdefault(d.kind, []).append(dt)
        kinds[d.kind] += 1
        victims += len(d.victims)
        t = time.perf_counter()
        if other is not None:
            if other_d.kind == d.kind:
                pairs.setdefault(d.kind, []).append((mine_cpu, other_cpu))
            if other_d.granted:
                other.apply(other_d)
        if d.granted:
            state.apply(d)
            live_ids.append(d.allocation.id)
            # an older allocation stops, so the pool stays about as full (the same one in the copy)
            while live_ids:
                gone = live_ids.pop(rng.randrange(len(live_ids)))
                if other is not None:
                    other.remove(gone)
                if state.remove(gone) is not None:
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
    print(f"decisions hash {digest.hexdigest()[:16]} (kind, node, cards and victims of each, in turn)")
    if other is not None:
        print_side_by_side(config.placement.node, args.against, pairs, args.tries)
    print(f"bookkeeping (apply + remove) per decision: {churn / args.decisions * 1000:.3f} ms")
    print(f"max decision {latencies[-1] * 1000:.3f} ms; target p99 < 5 ms: "
          f"{'met' if p99 < 5 else 'NOT met'}")
    cpu_times.sort()
    cpu_p99 = percentile(cpu_times, 99) * 1000
    print(f"CPU time per decision (excludes waiting for a core on a shared machine): "
          f"p50 {percentile(cpu_times, 50) * 1000:.3f} ms, p99 {cpu_p99:.3f} ms")
    if args.preempt_tries > 1 and preempt_least:
        preempt_least.sort()
        print(f"preemption CPU, the least of {args.preempt_tries} tries each: "
              f"p50 {percentile(preempt_least, 50) * 1000:.3f} ms, p99 {percentile(preempt_least, 99) * 1000:.3f} ms "
              f"over {len(preempt_least)} preemptions")
    # issue 25: every decision, preemption included, p99 <= 5 ms of CPU at 1,000 nodes x 8 GPUs
    # and <= 25 ms at 5,000 (between them, the bound of the nearer scale)
    target = 5.0 if args.nodes <= 1000 else 25.0
    worst = max(percentile(sorted(v), 99) * 1000 for v in cpu_by_kind.values())
    print(f"issue 25's target at this scale, CPU p99 <= {target:g} ms for every kind of decision: "
          f"{'met' if worst <= target else 'NOT met'} (worst kind {worst:.3f} ms)")
    ledger = list(state.allocations.values())
    for label, queue in () if args.no_queue or args.no_passes else (
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
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.queue_memo]
    for incremental in () if args.no_queue or not args.events else modes:
        cpu_s, wall_s, looks, grants, heads = time_events(
            AdmissionState(config, pool, ledger), random.Random(args.seed), now, args.event_waiting, args.events,
            incremental)
        cpu_s.sort()
        wall_s.sort()
        looks.sort()
        target = "met" if percentile(cpu_s, 99) * 1000 <= 50 else "NOT met"
        print(f"queue per event, incremental pass {'on ' if incremental else 'off'}: {len(cpu_s)} events "
              f"(a release or an arrival) with {args.event_waiting} waiting behind an overdue whole H100 request: "
              f"pump CPU p50 {percentile(cpu_s, 50) * 1000:.1f} ms, p99 {percentile(cpu_s, 99) * 1000:.1f} ms, "
              f"wall p50 {percentile(wall_s, 50) * 1000:.1f} ms ({grants} grants; {heads} heads in turn, "
              f"a new one once one is granted); "
              f"issue 25's <= 50 ms per event (CPU p99): {target}")
        if looks and incremental:
            print(f"move search for the overdue head (propose_moves) at {len(pool.nodes)} nodes: CPU p50 "
                  f"{percentile(looks, 50) * 1000:.1f} ms, p99 {percentile(looks, 99) * 1000:.1f} ms over "
                  f"{len(looks)} looks; issue 25's <= 50 ms: "
                  f"{'met' if percentile(looks, 99) * 1000 <= 50 else 'NOT met'}")
    print(f"admission p50_ms={p50:.3f} p99_ms={p99:.3f} decisions_per_s={args.decisions / total_s:.0f} "
          f"cpu_p99_ms={cpu_p99:.3f}")


if __name__ == "__main__":
    main()
