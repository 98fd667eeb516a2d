"""Placement quality: how much of the pool a policy fills before requests fail, and how long big
requests wait next to small ones.

    python bench/placement.py [--seed 1] [--nodes 100] [--hours 72] [--load 0.85] [--compare]

Two runs, both driven through the real admission core (``AdmissionState.decide()``, and for the
second the real queue, ``quotas.queue.AdmissionQueue``):

1. **Allocation ratio** (the FGD paper's experiment, USENIX ATC '23 "Beware of Fragmentation"):
   a seeded trace of GPU-sharing pods — fractional, whole and multi-GPU, each with CPU and host
   memory — arrives in order with no departures until the GPU it asks for adds up to 130 % of
   the pool's GPUs; a pod that does not fit fails. The figure is the share of the pool's GPUs
   allocated at the end. The trace is replayed through the product under each placement policy
   and, side by side, through this file's own implementations of Random, Best-fit and FGD as
   published (scalar GPU shares, the trace's task mix as FGD's target workload; the product's
   code is not used for them).
2. **Waits**: sessions — GPU kernels of the default priority class, small slices of 4-20 GiB
   and whole 80 GiB cards, with CPU and memory — arrive and leave (Poisson arrivals, log-normal
   lengths of 2 h on average, ``--load`` offered GPU memory, 85 % by default, on 12 nodes) for
   ``--hours`` simulated hours; every request waits in the product's queue, with the product's
   defaults (reservation, holding, moves), until granted. A moved kernel asks again at once (see
   :func:`wait_run`). The figures are the 95th percentile waits of large (whole-card) and small
   (slice) requests; requests still waiting at the end count with the wait they had so far.
   ``--compare`` also runs the queue with its rules switched off one by one.

The last line is ``placement policy=<default> alloc_ratio=<n> random=<n> bestfit=<n> fgd=<n>
large_wait_p95_s=<n> small_wait_p95_s=<n> moves_per_h=<n>`` (the product's default placement
first, then the reference implementations; the waits and the slices moved per hour with the
product's default queue).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quotas import GPU, AdmissionState, GPURequest, Node, Owner, Placement, Pool, load_config  # noqa: E402
from quotas.queue import AdmissionQueue  # noqa: E402

GIB = 1024
CARD_MIB = 80 * GIB
MILLI = 1000  # a whole GPU in the reference model's GPU shares

#: node shapes: (GPUs, CPU millicores, host memory GiB, weight)
NODE_SHAPES = [(8, 64_000, 512, 55), (4, 32_000, 256, 25), (2, 16_000, 128, 20)]

#: pod kinds: (GPU share in milli, or whole GPUs x 1000; CPU millicores; host memory GiB; weight)
TASKS = [
    (100, 2_000, 8, 6), (250, 4_000, 16, 10), (300, 6_000, 24, 5), (500, 8_000, 32, 12),
    (600, 6_000, 24, 4), (750, 12_000, 48, 4), (1000, 8_000, 64, 32), (1000, 16_000, 96, 8),
    (2000, 16_000, 128, 9), (4000, 32_000, 256, 7), (8000, 60_000, 480, 3),
]


@dataclass(frozen=True)
class Pod:
    gpu_milli: int  # < 1000: a share of one GPU; else whole GPUs x 1000
    cpu: int
    mem_gib: int
    kind: int  # index into TASKS


def make_nodes(n: int, rng: random.Random) -> list[tuple[int, int, int]]:
    shapes = [s[:3] for s in NODE_SHAPES]
    weights = [s[3] for s in NODE_SHAPES]
    return [shapes[i] for i in rng.choices(range(len(shapes)), weights, k=n)]


def make_trace(nodes: list[tuple[int, int, int]], rng: random.Random, load: float = 1.3) -> list[Pod]:
    total = sum(g for g, _, _ in nodes) * MILLI
    pods: list[Pod] = []
    asked = 0
    weights = [t[3] for t in TASKS]
    while asked < load * total:
        kind = rng.choices(range(len(TASKS)), weights)[0]
        gpu, cpu, mem, _ = TASKS[kind]
        pods.append(Pod(gpu, cpu, mem, kind))
        asked += gpu
    return pods


def product_pool(nodes: list[tuple[int, int, int]]) -> Pool:
    return Pool(tuple(
        Node(
            f"node-{ni:04d}",
            tuple(GPU(f"GPU-{ni:04d}-{gi}", "A100-80GB", CARD_MIB, index=gi) for gi in range(g)),
            cpu_millicores=cpu,
            host_memory_mib=mem * GIB,
        )
        for ni, (g, cpu, mem) in enumerate(nodes)
    ))


def product_request(pod: Pod, i: int, owner: Owner) -> GPURequest:
    if pod.gpu_milli < MILLI:
        return GPURequest(
            owner, memory_mib=pod.gpu_milli * CARD_MIB // MILLI, cores_percent=pod.gpu_milli // 10,
            cpu_millicores=pod.cpu, host_memory_mib=pod.mem_gib * GIB, request_id=f"p{i}",
        )
    return GPURequest(
        owner, memory_mib=CARD_MIB, cores_percent=100, count=pod.gpu_milli // MILLI, whole=True,
        cpu_millicores=pod.cpu, host_memory_mib=pod.mem_gib * GIB, request_id=f"p{i}",
    )


def config(node: str, gpu: str, queue: dict | None = None):
    """An admission config with this placement and ``queue`` section ({}/None: the defaults)."""
    return load_config({"placement": {"node": node, "gpu": gpu}, "queue": queue or {}})


def product_alloc_ratio(nodes, pods, node_policy: str, gpu_policy: str) -> float:
    state = AdmissionState(config(node_policy, gpu_policy), product_pool(nodes))
    owner = Owner("bench")
    placed = 0
    for i, pod in enumerate(pods):
        d = state.decide(product_request(pod, i, owner))
        if d.kind == "grant":
            state.apply(d)
            placed += pod.gpu_milli
    return placed / (sum(g for g, _, _ in nodes) * MILLI)


# ---- the reference schedulers (this file's own, as published) ---------------------------------


class RefNode:
    __slots__ = ("cpu", "mem", "gpus", "cpu_total", "mem_total")

    def __init__(self, gpus: int, cpu: int, mem_gib: int) -> None:
        self.cpu, self.mem, self.gpus = cpu, mem_gib, [MILLI] * gpus
        self.cpu_total, self.mem_total = cpu, mem_gib


def ref_fits(n: RefNode, p: Pod) -> bool:
    if n.cpu < p.cpu or n.mem < p.mem_gib:
        return False
    if p.gpu_milli < MILLI:
        return any(f >= p.gpu_milli for f in n.gpus)
    return sum(1 for f in n.gpus if f == MILLI) >= p.gpu_milli // MILLI


def ref_choices(n: RefNode, p: Pod) -> list[list[int]]:
    """The GPU choices on a node: each fitting GPU for a share (one per distinct free amount),
    the lowest-numbered free GPUs for whole ones."""
    if p.gpu_milli < MILLI:
        seen: dict[int, int] = {}
        for gi, f in enumerate(n.gpus):
            if f >= p.gpu_milli and f not in seen:
                seen[f] = gi
        return [[gi] for gi in seen.values()]
    free = [gi for gi, f in enumerate(n.gpus) if f == MILLI]
    return [free[: p.gpu_milli // MILLI]]


def ref_place(n: RefNode, p: Pod, gpus: list[int]) -> None:
    n.cpu -= p.cpu
    n.mem -= p.mem_gib
    take = p.gpu_milli if p.gpu_milli < MILLI else MILLI
    for gi in gpus:
        n.gpus[gi] -= take


def ref_random(nodes: list[RefNode], p: Pod, rng: random.Random) -> tuple[int, list[int]] | None:
    fits = [ni for ni, n in enumerate(nodes) if ref_fits(n, p)]
    if not fits:
        return None
    ni = rng.choice(fits)
    n = nodes[ni]
    if p.gpu_milli < MILLI:
        return ni, [rng.choice([gi for gi, f in enumerate(n.gpus) if f >= p.gpu_milli])]
    return ni, ref_choices(n, p)[0]


def ref_bestfit(nodes: list[RefNode], p: Pod, rng: random.Random) -> tuple[int, list[int]] | None:
    """The node left with the least resources (equal-weight sum of GPU, CPU and memory shares),
    and on it the GPU left with the least."""
    best = None
    for ni, n in enumerate(nodes):
        if not ref_fits(n, p):
            continue
        for gpus in ref_choices(n, p):
            take = p.gpu_milli if p.gpu_milli < MILLI else MILLI
            gpu_left = sum(n.gpus) - take * len(gpus)
            score = (gpu_left / (MILLI * len(n.gpus)) + (n.cpu - p.cpu) / n.cpu_total
                     + (n.mem - p.mem_gib) / n.mem_total)
            key = (score, n.gpus[gpus[0]] if p.gpu_milli < MILLI else 0)
            if best is None or key < best[0]:
                best = (key, ni, gpus)
    return (best[1], best[2]) if best else None


class RefFGD:
    """Fragmentation Gradient Descent: place where the expected fragmentation for the target
    workload grows least. F_n(m) = the free GPU shares of node n that task kind m cannot use
    (all of them if m does not fit the node at all)."""

    def __init__(self, pods: list[Pod]) -> None:
        counts: dict[int, int] = {}
        for p in pods:
            counts[p.kind] = counts.get(p.kind, 0) + 1
        self.mix = [(TASKS[k], n / len(pods)) for k, n in sorted(counts.items())]

    def frag(self, cpu: int, mem: int, gpus: list[int]) -> float:
        total = 0.0
        free = sum(gpus)
        for (d, tc, tm, _), w in self.mix:
            if cpu < tc or mem < tm:
                f = free
            elif d < MILLI:
                if any(g >= d for g in gpus):
                    f = sum(g for g in gpus if g < d)
                else:
                    f = free
            else:
                if sum(1 for g in gpus if g == MILLI) >= d // MILLI:
                    f = sum(g for g in gpus if g < MILLI)
                else:
                    f = free
            total += w * f
        return total

    def __call__(self, nodes: list[RefNode], p: Pod, rng: random.Random) -> tuple[int, list[int]] | None:
        best = None
        take = p.gpu_milli if p.gpu_milli < MILLI else MILLI
        for ni, n in enumerate(nodes):
            if not ref_fits(n, p):
                continue
            before = self.frag(n.cpu, n.mem, n.gpus)
            for gpus in ref_choices(n, p):
                after_gpus = list(n.gpus)
                for gi in gpus:
                    after_gpus[gi] -= take
                delta = self.frag(n.cpu - p.cpu, n.mem - p.mem_gib, after_gpus) - before
                if best is None or delta < best[0] - 1e-9:
                    best = (delta, ni, gpus)
        return (best[1], best[2]) if best else None


def ref_alloc_ratio(nodes, pods, policy, seed: int) -> float:
    rng = random.Random(seed)
    ref = [RefNode(*n) for n in nodes]
    placed = 0
    for p in pods:
        where = policy(ref, p, rng)
        if where is not None:
            ref_place(ref[where[0]], p, where[1])
            placed += p.gpu_milli
    return placed / (sum(g for g, _, _ in nodes) * MILLI)


# ---- waits with arrivals and departures -------------------------------------------------------

#: sessions: (GiB of an 80 GiB card, or 0 for a whole card; CPU millicores; memory GiB; weight)
SESSIONS = [(4, 500, 4, 30), (8, 1_000, 8, 20), (10, 1_000, 8, 15), (16, 2_000, 16, 10),
            (20, 2_000, 16, 10), (0, 8_000, 64, 15)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def session_trace(seed: int, hours: float, load: float, capacity_gib: float) -> list[tuple]:
    """The arrival/departure run's sessions, in arrival order: (arrival s, SESSIONS row, user
    index, length s). Poisson arrivals offering ``load`` of ``capacity_gib``, log-normal lengths
    of 2 h on average."""
    rng = random.Random(seed)
    mean_len_s = 2 * 3600.0
    sigma = 1.0
    mu = math.log(mean_len_s) - sigma**2 / 2
    weights = [s[3] for s in SESSIONS]
    mean_gib = sum((s[0] or 80) * s[3] for s in SESSIONS) / sum(weights)
    rate = load * capacity_gib / mean_gib / mean_len_s  # arrivals per second
    end = hours * 3600
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        times.append(t)
    trace = []
    for t in times:
        session = SESSIONS[rng.choices(range(len(SESSIONS)), weights)[0]]
        user = rng.randrange(200)
        trace.append((t, session, user, rng.lognormvariate(mu, sigma)))
    return trace


#: the queue's rules switched off one by one (``--compare``): the admission config's ``queue``
COMPARE = {
    "no reservation": {"reserve_after_seconds": None, "hold": False, "moves": None},
    "reserve only": {"hold": False, "moves": None},
    "reserve + hold, no moves": {"hold": True, "moves": None},
    "reserve + moves, no hold": {"hold": False},
}


def wait_nodes(n_nodes: int = 12) -> list[tuple[int, int, int]]:
    return [(8, 64_000, 512)] * (n_nodes // 2) + [(4, 32_000, 256)] * (n_nodes - n_nodes // 2)


@dataclass
class WaitRun:
    """What one arrival/departure run measured."""

    large_p95_s: float
    small_p95_s: float
    requests: int
    #: reservations made, and how many of those heads were granted on the reserved cards
    reservations: int = 0
    granted_on_reserved: int = 0
    #: p50 seconds from a reservation to its head's grant
    reserved_to_grant_p50_s: float = 0.0
    #: time-averaged whole-card requests waiting (the line behind the head)
    large_waiting_mean: float = 0.0
    #: while an overdue whole-card request waited: nodes (of all) with the CPU and host memory
    #: for one more whole-card session, and the share of the pool's CPU in use
    nodes_with_room: float = 0.0
    nodes: int = 0
    cpu_used: float = 0.0
    #: slices the queue moved (swapped out) for overdue heads, and how many sessions that was
    moves: int = 0
    moved_sessions: int = 0
    sessions: int = 0
    #: p95 wait of a moved kernel to come back; share of small first starts that waited > 60 s
    resume_p95_s: float = 0.0
    small_over_60s: float = 0.0


def wait_run(node_policy: str, gpu_policy: str, seed: int, hours: float, n_nodes: int = 12,
             load: float = 0.85, queue: dict | None = None) -> WaitRun:
    """One arrival/departure run through the product's queue (``AdmissionQueue.from_policy``,
    its ``pump`` with holding and moves) and admission core; ``queue``: the admission config's
    ``queue`` section ({}: the product's defaults).

    Every session is a GPU kernel of the default priority class. A slice the pump moves
    (``Step.moves``) is treated as the product treats it — swapped out: its slice goes back to
    the pool and the kernel asks again — except that here it asks again at once (in the product
    it asks on its next cell, usually later): a conservative stand-in, since it competes for
    room at the worst moment. Its wait to come back counts as a small request's wait, and it
    runs on for what was left of its length once granted again."""
    nodes = wait_nodes(n_nodes)
    pool = product_pool(nodes)
    cfg = config(node_policy, gpu_policy, queue)
    state = AdmissionState(cfg, pool)
    line = AdmissionQueue.from_policy(cfg.policy)
    end = hours * 3600
    events: list[tuple[float, int, str, str]] = []
    sessions = {}
    for i, (t, session, user, length) in enumerate(
            session_trace(seed, hours, load, sum(g for g, _, _ in nodes) * 80)):
        heapq.heappush(events, (t, i, "arrive", f"s{i}"))
        sessions[f"s{i}"] = (session, user, length)
    arrived: dict[str, tuple[float, bool, float]] = {}
    requests: dict[str, GPURequest] = {}
    leave_at: dict[str, float] = {}  # a moved session's old departure no longer counts
    waits: dict[bool, list[float]] = {True: [], False: []}
    first_small: list[float] = []  # small requests' waits to start (not to come back)
    resumes: list[float] = []
    moved_ids: set[str] = set()
    owner_of = [Owner(f"user{u}") for u in range(200)]
    seq = len(events)
    out = WaitRun(0, 0, 0, nodes=len(nodes), sessions=len(sessions))
    to_grant: list[float] = []
    large_waiting = 0
    area = last = 0.0
    samples = 0
    ix = state.index  # read-only, for the "why" figures
    cpu_total = sum(cpu for _, cpu, _ in nodes)
    large_cpu, large_hmem = SESSIONS[-1][1], SESSIONS[-1][2] * GIB
    bound = cfg.policy.reserve_after_seconds
    moving: set[str] = set()  # moved, not back yet
    while events:
        now, _, kind, rid = heapq.heappop(events)
        area += large_waiting * (now - last)
        last = now
        if kind == "leave":
            if leave_at.get(rid) != now:
                continue  # moved since: it leaves later
            del leave_at[rid]
            state.remove(rid)
        elif kind == "arrive":
            (gib, cpu, mem, _), user, length = sessions.pop(rid)
            large = gib == 0
            request = requests[rid] = GPURequest(
                owner_of[user],
                memory_mib=CARD_MIB if large else gib * GIB,
                cores_percent=100 if large else max(5, gib * 100 // 80),
                whole=large, cpu_millicores=cpu, host_memory_mib=mem * GIB, request_id=rid,
                kind="kernel",
            )
            arrived[rid] = (now, large, length)
            large_waiting += large
            line.push(request, 100, now)
            if bound is not None:
                seq += 1  # look again once it is overdue
                heapq.heappush(events, (now + bound + 1e-3, seq, "tick", ""))
        for _ in range(8):
            moved = 0
            for step in line.pump(state, now):
                w = step.waiting
                if step.decision.granted:
                    got = w.request.request_id
                    t0, large, length = arrived.pop(got)
                    waits[large].append(now - t0)
                    if got in moving:
                        moving.discard(got)
                        resumes.append(now - t0)
                    elif not large:
                        first_small.append(now - t0)
                    large_waiting -= large
                    r = w.reservation
                    if r is not None:
                        out.reservations += 1
                        to_grant.append(now - r.made_at)
                        out.granted_on_reserved += set(step.decision.allocation.gpu_uuids) <= set(r.cards)
                    seq += 1
                    leave_at[got] = now + length
                    heapq.heappush(events, (now + length, seq, "leave", got))
                for mv in step.moves:  # swapped out: the slice is free, the kernel asks again
                    aid = mv.allocation.id
                    moving.add(aid)
                    moved_ids.add(aid)
                    state.remove(aid)
                    arrived[aid] = (now, False, leave_at.pop(aid) - now)
                    line.push(requests[aid], 100, now, moved=True)
                    moved += 1
            out.moves += moved
            if not moved:
                break
        overdue = [w for w in line.ordered() if w.request.whole and w.reservation is not None]
        if overdue and kind == "arrive":
            samples += 1
            out.nodes_with_room += sum(
                1 for ni in range(len(nodes))
                if ix.cpu_free[ni] >= large_cpu and ix.hmem_free[ni] >= large_hmem)
            out.cpu_used += 1 - sum(ix.cpu_free) / cpu_total
    for t0, large, _ in arrived.values():  # still waiting at the end: the wait so far
        waits[large].append(end - t0)
    out.large_p95_s, out.small_p95_s = percentile(waits[True], 95), percentile(waits[False], 95)
    out.requests = len(waits[True]) + len(waits[False])
    out.moved_sessions, out.resume_p95_s = len(moved_ids), percentile(resumes, 95)
    out.small_over_60s = sum(w > 60 for w in first_small) / max(1, len(first_small))
    out.reserved_to_grant_p50_s = percentile(to_grant, 50)
    out.large_waiting_mean = area / max(last, 1e-9)
    if samples:
        out.nodes_with_room /= samples
        out.cpu_used /= samples
    return out


def pooled_wait_run(seed: int, hours: float, n_nodes: int = 12, load: float = 0.85,
                    hold_after: float | None = None) -> tuple[float, float]:
    """The same sessions on an ideal pool: the whole pool is ONE machine with the pool's total
    GPU memory, CPU and host memory (no fragmentation anywhere), first come first served with
    backfill (a request is granted as soon as the totals have room for it). This file's own
    code, not the product's. No placement that lets a later request take room it fits can give
    large requests shorter waits than this; (large p95 s, small p95 s). ``hold_after``: once a
    whole-card request has waited that long, nobody behind it is granted until it is."""
    nodes = wait_nodes(n_nodes)
    free = [sum(g for g, _, _ in nodes) * 80, sum(c for _, c, _ in nodes), sum(m for _, _, m in nodes)]
    end = hours * 3600
    events: list[tuple] = []
    for i, (t, session, _, length) in enumerate(session_trace(seed, hours, load, free[0])):
        heapq.heappush(events, (t, i, session, length))
        if hold_after is not None and session[0] == 0:  # look again once it is overdue
            heapq.heappush(events, (t + hold_after + 1e-3, -1 - i, None, None))
    seq = len(events)
    line: list[tuple] = []
    waits: dict[bool, list[float]] = {True: [], False: []}
    while events:
        now, _, session, length = heapq.heappop(events)
        if session is not None:
            gib, cpu, mem, _ = session
            need = (gib or 80, cpu, mem)
            if length is None:  # a departure
                free = [f + n for f, n in zip(free, need, strict=True)]
            else:
                line.append((now, need, gib == 0, length, session))
        still = []
        held = False
        for t0, need, large, length, session in line:
            if not held and all(f >= n for f, n in zip(free, need, strict=True)):
                free = [f - n for f, n in zip(free, need, strict=True)]
                waits[large].append(now - t0)
                seq += 1
                heapq.heappush(events, (now + length, seq, session, None))
            else:
                still.append((t0, need, large, length, session))
                held = held or (large and hold_after is not None and now - t0 >= hold_after)
        line = still
    for t0, _, large, _, _ in line:
        waits[large].append(end - t0)
    return percentile(waits[True], 95), percentile(waits[False], 95)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=100, help="nodes in the allocation-ratio run")
    parser.add_argument("--hours", type=float, default=72.0, help="simulated hours in the wait run")
    parser.add_argument("--load", type=float, default=0.85,
                        help="offered GPU memory in the wait run, as a share of the pool's (default 0.85)")
    parser.add_argument("--compare", action="store_true",
                        help="also run the wait run with the queue's rules switched off one by one "
                             "(no reservation; reservation only; + holding; + moves)")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.hours <= 0 or not 0 < args.load < 2:
        parser.error("--nodes must be at least 1, --hours above 0 and --load between 0 and 2")

    rng = random.Random(args.seed)
    nodes = make_nodes(args.nodes, rng)
    pods = make_trace(nodes, rng)
    default = Placement()
    print(f"pool: {len(nodes)} nodes, {sum(g for g, _, _ in nodes)} GPUs; trace: {len(pods)} pods "
          f"asking {sum(p.gpu_milli for p in pods) / MILLI:.0f} GPUs (130 %), seed {args.seed}")
    ratios: dict[str, float] = {}
    t0 = time.perf_counter()
    for name, (node_p, gpu_p) in {"binpack": ("binpack", "binpack"), "spread": ("spread", "spread"),
                                  "fgd": ("fgd", "fgd")}.items():
        ratios[f"product {name}"] = product_alloc_ratio(nodes, pods, node_p, gpu_p)
    product_s = time.perf_counter() - t0
    refs = {"random": ref_random, "bestfit": ref_bestfit, "fgd": RefFGD(pods)}
    for name, policy in refs.items():
        ratios[f"reference {name}"] = ref_alloc_ratio(nodes, pods, policy, args.seed)
    for name, value in ratios.items():
        print(f"  alloc_ratio {name:18s} {value:.3f}")
    print(f"  (the product's three replays took {product_s:.1f} s)")
    default_name = default.node if default.node == default.gpu else f"{default.node}/{default.gpu}"
    default_ratio = product_alloc_ratio(nodes, pods, default.node, default.gpu)

    cfg_default = load_config({})
    bound = cfg_default.policy.reserve_after_seconds
    variants = {"the product's default queue": {}}
    if args.compare:
        variants.update(COMPARE)
    runs = {}
    for label, queue in variants.items():
        t0 = time.perf_counter()
        run = runs[label] = wait_run(default.node, default.gpu, args.seed, args.hours, load=args.load,
                                     queue=queue)
        print(f"  waits ({default_name}, {label}, load {args.load:g}): large p95 "
              f"{run.large_p95_s:.0f} s, small p95 {run.small_p95_s:.0f} s, {run.moves} slices moved "
              f"({run.moves / args.hours:.1f} per hour, {run.moved_sessions} of {run.sessions} sessions; "
              f"back in p95 {run.resume_p95_s:.0f} s); {100 * run.small_over_60s:.0f} % of small "
              f"starts waited > 60 s ({run.requests} requests, {time.perf_counter() - t0:.1f} s)")
    run = runs["the product's default queue"]
    print(f"  why: {run.reservations} heads held a reservation, {run.granted_on_reserved} were granted "
          f"on the reserved cards (p50 {run.reserved_to_grant_p50_s:.0f} s after reserving); "
          f"{run.large_waiting_mean:.1f} whole-card requests waiting on average; while an overdue "
          f"one waited, {run.nodes_with_room:.1f} of {run.nodes} nodes had the CPU and memory for "
          f"one more whole-card session and {100 * run.cpu_used:.0f} % of the pool's CPU was in use")
    ideal_large, ideal_small = pooled_wait_run(args.seed, args.hours, load=args.load)
    print(f"  ideal pool (one machine with the pool's totals, backfill; this file's own code): "
          f"large p95 {ideal_large:.0f} s, small p95 {ideal_small:.0f} s "
          f"({'within' if ideal_large <= 3 * max(ideal_small, 30) else 'NOT within'} 3 x max(small, 30))")
    held_large, held_small = pooled_wait_run(args.seed, args.hours, load=args.load, hold_after=bound)
    print(f"  ideal pool, nobody passes a whole-card request that waited {bound:g} s: large p95 "
          f"{held_large:.0f} s, small p95 {held_small:.0f} s")
    large, small = run.large_p95_s, run.small_p95_s
    ok_alloc = default_ratio >= ratios["reference fgd"]
    ok_wait = large <= 3 * max(small, 30)
    print(f"default alloc_ratio >= reference fgd: {'met' if ok_alloc else 'NOT met'}; "
          f"large_wait_p95 <= 3 x max(small_wait_p95, 30 s): {'met' if ok_wait else 'NOT met'}")
    print(f"placement policy={default_name} alloc_ratio={default_ratio:.3f} "
          f"random={ratios['reference random']:.3f} bestfit={ratios['reference bestfit']:.3f} "
          f"fgd={ratios['reference fgd']:.3f} large_wait_p95_s={large:.0f} small_wait_p95_s={small:.0f} "
          f"moves_per_h={run.moves / args.hours:.1f}")


if __name__ == "__main__":
    main()
