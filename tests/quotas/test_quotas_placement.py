"""Placement: binpack/spread at node and card level, model filter, multi-GPU, whole cards, modes,
oversubscription."""

from quotas import GPU, Mode, Node

from .builders import GIB, alloc, grant, node, pool, req, state


def test_binpack_puts_a_slice_on_the_fullest_node_and_card_that_fits():
    st = state(pool(node("a", 2), node("b", 2)),
               allocations=[alloc("x", "b-gpu1", 30), alloc("y", "a-gpu0", 10)])
    a = grant(st, req())
    assert (a.node, a.gpu_uuids) == ("b", ("b-gpu1",))


def test_spread_puts_a_slice_on_the_emptiest_node_and_card():
    st = state(pool(node("a", 2), node("b", 2)), placement={"node": "spread", "gpu": "spread"},
               allocations=[alloc("x", "b-gpu1", 30), alloc("y", "a-gpu0", 10)])
    a = grant(st, req())
    assert (a.node, a.gpu_uuids) == ("a", ("a-gpu1",))


def test_node_and_card_strategies_are_chosen_separately():
    allocations = [alloc("x", "b-gpu1", 30), alloc("y", "a-gpu0", 10)]
    st = state(pool(node("a", 2), node("b", 2)), placement={"node": "binpack", "gpu": "spread"},
               allocations=allocations)
    assert grant(st, req()).gpu_uuids == ("b-gpu0",)
    st = state(pool(node("a", 2), node("b", 2)), placement={"node": "spread", "gpu": "binpack"},
               allocations=allocations)
    assert grant(st, req()).gpu_uuids == ("a-gpu0",)


def test_binpack_skips_a_fuller_card_that_cannot_hold_the_slice():
    st = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 75)])
    assert grant(st, req(memory_gib=10)).gpu_uuids == ("a-gpu1",)


def test_the_model_filter_matches_case_insensitively():
    st = state(pool(node("a", 1, "A100-40GB", 40 * GIB), node("h", 1, "H100-80GB")))
    assert grant(st, req(model="h100-80gb")).node == "h"
    assert grant(st, req(model="A100-40GB")).node == "a"


def test_a_multi_gpu_request_gets_that_many_cards_on_one_node_with_equal_limits():
    st = state(pool(node("a", 2), node("b", 4)))
    a = grant(st, req(memory_gib=6, cores=80, count=3))
    assert a.node == "b" and len(set(a.gpu_uuids)) == 3
    assert (a.memory_mib, a.cores_percent) == (6 * GIB, 80)


def test_a_multi_gpu_request_is_never_split_across_nodes():
    st = state(pool(node("a", 2), node("b", 2)),
               allocations=[alloc("x", "a-gpu0", 80), alloc("y", "b-gpu0", 80)])
    d = st.decide(req(count=2))
    assert d.kind == "wait"
    assert "No node has 2 GPUs with 10 GiB and 25% free each" in d.reason


def test_a_whole_card_request_takes_only_empty_cards_and_all_of_them():
    st = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 1, 1)])
    a = grant(st, req(whole=True))
    assert a.gpu_uuids == ("a-gpu1",) and a.whole
    assert (a.memory_mib, a.cores_percent) == (80 * GIB, 100)
    d = st.decide(req(memory_gib=1, cores=1))
    assert d.kind == "grant" and d.allocation.gpu_uuids == ("a-gpu0",)
    assert st.decide(req(whole=True)).kind == "wait"


def test_a_slice_never_joins_a_card_held_whole():
    st = state(pool(node("a", 1)))
    grant(st, req(whole=True))
    d = st.decide(req(memory_gib=1, cores=1))
    assert d.kind == "wait"


def test_slices_never_go_on_whole_or_mig_mode_cards():
    n = Node("a", (
        GPU("w", "H100", 80 * GIB, mode=Mode.WHOLE, index=0),
        GPU("m", "H100", 80 * GIB, mode=Mode.MIG, mig_profiles=("3g.40gb",), index=1),
        GPU("s", "H100", 80 * GIB, index=2),
    ))
    st = state(pool(n))
    assert grant(st, req()).gpu_uuids == ("s",)
    assert grant(st, req()).gpu_uuids == ("s",)
    # the whole request prefers the dedicated whole card; the MIG card is never handed out
    assert grant(st, req(whole=True)).gpu_uuids == ("w",)
    assert st.decide(req(whole=True)).kind == "wait"


def test_memory_oversubscription_lets_slices_add_up_past_the_card():
    st = state(pool(node("a", 1, memory_mib=40 * GIB, memory_oversub=1.5)))
    grant(st, req(memory_gib=30, cores=10))
    grant(st, req(memory_gib=30, cores=10))
    assert st.decide(req(memory_gib=1, cores=10)).kind == "wait"


def test_compute_is_capped_at_100_percent_times_the_cores_factor():
    st = state(pool(node("a", 1)))
    for _ in range(4):
        grant(st, req(memory_gib=1, cores=25))
    d = st.decide(req(memory_gib=1, cores=1))
    assert d.kind == "wait" and "0%" in d.reason
    st = state(pool(node("a", 1, cores_oversub=2.0)))
    for _ in range(8):
        grant(st, req(memory_gib=1, cores=25))
    assert st.decide(req(memory_gib=1, cores=1)).kind == "wait"


def test_oversubscription_below_one_reserves_headroom():
    st = state(pool(node("a", 1, memory_mib=10 * GIB, memory_oversub=0.5)))
    d = st.decide(req(memory_gib=6))
    assert d.kind == "reject" and "the largest holds 5 GiB" in d.reason


def test_a_whole_request_takes_smaller_cards_elsewhere_when_the_memory_quota_needs_it():
    st = state(pool(node("big", 1), node("small", 2, "A100-40GB", 40 * GIB)),
               {"v": {"limits": {"memory_mib": 50 * GIB}}},
               allocations=[alloc("x", "small-gpu1", 1, 1, ws="other")])
    a = grant(st, req(whole=True, ws="v"))
    assert a.gpu_uuids == ("small-gpu0",) and a.memory_mib == 40 * GIB
    d = st.decide(req(whole=True, ws="v"))
    assert d.kind == "wait" and "50 GiB of GPU memory; 40 GiB are in use" in d.reason
