"""Over-quota borrowing of idle capacity, and reclaiming it (as Kueue's cohorts)."""

from quotas import PoolFull, QuotaExceeded

from .builders import GIB, alloc, grant, node, pool, req, state

WS = {"vision": {"limits": {"memory_mib": 20 * GIB}}, "nlp": {"limits": {"memory_mib": 60 * GIB}}}


def test_a_borrowing_class_may_exceed_its_quota_with_idle_capacity():
    st = state(pool(node("a", 1)), WS)
    grant(st, req(memory_gib=20, priority_class="low", ws="vision"))
    d = st.decide(req(memory_gib=20, priority_class="low", ws="vision"))
    assert d.kind == "grant" and d.allocation.borrowed
    assert d.reason.startswith("Borrowed idle capacity: workspace 'vision' is over the GPU memory "
                               "quota (20 GiB of 20 GiB in use)")


def test_within_quota_a_borrowing_class_gets_an_ordinary_grant():
    st = state(pool(node("a", 1)), WS)
    d = st.decide(req(memory_gib=10, priority_class="low", ws="vision"))
    assert d.kind == "grant" and not d.allocation.borrowed


def test_a_class_without_borrowing_waits_on_its_quota():
    st = state(pool(node("a", 1)), WS)
    grant(st, req(memory_gib=20, ws="vision"))
    d = st.decide(req(memory_gib=10, ws="vision"))
    assert d.kind == "wait" and isinstance(d.error, QuotaExceeded)


def test_borrowing_needs_idle_capacity_and_never_preempts():
    st = state(pool(node("a", 1)), WS, allocations=[
        alloc("mine", "a-gpu0", 20, 10, pc="low", ws="vision"),
        alloc("other", "a-gpu0", 60, 10, pc="lowest", ws="nlp"),
    ])
    d = st.decide(req(memory_gib=10, priority_class="low", ws="vision"))
    assert d.kind == "wait" and isinstance(d.error, PoolFull)
    assert "Workspace 'vision' is over the GPU memory quota (20 GiB of 20 GiB in use); priority " \
           "class 'low' may borrow idle capacity, but none is free." in d.reason


def test_the_quota_owner_reclaims_borrowed_capacity_even_from_a_higher_priority():
    # 'vision' borrowed 40 GiB beyond its quota; 'nlp' now needs its own quota back.
    st = state(pool(node("a", 1)), WS, allocations=[
        alloc("v-own", "a-gpu0", 20, 10, pc="low", ws="vision"),
        alloc("v-borrowed", "a-gpu0", 40, 10, pc="high", ws="vision", borrowed=True),
        alloc("n-1", "a-gpu0", 20, 10, pc="default", ws="nlp"),
    ])
    d = st.decide(req(memory_gib=30, ws="nlp"))  # default class: may not preempt, yet reclaims
    assert d.kind == "preempt" and [v.id for v in d.victims] == ["v-borrowed"]


def test_borrowed_allocations_go_before_lower_priority_ones():
    st = state(pool(node("a", 1)), {**WS, "nlp": {}}, allocations=[
        alloc("lowest", "a-gpu0", 40, 10, pc="lowest", ws="nlp"),
        alloc("borrowed", "a-gpu0", 40, 10, pc="low", ws="vision", borrowed=True),
    ])
    d = st.decide(req(memory_gib=30, priority_class="high", ws="nlp"))
    assert [v.id for v in d.victims] == ["borrowed"]


def test_borrowed_usage_does_not_count_against_the_quota_but_yields_its_capacity():
    # ann borrowed 20 GiB beyond vision's 20 GiB quota; bob's request is within the quota
    st = state(pool(node("a", 1)), WS, allocations=[
        alloc("own", "a-gpu0", 10, 10, pc="low", ws="vision", user="ann"),
        alloc("extra", "a-gpu0", 20, 10, pc="high", ws="vision", user="ann", borrowed=True),
    ])
    d = st.decide(req("bob", memory_gib=10, ws="vision"))
    assert d.kind == "grant" and not d.allocation.borrowed  # idle capacity: both keep running
    st.add(alloc("filler", "a-gpu0", 50, 10, pc="high", ws="nlp"))
    d = st.decide(req("bob", memory_gib=10, ws="vision"))
    assert d.kind == "preempt" and [v.id for v in d.victims] == ["extra"]
    # 20 GiB would be over vision's quota even without the borrowed part: it waits
    d = st.decide(req("bob", memory_gib=20, ws="vision"))
    assert d.kind == "wait" and "10 GiB are in use" in d.reason


def test_only_non_borrowed_usage_is_held_to_the_quota():
    st = state(pool(node("a", 1)), WS)
    for _ in range(3):
        st.apply(st.decide(req(memory_gib=10, priority_class="low", ws="vision")))
    vision = {w["name"]: w for w in st.usage()["workspaces"]}["vision"]
    assert vision["used"]["memory_mib"] == 30 * GIB
    assert vision["borrowed"]["memory_mib"] == 10 * GIB
