"""A request pinned to given cards (a swapped-out kernel pod's resume: its container sees only its
own cards): granted there or waiting for them, never placed elsewhere, never preempting."""

from quotas.queue import reserve

from .builders import alloc, grant, node, pool, req, state


def test_a_pinned_request_waits_for_its_card_while_another_card_is_free_and_says_which():
    st = state(pool(node("a", 2)), allocations=[alloc("full", "a-gpu0", 80, 100)])
    d = st.decide(req(rid="r", pinned_uuids=("a-gpu0",)))
    assert d.kind == "wait", d.reason
    assert "a-gpu0 on node a" in d.reason and "no room" in d.reason, d.reason
    st.remove("full")
    granted = grant(st, req(rid="r", pinned_uuids=("a-gpu0",)))
    assert granted.gpu_uuids == ("a-gpu0",) and granted.node == "a"


def test_a_pinned_request_never_preempts():
    st = state(pool(node("a", 2)), allocations=[alloc("low", "a-gpu0", 80, 100, pc="low")])
    assert st.decide(req(priority_class="high")).kind == "grant"  # unpinned: the free card
    d = st.decide(req(priority_class="high", pinned_uuids=("a-gpu0",)))
    assert d.kind == "wait" and not d.victims, d


def test_pins_that_are_unknown_span_nodes_or_miscount_are_refused_with_a_sentence():
    st = state(pool(node("a", 2), node("b", 1)))
    for pins, count, words in (
        (("gone-gpu0",), 1, "not in the pool"),
        (("a-gpu0", "b-gpu0"), 2, "of one node"),
        (("a-gpu0",), 2, "of one node"),
    ):
        d = st.decide(req(count=count, pinned_uuids=pins))
        assert d.kind == "reject" and words in d.reason, (pins, d.reason)
        assert "Traceback" not in d.reason


def test_the_queue_reserves_only_the_pinned_card_for_a_pinned_head():
    st = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 80, 100), alloc("y", "a-gpu1", 40, 50)])
    r = reserve(st, req(memory_gib=60, rid="r", pinned_uuids=("a-gpu0",)), now=0.0)
    assert r is not None and r.cards == ("a-gpu0",) and r.blockers == frozenset({"x"}), r


def test_a_request_pinned_to_several_cards_takes_the_first_with_room_and_waits_only_when_none_has():
    # a kernel pod's resume where its node's driver can restore onto another card: its own card first
    pins = ("a-gpu0", "a-gpu1")
    assert grant(state(pool(node("a", 3))), req(rid="r", pinned_uuids=pins)).gpu_uuids == ("a-gpu0",)
    st = state(pool(node("a", 3)), allocations=[alloc("full", "a-gpu0", 80, 100)])
    assert grant(st, req(rid="r", pinned_uuids=pins)).gpu_uuids == ("a-gpu1",)
    st = state(pool(node("a", 3)), allocations=[alloc("x", "a-gpu0", 80, 100), alloc("y", "a-gpu1", 80, 100)])
    d = st.decide(req(rid="r", pinned_uuids=pins))  # a-gpu2 is free, but not one of its cards
    assert d.kind == "wait" and "None of the GPUs" in d.reason and "(a-gpu0, a-gpu1 on node a)" in d.reason, d.reason
    d = st.decide(req(rid="r", pinned_uuids=("a-gpu0", "a-gpu0")))
    assert d.kind == "reject" and "different GPU(s) of one node" in d.reason, d.reason
