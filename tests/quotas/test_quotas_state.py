"""AdmissionState bookkeeping: add, remove, replace, set_pool, apply."""

import pytest

from quotas import AdmissionState

from .builders import GIB, alloc, config, grant, node, pool, req, state


def test_remove_frees_the_capacity_and_returns_the_allocation():
    st = state(pool(node("a", 1)))
    a = grant(st, req(memory_gib=80, rid="k1"))
    assert st.decide(req()).kind == "wait"
    assert st.remove("k1") == a
    assert st.remove("k1") is None
    assert st.decide(req()).kind == "grant"


def test_adding_an_id_again_replaces_the_old_record():
    st = state(pool(node("a", 1)))
    st.add(alloc("k", "a-gpu0", 70))
    st.add(alloc("k", "a-gpu0", 10))
    assert len(st.allocations) == 1
    assert st.usage()["gpus"][0]["memory_used_mib"] == 10 * GIB
    assert st.decide(req(memory_gib=70)).kind == "grant"


def test_allocations_is_a_read_only_view():
    st = state(pool(node("a", 1)), allocations=[alloc("k", "a-gpu0")])
    with pytest.raises(TypeError):
        st.allocations["x"] = None  # type: ignore[index]
    assert st.allocations["k"].id == "k"


def test_set_pool_keeps_allocations_and_their_quota_even_on_cards_that_left():
    st = state(pool(node("a", 1), node("b", 1)), {"v": {"limits": {"memory_mib": 30 * GIB}}})
    grant(st, req(memory_gib=20, ws="v", rid="k"))
    gone = st.allocations["k"].node
    keep = "b" if gone == "a" else "a"
    st.set_pool(pool(node(keep, 1)))
    assert "k" in st.allocations
    d = st.decide(req(memory_gib=20, ws="v"))
    assert d.kind == "wait" and "20 GiB are in use" in d.reason
    assert [g["node"] for g in st.usage()["gpus"]] == [keep]
    st.set_pool(pool(node("a", 1), node("b", 1)))
    card = next(g for g in st.usage()["gpus"] if g["node"] == gone)
    assert card["allocations"] == ["k"]


def test_apply_removes_victims_and_records_the_grant():
    st = state(pool(node("a", 1)), allocations=[alloc("low", "a-gpu0", 80, pc="low")])
    d = st.decide(req(priority_class="high", rid="h"))
    assert st.apply(d).id == "h"
    assert list(st.allocations) == ["h"]
    assert st.apply(st.decide(req(memory_gib=80))) is None  # a wait changes nothing


def test_a_state_built_with_allocations_equals_one_fed_by_add():
    allocations = [alloc(f"k{i}", f"a-gpu{i % 2}", 5, 10, created_at=i) for i in range(6)]
    built = AdmissionState(config(), pool(node("a", 2)), allocations)
    fed = AdmissionState(config(), pool(node("a", 2)))
    for a in allocations:
        fed.add(a)
    assert built.usage() == fed.usage()
    assert built.decide(req(rid="x")) == fed.decide(req(rid="x"))
