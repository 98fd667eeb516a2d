"""Elastic slices in the admission core: admission, quotas and placement count the request (what
is guaranteed); the limit only says how far the slice may grow, bounded by the card (issue 27)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotas import InvalidRequest

from .builders import GIB, alloc, grant, node, pool, req, state


def test_a_limit_larger_than_what_is_free_does_not_block_a_request_that_fits():
    s = state(pool(node("a", 1)))  # one 80 GiB card
    s.apply(s.decide(req("bob", 60, 60, rid="held")))
    d = s.decide(req("alice", 20, 25, memory_limit_mib=80 * GIB, cores_limit_percent=100))
    assert d.kind == "grant", d.reason
    assert (d.allocation.memory_mib, d.allocation.memory_limit_mib) == (20 * GIB, 80 * GIB)
    assert (d.allocation.cores_percent, d.allocation.cores_limit_percent) == (25, 100)


def test_quotas_count_the_request_not_the_limit():
    s = state(pool(node("a", 2)), workspaces={"default": {"limits": {"memory_mib": 40 * GIB}}})
    grant(s, req("alice", 20, 25, memory_limit_mib=80 * GIB))
    d = s.decide(req("alice", 20, 25, memory_limit_mib=80 * GIB))
    assert d.kind == "grant", d.reason
    s.apply(d)
    assert s.usage()["workspaces"][0]["used"]["memory_mib"] == 40 * GIB


def test_what_is_guaranteed_never_exceeds_the_card():
    s = state(pool(node("a", 1)))
    grant(s, req("alice", 40, 50, memory_limit_mib=80 * GIB, cores_limit_percent=100))
    grant(s, req("bob", 40, 50, memory_limit_mib=80 * GIB, cores_limit_percent=100))
    d = s.decide(req("carol", 1, 1, memory_limit_mib=80 * GIB))
    assert d.kind == "wait", d.reason


def test_a_limit_above_every_card_is_refused_with_a_sentence():
    s = state(pool(node("a", 1), node("b", 1, "A100-40GB", 40 * GIB)))
    d = s.decide(req("alice", 10, 25, memory_limit_mib=100 * GIB))
    assert d.kind == "reject" and isinstance(d.error, InvalidRequest)
    assert d.reason == (
        "A slice that may grow to 100 GiB is larger than any GPU in the pool (the largest holds "
        "80 GiB). Pick a profile with a smaller memory limit."
    )
    d = s.decide(req("alice", 10, 25, memory_limit_mib=60 * GIB, model="A100-40GB"))
    assert "larger than any A100-40GB GPU in the pool (the largest holds 40 GiB)" in d.reason


def test_a_memory_limit_is_bounded_by_the_card_not_its_oversubscribed_capacity():
    s = state(pool(node("a", 1, memory_oversub=2.0)))  # 80 GiB card, 160 GiB of requests
    d = s.decide(req("alice", 10, 25, memory_limit_mib=120 * GIB))
    assert d.kind == "reject"
    assert "may grow to 120 GiB" in d.reason and "holds 80 GiB" in d.reason


def test_a_limit_on_a_smaller_card_of_a_mixed_pool_is_that_card():
    s = state(pool(node("a", 1), node("b", 1, "A100-40GB", 40 * GIB)),
              allocations=[alloc("big", "a-gpu0", 75, 90, user="bob")])
    d = s.decide(req("alice", 10, 10, memory_limit_mib=60 * GIB))
    assert d.kind == "grant", d.reason
    assert d.allocation.node == "b"
    assert d.allocation.memory_limit_mib == 40 * GIB
    assert s.decide(req("alice", 10, 10)).allocation.memory_limit_mib == 0


def test_a_limit_below_the_request_or_above_100_percent_is_refused():
    s = state(pool(node("a", 1)))
    d = s.decide(req("alice", 20, 25, memory_limit_mib=10 * GIB))
    assert d.kind == "reject"
    assert d.reason == (
        "A GPU memory limit (10 GiB) must be at least the memory asked for (20 GiB); "
        "leave it out for a slice that does not grow."
    )
    d = s.decide(req("alice", 20, 50, cores_limit_percent=25))
    assert d.reason == (
        "A GPU compute limit (25%) must be at least the compute asked for (50%) and at most 100%; "
        "leave it out for a slice that does not grow."
    )
    assert "at most 100%" in s.decide(req("alice", 20, 50, cores_limit_percent=150)).reason


def test_a_whole_card_has_no_limit_to_grow_to():
    s = state(pool(node("a", 1)))
    d = s.decide(req("alice", 0, 0, whole=True, memory_limit_mib=80 * GIB))
    assert d.kind == "reject"
    assert "A whole GPU is all of the card already" in d.reason


CARDS = st.lists(st.sampled_from([24, 40, 80]), min_size=1, max_size=4)
ASKS = st.lists(st.tuples(st.integers(1, 80), st.integers(1, 100), st.integers(0, 80), st.integers(0, 100)),
                max_size=12)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CARDS, ASKS)
def test_requests_never_oversubscribe_a_card_and_limits_never_exceed_it(cards, asks):
    from quotas import GPU, Node, Pool

    p = Pool(nodes=(Node("n", tuple(GPU(f"g{i}", f"M{gib}", gib * GIB, index=i) for i, gib in enumerate(cards))),))
    s = state(p)
    for i, (m, c, extra_m, extra_c) in enumerate(asks):
        r = req("u", m, c, rid=f"r{i}", memory_limit_mib=(m + extra_m) * GIB if extra_m else 0,
                cores_limit_percent=min(100, c + extra_c) if extra_c else 0)
        d = s.decide(r)
        if d.granted:
            s.apply(d)
    card = {g.uuid: g for g in p.all_gpus()}
    for g in p.all_gpus():
        on = [a for a in s.allocations.values() if g.uuid in a.gpu_uuids]
        assert sum(a.memory_mib for a in on) <= g.memory_mib
        assert sum(a.cores_percent for a in on) <= 100
    for a in s.allocations.values():
        for u in a.gpu_uuids:
            assert a.memory_ceiling_mib <= card[u].memory_mib
            assert a.cores_ceiling_percent <= 100
