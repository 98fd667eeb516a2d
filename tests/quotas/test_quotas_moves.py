"""Proposals to move slices so that a request waiting only on fragmentation starts now."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from quotas import GPU, Node
from quotas.queue import propose_moves

from .builders import alloc, node, pool, req, state


def _snapshot(s):
    return dict(s.allocations), s.usage(), list(s._mix._recent)


def test_a_whole_card_request_gets_the_one_move_that_frees_a_card():
    s = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 40), alloc("y", "a-gpu1", 30)])
    big = req(memory_gib=80, cores=100, whole=True, rid="big")
    assert s.decide(big).kind == "wait"  # 90 GiB free in all, no card free
    before = _snapshot(s)
    p = propose_moves(s, big, now=5.0)
    assert p is not None and len(p.moves) == 1
    (mv,) = p.moves
    assert mv.allocation.id == "y" and mv.to.gpu_uuids == ("a-gpu0",)  # the smaller one moves
    assert p.cards == ("a-gpu1",)
    assert _snapshot(s) == before  # nothing moved for real


def test_no_proposal_when_the_slices_have_nowhere_to_go_or_the_bound_is_too_small():
    s = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 60), alloc("y", "a-gpu1", 60)])
    big = req(memory_gib=80, cores=100, whole=True)
    assert propose_moves(s, big, now=0.0) is None  # 60 + 60 fit no card
    s2 = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 20), alloc("y", "a-gpu1", 10),
                                               alloc("z", "a-gpu1", 10, user="carol")])
    assert propose_moves(s2, big, now=0.0, up_to=0) is None
    assert len(propose_moves(s2, big, now=0.0, up_to=1).moves) == 1  # x moves to a-gpu1


def test_moves_make_room_for_the_node_cpu_too():
    n = Node("a", tuple(GPU(f"a-gpu{i}", "H100-80GB", 80 * 1024, index=i) for i in range(2)),
             cpu_millicores=8000, host_memory_mib=64 * 1024)
    m = Node("b", (GPU("b-gpu0", "H100-80GB", 80 * 1024),), cpu_millicores=8000, host_memory_mib=64 * 1024)
    s = state(pool(n, m), allocations=[
        alloc("x", "a-gpu0", 10, cpu_millicores=6000, host_memory_mib=1024),
        alloc("w", "b-gpu0", 80, cores=100, whole=True, cpu_millicores=1000),
    ])
    big = req(memory_gib=80, cores=100, whole=True, cpu_millicores=4000, host_memory_mib=1024)
    assert s.decide(big).kind == "wait"  # a-gpu1 is free but node a has only 2 CPUs left
    assert propose_moves(s, big, now=0.0) is None  # x fits nowhere else (b is whole)
    s.remove("w")
    p = propose_moves(s, big, now=0.0)
    assert p is not None and p.node == "a" and [mv.to.node for mv in p.moves] == ["b"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.sampled_from([4, 8, 10, 16, 20, 40]), max_size=4), min_size=6, max_size=6),
       st.booleans(), st.integers(1, 8))
def test_a_proposal_once_carried_out_lets_the_request_in_and_fits_every_card(per_card, whole, up_to):
    s = state(pool(node("a", 4), node("b", 2)))
    cards = ["a-gpu0", "a-gpu1", "a-gpu2", "a-gpu3", "b-gpu0", "b-gpu1"]
    for card, sizes in zip(cards, per_card, strict=True):
        used = 0
        for gib in sizes:
            if used + gib <= 80:
                s.add(alloc(f"s{len(s.allocations)}", card, gib, cores=gib))
                used += gib
    big = req(memory_gib=80 if whole else 60, cores=100 if whole else 60, whole=whole, rid="big")
    if s.decide(big).granted:
        event("fits already")
        return
    before = _snapshot(s)
    p = propose_moves(s, big, now=1.0, up_to=up_to)
    assert _snapshot(s) == before
    event("no proposal" if p is None else "a proposal")
    if p is None:
        return
    assert 1 <= len(p.moves) <= up_to
    for mv in p.moves:
        assert mv.to.id == mv.allocation.id and mv.to.gpu_uuids != mv.allocation.gpu_uuids
        assert (mv.to.memory_mib, mv.to.cores_percent, mv.to.owner) == (
            mv.allocation.memory_mib, mv.allocation.cores_percent, mv.allocation.owner)
        s.remove(mv.allocation.id)
    for mv in p.moves:
        s.add(mv.to)
    for g in s.usage()["gpus"]:
        assert g["memory_used_mib"] <= g["memory_capacity_mib"]
        assert g["cores_used_percent"] <= g["cores_capacity_percent"]
    assert s.decide(big).kind == "grant"


def test_a_kernel_running_a_cell_is_moved_only_where_no_place_without_one_is_found():
    # x (in a cell) is the smaller: without cells it moves; with them the idle y moves instead
    s = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 20), alloc("y", "a-gpu1", 30)])
    big = req(memory_gib=80, cores=100, whole=True, rid="big")
    assert [mv.allocation.id for mv in propose_moves(s, big, now=0.0).moves] == ["x"]
    p = propose_moves(s, big, now=0.0, in_cell=lambda a: a.id == "x")
    assert [(mv.allocation.id, mv.in_cell) for mv in p.moves] == [("y", False)]
    # both in cells: the fewest moves again, and the move says it is live
    p = propose_moves(s, big, now=0.0, in_cell=lambda a: True)
    assert [(mv.allocation.id, mv.in_cell) for mv in p.moves] == [("x", True)]
    # two moves of idle kernels come before one of a kernel in a cell
    s.add(alloc("z", "a-gpu1", 10))
    p = propose_moves(s, big, now=0.0, in_cell=lambda a: a.id == "x")
    assert sorted((mv.allocation.id, mv.in_cell) for mv in p.moves) == [("y", False), ("z", False)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from([4, 10, 16, 20, 30, 40]), st.booleans()), min_size=1, max_size=4),
                min_size=6, max_size=6), st.booleans(), st.integers(1, 8))
def test_no_kernel_in_a_cell_is_moved_where_a_place_needs_none(per_card, whole, up_to):
    s = state(pool(node("a", 4), node("b", 2)))
    cards = ["a-gpu0", "a-gpu1", "a-gpu2", "a-gpu3", "b-gpu0", "b-gpu1"]
    busy: set[str] = set()
    for card, sizes in zip(cards, per_card, strict=True):
        used = 0
        for gib, in_cell in sizes:
            if used + gib <= 80:
                aid = f"s{len(s.allocations)}"
                s.add(alloc(aid, card, gib, cores=gib))
                used += gib
                if in_cell:
                    busy.add(aid)
    big = req(memory_gib=80 if whole else 60, cores=100 if whole else 60, whole=whole, rid="big")
    if s.decide(big).granted:
        event("fits already")
        return
    idle_only = propose_moves(s, big, now=1.0, up_to=up_to, can_move=lambda a: a.id not in busy)
    p = propose_moves(s, big, now=1.0, up_to=up_to, in_cell=lambda a: a.id in busy)
    plain = propose_moves(s, big, now=1.0, up_to=up_to)
    event("lost" if p is None and plain else "found more" if p and plain is None else "same")
    for mv in p.moves if p else ():
        assert mv.in_cell == (mv.allocation.id in busy)
    event("a place without a cell" if idle_only else "cells must move" if p else "no proposal")
    if idle_only is not None:
        assert p is not None and not any(mv.in_cell for mv in p.moves), (p, idle_only.moves)
