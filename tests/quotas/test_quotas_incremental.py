"""Incremental queue passes (quotas.incremental): a pump that decides again only the waiting
requests something changed for returns what a pump deciding every one of them returns."""

from __future__ import annotations

import dataclasses

from hypothesis import event, given
from hypothesis import strategies as st

from quotas import AdmissionState, GPURequest, load_config
from quotas.errors import QuotaExceeded
from quotas.queue import AdmissionQueue, Step
from quotas.reserve import SoftReservation

from .builders import alloc, node, pool, req, state
from .test_quotas_properties import (
    CLASSES,
    LARGE,
    NAMESPACES,
    PROPERTY,
    SMALL,
    WORKSPACES,
    limits,
    pools,
    requests,
    value_of,
)

MOVABLE = {name: {**body, "movable": True} for name, body in CLASSES.items()}


@st.composite
def queue_runs(draw):
    """A config (quotas, placement, queue rules), a pool, a fill of live allocations, then
    arrivals of any request, departures, clock ticks and carried-out moves, pumped after each."""
    workspaces = {ws: {"limits": draw(limits()), "namespaces": {
        ns: {"limits": draw(limits()), "user_limits": draw(limits())} for ns in NAMESPACES}}
        for ws in WORKSPACES}
    queue = {"hold": draw(st.sampled_from([True, False, "with-moves"])),
             "moves": draw(st.sampled_from([None, {}, {"per_hour": 2}])),
             "reserve_after_seconds": draw(st.sampled_from([0, 30, 60]))}
    cfg = load_config({"priority_classes": MOVABLE, "queue": queue, "workspaces": workspaces,
                       "placement": {"node": draw(st.sampled_from(["binpack", "spread", "fgd"])),
                                     "gpu": draw(st.sampled_from(["binpack", "spread", "fgd"]))}})
    fill = [draw(requests(i, tuple(CLASSES), SMALL)) for i in range(draw(st.integers(0, 20)))]
    ops = []
    # mostly two classes, so that several wait behind the head of each
    classes = st.sampled_from(["default", "default", "low", "low", None, "high", "urgent", "lowest"])
    for i in range(draw(st.integers(1, 60))):
        kind = draw(st.sampled_from(["arrive", "arrive", "arrive", "depart", "tick", "soft"]))
        if kind == "arrive":
            r = draw(requests(100 + i, (draw(classes),), (*SMALL, *LARGE)))
            if draw(st.booleans()):  # most ask for any model (fewer are refused at once)
                r = dataclasses.replace(r, model=None)
            ops.append(("arrive", r))
        elif kind == "depart":
            ops.append(("depart", draw(st.integers(0, 1000))))
        elif kind == "soft":  # the room kept for swapped-out kernels (quotas/reserve.py) is now:
            ops.append(("soft", draw(st.lists(st.tuples(
                st.integers(0, 1000), st.sampled_from([4, 10, 20]), st.sampled_from([10, 50]), st.booleans()),
                max_size=2))))
        else:
            ops.append(("tick", draw(st.sampled_from([1.0, 5.0, 30.0, 120.0]))))
    return cfg, draw(pools()), fill, ops, draw(st.booleans())


def same(a: Step, b: Step, kept: bool) -> None:
    """``b`` (the incremental pump's) is ``a``; ``kept``: ``b`` is its last decision, kept (its
    sentence may quote figures of then)."""
    da, db = a.decision, b.decision
    assert a.waiting.request == b.waiting.request
    assert (da.kind, da.allocation, [v.id for v in da.victims], type(da.error)) == \
        (db.kind, db.allocation, [v.id for v in db.victims], type(db.error))
    assert [(m.allocation, m.to) for m in a.moves] == [(m.allocation, m.to) for m in b.moves]
    assert a.waiting.position == b.waiting.position
    assert a.waiting.reservation == b.waiting.reservation
    if not kept:
        assert da.reason == db.reason  # decided in this pass: the same sentence


@PROPERTY
@given(queue_runs())
def test_the_incremental_pump_decides_like_the_pump_that_decides_every_waiting_request(run):
    cfg, pl, fill, ops, possible = run
    states = [AdmissionState(cfg, pl), AdmissionState(cfg, pl)]
    for r in fill:
        for s in states:
            d = s.decide(r)
            if d.kind == "grant":
                s.apply(d)
    full = AdmissionQueue.from_policy(cfg.policy)
    full.incremental = False
    fast = AdmissionQueue.from_policy(cfg.policy)
    queues = [full, fast]
    now = 0.0
    kept = bound = 0
    for kind, op in [("tick", 0.0), *ops]:
        if kind == "arrive":
            for q in queues:
                q.push(op, value_of(cfg, op.priority_class), now)
        elif kind == "depart":
            live = sorted(states[0].allocations)
            if live:
                for s in states:
                    s.remove(live[op % len(live)])
        elif kind == "soft":
            uuids = [g.uuid for g in pl.all_gpus()]
            wanted = {f"k{i}": SoftReservation((uuids[u % len(uuids)],), gib * 1024, cores, whole)
                      for i, (u, gib, cores, whole) in enumerate(op)}
            for s in states:
                s.index.soft.replace(s.index, wanted)
        else:
            now += op
        before = {id(w): w.seen.decision for w in fast.ordered() if w.seen is not None}
        ref = full.pump(states[0], now, moves_possible=possible)
        got = fast.pump(states[1], now, moves_possible=possible)
        assert len(ref) == len(got)
        for a, b in zip(ref, got, strict=True):
            again = b.decision is before.get(id(b.waiting))
            same(a, b, again)
            kept += again
            # a wait on quota no eviction can fix, kept across a change (the skip rule of
            # QuotaExceeded.quota_bound)
            bound += again and isinstance(b.decision.error, QuotaExceeded) and b.decision.error.quota_bound
            for mv in b.moves:  # carried out: the slice leaves, and its kernel asks back
                for s, q in zip(states, queues, strict=True):
                    s.remove(mv.allocation.id)
                    q.push(GPURequest(mv.allocation.owner, mv.allocation.memory_mib, mv.allocation.cores_percent,
                                      priority_class=mv.allocation.priority_class or None,
                                      request_id=f"{mv.allocation.id}-back", kind="kernel"),
                           value_of(cfg, mv.allocation.priority_class), now, moved=True)
        assert states[0].allocations == states[1].allocations
    event(f"waits kept without a decision: {'some' if kept else 'none'}")
    event(f"quota-bound waits kept: {'some' if bound else 'none'}")


def test_a_waiting_request_is_not_decided_again_when_nothing_it_could_use_changed():
    # two nodes of H100s, full; an A100 node, full too
    st_ = state(pool(node("a", 2), node("b", 1, model="A100-40GB", memory_mib=40 * 1024)), allocations=[
        alloc("x", "a-gpu0", 80), alloc("y", "a-gpu1", 80), alloc("z", "b-gpu0", 40, ws="other")])
    q = AdmissionQueue.from_policy(st_.config.policy)
    q.push(req(memory_gib=40, rid="first", model="H100-80GB"), 100, 0.0)
    behind = q.push(req(memory_gib=20, rid="behind", model="H100-80GB"), 100, 0.0)
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 1.0)}
    waited = steps["behind"].decision
    assert waited.kind == "wait"
    # the A100 frees up: nothing for an H100 request
    st_.remove("z")
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 2.0)}
    assert steps["behind"].decision is waited and behind.position == 1
    # an H100 slice leaves: decided again, and granted (the head, 40 GiB, does not fit in 30)
    st_.remove("y")
    st_.add(alloc("y2", "a-gpu1", 50))
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 3.0)}
    assert steps["first"].decision.kind == "wait" and steps["behind"].decision.granted


def test_a_request_waiting_on_a_quota_no_eviction_can_fix_is_not_decided_again_when_capacity_frees():
    # alice's workspace is at its 40 GiB quota and nothing in it may be evicted for her (her
    # class does not preempt): only a change in her quota levels can end her wait, so cards
    # freeing up elsewhere in the pool do not make the queue decide her request again
    workspaces = {"vision": {"limits": {"memory_mib": 40 * 1024}}, "other": {}}
    st_ = state(pool(node("a", 2)), workspaces, allocations=[
        alloc("v1", "a-gpu0", 40, user="alice", ws="vision"),
        alloc("x", "a-gpu1", 50, ws="other"), alloc("y", "a-gpu1", 30, ws="other")])
    q = AdmissionQueue.from_policy(st_.config.policy)
    q.push(req("carol", memory_gib=60, rid="head", ws="other"), 100, 0.0)
    mine = q.push(req("alice", memory_gib=10, rid="alice", ws="vision"), 100, 0.0)
    # the head of its class, waiting on the same quota: it reserves nothing, so it is kept too
    q.push(req("eve", memory_gib=10, rid="eve", ws="vision", priority_class="lowest"), 1, 0.0)
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 1.0)}
    waited, eves = steps["alice"].decision, steps["eve"].decision
    assert waited.kind == "wait" and type(waited.error).__name__ == "QuotaExceeded", waited.reason
    assert eves.kind == "wait" and type(eves.error).__name__ == "QuotaExceeded", eves.reason
    st_.remove("y")  # 30 GiB free on a card where her 10 GiB would fit
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 2.0)}
    assert steps["head"].decision.kind == "wait"
    assert steps["alice"].decision is waited and mine.position == 1
    assert steps["eve"].decision is eves
    st_.remove("v1")  # her own quota frees: decided again, and granted
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 3.0)}
    assert steps["alice"].decision.granted


def test_a_grant_in_its_workspace_that_leaves_every_quota_level_as_it_was_does_not_decide_a_wait_again():
    # bob waits for a card; a colleague of his workspace is granted a slice in a later turn of
    # the same pass: his quota levels (unlimited) are no shorter for it, and a slice arriving
    # only takes room, so the next pass keeps his wait
    st_ = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 80, user="erin"),
                                                  alloc("y", "a-gpu1", 60, user="erin")])
    q = AdmissionQueue.from_policy(st_.config.policy)
    q.push(req("carol", memory_gib=80, rid="head"), 100, 0.0)
    bobs = q.push(req("bob", memory_gib=40, rid="bob"), 100, 0.0)
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 1.0)}
    waited = steps["bob"].decision
    assert waited.kind == "wait" and type(waited.error).__name__ == "PoolFull", waited.reason
    q.push(req("dave", memory_gib=10, rid="dave"), 100, 2.0)
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 2.0)}
    assert steps["dave"].decision.granted and steps["bob"].decision is waited
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 3.0)}
    assert steps["bob"].decision is waited and bobs.position == 1


def test_a_wait_on_quota_is_not_decided_again_when_a_release_leaves_the_same_quota_short():
    # alice's class does not preempt and her workspace is at its 40 GiB quota: a borrowed slice
    # leaving gives back no quota, and a slice leaving that still leaves the workspace short
    # for her cannot end her wait either; only one that makes room in the quota does
    workspaces = {"vision": {"limits": {"memory_mib": 40 * 1024}}, "other": {}}
    st_ = state(pool(node("a", 2)), workspaces, allocations=[
        alloc("v1", "a-gpu0", 20, user="alice", ws="vision"), alloc("c1", "a-gpu0", 15, user="carol", ws="vision"),
        alloc("c2", "a-gpu0", 5, user="carol", ws="vision"),
        alloc("b1", "a-gpu1", 10, user="bob", ws="vision", pc="low", borrowed=True)])
    q = AdmissionQueue.from_policy(st_.config.policy)
    q.push(req("erin", memory_gib=80, rid="head", ws="other", count=2), 100, 0.0)  # never fits here
    mine = q.push(req("alice", memory_gib=10, rid="alice", ws="vision"), 100, 0.0)
    waited = {s.waiting.request.request_id: s for s in q.pump(st_, 1.0)}["alice"].decision
    assert waited.kind == "wait" and isinstance(waited.error, QuotaExceeded) and waited.error.quota_bound
    st_.remove("b1")  # borrowed: the quota is as it was
    assert {s.waiting.request.request_id: s for s in q.pump(st_, 2.0)}["alice"].decision is waited
    st_.remove("c2")  # 35 of 40 GiB in use: still no room for 10
    assert {s.waiting.request.request_id: s for s in q.pump(st_, 3.0)}["alice"].decision is waited
    assert mine.position == 1
    st_.remove("c1")  # 20 of 40 GiB: decided again, and granted
    assert {s.waiting.request.request_id: s for s in q.pump(st_, 4.0)}["alice"].decision.granted


def test_a_whole_card_wait_with_quota_to_spare_is_not_decided_again_when_its_workspace_takes_a_slice():
    # bob waits for a whole card; his workspace has no quota limit, so no grant in it can change
    # what his card would be charged against: a slice granted to a colleague only takes room
    st_ = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 10, user="erin"),
                                                  alloc("y", "a-gpu1", 10, user="erin")])
    q = AdmissionQueue.from_policy(st_.config.policy)
    q.push(req("carol", memory_gib=80, rid="head", whole=True), 100, 0.0)
    bobs = q.push(req("bob", memory_gib=80, rid="bob", whole=True), 100, 0.0)
    waited = {s.waiting.request.request_id: s for s in q.pump(st_, 1.0)}["bob"].decision
    assert waited.kind == "wait" and type(waited.error).__name__ == "PoolFull", waited.reason
    q.push(req("dave", memory_gib=10, rid="dave"), 100, 2.0)
    steps = {s.waiting.request.request_id: s for s in q.pump(st_, 2.0)}
    assert steps["dave"].decision.granted and steps["bob"].decision is waited
    assert {s.waiting.request.request_id: s for s in q.pump(st_, 3.0)}["bob"].decision is waited
    assert bobs.position == 1
