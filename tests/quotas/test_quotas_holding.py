"""The queue's rules for an overdue head: holding (nobody of its class or lower starts where it
could run) and moving (movable kernels' slices swapped out to make room for it)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from quotas import GPU, AdmissionState, ConfigError, Node, Pool, load_config
from quotas.moving import held_nodes
from quotas.queue import AdmissionQueue

from .builders import CLASSES, alloc, pool, req, state
from .test_quotas_properties import (
    NAMESPACES,
    PROPERTY,
    SMALL,
    WORKSPACES,
    assert_pool_holds,
    drive_queue,
    requests,
)

MOVABLE = {name: {**body, "movable": True} for name, body in CLASSES.items()}
WHOLE = dict(memory_gib=80, cores=100, whole=True)


def h100s(name: str, n: int) -> Node:
    return Node(name, tuple(GPU(f"{name}-gpu{i}", "H100-80GB", 80 * 1024, index=i) for i in range(n)))


def queue_for(st_: AdmissionState) -> AdmissionQueue:
    return AdmissionQueue.from_policy(st_.config.policy)


def kinds(steps) -> dict[str, str]:
    return {s.waiting.request.request_id: s.decision.kind for s in steps}


def test_with_hold_true_nothing_of_its_class_or_lower_starts_where_an_overdue_head_could_run():
    # node a: three H100s, each partly used; node b: one H100, where two whole cards never fit
    st_ = state(pool(h100s("a", 3), h100s("b", 1)), queue={"hold": True}, allocations=[
        alloc("x", "a-gpu0", 30), alloc("y", "a-gpu1", 30), alloc("w", "a-gpu2", 30), alloc("z", "b-gpu0", 10)])
    q = queue_for(st_)
    q.push(req(**WHOLE, count=2, rid="head"), 100, 0.0)
    q.push(req(memory_gib=20, rid="early"), 100, 1.0)
    assert kinds(q.pump(st_, 1.0)) == {"head": "wait", "early": "grant"}  # before the bound: backfill
    st_.remove("early")
    q.push(req(memory_gib=20, rid="same"), 100, 70.0)
    q.push(req(memory_gib=20, rid="lower", priority_class="low"), 10, 70.0)
    q.push(req(memory_gib=20, rid="higher", priority_class="high"), 1000, 70.0)
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 70.0)}
    assert {k: s.decision.kind for k, s in steps.items()} == {
        "higher": "grant", "head": "wait", "same": "grant", "lower": "grant"}
    # two of a's cards are reserved for the head; 'same' and 'lower' fit on the third, but all of a
    # is held: they started on b, where the head can never go
    assert {steps[k].decision.allocation.node for k in ("same", "lower")} == {"b"}
    assert held_nodes(st_, steps["head"].waiting.request) == {"a"}
    q.push(req(memory_gib=40, rid="late"), 100, 80.0)  # fits only on a-gpu2 now
    (late,) = [s for s in q.pump(st_, 80.0) if s.waiting.request.request_id == "late"]
    assert late.decision.kind == "wait" and late.waiting.position == 1
    assert "2 whole GPUs has waited 80 s" in late.decision.reason and "goes first" in late.decision.reason


@pytest.mark.parametrize("hold", [True, False])
def test_with_holding_off_later_requests_still_start_beside_the_reservation(hold):
    st_ = state(pool(h100s("a", 3)), allocations=[alloc("x", "a-gpu0", 30), alloc("y", "a-gpu1", 40)],
                queue={"hold": hold})
    q = queue_for(st_)
    head = q.push(req(**WHOLE, count=2, rid="head"), 100, 0.0)
    q.push(req(memory_gib=20, rid="late"), 100, 70.0)
    assert kinds(q.pump(st_, 70.0)) == {"head": "wait", "late": "grant" if not hold else "wait"}
    assert set(head.reservation.cards) == {"a-gpu0", "a-gpu2"}  # the fewest in the way
    if not hold:
        assert st_.allocations["late"].gpu_uuids == ("a-gpu1",)  # beside the reservation


@pytest.mark.parametrize("hold, moves, possible, held", [
    ("with-moves", {}, True, True), ("with-moves", {}, False, False), ("with-moves", None, True, False),
    (True, None, False, True), (False, {}, True, False),
])
def test_by_default_the_queue_holds_only_where_slices_can_be_moved_too(hold, moves, possible, held):
    """Holding without moving makes everyone wait (docs/admission.md): by default ('with-moves')
    the queue holds only where moves are on and the edge can move slices (not on Kubernetes)."""
    st_ = state(pool(h100s("a", 3)), priority_classes=MOVABLE, queue={"hold": hold, "moves": moves},
                allocations=[alloc("x", "a-gpu0", 30, kind="kernel"), alloc("y", "a-gpu1", 40, kind="kernel")])
    q = queue_for(st_)
    q.push(req(**WHOLE, count=2, rid="head"), 100, 0.0)
    q.push(req(memory_gib=20, rid="late"), 100, 70.0)
    assert kinds(q.pump(st_, 70.0, moves_possible=possible))["late"] == ("wait" if held else "grant")


def fragmented(**queue):
    """Two H100s with a movable kernel slice on each: 100 GiB free, no card free."""
    return state(pool(h100s("a", 2)), priority_classes=MOVABLE, queue=queue, allocations=[
        alloc("k1", "a-gpu0", 40, kind="kernel"), alloc("k2", "a-gpu1", 20, kind="kernel")])


def test_the_pump_moves_a_movable_kernel_for_an_overdue_head_and_grants_it_once_the_slice_left():
    st_ = fragmented()
    q = queue_for(st_)
    head = q.push(req(**WHOLE, rid="head"), 100, 0.0)
    (step,) = q.pump(st_, 10.0)
    assert step.decision.kind == "wait" and step.moves == ()  # not overdue yet: nothing moves
    (step,) = q.pump(st_, 60.0)
    assert step.decision.kind == "wait" and [mv.allocation.id for mv in step.moves] == ["k2"]
    assert step.moves[0].to.gpu_uuids == ("a-gpu0",) and "k2" in st_.allocations  # the caller moves it
    (again,) = q.pump(st_, 61.0)
    assert again.moves == ()  # under way: not proposed twice
    st_.remove("k2")  # swapped out
    (granted,) = q.pump(st_, 62.0)
    assert granted.waiting is head and granted.decision.granted
    assert st_.allocations["head"].gpu_uuids == ("a-gpu1",)


def test_a_moved_kernel_asking_back_is_not_held_but_keeps_off_the_reserved_cards():
    st_ = state(pool(h100s("a", 3)), priority_classes=MOVABLE, allocations=[
        alloc("x", "a-gpu0", 30, kind="kernel"), alloc("y", "a-gpu1", 40, kind="kernel"),
        alloc("z", "a-gpu2", 60, kind="kernel")])
    q = queue_for(st_)
    head = q.push(req(**WHOLE, rid="head"), 100, 0.0)
    q.push(req(memory_gib=20, rid="new"), 100, 70.0)
    back = q.push(req(memory_gib=20, rid="back"), 100, 70.0, moved=True)
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 70.0)}
    assert head.reservation.cards == ("a-gpu0",)  # the fewest and least in the way
    assert steps["new"].decision.kind == "wait" and "goes first" in steps["new"].decision.reason
    assert steps["back"].waiting is back and steps["back"].decision.granted
    assert st_.allocations["back"].gpu_uuids == ("a-gpu2",)  # held node, but not the reserved card


@pytest.mark.parametrize("why", ["notebook", "class", "edge", "off"])
def test_only_movable_kernels_move(why):
    st_ = fragmented(**({"moves": None} if why == "off" else {}))
    if why == "notebook":
        for aid in ("k1", "k2"):
            st_.add(dataclasses.replace(st_.allocations[aid], kind="notebook"))
    if why == "class":
        st_ = state(st_.pool, priority_classes=CLASSES, allocations=st_.allocations.values())
    q = queue_for(st_)
    q.push(req(**WHOLE, rid="head"), 100, 0.0)
    (step,) = q.pump(st_, 60.0, (lambda a: None) if why == "edge" else None)
    assert step.decision.kind == "wait" and step.moves == ()


def test_a_session_moves_at_most_once_in_the_interval_and_the_pool_at_most_per_hour():
    st_ = fragmented(moves={"same_session_after_seconds": 600, "per_hour": 2})
    q = queue_for(st_)

    def cycle(now: float, rid: str, session=lambda a: "s-" + a.id.split("#")[0]):
        head = q.push(req(**WHOLE, rid=rid), 100, now - 60)
        (step,) = [s for s in q.pump(st_, now, session) if s.waiting is head]
        moved = [mv.allocation.id for mv in step.moves]
        for aid in moved:  # swapped out, then resumed at once on the other card (a new allocation)
            a = st_.remove(aid)
            st_.add(dataclasses.replace(a, id=aid.split("#")[0] + f"#{now:.0f}", gpu_uuids=step.moves[0].to.gpu_uuids))
        q.discard(head)
        for other in [a for a in st_.allocations.values() if a.whole]:
            st_.remove(other.id)
        return moved

    assert cycle(100.0, "h1") == ["k2"]
    # k2's session moved 60 s ago: now only k1's may move (k2 went beside it, on a-gpu0)
    st_.add(alloc("k3", "a-gpu1", 10, kind="kernel"))
    assert cycle(160.0, "h2") == ["k3"]
    st_.add(alloc("k4", "a-gpu1", 10, kind="kernel"))
    assert cycle(220.0, "h3") == []  # two moved in this hour already
    assert cycle(3800.0, "h4") == ["k4"]  # the hour has passed


def test_the_queue_config_says_what_is_wrong():
    assert load_config({}).policy.priority_classes["default"].movable
    assert not load_config({"priority_classes": {"default": {"value": 1}}}).policy.priority_classes[
        "default"].movable
    policy = load_config({"queue": {"hold": False, "moves": {"max_slices": 2, "per_hour": 5,
                                                             "same_session_after_seconds": 60}}}).policy
    assert not policy.hold_for_overdue_head and (policy.moves.max_slices, policy.moves.per_hour) == (2, 5)
    assert load_config({"queue": {"moves": None}}).policy.moves.max_slices == 0
    assert load_config({}).policy.hold_for_overdue_head is None  # 'with-moves'
    assert load_config({"queue": {"hold": "with-moves"}}).policy.hold_for_overdue_head is None
    for bad, message in [
        ({"hold": "yes"}, "queue.hold: must be true, false or 'with-moves', got 'yes'"),
        ({"moves": {"per_hour": -1}}, "queue.moves.per_hour: must be an integer >= 0, got -1"),
        ({"moves": {"slices": 1}}, "queue.moves.slices: unknown key; allowed keys: max_slices, per_hour"),
        ({"moves": {"same_session_after_seconds": "1h"}}, "must be a number of seconds >= 0, got '1h'"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_config({"queue": bad})
    with pytest.raises(ConfigError, match="priority_classes.x.movable: must be true or false"):
        load_config({"priority_classes": {"x": {"value": 1, "movable": 1}}})


# ---- properties ----------------------------------------------------------------------------


@st.composite
def holding_scenarios(draw):
    """Nodes of H100s with movable kernel slices scattered over the cards (fragmented: room in
    total, few cards free), a big head, then arrivals (its class or lower), departures and clock
    ticks; moves on or off."""
    unlimited = {ws: {"namespaces": {ns: {} for ns in NAMESPACES}} for ws in WORKSPACES} | {"default": {}}
    queue = {"moves": draw(st.sampled_from([{}, {}, None])), "hold": True,
             "reserve_after_seconds": draw(st.sampled_from([0, 60]))}
    cfg = load_config({"priority_classes": MOVABLE, "queue": queue, "workspaces": unlimited,
                       "placement": {"node": draw(st.sampled_from(["binpack", "spread", "fgd"])),
                                     "gpu": draw(st.sampled_from(["binpack", "spread", "fgd"]))}})
    nodes = [Node(f"n{ni}", tuple(GPU(f"n{ni}-g{gi}", "H100-80GB", 80 * 1024, index=gi)
                                  for gi in range(draw(st.integers(1, 4)))),
                  cpu_millicores=draw(st.sampled_from([None, 16000, 64000])))
             for ni in range(draw(st.integers(1, 3)))]
    fill = []
    for n in nodes:
        for gpu in n.gpus:
            used = 0
            for gib in draw(st.lists(st.sampled_from([4, 8, 10, 16, 20, 40]), min_size=1, max_size=4)):
                if used + gib <= 80:
                    fill.append(alloc(f"f{len(fill)}", gpu.uuid, gib, cores=gib, kind="kernel", node_name=n.name,
                                      pc=draw(st.sampled_from(["default", "low"])),
                                      cpu_millicores=draw(st.sampled_from([0, 1000]))))  # <= 16 CPUs a node
                    used += gib
    whole = draw(st.booleans())
    head = req(memory_gib=80 if whole else 60, cores=100 if whole else 60, whole=whole,
               count=draw(st.sampled_from([1, 1, 2])) if whole else 1, rid="head",
               cpu_millicores=draw(st.sampled_from([0, 2000, 8000])))
    ops = []
    for i in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["arrive", "arrive", "depart", "tick"]))
        if kind == "arrive":
            r = draw(requests(100 + i, ("default", "low", "lowest"), SMALL))
            ops.append(("arrive", dataclasses.replace(r, model=None)))
        elif kind == "depart":
            ops.append(("depart", draw(st.integers(0, 1000))))
        else:
            ops.append(("tick", draw(st.sampled_from([1.0, 30.0, 120.0]))))
    return cfg, Pool(tuple(nodes)), fill, head, ops


@PROPERTY
@given(holding_scenarios())
def test_holding_never_overfits_and_the_head_is_granted_within_its_blockers_departures_and_moves(scenario):
    cfg, pool_, fill, head, ops = scenario
    st_ = AdmissionState(cfg, pool_, fill)
    first = st_.decide(head).kind
    event(f"head first: {first}")
    if first != "wait":
        return
    q = AdmissionQueue.from_policy(cfg.policy)
    waiting = q.push(head, 100, 0.0)
    requests_of = {}
    gone, granted, moved_total = set(), False, 0

    def pump(now: float) -> None:
        nonlocal granted, moved_total
        overdue = waiting in q and waiting.reservation is not None
        held = held_nodes(st_, head) if overdue else set()
        reservation, after_moves = waiting.reservation, bool(waiting.moving) and not (
            set(waiting.moving) & set(st_.allocations))
        steps = q.pump(st_, now)
        assert_pool_holds(pool_, list(st_.allocations.values()))
        for step in steps:
            if not step.decision.granted:
                continue
            if step.waiting is waiting:
                granted = True
            elif overdue and not granted and not step.waiting.moved:  # behind the head: never where it could run
                assert step.decision.allocation.node not in held, "a later request took held capacity"
            if overdue and reservation is not None and not granted:  # nobody behind it takes its cards
                assert not set(step.decision.allocation.gpu_uuids) & set(reservation.cards) or (
                    step.waiting is waiting)
        if overdue and after_moves:
            assert granted, "the moves were carried out, yet the head still waits"
        if overdue and reservation is not None and reservation.blockers <= gone:
            assert granted, "everything in its way left or moved, yet the head still waits"
        for step in steps:
            for mv in step.moves:  # carried out: swapped out now, asks again at once (not held)
                assert mv.allocation.kind == "kernel" and not mv.allocation.whole
                gone.add(mv.allocation.id)
                st_.remove(mv.allocation.id)
                q.push(requests_of.get(mv.allocation.id) or dataclasses.replace(
                    head, request_id=mv.allocation.id + "'", memory_mib=mv.allocation.memory_mib,
                    cores_percent=mv.allocation.cores_percent, count=1, whole=False, model=None,
                    cpu_millicores=mv.allocation.cpu_millicores,
                    host_memory_mib=mv.allocation.host_memory_mib), 100, now, moved=True)
                moved_total += 1
        assert_pool_holds(pool_, list(st_.allocations.values()))

    def arrive(op, now: float) -> None:
        requests_of[op.request_id] = op
        q.push(op, 100 if op.priority_class == "default" else 10, now)

    drive_queue(st_, waiting, ops, arrive, pump, lambda: granted, gone)
    event("granted" if granted else "still waiting")
    event("moved" if moved_total else "no move")


def test_the_held_reason_names_the_heads_size_as_the_refusals_do():
    """'A request for 1.5 GiB has waited ...', not '1 GiB' (the size by quotas.messages.mib)."""
    st_ = state(pool(h100s("a", 2)), queue={"hold": True},
                allocations=[alloc("x", "a-gpu0", 79), alloc("y", "a-gpu1", 79)])
    q = queue_for(st_)
    q.push(req(memory_gib=1.5, rid="head"), 100, 0.0)
    q.push(req(memory_gib=0.5, rid="late"), 100, 80.0)  # fits in the 1 GiB the head leaves, but a is held
    (late,) = [s for s in q.pump(st_, 80.0) if s.waiting.request.request_id == "late"]
    assert late.decision.kind == "wait"
    assert "A request for 1.5 GiB has waited 80 s" in late.decision.reason, late.decision.reason
