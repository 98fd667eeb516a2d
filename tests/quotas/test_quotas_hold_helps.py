"""Properties of the queue's rules for overdue heads with the hub's defaults (issue 25):

- holding helps or holds nothing: a request behind an overdue head is only kept waiting by
  holding when the place it would have taken is capacity a blocker of the head would free (a
  movable slice in the head's way there), never on cards or node CPU no move could clear;
- one slice is offered to one head: two overdue heads (one per priority class) are never both
  told to move the same slice, in one pass or while an earlier move is under way.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from quotas import GPU, AdmissionState, Allocation, GPURequest, Node, Pool, load_config
from quotas.queue import AdmissionQueue

from .builders import GIB, alloc, req
from .test_quotas_properties import PROPERTY

#: the hub's defaults: priority classes high (not movable), default and low (movable); queue
#: hold 'with-moves', moves on, reservation after 20 s (quotas.policy.RESERVE_AFTER_SECONDS)
DEFAULT = load_config({})
NO_HOLD = load_config({"queue": {"hold": False}})
#: a session may move again at once (``same_session_after_seconds`` 0 is a valid setting)
AGAIN = load_config({"queue": {"moves": {"same_session_after_seconds": 0}}})
#: the same without holding (only the offer rule then stops a second head being offered the slice)
AGAIN_NO_HOLD = load_config({"queue": {"hold": False, "moves": {"same_session_after_seconds": 0}}})
VALUE = {"high": 1000, "default": 100, "low": 10}


def movable(a: Allocation) -> bool:
    """The default policy's movable slices (independent of quotas.moving)."""
    return a.kind == "kernel" and not a.whole and len(a.gpu_uuids) == 1 and a.priority_class in (
        "default", "low")


@st.composite
def filled_pools(draw, max_nodes: int = 3, kinds=("notebook", "notebook", "kernel"), min_per_card: int = 0):
    """Nodes of H100s (some with little CPU) whose cards hold notebook servers (never moved)
    and kernels of every class, some cards empty."""
    nodes, fill = [], []
    for ni in range(draw(st.integers(1, max_nodes))):
        n = Node(f"n{ni}", tuple(GPU(f"n{ni}-g{gi}", "H100-80GB", 80 * GIB, index=gi)
                                 for gi in range(draw(st.integers(1, 4)))),
                 cpu_millicores=draw(st.sampled_from([None, 8000, 64000])))
        nodes.append(n)
        for gpu in n.gpus:
            used = 0
            for gib in draw(st.lists(st.sampled_from([4, 8, 10, 16, 20, 40]), min_size=min_per_card, max_size=4)):
                if used + gib > 80:
                    continue
                fill.append(alloc(
                    f"f{len(fill)}", gpu.uuid, gib, cores=gib, node_name=n.name,
                    kind=draw(st.sampled_from(kinds)),
                    pc=draw(st.sampled_from(["default", "default", "low", "high"])),
                    cpu_millicores=draw(st.sampled_from([0, 1000, 2000]))))
                used += gib
    return Pool(tuple(nodes)), fill


@st.composite
def heads(draw, rid: str, pc: str = "default") -> GPURequest:
    whole = draw(st.booleans())
    return req(memory_gib=80 if whole else draw(st.sampled_from([50, 60])),
               cores=100 if whole else 60, whole=whole, priority_class=pc, kind="kernel",
               count=draw(st.sampled_from([1, 1, 2])) if whole else 1, rid=rid,
               cpu_millicores=draw(st.sampled_from([0, 0, 2000, 6000])))


@st.composite
def later(draw, rid: str) -> GPURequest:
    return req(memory_gib=draw(st.sampled_from([2, 4, 8, 10, 16, 30])), cores=draw(st.sampled_from([5, 10, 25])),
               priority_class=draw(st.sampled_from(["default", "low"])), rid=rid,
               kind=draw(st.sampled_from(["notebook", "kernel"])),
               cpu_millicores=draw(st.sampled_from([0, 0, 1000, 4000])))


def frees_for(pool: Pool, fill: list[Allocation], head: GPURequest, got: Allocation) -> bool:
    """Is ``got`` (where a later request would have started without holding) capacity a blocker
    of ``head`` would free? Its node takes the head once the movable slices there are gone, and
    ``got`` takes room the head would need there: a card whose movable slices would clear it for
    the head, or node CPU the head would lack."""
    node = pool.node(got.node)
    staying = [a for a in fill if a.node == node.name and not movable(a)]
    alone = AdmissionState(DEFAULT, Pool((node,)), staying)
    if not alone.decide(head).granted:
        return False  # no move could make room for it there: nothing to hold
    for uuid in got.gpu_uuids:
        card = pool.gpu(uuid)
        fixed = [a for a in staying if uuid in a.gpu_uuids]
        if head.whole:
            if not fixed:
                return True  # a card moves would empty for it
            continue
        free_m = card.memory_mib - sum(a.memory_mib for a in fixed)
        free_c = 100 - sum(a.cores_percent for a in fixed)
        if free_m >= head.memory_mib and free_c >= head.cores_percent and (
                free_m - got.memory_mib < head.memory_mib or free_c - got.cores_percent < head.cores_percent):
            return True  # moves would give the head this card, and it would no longer fit
    if node.cpu_millicores is not None:
        cpu_free = node.cpu_millicores - sum(a.cpu_millicores for a in staying)
        if cpu_free - got.cpu_millicores < head.cpu_millicores:
            return True
    return False


@PROPERTY
@given(filled_pools(), heads("head"), st.lists(later("r"), min_size=1, max_size=4))
def test_holding_never_delays_a_request_no_held_capacity_could_serve(scenario, head, behind):
    pool_, fill = scenario
    if AdmissionState(DEFAULT, pool_, fill).decide(head).kind != "wait":
        return
    behind = [dataclasses.replace(r, request_id=f"r{i}") for i, r in enumerate(behind)]
    # each later request alone behind the head, so that what one took does not decide another's
    for r in behind:
        held, free = [], []
        for cfg, out in ((DEFAULT, held), (NO_HOLD, free)):
            st_ = AdmissionState(cfg, pool_, fill)
            q = AdmissionQueue.from_policy(cfg.policy)
            q.push(head, 100, 0.0)
            q.push(r, VALUE[r.priority_class], 70.0)
            out.extend(s.decision for s in q.pump(st_, 70.0) if s.waiting.request is r)
        if held[0].granted or not free[0].granted:
            event("not delayed by holding")
            continue
        event("delayed by holding")
        assert "goes first" in held[0].reason
        assert frees_for(pool_, fill, head, free[0].allocation), (
            f"{r.request_id} waits for the head on {free[0].allocation.gpu_uuids}, capacity no "
            f"move would free for it")


@PROPERTY
@given(filled_pools(max_nodes=4, kinds=("notebook", "kernel", "kernel"), min_per_card=1),
       heads("first", "default"), heads("second", "low"),
       st.lists(st.sampled_from([5.0, 30.0, 130.0]), min_size=1, max_size=4),
       st.sampled_from([DEFAULT, AGAIN, AGAIN_NO_HOLD]))
def test_one_slice_is_never_offered_to_two_heads(scenario, first, second, ticks, cfg):
    pool_, fill = scenario
    st_ = AdmissionState(cfg, pool_, fill)
    if st_.decide(first).kind != "wait" or st_.decide(second).kind != "wait":
        event("a head fits at once")
        return
    q = AdmissionQueue.from_policy(cfg.policy)
    q.push(first, 100, 0.0)
    q.push(second, 10, 0.0)
    now, offered = 70.0, {}
    for tick in [0.0, *ticks]:
        now += tick
        under_way = {aid for w in q.ordered() for aid in w.moving if aid in st_.allocations}
        steps = q.pump(st_, now)
        seen: set[str] = set()
        for step in steps:
            ids = {mv.allocation.id for mv in step.moves}
            assert not ids & seen, f"{ids & seen} offered to two heads in one pass"
            assert not ids & under_way, f"{ids & under_way} offered while its move is under way"
            seen |= ids
            offered.update(dict.fromkeys(ids, step.waiting.request.request_id))
        # the first head's moves are carried out: its slices leave; the second head's are not yet
        for step in steps:
            if step.waiting.request is first:
                for mv in step.moves:
                    st_.remove(mv.allocation.id)
    event(f"{len(set(offered.values()))} heads offered moves")


@pytest.mark.parametrize("cfg", [DEFAULT, AGAIN, AGAIN_NO_HOLD], ids=["default", "same-session-0", "no-hold"])
def test_two_heads_are_not_offered_the_same_slice(cfg):
    """a-g0 has the fewest in the way of a whole card (one notebook server, most free): the first
    head reserves it; the kernel on a-g1 is the only slice that can move (to a-g2). The second
    head (another class) reserves a-g1 and must not be told to move that kernel too."""
    pool_ = Pool((Node("a", tuple(GPU(f"a-g{i}", "H100-80GB", 80 * GIB, index=i) for i in range(3))),))
    st_ = AdmissionState(cfg, pool_, [
        alloc("nb0", "a-g0", 10, node_name="a"), alloc("k", "a-g1", 10, kind="kernel", node_name="a"),
        alloc("nb2", "a-g2", 20, node_name="a")])
    q = AdmissionQueue.from_policy(cfg.policy)
    first = q.push(req(memory_gib=80, cores=100, whole=True, rid="first"), 100, 0.0)
    second = q.push(req(memory_gib=80, cores=100, whole=True, rid="second", priority_class="low"), 10, 0.0)
    moves = [(s.waiting.request.request_id, mv.allocation.id) for s in q.pump(st_, 70.0) for mv in s.moves]
    assert (first.reservation.cards, second.reservation.cards) == (("a-g0",), ("a-g1",))
    assert moves == [("first", "k")]


def test_no_node_is_held_where_only_notebook_servers_stand_in_the_way():
    """Notebook servers never move: holding their node would keep every later request waiting
    for nothing (the issue: p95 wait 0 s -> 46 min)."""
    pool_ = Pool((Node("a", tuple(GPU(f"a-g{i}", "H100-80GB", 80 * GIB, index=i) for i in range(2))),))
    fill = [alloc("nb0", "a-g0", 40, node_name="a"), alloc("nb1", "a-g1", 20, node_name="a")]
    st_ = AdmissionState(DEFAULT, pool_, fill)
    q = AdmissionQueue.from_policy(DEFAULT.policy)
    head = q.push(req(memory_gib=80, cores=100, whole=True, rid="head"), 100, 0.0)
    q.push(req(memory_gib=10, rid="small"), 100, 70.0)
    steps = {s.waiting.request.request_id: s.decision for s in q.pump(st_, 70.0)}
    assert head.reservation is not None and head.reservation.cards == ("a-g1",)
    assert steps["small"].granted and steps["small"].allocation.gpu_uuids == ("a-g0",)


def test_a_node_is_held_where_a_movable_kernel_stands_in_the_way_but_not_its_other_cards():
    pool_ = Pool((Node("a", tuple(GPU(f"a-g{i}", "H100-80GB", 80 * GIB, index=i) for i in range(3))),))
    fill = [alloc("nb0", "a-g0", 40, node_name="a"), alloc("nb1", "a-g1", 20, node_name="a"),
            alloc("k", "a-g2", 30, kind="kernel", node_name="a")]
    st_ = AdmissionState(DEFAULT, pool_, fill)
    q = AdmissionQueue.from_policy(DEFAULT.policy)
    q.push(req(memory_gib=80, cores=100, whole=True, rid="head"), 100, 0.0)
    q.push(req(memory_gib=45, cores=10, rid="big"), 100, 70.0)  # fits a-g2 only
    q.push(req(memory_gib=30, cores=10, rid="small"), 100, 71.0)
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 70.0)}
    assert [mv.allocation.id for mv in steps["head"].moves] == ["k"]
    # the reservation holds a-g1 (fewest in the way), moves would empty a-g2: both held;
    # a-g0's room is no one's to free, so 'small' starts there
    assert steps["small"].decision.granted and steps["small"].decision.allocation.gpu_uuids == ("a-g0",)
    assert not steps["big"].decision.granted and "goes first" in steps["big"].decision.reason
