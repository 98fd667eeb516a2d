"""The queue: priority order, backfill, and capacity reserved for an overdue head."""

from __future__ import annotations

import pytest

from quotas import GPU, ConfigError, Node
from quotas.queue import AdmissionQueue

from .builders import alloc, config, pool, req, state

BIG = dict(memory_gib=80, cores=100)


def busy_pool():
    """Two cards, each full with two 40 GiB slices of staggered ages."""
    ages = {"o1": ("a-gpu0", -40.0), "o2": ("a-gpu1", -30.0), "o3": ("a-gpu0", -20.0),
            "o4": ("a-gpu1", -10.0)}
    return state(pool(Node("a", tuple(GPU(f"a-gpu{i}", "H100", 80 * 1024, index=i)
                                      for i in range(2)))),
                 allocations=[alloc(k, card, 40, node_name="a", created_at=t)
                              for k, (card, t) in ages.items()])


def churn(q: AdmissionQueue, st, steps: int, every: float = 30.0):
    """40 GiB slices keep coming (two always wait) and the oldest slice leaves every ``every``
    seconds. Returns (time the big request was granted or None, departed ids in order)."""
    departed = []
    now = 0.0
    for i in range(2):
        q.push(req(memory_gib=40, rid=f"w{i}"), 100, now)
    for i in range(steps):
        for step in q.pump(st, now):
            if step.decision.granted and step.waiting.request.request_id == "big":
                return now, departed
        oldest = min((a for a in st.allocations.values()), key=lambda a: a.created_at)
        st.remove(oldest.id)
        departed.append(oldest.id)
        now += every
        q.push(req(memory_gib=40, rid=f"s{i}"), 100, now)
    return None, departed


def test_without_a_reservation_small_slices_pass_a_whole_card_request_for_ever():
    st = busy_pool()
    q = AdmissionQueue(reserve_after_seconds=None)
    q.push(req(**BIG, rid="big"), 100, 0.0)
    granted_at, departed = churn(q, st, 50)
    assert granted_at is None and len(departed) == 50  # 50 departures later it still waits


def test_an_overdue_head_gets_a_card_reserved_and_is_granted_once_its_blockers_left():
    st = busy_pool()
    q = AdmissionQueue(reserve_after_seconds=60)
    big = q.push(req(**BIG, rid="big"), 100, 0.0)
    granted_at, departed = churn(q, st, 50)
    assert granted_at is not None and st.allocations["big"].memory_mib == 80 * 1024
    r = big.reservation
    assert r is not None and r.made_at == 60.0 and r.node == "a" and r.blockers
    # granted right after the last of the allocations in its way left, not a step later
    last_blocker = max(departed.index(b) for b in r.blockers)
    assert len(departed) == last_blocker + 1
    assert st.allocations["big"].gpu_uuids == r.cards


def test_backfill_still_happens_before_the_bound_and_beside_the_reservation():
    st = state(pool(Node("a", tuple(GPU(f"a-gpu{i}", "H100", 80 * 1024, index=i)
                                    for i in range(2)))),
               allocations=[alloc("o1", "a-gpu0", 40, node_name="a")])
    q = AdmissionQueue(reserve_after_seconds=60)
    q.push(req(**BIG, count=2, rid="big"), 100, 0.0)
    q.push(req(memory_gib=20, rid="early"), 100, 1.0)
    steps = {s.waiting.request.request_id: s.decision.kind for s in q.pump(st, 1.0)}
    assert steps == {"big": "wait", "early": "grant"}  # best-effort FIFO before the bound
    q.push(req(memory_gib=20, rid="late"), 100, 100.0)
    steps = {s.waiting.request.request_id: s for s in q.pump(st, 100.0)}
    reservation = steps["big"].waiting.reservation
    assert reservation is not None and set(reservation.cards) == {"a-gpu0", "a-gpu1"}
    assert steps["late"].decision.kind == "wait"  # both cards are held for the head now
    assert steps["late"].waiting.position == 1


def test_a_higher_class_may_take_reserved_capacity_and_holds_leave_no_trace():
    st = state(pool(Node("a", tuple(GPU(f"a-gpu{i}", "H100", 80 * 1024, index=i)
                                    for i in range(2)))),
               allocations=[alloc("o1", "a-gpu0", 20, node_name="a"),
                            alloc("o2", "a-gpu1", 20, node_name="a")])
    before = st.usage()
    q = AdmissionQueue(reserve_after_seconds=0)
    q.push(req(**BIG, rid="big"), 100, 0.0)
    q.push(req(memory_gib=30, rid="low"), 10, 0.0)
    q.push(req(memory_gib=40, priority_class="high", rid="high"), 1000, 0.0)
    steps = {s.waiting.request.request_id: s.decision.kind for s in q.pump(st, 0.0)}
    assert steps == {"high": "grant", "big": "wait", "low": "wait"}
    st.remove("high")
    assert st.usage() == before  # the holds are gone once the pump is over


def test_a_head_waiting_on_its_quota_reserves_nothing():
    st = state(pool(Node("a", tuple(GPU(f"a-gpu{i}", "H100", 80 * 1024, index=i)
                                    for i in range(2)))),
               workspaces={"default": {"limits": {"memory_mib": 50 * 1024}}},
               allocations=[alloc("o1", "a-gpu0", 40, node_name="a")])
    q = AdmissionQueue(reserve_after_seconds=0)
    head = q.push(req(memory_gib=20, rid="over"), 100, 0.0)
    q.push(req(memory_gib=10, user="carol", rid="fits"), 100, 0.0)
    steps = {s.waiting.request.request_id: s.decision.kind for s in q.pump(st, 10.0)}
    assert steps == {"over": "wait", "fits": "grant"} and head.reservation is None


def test_the_bound_must_not_be_negative_and_spots_at_least_one():
    with pytest.raises(ValueError, match="reserve_after_seconds must be 0 or more"):
        AdmissionQueue(reserve_after_seconds=-1)
    with pytest.raises(ValueError, match="reserve_spots must be a whole number >= 1, got 0"):
        AdmissionQueue(reserve_spots=0)


def test_with_two_spots_the_head_holds_capacity_on_two_nodes_and_takes_the_first_to_clear():
    st = state(pool(*(Node(n, (GPU(f"{n}-gpu0", "H100", 80 * 1024),)) for n in "ab")),
               allocations=[alloc("x", "a-gpu0", 40, node_name="a"),
                            alloc("y", "b-gpu0", 40, node_name="b")])
    q = AdmissionQueue(reserve_after_seconds=0, reserve_spots=2)
    big = q.push(req(**BIG, rid="big"), 100, 0.0)
    q.push(req(memory_gib=20, rid="small"), 100, 0.0)
    kinds = {s.waiting.request.request_id: s.decision.kind for s in q.pump(st, 0.0)}
    assert kinds == {"big": "wait", "small": "wait"}  # both cards are held
    assert {big.reservation.node, *(n for n, _ in big.reservation.also)} == {"a", "b"}
    st.remove("y")  # b clears first although a was the first spot
    kinds = {s.waiting.request.request_id: s.decision.kind for s in q.pump(st, 1.0)}
    assert kinds == {"big": "grant", "small": "grant"} and st.allocations["big"].node == "b"


def test_config_reads_the_reservation_bound():
    assert config(queue={"reserve_after_seconds": 30}).policy.reserve_after_seconds == 30
    assert config(queue={"reserve_after_seconds": None}).policy.reserve_after_seconds is None
    assert config(queue={"reserve_spots": 3}).policy.reserve_spots == 3
    with pytest.raises(ConfigError, match="queue.reserve_after_seconds: must be a number of seconds"):
        config(queue={"reserve_after_seconds": "1m"})
