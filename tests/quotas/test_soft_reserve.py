"""Room kept for a swapped-out kernel's resume (quotas/reserve.py): a new request goes elsewhere
where it can, takes the reserved room only where nothing else fits, and the kernel's own resume
finds its room; the default placement (fgd) and binpack alike."""

import pytest

from quotas import Placement, SoftReservation

from .builders import GIB, alloc, grant, node, pool, req, state

#: alice's kernel, swapped out from a-gpu0 (20 GiB, 50 %), will come back there
SWAPPED = {"alice-kernel": SoftReservation(("a-gpu0",), 20 * GIB, 50)}


@pytest.mark.parametrize("placement", ["fgd", "binpack"])
def test_a_new_slice_goes_elsewhere_where_it_can_and_into_the_reserved_room_only_where_nothing_else_fits(placement):
    # a-gpu0 holds 40 GiB: binpack and fgd alike put a 40 GiB slice there (it fills the card)
    st = state(pool(node("a", 1), node("b", 1)), allocations=[alloc("x", "a-gpu0", 40, 25)],
               placement={"node": placement, "gpu": placement})  # fmt: skip
    assert grant(st, req("carol", 40, 25, rid="probe")).gpu_uuids == ("a-gpu0",)  # without the reservation
    st.remove("probe")
    st.index.soft.replace(st.index, SWAPPED)  # alice's 20 GiB kernel, swapped out from a-gpu0
    assert grant(st, req("carol", 40, 25, rid="c1")).gpu_uuids == ("b-gpu0",)  # alice's room is kept
    assert grant(st, req("dave", 40, 25, rid="d1")).gpu_uuids == ("b-gpu0",)
    # b-gpu0 is full: nothing else fits, so the next slice takes the reserved room
    assert grant(st, req("erin", 40, 25, rid="e1")).gpu_uuids == ("a-gpu0",)
    # alice's resume asks (her reservation dropped): her card has no room left now, so it waits
    st.index.soft.replace(st.index, {})
    assert st.decide(req("alice", 20, 50, rid="r", pinned_uuids=("a-gpu0",))).kind == "wait"
    st.remove("e1")
    assert grant(st, req("alice", 20, 50, rid="r", pinned_uuids=("a-gpu0",))).gpu_uuids == ("a-gpu0",)


def test_the_kernels_own_resume_and_a_whole_card_see_the_reserved_room_as_theirs_only_when_needed():
    st = state(pool(node("a", 1), node("b", 1)))
    st.index.soft.replace(st.index, SWAPPED)
    assert grant(st, req("carol", whole=True, rid="w1")).gpu_uuids == ("b-gpu0",)  # not the reserved card
    assert grant(st, req("dave", whole=True, rid="w2")).gpu_uuids == ("a-gpu0",)  # nothing else
    st.remove("w2")
    st.index.soft.replace(st.index, {})  # alice asks: her own room
    assert grant(st, req("alice", 20, 50, rid="r", pinned_uuids=("a-gpu0",))).gpu_uuids == ("a-gpu0",)


def test_reservations_outlive_an_inventory_change_and_leave_the_index_as_it_was():
    st = state(pool(node("a", 1), node("b", 1)))
    before = (list(st.index.used_m), list(st.index.used_c), list(st.index.nalloc))
    st.index.soft.replace(st.index, SWAPPED)
    st.set_pool(pool(node("a", 1), node("b", 1), node("c", 1)))  # a node came
    assert grant(st, req("carol", 70, 25, rid="c1")).gpu_uuids != ("a-gpu0",)
    st.remove("c1")
    st.index.soft.replace(st.index, {})
    assert (st.index.used_m[:2], st.index.used_c[:2], st.index.nalloc[:2]) == tuple(v[:2] for v in before)
    assert Placement().node == "fgd"  # the product's default is the one tested above
