"""Property tests of the admission core: for random pools, quotas and request sequences, no
decision ever oversubscribes a card or a quota level, preemption never evicts an equal or
higher priority, wait/reject mean what they say, and the incremental indexes decide exactly as
a state built from scratch."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotas import (
    GPU,
    AdmissionConfig,
    AdmissionState,
    Allocation,
    Decision,
    GPURequest,
    Mode,
    Node,
    Owner,
    Pool,
    load_config,
)
from quotas.preemption import VictimSearch
from quotas.queue import AdmissionQueue

GIB = 1024
PROPERTY = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

CLASSES = {
    "high": {"value": 1000, "preempt": True},
    "urgent": {"value": 500, "preempt": True, "borrow": True},
    "default": {"value": 100},
    "low": {"value": 10, "borrow": True},
    "lowest": {"value": 1},
}
MODELS = [("H100-80GB", 80), ("A100-40GB", 40), ("L4-24GB", 24)]
USERS, NAMESPACES, WORKSPACES = ("u1", "u2", "u3"), ("n1", "n2"), ("w1", "w2")


# ---- strategies -------------------------------------------------------------------------------


@st.composite
def pools(draw) -> Pool:
    nodes = []
    for ni in range(draw(st.integers(1, 3))):
        gpus = []
        for gi in range(draw(st.integers(1, 4))):
            model, gib = draw(st.sampled_from(MODELS))
            gpus.append(GPU(
                uuid=f"n{ni}-g{gi}", model=model, memory_mib=gib * GIB, index=gi,
                memory_oversub=draw(st.sampled_from([1.0, 1.0, 1.5, 2.0, 0.75])),
                cores_oversub=draw(st.sampled_from([1.0, 1.0, 2.0, 1.3])),
                mode=draw(st.sampled_from([Mode.SHARED] * 8 + [Mode.WHOLE, Mode.MIG])),
            ))
        nodes.append(Node(
            f"n{ni}", tuple(gpus),
            cpu_millicores=draw(st.sampled_from([None, 2000, 8000, 16000, 64000])),
            host_memory_mib=draw(st.sampled_from([None, 8 * GIB, 32 * GIB, 256 * GIB])),
            cpu_requested_millicores=draw(st.sampled_from([0, 0, 1000])),
            host_memory_requested_mib=draw(st.sampled_from([0, 0, 4 * GIB])),
        ))
    return Pool(tuple(nodes))


def limits():
    return st.one_of(st.none(), st.fixed_dictionaries({}, optional={
        "memory_mib": st.integers(4, 160).map(lambda g: g * GIB),
        "cores_percent": st.integers(20, 400),
        "gpus": st.integers(1, 6),
    }))


@st.composite
def configs(draw) -> AdmissionConfig:
    workspaces = {}
    for ws in WORKSPACES:
        namespaces = {}
        for ns in NAMESPACES:
            namespaces[ns] = {
                "limits": draw(limits()),
                "user_limits": draw(limits()),
                "users": {u: draw(limits()) for u in draw(st.sets(st.sampled_from(USERS)))},
            }
        workspaces[ws] = {"limits": draw(limits()), "namespaces": namespaces}
    placement = {"node": draw(st.sampled_from(["binpack", "spread", "fgd"])),
                 "gpu": draw(st.sampled_from(["binpack", "spread", "fgd"]))}
    return load_config({"priority_classes": CLASSES, "workspaces": workspaces,
                        "placement": placement})


SMALL = [1, 2, 4, 5, 8, 10, 10, 16, 20]
LARGE = [10, 20, 30, 40, 60]


@st.composite
def requests(draw, i: int, classes=(*CLASSES, None), sizes=(*SMALL, *LARGE)) -> GPURequest:
    return GPURequest(
        owner=Owner(draw(st.sampled_from(USERS)), draw(st.sampled_from(NAMESPACES)),
                    draw(st.sampled_from(WORKSPACES))),
        memory_mib=draw(st.sampled_from(sizes)) * GIB,
        cores_percent=draw(st.sampled_from([5, 10, 20, 25, 40, 50, 75, 100])),
        count=draw(st.sampled_from([1, 1, 1, 1, 2, 3])),
        model=draw(st.sampled_from([None] * 6 + ["H100-80GB", "a100-40gb"])),
        priority_class=draw(st.sampled_from(classes)),
        whole=draw(st.integers(0, 11)) == 0,
        request_id=f"r{i}",
        kind="kernel",
        cpu_millicores=draw(st.sampled_from([0, 0, 500, 2000, 4000, 12000])),
        host_memory_mib=draw(st.sampled_from([0, 0, 2 * GIB, 8 * GIB, 24 * GIB])),
    )


@st.composite
def scenarios(draw, max_ops: int = 14, busy: bool = False):
    """A config, a pool and ops. ``busy``: first fill the pool with small low-priority slices,
    then mix in bigger high-priority requests (so preemption with several victims happens)."""
    ops = []
    n = draw(st.integers(1, max_ops))
    for i in range(n):
        if draw(st.integers(0, 5)) == 0:
            ops.append(("remove", draw(st.integers(0, 1000))))
        elif busy and i < n // 2:
            ops.append(("request", draw(requests(i, ("low", "lowest", "default"), SMALL))))
        elif busy:
            ops.append(("request", draw(requests(i, ("high", "urgent", "default", "low"), LARGE))))
        else:
            ops.append(("request", draw(requests(i))))
    return draw(configs()), draw(pools()), ops


# ---- independent checks (they do not use the state's indexes) --------------------------------


def value_of(cfg: AdmissionConfig, name: str | None) -> int:
    return cfg.priority_classes[name or cfg.default_priority_class].value


def charge(pool: Pool, a: Allocation) -> tuple[int, int, int]:
    n = len(a.gpu_uuids)
    if a.whole:
        return sum(pool.gpu(u).memory_mib for u in a.gpu_uuids), 100 * n, n
    return a.memory_mib * n, a.cores_percent * n, n


def assert_pool_holds(pool: Pool, allocations: list[Allocation]) -> None:
    memory: dict[str, float] = defaultdict(float)
    cores: dict[str, float] = defaultdict(float)
    holders: dict[str, list[Allocation]] = defaultdict(list)
    for a in allocations:
        assert len(set(a.gpu_uuids)) == len(a.gpu_uuids) >= 1
        assert {pool.node_of(u).name for u in a.gpu_uuids} == {a.node}, "one node per allocation"
        for u in a.gpu_uuids:
            gpu = pool.gpu(u)
            holders[u].append(a)
            if a.whole:
                assert gpu.mode in (Mode.SHARED, Mode.WHOLE), "whole card on a MIG card"
            else:
                assert gpu.mode == Mode.SHARED, f"slice on a {gpu.mode} card"
                memory[u] += a.memory_mib
                cores[u] += a.cores_percent
    for node in pool.nodes:  # node CPU and host memory (None: unknown, never refused)
        mine = [a for a in allocations if a.node == node.name]
        if node.cpu_millicores is not None:
            assert sum(a.cpu_millicores for a in mine) <= (
                node.cpu_millicores - node.cpu_requested_millicores), f"{node.name} CPU"
        if node.host_memory_mib is not None:
            assert sum(a.host_memory_mib for a in mine) <= (
                node.host_memory_mib - node.host_memory_requested_mib), f"{node.name} memory"
    for u, held in holders.items():
        gpu = pool.gpu(u)
        if any(a.whole for a in held):
            assert len(held) == 1, f"{u} is held whole and shared"
        assert memory[u] <= gpu.memory_mib * gpu.memory_oversub + 1e-6, f"{u} memory"
        assert cores[u] <= 100 * gpu.cores_oversub + 1e-6, f"{u} cores"


def assert_quotas_hold(cfg: AdmissionConfig, pool: Pool, allocations: list[Allocation]) -> None:
    """Non-borrowed usage of every level stays within its limits."""
    used: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    for a in allocations:
        if a.borrowed:
            continue
        o = a.owner
        for key in ((o.workspace,), (o.workspace, o.namespace),
                    (o.workspace, o.namespace, o.user)):
            for r, amount in enumerate(charge(pool, a)):
                used[key][r] += amount
    for key, amounts in used.items():
        limits = cfg.quotas.limits_of(key)
        for r, res in enumerate(("memory_mib", "cores_percent", "gpus")):
            limit = limits.get(res)
            assert limit is None or amounts[r] <= limit, f"{key} {res} {amounts[r]} > {limit}"


def assert_victims_allowed(cfg: AdmissionConfig, request: GPURequest, d: Decision) -> None:
    pc = cfg.priority_classes[request.priority_class or cfg.default_priority_class]
    assert not d.allocation.borrowed, "a preempting grant is never a borrowing one"
    for v in d.victims:
        if not v.borrowed:
            assert pc.preempt, "only a preempting class evicts non-borrowed allocations"
            assert value_of(cfg, v.priority_class) < pc.value, "evicted equal or higher priority"


@dataclass
class Run:
    cfg: AdmissionConfig
    pool: Pool
    state: AdmissionState


def play(cfg, pool, ops, on_decision=None) -> Run:
    """Drive a state through the ops, applying every decision, checking invariants each step."""
    state = AdmissionState(cfg, pool)
    for kind, op in ops:
        if kind == "remove":
            if state.allocations:
                ids = sorted(state.allocations)
                assert state.remove(ids[op % len(ids)]) is not None
            continue
        before = dict(state.allocations)
        d = state.decide(op, now=float(len(before)))
        assert dict(state.allocations) == before, "decide() changed the state"
        assert d.kind in ("grant", "preempt", "wait", "reject")
        if d.granted:
            assert d.allocation.id == op.request_id
            assert d.allocation.owner == op.owner and len(d.allocation.gpu_uuids) == op.count
            assert all(v.id in before for v in d.victims)
            if d.allocation.borrowed:
                assert cfg.priority_classes[d.allocation.priority_class].borrow
        else:
            assert d.reason and d.error is not None and d.allocation is None
        if d.kind == "preempt":
            assert d.victims
            assert_victims_allowed(cfg, op, d)
        if on_decision:
            on_decision(state, op, d)
        state.apply(d)
        allocations = list(state.allocations.values())
        assert_pool_holds(pool, allocations)
        assert_quotas_hold(cfg, pool, allocations)
    return Run(cfg, pool, state)


# ---- the properties ---------------------------------------------------------------------------


@PROPERTY
@given(scenarios())
def test_no_decision_sequence_oversubscribes_a_card_or_a_quota_level(scenario):
    play(*scenario)


@PROPERTY
@given(scenarios())
def test_wait_means_it_fits_once_others_stop_and_reject_means_it_never_fits(scenario):
    cfg, pool, ops = scenario

    def check(state, request, d):
        empty = AdmissionState(cfg, pool).decide(request)
        if d.kind == "wait":
            assert empty.kind == "grant", f"waits but would not fit an empty pool: {empty.reason}"
        if d.kind == "reject":
            assert empty.kind == "reject", "rejected although it fits an empty pool"

    play(cfg, pool, ops, check)


def without(state: AdmissionState, cfg, pool, ids) -> AdmissionState:
    return AdmissionState(cfg, pool, [a for a in state.allocations.values() if a.id not in ids])


@PROPERTY
@given(scenarios(max_ops=20, busy=True))
def test_preemption_takes_a_minimal_set_one_victim_when_one_suffices_and_waits_only_without_one(
    scenario,
):
    cfg, pool, ops = scenario

    def fits_plainly(d: Decision) -> bool:
        return d.kind == "grant" and not d.allocation.borrowed

    def eligible(request, a: Allocation) -> bool:
        pc = cfg.priority_classes[request.priority_class or cfg.default_priority_class]
        return a.borrowed or (pc.preempt and value_of(cfg, a.priority_class) < pc.value)

    def check(state, request, d):
        if d.kind == "wait":
            # it waits only if even evicting everything it may evict would not make room
            allowed = {a.id for a in state.allocations.values() if eligible(request, a)}
            if allowed:
                assert not fits_plainly(without(state, cfg, pool, allowed).decide(request))
        if d.kind != "preempt":
            return
        victims = {v.id for v in d.victims}
        # the victims make it fit, and none of them is superfluous
        assert fits_plainly(without(state, cfg, pool, victims).decide(request))
        for v in victims:
            assert not fits_plainly(without(state, cfg, pool, victims - {v}).decide(request))
        if len(victims) > 1:
            for a in state.allocations.values():
                if eligible(request, a):
                    d1 = without(state, cfg, pool, {a.id}).decide(request)
                    assert not fits_plainly(d1), f"{a.id} alone would have been enough"

    play(cfg, pool, ops, check)


def index_snapshot(state: AdmissionState) -> dict:
    """Every incrementally kept summary of the card index (white box, on purpose)."""
    ix = state._index
    names = ("cpu_free", "hmem_free", "used_m", "used_c", "nalloc", "on", "free_sum", "order",
             "max_m", "max_c", "empty", "worder", "em", "ec", "en", "pmax_m", "pmax_c", "pempty", "elig", "em1", "ec1",
             "p1max_m", "p1max_c", "pempty1")
    snap = {name: getattr(ix, name) for name in names}
    snap["node_allocs"] = [sorted(d) for d in ix.node_allocs]
    snap["victim_order"] = state._order
    snap["level_order"] = {k: v for k, v in state._level_order.items() if v}
    snap["group_order"] = {k: v for k, v in state._group_order.items() if v}
    return snap


@PROPERTY
@given(scenarios(busy=True))
def test_the_incremental_indexes_decide_like_a_state_built_from_scratch(scenario):
    cfg, pool, ops = scenario

    def check(state, request, d):
        fresh = AdmissionState(cfg, pool, state.allocations.values())
        # fgd weighs the recent requests, which include allocations gone since: same past
        fresh._index.mix = fresh._mix = state._mix
        again = fresh.decide(request, now=float(len(state.allocations)))
        assert (again.kind, again.allocation, again.victims, again.reason) == (
            d.kind, d.allocation, d.victims, d.reason)
        assert type(again.error) is type(d.error)
        assert index_snapshot(fresh) == index_snapshot(state)
        assert fresh.usage() == state.usage()

    play(cfg, pool, ops, check)


@PROPERTY
@given(scenarios(max_ops=20, busy=True))
def test_the_indexed_single_victim_search_agrees_with_the_ordered_walk(scenario):
    cfg, pool, ops = scenario

    def check(state, request, d):
        saved = VictimSearch.scan_budget
        try:
            VictimSearch.scan_budget = 0  # straight to the card index
            indexed = state.decide(request, now=float(len(state.allocations)))
        finally:
            VictimSearch.scan_budget = saved
        assert (indexed.kind, indexed.allocation, indexed.victims) == (
            d.kind, d.allocation, d.victims)

    play(cfg, pool, ops, check)


# ---- the queue: an overdue head is granted within a bounded number of departures -------------


@st.composite
def queue_scenarios(draw):
    """A pool filled with small slices, a big head request, then arrivals of small requests
    (same class, behind the head), departures of any live allocation, and clock ticks."""
    cfg = load_config({"priority_classes": CLASSES,
                       "placement": {"node": draw(st.sampled_from(["binpack", "spread", "fgd"])),
                                     "gpu": draw(st.sampled_from(["binpack", "spread", "fgd"]))}})
    pool = draw(pools())
    fill = [draw(requests(i, ("default",), SMALL)) for i in range(draw(st.integers(2, 12)))]
    head = draw(requests(999, ("default",), LARGE))
    ops = []
    for i in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["arrive", "arrive", "depart", "depart", "tick"]))
        if kind == "arrive":
            ops.append(("arrive", draw(requests(100 + i, ("default",), SMALL))))
        elif kind == "depart":
            ops.append(("depart", draw(st.integers(0, 1000))))
        else:
            ops.append(("tick", draw(st.sampled_from([1.0, 30.0, 120.0]))))
    return cfg, pool, fill, head, ops, draw(st.sampled_from([0.0, 60.0]))


@PROPERTY
@given(queue_scenarios())
def test_an_overdue_head_is_granted_once_the_allocations_in_its_way_have_left(scenario):
    cfg, pool, fill, head, ops, bound = scenario
    state = AdmissionState(cfg, pool)
    for r in fill:
        d = state.decide(r)
        if d.kind == "grant":
            state.apply(d)
    queue = AdmissionQueue(reserve_after_seconds=bound)
    if state.decide(head).kind != "wait":
        return  # the head must wait to begin with
    waiting = queue.push(head, 100, 0.0)
    departed: set[str] = set()
    granted = False

    def pump(now: float) -> None:
        nonlocal granted
        was_waiting_for_capacity = waiting in queue
        reservation = waiting.reservation
        steps = queue.pump(state, now)
        assert_pool_holds(pool, list(state.allocations.values()))
        for step in steps:
            if step.waiting is waiting and step.decision.granted:
                granted = True
        if was_waiting_for_capacity and reservation is not None and reservation.blockers <= departed:
            assert granted, "every allocation in its way has left, yet the head still waits"

    drive_queue(state, waiting, ops, lambda op, now: queue.push(op, 100, now), pump, lambda: granted,
                departed)


def drive_queue(state: AdmissionState, waiting, ops, arrive, pump, granted, departed: set[str]) -> None:
    """Play a queue scenario's ops — ``arrive(request, now)``, the departure of any live
    allocation (added to ``departed``), clock ticks — with ``pump(now)`` after each, until
    ``granted()``; then check the bound is real: with everything that stood in the head's
    reservation's way gone, the next pump grants it."""
    now = 0.0
    pump(now)
    for kind, op in ops:
        if granted():
            break
        if kind == "arrive":
            arrive(op, now)
        elif kind == "depart":
            live = sorted(state.allocations)
            if live:
                departed.add(live[op % len(live)])
                state.remove(live[op % len(live)])
        else:
            now += op
        pump(now)
    if not granted() and waiting.reservation is not None:
        for aid in sorted(waiting.reservation.blockers & set(state.allocations)):
            departed.add(aid)
            state.remove(aid)
        pump(now)
        assert granted()
