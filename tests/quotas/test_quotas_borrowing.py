"""Over-quota borrowing of idle capacity, and reclaiming it (as Kueue's cohorts)."""

from quotas import PoolFull, QuotaExceeded

from .builders import GIB, alloc, grant, node, pool, req, state

WS = {"vision": {"limits": {"memory_mib": 20 * GIB}}, "nlp": {"limits": {"memory_mib": 60 * GIB}}}


def test_a_borrowing_class_may_exceed_its_quota_with_idle_capacity():
    st = state(pool(node("a", 1)), WS)
    grant(st, req(memory_gib=20, priority_class="low", ws="vision"))
    d = st.decide(req(memory_gib=20, priority_class="low", ws="vision"))
    assert d.kind == "grant" and d.allocation.borrowed
    assert d.reason.startswith("Borrowed idle capacity: workspace 'vision' is over its GPU memory "
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
    assert "Workspace 'vision' is over its GPU memory quota (20 GiB of 20 GiB in use); priority " \
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


def test_a_borrowed_allocation_frees_quota_of_its_own_workspace_for_a_non_borrowing_request():
    st = state(pool(node("a", 2)), WS, allocations=[
        alloc("own", "a-gpu0", 10, 10, pc="low", ws="vision", user="ann"),
        alloc("extra", "a-gpu1", 20, 10, pc="high", ws="vision", user="ann", borrowed=True),
    ])
    d = st.decide(req("bob", memory_gib=10, ws="vision"))
    assert d.kind == "preempt" and [v.id for v in d.victims] == ["extra"]
    # 10 GiB more would need 'own' gone too, and a default-class request may not preempt it
    assert st.decide(req("bob", memory_gib=20, ws="vision")).kind == "wait"


def test_only_non_borrowed_usage_is_held_to_the_quota():
    st = state(pool(node("a", 1)), WS)
    for _ in range(3):
        st.apply(st.decide(req(memory_gib=10, priority_class="low", ws="vision")))
    vision = {w["name"]: w for w in st.usage()["workspaces"]}["vision"]
    assert vision["used"]["memory_mib"] == 30 * GIB
    assert vision["borrowed"]["memory_mib"] == 10 * GIB
