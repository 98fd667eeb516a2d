"""Production-shaped heterogeneous GPU-cluster traces and the FGD paper's baseline schedulers.

Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation
Gradient Descent", USENIX ATC '23. What this file follows from the paper:

- the cluster and workload of §2 (a production GPU cluster): nodes of several GPU models with
  CPU and host memory per GPU that differ by node type, some nodes without GPUs; tasks that ask
  for no GPU, for a share of one GPU (0.05–0.95, constrained or not to one GPU model) or for 1,
  2, 4 or 8 whole GPUs, each with CPU and memory. The shapes here are generated (seeded), not
  the published trace: node and task tables below, two mixes (``default`` and the GPU-share
  heavy ``share``, as the paper's "multi-GPU" / "GPU-sharing" trace variants of §6.3);
- the experiment of §6.1 ("inflating the workload"): tasks arrive in trace order with no
  departures until the GPUs they ask add up to 130 % of the cluster's; a task no node fits
  fails; the figure is the share of the cluster's GPUs allocated, read when the GPUs asked
  reach 100 % and at 130 %;
- fragmentation, §3.2: for a node n and a task kind m, F_n(m) is the free GPU capacity of n
  that m cannot use — all of it when m cannot run on n at all (too little CPU or memory, the
  wrong model, too few GPUs), else the free parts of GPUs too small for m (for a whole-GPU
  task: every partly used GPU); F_n(M) = Σ_m p_m F_n(m) over the target workload M (here the
  trace's own task kinds and their popularity, as in §4);
- the schedulers of §4 and §6.1: FGD (the node and GPU where F_n(M) grows least) and the
  baselines Random-fit, DotProd (Tetris' alignment: the smallest dot product of the node's free
  CPU and GPU, normalised, with the task's demand), GPU Clustering (tasks with the same GPU
  demand together), GPU Packing (a used GPU first, then a free GPU of a used node, then a free
  node) and Best-fit (the least free CPU and GPU left, weighted equally). Tasks without GPUs are
  placed as kube-scheduler places them (LeastAllocated), as the product's users get; with
  ``own_gpu_less`` by each scheduler itself, as in the paper (for Packing and Clustering, which
  have no opinion on them, at random among the nodes that fit).

The product is replayed on the same trace through ``AdmissionState.decide()``: a GPU share is a
slice of that share of the card's compute (``cores_percent``) and of the smallest card's memory
(the card's own when the task names a model), whole GPUs are ``whole`` requests; tasks without
GPUs are placed as kube-scheduler's default (NodeResourcesFit LeastAllocated: the node with the
most CPU and memory free) places a pod the GPU admission never sees, and enter the state as
CPU and memory that others take on that node.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from quotas import GPU, AdmissionState, Allocation, GPURequest, Node, Owner, Pool, load_config

GIB = 1024
MILLI = 1000

#: node types: (GPU model, card GiB, GPUs, CPU cores, host memory GiB, weight)
NODE_TYPES = [
    ("V100-16GB", 16, 8, 96, 368, 22),
    ("V100-32GB", 32, 8, 96, 736, 10),
    ("P100-16GB", 16, 2, 64, 512, 10),
    ("T4-16GB", 16, 2, 96, 384, 20),
    ("A10-24GB", 24, 1, 128, 1024, 12),
    ("A100-80GB", 80, 8, 128, 1024, 8),
    ("", 0, 0, 96, 384, 18),  # CPU only
]

#: GPU shares of one card a share task asks (milli), with weights
SHARES = [(50, 6), (100, 10), (200, 8), (250, 12), (300, 6), (400, 6), (500, 18), (600, 4),
          (700, 4), (750, 4), (800, 4), (900, 4)]

#: task mixes: kind -> weight. Kinds: "none" (no GPU), "share", 1, 2, 4, 8 whole GPUs
MIXES = {
    "default": {"none": 14, "share": 46, 1: 30, 2: 5, 4: 3, 8: 2},
    "share": {"none": 14, "share": 76, 1: 8, 2: 1, 4: 0.6, 8: 0.4},
}

#: the share of GPU tasks that name a GPU model
MODEL_CONSTRAINED = 0.2


@dataclass(frozen=True)
class Task:
    gpu_milli: int  # per GPU: < 1000 a share of one GPU, 1000 whole GPUs
    gpus: int  # 0: no GPU
    cpu: int  # millicores
    mem_gib: int
    model: str  # "" any

    def kind(self) -> tuple[int, int, int, int]:
        """What FGD's target workload counts (§4): GPU demand, CPU and memory."""
        return self.gpu_milli, self.gpus, self.cpu, self.mem_gib


@dataclass(frozen=True)
class NodeSpec:
    model: str
    card_gib: int
    gpus: int
    cpu: int  # millicores
    mem_gib: int


def make_cluster(n: int, rng: random.Random) -> list[NodeSpec]:
    rows = rng.choices(NODE_TYPES, [t[5] for t in NODE_TYPES], k=n)
    return [NodeSpec(m, g, k, c * 1000, mem) for m, g, k, c, mem, _ in rows]


def make_trace(cluster: list[NodeSpec], mix: str, rng: random.Random, load: float = 1.3) -> list[Task]:
    """Tasks in arrival order until the GPUs they ask reach ``load`` of the cluster's."""
    total = sum(n.gpus for n in cluster) * MILLI
    models = sorted({n.model for n in cluster if n.gpus})
    kinds = list(MIXES[mix])
    weights = [MIXES[mix][k] for k in kinds]
    tasks: list[Task] = []
    asked = 0
    while asked < load * total:
        kind = rng.choices(kinds, weights)[0]
        model = rng.choice(models) if kind != "none" and rng.random() < MODEL_CONSTRAINED else ""
        if kind == "none":
            t = Task(0, 0, rng.choice([2, 4, 8, 16, 32]) * 1000, rng.choice([8, 16, 32, 64, 128]), "")
        elif kind == "share":
            milli = rng.choices([s for s, _ in SHARES], [w for _, w in SHARES])[0]
            t = Task(milli, 1, rng.choice([1, 2, 4, 6, 8, 12]) * 1000, rng.choice([4, 8, 16, 32, 48]), model)
        else:
            k = int(kind)
            t = Task(MILLI, k, k * rng.choice([4, 8, 12, 16]) * 1000, k * rng.choice([16, 32, 64, 92]), model)
        tasks.append(t)
        asked += t.gpu_milli * t.gpus
    return tasks


# ---- the reference cluster and schedulers (this file's own, after the paper) -------------------


class RefNode:
    __slots__ = ("spec", "cpu", "mem", "gpus", "tags")

    def __init__(self, spec: NodeSpec) -> None:
        self.spec, self.cpu, self.mem = spec, spec.cpu, spec.mem_gib
        self.gpus = [MILLI] * spec.gpus
        self.tags: dict[tuple[int, int], int] = {}  # GPU demand -> tasks here (Clustering)


def fits_node(n: RefNode, t: Task) -> bool:
    if n.cpu < t.cpu or n.mem < t.mem_gib:
        return False
    if t.gpus == 0:
        return True
    if t.model and t.model != n.spec.model:
        return False
    if t.gpu_milli < MILLI:
        return any(f >= t.gpu_milli for f in n.gpus)
    return sum(1 for f in n.gpus if f == MILLI) >= t.gpus


def choices(n: RefNode, t: Task) -> list[list[int]]:
    """GPU choices on a node: for a share, one GPU per distinct free amount that fits; for whole
    GPUs, the lowest-numbered free ones; [[]] for a task without GPUs."""
    if t.gpus == 0:
        return [[]]
    if t.gpu_milli < MILLI:
        seen: dict[int, int] = {}
        for gi, f in enumerate(n.gpus):
            if f >= t.gpu_milli and f not in seen:
                seen[f] = gi
        return [[gi] for gi in seen.values()]
    return [[gi for gi, f in enumerate(n.gpus) if f == MILLI][: t.gpus]]


def place(n: RefNode, t: Task, gpus: list[int]) -> None:
    n.cpu -= t.cpu
    n.mem -= t.mem_gib
    for gi in gpus:
        n.gpus[gi] -= t.gpu_milli
    if t.gpus:
        key = (t.gpu_milli, t.gpus)
        n.tags[key] = n.tags.get(key, 0) + 1


Choice = tuple[int, list[int]]


def random_fit(nodes: list[RefNode], t: Task, rng: random.Random) -> Choice | None:
    fit = [ni for ni, n in enumerate(nodes) if fits_node(n, t)]
    if not fit:
        return None
    ni = rng.choice(fit)
    return ni, rng.choice(choices(nodes[ni], t))


def _max_spec(nodes: list[RefNode]) -> tuple[int, int]:
    return max(n.spec.cpu for n in nodes), max(max(n.spec.gpus, 1) * MILLI for n in nodes)


def best_fit(nodes: list[RefNode], t: Task, rng: random.Random) -> Choice | None:
    """§6.1 Best-fit: the node left with the least free CPU and GPU (each over the largest
    node's, weighted 0.5 each); on it the GPU with the least left."""
    cpu_max, gpu_max = _max_spec(nodes)
    best = None
    for ni, n in enumerate(nodes):
        if not fits_node(n, t):
            continue
        left = 0.5 * (n.cpu - t.cpu) / cpu_max + 0.5 * (sum(n.gpus) - t.gpu_milli * t.gpus) / gpu_max
        for gpus in choices(n, t):
            key = (left, n.gpus[gpus[0]] if gpus else 0)
            if best is None or key < best[0]:
                best = (key, ni, gpus)
    return (best[1], best[2]) if best else None


def dot_prod(nodes: list[RefNode], t: Task, rng: random.Random) -> Choice | None:
    """§6.1 DotProd (Tetris): the smallest dot product of the node's free CPU and GPU (each over
    the node's own capacity) with the task's demand (over the same), per GPU choice."""
    best = None
    for ni, n in enumerate(nodes):
        if not fits_node(n, t):
            continue
        cpu_cap = n.spec.cpu or 1
        for gpus in choices(n, t):
            dp = (n.cpu / cpu_cap) * (t.cpu / cpu_cap)
            if gpus:
                free = sum(n.gpus[gi] for gi in gpus) / (MILLI * len(gpus))
                dp += free * (t.gpu_milli / MILLI)
            dp /= 2
            if best is None or dp < best[0]:
                best = (dp, ni, gpus)
    return (best[1], best[2]) if best else None


def gpu_packing(nodes: list[RefNode], t: Task, rng: random.Random) -> Choice | None:
    """§6.1 GPU Packing: a used GPU first (the one with the least left), then free GPUs of a
    used node, then a free node (the smallest)."""
    if t.gpus == 0:
        return random_fit(nodes, t, rng)
    best = None
    for ni, n in enumerate(nodes):
        if not fits_node(n, t):
            continue
        order = sorted(range(len(n.gpus)), key=lambda gi: (n.gpus[gi], gi))
        take = [gi for gi in order if n.gpus[gi] >= t.gpu_milli][: t.gpus]
        fresh = sum(1 for gi in take if n.gpus[gi] == MILLI)
        if all(f == MILLI for f in n.gpus):
            key = (2, len(n.gpus), 0)
        elif fresh:
            key = (1, fresh, 0)
        else:
            key = (0, sum(n.gpus[gi] for gi in take), 0)
        if best is None or key < best[0]:
            best = (key, ni, take)
    return (best[1], best[2]) if best else None


def gpu_clustering(nodes: list[RefNode], t: Task, rng: random.Random) -> Choice | None:
    """§6.1 GPU Clustering: a node that runs only tasks of the same GPU demand, then one that
    runs some, then an idle node, then any; among equals the one with the least GPU left."""
    if t.gpus == 0:
        return random_fit(nodes, t, rng)
    key_t = (t.gpu_milli, t.gpus)
    best = None
    for ni, n in enumerate(nodes):
        if not fits_node(n, t):
            continue
        tags = {k for k, v in n.tags.items() if v}
        rank = 0 if tags == {key_t} else 1 if key_t in tags else 2 if not tags else 3
        gpus = min(choices(n, t), key=lambda g: n.gpus[g[0]])
        key = (rank, sum(n.gpus))
        if best is None or key < best[0]:
            best = (key, ni, gpus)
    return (best[1], best[2]) if best else None


class FGD:
    """§3–§4: place where the node's expected fragmentation F_n(M) grows least (M: the trace's
    task kinds and their popularity)."""

    def __init__(self, tasks: list[Task]) -> None:
        counts: dict[tuple, int] = {}
        for t in tasks:
            counts[t.kind()] = counts.get(t.kind(), 0) + 1
        self.mix = [(k, c / len(tasks)) for k, c in counts.items()]

    def frag(self, n: RefNode, cpu: int, mem: int, gpus: list[int]) -> float:
        free = sum(gpus)
        if not free:
            return 0.0
        total = 0.0
        for (milli, k, tc, tm), p in self.mix:
            if k == 0:
                f = free if (cpu < tc or mem < tm) else 0  # §3.2: a task without GPUs
            elif cpu < tc or mem < tm:
                f = free
            elif milli < MILLI:
                f = sum(g for g in gpus if g < milli) if any(g >= milli for g in gpus) else free
            else:
                f = sum(g for g in gpus if g < MILLI) if sum(1 for g in gpus if g == MILLI) >= k else free
            total += p * f
        return total

    def __call__(self, nodes: list[RefNode], t: Task, rng: random.Random) -> Choice | None:
        best = None
        for ni, n in enumerate(nodes):
            if not fits_node(n, t):
                continue
            before = self.frag(n, n.cpu, n.mem, n.gpus)
            for gpus in choices(n, t):
                after = list(n.gpus)
                for gi in gpus:
                    after[gi] -= t.gpu_milli
                delta = self.frag(n, n.cpu - t.cpu, n.mem - t.mem_gib, after) - before
                if best is None or delta < best[0] - 1e-9:
                    best = (delta, ni, gpus)
        return (best[1], best[2]) if best else None


BASELINES = {"Random": lambda tasks: random_fit, "DotProd": lambda tasks: dot_prod,
             "Clustering": lambda tasks: gpu_clustering, "Packing": lambda tasks: gpu_packing,
             "Best-fit": lambda tasks: best_fit, "FGD": FGD}


@dataclass
class Ratio:
    """GPUs allocated (share of the cluster's) when the GPUs asked reached 100 % and at the end
    (130 %), and the scheduler's seconds for the whole trace."""

    at_100: float
    at_130: float
    seconds: float = 0.0
    #: the GPU tasks that failed
    failed: list[Task] = field(default_factory=list)
    #: where the unallocated GPU capacity is at the end (:func:`stranded`)
    left: dict[str, float] = field(default_factory=dict)


def _ratio(cluster: list[NodeSpec], tasks: list[Task], placed_after) -> Ratio:
    total = sum(n.gpus for n in cluster) * MILLI
    asked = placed = 0
    at_100 = None
    failed = []
    for t, ok in zip(tasks, placed_after, strict=True):
        asked += t.gpu_milli * t.gpus
        placed += ok * t.gpu_milli * t.gpus
        if t.gpus and not ok:
            failed.append(t)
        if at_100 is None and asked >= total:
            at_100 = placed / total
    return Ratio(at_100 if at_100 is not None else placed / total, placed / total, failed=failed)


#: :func:`stranded`'s classes of unallocated GPU capacity
LEFT = ("CPU/memory", "model", "shape")


def stranded(nodes: list[RefNode], failed: list[Task]) -> dict[str, float]:
    """Where the free GPU capacity is at the end, as a share of the cluster's GPUs, by why the
    GPU tasks that failed could not use it: ``CPU/memory``, on nodes where none of them has
    the CPU and host memory; ``model``, where some have but none of those may use the node's
    model; ``shape``, where one could run but the cards are too fragmented for it (a share
    larger than any card's free part, or more whole free cards than the node has)."""
    kinds = {(t.cpu, t.mem_gib, t.model) for t in failed}
    total = sum(n.spec.gpus for n in nodes) * MILLI
    out = dict.fromkeys(LEFT, 0.0)
    for n in nodes:
        free = sum(n.gpus)
        if not free:
            continue
        room = [(c, m, model) for c, m, model in kinds if c <= n.cpu and m <= n.mem]
        if not room:
            out["CPU/memory"] += free / total
        elif not any(not model or model == n.spec.model for _, _, model in room):
            out["model"] += free / total
        else:
            out["shape"] += free / total
    return out


def kube_least_allocated(nodes: list[RefNode], t: Task, rng: random.Random) -> Choice | None:
    """kube-scheduler's default for a pod without GPUs (NodeResourcesFit, LeastAllocated): the
    node with the most CPU and memory free, each over the node's own."""
    best = None
    for ni, n in enumerate(nodes):
        if n.cpu < t.cpu or n.mem < t.mem_gib:
            continue
        score = (n.cpu - t.cpu) / n.spec.cpu + (n.mem - t.mem_gib) / n.spec.mem_gib
        if best is None or score > best[0]:
            best = (score, ni)
    return (best[1], []) if best else None


def baseline_ratio(cluster: list[NodeSpec], tasks: list[Task], name: str, seed: int,
                   own_gpu_less: bool = False) -> Ratio:
    """A baseline's run; tasks without GPUs are placed as kube-scheduler places them (what the
    product's users get), or with ``own_gpu_less`` by the baseline itself (the paper's setup)."""
    import time

    t0 = time.process_time()
    rng = random.Random(seed)
    nodes = [RefNode(s) for s in cluster]
    policy = BASELINES[name](tasks)

    def run():
        for t in tasks:
            where = (kube_least_allocated if t.gpus == 0 and not own_gpu_less else policy)(nodes, t, rng)
            if where is not None:
                place(nodes[where[0]], t, where[1])
            yield where is not None

    r = _ratio(cluster, tasks, run())
    r.seconds = time.process_time() - t0
    r.left = stranded(nodes, r.failed)
    return r


# ---- the product on the same trace ----------------------------------------------------------


def product_pool(cluster: list[NodeSpec]) -> Pool:
    return Pool(tuple(
        Node(f"node-{ni:04d}",
             tuple(GPU(f"GPU-{ni:04d}-{gi}", s.model, s.card_gib * GIB, index=gi) for gi in range(s.gpus)),
             cpu_millicores=s.cpu, host_memory_mib=s.mem_gib * GIB)
        for ni, s in enumerate(cluster)))


def product_request(t: Task, i: int, owner: Owner, cluster: list[NodeSpec]) -> GPURequest:
    cards = {s.model: s.card_gib for s in cluster if s.gpus}
    if t.gpu_milli < MILLI:
        card = cards[t.model] if t.model else min(cards.values())
        return GPURequest(owner, memory_mib=t.gpu_milli * card * GIB // MILLI, cores_percent=t.gpu_milli // 10,
                          model=t.model or None, cpu_millicores=t.cpu, host_memory_mib=t.mem_gib * GIB,
                          request_id=f"t{i}", kind="kernel")
    return GPURequest(owner, memory_mib=max(cards.values()) * GIB, cores_percent=100, count=t.gpus, whole=True,
                      model=t.model or None, cpu_millicores=t.cpu, host_memory_mib=t.mem_gib * GIB,
                      request_id=f"t{i}", kind="kernel")


def kube_default_node(state: AdmissionState, t: Task, cluster: list[NodeSpec]) -> int | None:
    """:func:`kube_least_allocated` on the product's state (a pod the GPU admission never sees)."""
    ix = state.index
    best = None
    for ni, s in enumerate(cluster):
        fc, fm = ix.cpu_free[ni], ix.hmem_free[ni]
        if fc < t.cpu or fm < t.mem_gib * GIB:
            continue
        score = (fc - t.cpu) / s.cpu + (fm - t.mem_gib * GIB) / (s.mem_gib * GIB)
        if best is None or score > best[0]:
            best = (score, ni)
    return best[1] if best else None


def product_ratio(cluster: list[NodeSpec], tasks: list[Task], node_policy: str, gpu_policy: str) -> Ratio:
    import time

    state = AdmissionState(load_config({"placement": {"node": node_policy, "gpu": gpu_policy}}),
                           product_pool(cluster))
    owner = Owner("bench")
    decide_s = 0.0

    def run():
        nonlocal decide_s
        for i, t in enumerate(tasks):
            if t.gpus == 0:
                ni = kube_default_node(state, t, cluster)
                if ni is not None:
                    with state.mix_kept():  # not a GPU request: fgd's mix never sees it
                        state.add(Allocation(f"t{i}", owner, f"node-{ni:04d}", (), 0, 0, "default",
                                             kind="pod", cpu_millicores=t.cpu, host_memory_mib=t.mem_gib * GIB))
                yield ni is not None
                continue
            t0 = time.process_time()
            d = state.decide(product_request(t, i, owner, cluster))
            decide_s += time.process_time() - t0
            if d.kind == "grant":
                state.apply(d)
            yield d.kind == "grant"

    r = _ratio(cluster, tasks, run())
    r.seconds = decide_s
    r.left = stranded(product_end_nodes(state, cluster), r.failed)
    return r


def product_end_nodes(state: AdmissionState, cluster: list[NodeSpec]) -> list[RefNode]:
    """The product's state as :class:`RefNode` rows: free CPU and memory, and each card's free
    part (the smaller of its free memory and its free compute)."""
    ix = state.index
    nodes = []
    for ni, s in enumerate(cluster):
        n = RefNode(s)
        n.cpu, n.mem = ix.cpu_free[ni], ix.hmem_free[ni] // GIB
        n.gpus = [min(MILLI * (ix.cap_m[gi] - ix.used_m[gi]) // ix.cap_m[gi],
                      MILLI * (ix.cap_c[gi] - ix.used_c[gi]) // ix.cap_c[gi]) for gi in ix.node_gpus[ni]]
        nodes.append(n)
    return nodes
