"""Preemption: fewest and lowest-priority victims, newest first, never equal or higher priority;
borrowed allocations go first."""

from quotas import GPU, Node, PoolFull

from .builders import GIB, alloc, grant, node, pool, req, state


def full_card(*allocs):
    return state(pool(node("a", 1)), allocations=allocs)


def test_a_preempting_class_evicts_a_lower_priority_allocation_when_the_card_is_full():
    st = full_card(alloc("low1", "a-gpu0", 80, 50, pc="low"))
    d = st.decide(req(priority_class="high", rid="h"))
    assert d.kind == "preempt" and d.granted
    assert [v.id for v in d.victims] == ["low1"]
    assert d.allocation.id == "h" and not d.allocation.borrowed
    assert "preempting 1 allocation: 'low1' of user 'bob' (priority class 'low')" in d.reason


def test_the_lowest_priority_goes_first_then_the_newest():
    st = full_card(
        alloc("default-old", "a-gpu0", 20, 20, pc="default", created_at=1),
        alloc("low-old", "a-gpu0", 20, 20, pc="low", created_at=1),
        alloc("low-new", "a-gpu0", 20, 20, pc="low", created_at=5),
        alloc("lowest", "a-gpu0", 20, 20, pc="lowest", created_at=0),
    )
    d = st.decide(req(memory_gib=10, priority_class="high"))
    assert [v.id for v in d.victims] == ["lowest"]
    st.remove("lowest")
    st.add(alloc("other", "a-gpu0", 20, 20, pc="default", created_at=9))
    d = st.decide(req(memory_gib=10, priority_class="high"))
    assert [v.id for v in d.victims] == ["low-new"]


def test_fewest_victims_win_over_lower_priority():
    st = full_card(
        alloc("small-1", "a-gpu0", 10, 10, pc="lowest"),
        alloc("small-2", "a-gpu0", 10, 10, pc="lowest"),
        alloc("big", "a-gpu0", 60, 60, pc="low"),
    )
    d = st.decide(req(memory_gib=20, cores=20, priority_class="high"))
    assert [v.id for v in d.victims] == ["big"]


def test_victims_are_minimal_and_together_make_room():
    st = full_card(
        alloc("v1", "a-gpu0", 30, 30, pc="lowest", created_at=3),
        alloc("v2", "a-gpu0", 30, 30, pc="lowest", created_at=2),
        alloc("keep", "a-gpu0", 20, 20, pc="default"),
    )
    d = st.decide(req(memory_gib=55, cores=50, priority_class="high"))
    assert d.kind == "preempt"
    assert sorted(v.id for v in d.victims) == ["v1", "v2"]


def test_equal_or_higher_priority_is_never_evicted():
    st = full_card(alloc("peer", "a-gpu0", 80, 50, pc="high"))
    d = st.decide(req(priority_class="high"))
    assert d.kind == "wait" and isinstance(d.error, PoolFull) and not d.victims
    st = full_card(alloc("boss", "a-gpu0", 80, 50, pc="high", created_at=0))
    assert st.decide(req(priority_class="default")).kind == "wait"


def test_a_class_that_may_not_preempt_waits_even_above_lower_priorities():
    st = full_card(alloc("low1", "a-gpu0", 80, 50, pc="low"))
    d = st.decide(req(priority_class="default"))
    assert d.kind == "wait"
    assert d.reason.startswith("No GPU has 10 GiB of memory and 25% of compute free right now "
                               "(the most free on one card is 0 MiB and 50%).")


def test_preemption_frees_cards_on_one_node_for_a_multi_gpu_request():
    st = state(pool(node("a", 2), node("b", 2)), allocations=[
        alloc("a0", "a-gpu0", 80, 10, pc="low"), alloc("a1", "a-gpu1", 80, 10, pc="default"),
        alloc("b0", "b-gpu0", 80, 10, pc="low"), alloc("b1", "b-gpu1", 80, 10, pc="lowest"),
    ])
    d = st.decide(req(memory_gib=40, count=2, priority_class="high"))
    assert d.kind == "preempt" and d.allocation.node == "b"
    assert sorted(v.id for v in d.victims) == ["b0", "b1"]


def test_a_whole_card_request_can_preempt_the_slices_on_a_card():
    st = full_card(alloc("s1", "a-gpu0", 10, 10, pc="low"), alloc("s2", "a-gpu0", 10, 10, pc="low"))
    d = st.decide(req(whole=True, priority_class="high"))
    assert d.kind == "preempt" and sorted(v.id for v in d.victims) == ["s1", "s2"]


def test_preemption_within_a_quota_evicts_lower_priority_of_the_same_workspace():
    ws = {"vision": {"limits": {"memory_mib": 40 * GIB}}, "nlp": {}}
    st = state(pool(node("a", 2)), ws, allocations=[
        alloc("mine-low", "a-gpu0", 40, 10, pc="low", ws="vision", created_at=1),
        alloc("other-low", "a-gpu1", 10, 10, pc="lowest", ws="nlp", created_at=2),
    ])
    d = st.decide(req(memory_gib=20, priority_class="high", ws="vision"))
    # the card has room; the workspace quota does not: only a vision allocation can help
    assert d.kind == "preempt" and [v.id for v in d.victims] == ["mine-low"]


def test_a_victim_must_help_both_capacity_and_quota():
    ws = {"vision": {"limits": {"memory_mib": 60 * GIB}}, "nlp": {}}
    st = state(pool(node("a", 1)), ws, allocations=[
        alloc("nlp-low", "a-gpu0", 30, 10, pc="lowest", ws="nlp"),
        alloc("vis-low", "a-gpu0", 50, 10, pc="low", ws="vision"),
    ])
    d = st.decide(req(memory_gib=30, priority_class="high", ws="vision"))
    assert d.kind == "preempt" and [v.id for v in d.victims] == ["vis-low"]


def test_preemption_does_not_change_the_state():
    st = full_card(alloc("low1", "a-gpu0", 80, 50, pc="low"))
    st.decide(req(priority_class="high"))
    assert list(st.allocations) == ["low1"]


def test_a_victim_taken_early_is_given_back_when_later_ones_suffice():
    st = full_card(
        alloc("tiny", "a-gpu0", 10, 10, pc="lowest"),
        alloc("mid-1", "a-gpu0", 30, 10, pc="low", created_at=2),
        alloc("mid-2", "a-gpu0", 30, 10, pc="low", created_at=1),
        alloc("keep", "a-gpu0", 10, 10, pc="default"),
    )
    d = st.decide(req(memory_gib=60, cores=10, priority_class="high"))
    assert d.kind == "preempt"
    assert sorted(v.id for v in d.victims) == ["mid-1", "mid-2"]


def test_a_request_within_its_quota_reclaims_several_borrowed_allocations():
    st = full_card(
        alloc("b1", "a-gpu0", 30, 10, pc="low", ws="other", borrowed=True),
        alloc("b2", "a-gpu0", 30, 10, pc="low", ws="other", borrowed=True),
        alloc("d1", "a-gpu0", 20, 10, pc="lowest"),
    )
    d = st.decide(req(memory_gib=50, priority_class="default"))
    assert d.kind == "preempt" and sorted(v.id for v in d.victims) == ["b1", "b2"]


def test_a_whole_card_over_quota_on_the_free_card_preempts_for_the_smaller_card_it_frees():
    """Whole cards are charged their size: with a 40 GiB quota, the 80 GiB card that is free
    can never be had, but the 40 GiB card a lower-priority allocation holds can (it waited)."""
    mixed = Node("a", (
        GPU(uuid="a-gpu0", model="H100-80GB", memory_mib=80 * GIB, index=0),
        GPU(uuid="a-gpu1", model="A100-40GB", memory_mib=40 * GIB, index=1),
    ))
    st = state(pool(mixed), {"vision": {"limits": {"memory_mib": 40 * GIB}}})
    low = grant(st, req(whole=True, priority_class="low", ws="vision", rid="low"))
    assert low.gpu_uuids == ("a-gpu1",)
    d = st.decide(req(whole=True, priority_class="high", ws="vision", rid="high"))
    assert d.kind == "preempt", d.reason
    assert [v.id for v in d.victims] == ["low"] and d.allocation.gpu_uuids == ("a-gpu1",)


def test_a_whole_card_over_quota_clears_the_small_card_when_the_free_big_one_is_cheaper_to_take():
    """Found by the preemption property (hypothesis): a 24 GiB quota with 1 GiB in use. The free
    80 GiB card is the cheapest card of the node to clear but the quota never allows it; the
    24 GiB card a borrowed allocation holds does, once that one and the 1 GiB slice are evicted.
    The search used to weigh only the cheapest card per node and waited."""
    mixed = Node("m", (
        GPU(uuid="m-gpu0", model="H100-80GB", memory_mib=80 * GIB, index=0),
        GPU(uuid="m-gpu1", model="L4-24GB", memory_mib=24 * GIB, index=1),
    ))
    st = state(
        pool(node("a", 1), mixed),
        {"w1": {"limits": {"memory_mib": 24 * GIB}}},
        allocations=(
            alloc("slice", "a-gpu0", 1, 5, ws="w1", pc="low"),
            alloc("borrowed", "m-gpu1", 24, 100, ws="w1", pc="low", whole=True, borrowed=True),
        ),
    )
    d = st.decide(req(whole=True, priority_class="high", ws="w1", rid="high"))
    assert d.kind == "preempt", d.reason
    assert sorted(v.id for v in d.victims) == ["borrowed", "slice"] and d.allocation.gpu_uuids == ("m-gpu1",)
