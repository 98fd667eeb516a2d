"""Shortcuts that make decisions and move searches cheap at scale (issue 25) choose exactly what
the plain paths choose, on random heterogeneous pools the admission core filled and churned."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from quotas import AdmissionState, Owner, load_config, node_victims
from quotas import queue as queue_module
from quotas.preemption import VictimSearch

from .builders import CLASSES
from .test_quotas_fast_placement import churned_states, random_pool, random_request


@pytest.mark.parametrize("seed", range(4))
def test_the_indexed_single_victim_is_the_one_a_walk_in_preference_order_finds(seed, monkeypatch):
    # the walk of every eligible allocation in preference order is the definition; the card
    # index (with its filters of nodes and of CPU and host memory) must give the same decision,
    # and so must the default (a multi-card request goes straight to the index: scan_budget_cards)
    compared = preempted = several_cards = 0
    for st, rng in churned_states(seed, {"node": "fgd", "gpu": "binpack"}, 12, 200):
        r = random_request(rng, 30_000, classes=("high",))
        monkeypatch.setattr(VictimSearch, "scan_budget", 1 << 30)
        monkeypatch.setattr(VictimSearch, "scan_budget_cards", 1 << 30)
        walked = st.decide(r, now=1e6)
        monkeypatch.undo()
        default = st.decide(r, now=1e6)
        monkeypatch.setattr(VictimSearch, "scan_budget", 0)
        indexed = st.decide(r, now=1e6)
        monkeypatch.undo()
        for got in (indexed, default):
            assert (got.kind, got.allocation, got.victims) == (walked.kind, walked.allocation, walked.victims), r
        compared += 1
        one = walked.kind == "preempt" and len(walked.victims) == 1
        preempted += one
        several_cards += one and r.count > 1
    assert compared == 200 and preempted > 10 and several_cards > 2


@pytest.mark.parametrize("seed", range(4))
def test_a_decision_without_the_victim_search_is_the_same_grant_or_a_wait(seed):
    compared = preempts = 0
    for st, rng in churned_states(seed, {"node": "fgd", "gpu": "binpack"}, 12, 150):
        r = random_request(rng, 40_000, classes=("high", "default", "low"))
        full, plain = st.decide(r, now=1e6), st.decide(r, now=1e6, preempt=False)
        if full.kind == "preempt":
            preempts += 1
            assert plain.kind == "wait" and plain.reason
        else:
            assert (plain.kind, plain.allocation, plain.reason) == (full.kind, full.allocation, full.reason)
        compared += 1
    assert compared == 150 and preempts > 5


@pytest.mark.parametrize("seed", range(6))
def test_move_search_skipping_places_by_a_bound_proposes_what_weighing_every_place_proposes(seed, monkeypatch):
    # propose_moves tries the TRIES places with the fewest moves; it skips a node whose lower
    # bound on moves cannot beat them. Never skipping must propose the same moves.
    monkeypatch.setattr(queue_module, "TRIES", 2)  # small pools still have places past the cut
    plain = queue_module._fewest_moves
    bounds: list[int] = []

    def bound(*args):
        bounds.append(plain(*args))
        return bounds[-1]

    compared = proposed = 0
    for step, (st, rng) in enumerate(churned_states(seed, {"node": "binpack", "gpu": "binpack"}, 16, 240)):
        r = random_request(rng, 50_000 + step, classes=("default",))
        if rng.random() < 0.4:
            r = dataclasses.replace(r, whole=True)
        if st.decide(r, now=1e6).kind != "wait":
            continue
        monkeypatch.setattr(queue_module, "_fewest_moves", lambda *args: 0)
        every = queue_module.propose_moves(st, r, now=1e6)
        monkeypatch.setattr(queue_module, "_fewest_moves", bound)
        skipping = queue_module.propose_moves(st, r, now=1e6)
        assert skipping == every, r
        compared += 1
        proposed += every is not None
    assert compared > 40 and proposed > 3
    assert any(b > 1 for b in bounds)  # the bound says something



def plain_quota_fixable(search: VictimSearch) -> bool:
    """The definition: evict every candidate of the widest level in deficit (walked one by one),
    give each limited level back what they charge it, and ask the quota again."""
    t = search._trial()
    for a in search._quota_candidates():
        for i in search._members(a):
            for r in range(3):
                t.back[i][r] += search.st._charges[a.id][r]
    return search._quota_ok(t, search.low)


@pytest.mark.parametrize("seed", range(4))
def test_whether_evictions_could_fix_a_quota_is_what_walking_the_candidates_says(seed, monkeypatch):
    rng = random.Random(seed)
    gib = 1024
    workspaces = {f"ws{w}": {"limits": {"memory_mib": rng.choice([60, 120, 400]) * gib},
                             "namespaces": {f"ns{n}": {"limits": {"memory_mib": rng.choice([40, 80, 200]) * gib},
                                                       "user_limits": {"gpus": rng.choice([2, 4, 8])}}
                                            for n in range(2)}}
                  for w in range(3)}
    st = AdmissionState(load_config({"priority_classes": CLASSES, "workspaces": workspaces}), random_pool(rng, 12))
    fixable = VictimSearch._quota_fixable
    answers = []

    def checked(self):
        got = fixable(self)
        assert got == plain_quota_fixable(self)
        answers.append(got)
        return got

    monkeypatch.setattr(VictimSearch, "_quota_fixable", checked)
    for i in range(400):
        r = random_request(rng, i, classes=("high", "default", "low", "lowest", "high"))
        owner = Owner(f"u{rng.randrange(4)}", f"ns{rng.randrange(2)}", f"ws{rng.randrange(3)}")
        r = dataclasses.replace(r, owner=owner)
        d = st.decide(r, now=float(i))
        if d.granted:
            st.apply(d)
        if st.allocations and rng.random() < 0.3:
            st.remove(rng.choice(sorted(st.allocations)))
    assert answers.count(True) > 10 and answers.count(False) > 10  # both answers occur


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("nested", [True, False])
def test_a_levels_own_victims_are_those_a_walk_of_every_allocation_finds(seed, nested, monkeypatch):
    # the single victim for a short quota and the quota's candidates are read from a slice of
    # the level's own victim order (kept per workspace, namespace and user); the definition:
    # every allocation that counts against the level, of a lower priority value, by victim key.
    # (nested: namespace and user limits too; else only workspace limits: long walks)
    rng = random.Random(seed)
    workspaces = {f"ws{w}": {"limits": {"memory_mib": rng.choice([60, 120, 400] if nested else [300, 500]) * 1024},
                             "namespaces": {f"ns{n}": {"limits": {"memory_mib": rng.choice([40, 80, 200]) * 1024},
                                                       "user_limits": {"gpus": rng.choice([2, 4, 8])}}
                                            if nested else {} for n in range(2)}}
                  for w in range(3 if nested else 1)}
    st = AdmissionState(load_config({"priority_classes": CLASSES, "workspaces": workspaces}), random_pool(rng, 12))
    sliced = VictimSearch._owned_eligible
    found: list[int] = []

    def checked(self, level):
        got = sliced(self, level)
        plain = sorted(
            st._key[a.id] for a in st.allocations.values()
            if not a.borrowed and VictimSearch._belongs(a, level)
            and self.pc.preempt and st._key[a.id][1] < self.pc.value
        )
        assert got == plain, level
        found.append(len(got))
        return got

    chunked = VictimSearch._charging

    def charging(self, keys):
        # the chunked filter yields what one filter of every key yields, in the same order
        got = list(chunked(self, keys))
        plain = [st.allocations[k[3]] for k in keys
                 if all(st._charges[k[3]][r] >= need for _, r, need in self.deficits)]
        assert got == plain
        return iter(got)

    monkeypatch.setattr(VictimSearch, "_owned_eligible", checked)
    monkeypatch.setattr(VictimSearch, "_charging", charging)
    kinds = set()
    for i in range(400):
        r = random_request(rng, i, classes=("high", "default", "low", "lowest", "high"))
        owner = Owner(f"u{rng.randrange(4)}", f"ns{rng.randrange(2)}", f"ws{rng.randrange(3 if nested else 1)}")
        d = st.decide(dataclasses.replace(r, owner=owner), now=float(i))
        kinds.add(d.kind)
        if d.granted:
            st.apply(d)
        if st.allocations and rng.random() < 0.3:
            st.remove(rng.choice(sorted(st.allocations)))
    assert sum(1 for n in found if n) > (20 if nested else 3) and "preempt" in kinds  # levels with victims asked


def test_the_chunked_filter_of_a_long_level_order_keeps_what_charges_every_deficit_in_order():
    # the walks above are short (small pools); here orders of up to 600 keys, past many chunks
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randrange(600)
        keys = sorted((1, rng.randrange(5), -float(i), f"a{i}") for i in range(n))
        charges = {k[3]: (rng.randrange(100), rng.randrange(100), rng.randrange(1, 9)) for k in keys}
        deficits = [(None, r, rng.randrange(1, 100)) for r in rng.sample(range(3), rng.randint(1, 2))]
        search = SimpleNamespace(st=SimpleNamespace(_charges=charges, _allocs={k[3]: k[3] for k in keys}),
                                 deficits=deficits)
        got = list(VictimSearch._charging(search, keys))
        assert got == [k[3] for k in keys if all(charges[k[3]][r] >= need for _, r, need in deficits)]


def plain_victims_at_least(search: VictimSearch, ni: int) -> int:
    """The definition of the bound: per card to clear the fewest of its evictable charges that
    make room (sorted, the largest first), the short cards' cheapest, covered by the node's
    evictable allocations, the widest first (each counts on every card it holds)."""
    ix, a, p = search.ix, search.ask, search.p
    needs, ready = [], 0
    for gi in (ix.wgpus if a.whole else ix.sgpus)[ni].get(a.group, ()):
        mine = [charge for aid, charge in ix.on[gi].items() if ix.elig[aid][p]]
        if a.whole:
            if not ix.on[gi]:
                ready += 1
            elif len(mine) == len(ix.on[gi]):
                needs.append(len(mine))
            continue
        need = (a.m - ix.cap_m[gi] + ix.used_m[gi], a.c - ix.cap_c[gi] + ix.used_c[gi])
        if need[0] <= 0 and need[1] <= 0:
            ready += 1
            continue
        n = max(node_victims._fewest([charge[r] for charge in mine], need[r]) for r in range(2))
        if n < node_victims.NEVER:
            needs.append(n)
    short = a.k - ready
    if short <= 0:
        return 0
    if len(needs) < short:
        return node_victims.NEVER
    cover = sum(sorted(needs)[:short])
    spans = sorted((len(v.gpu_uuids) for aid, v in ix.node_allocs[ni].items() if ix.elig[aid][p]), reverse=True)
    for n, span in enumerate(spans, 1):
        cover -= span
        if cover <= 0:
            return n
    return node_victims.NEVER


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_on_a_nodes_victims_is_its_definition(seed, monkeypatch):
    # _victims_at_least reads one victim per card from the index's largest evictable charges
    # and counts victims when none holds several cards; the definition sorts both
    bounds = []
    run = VictimSearch.run

    def checked(self):  # every node, for each search's request and class
        for ni in range(len(self.ix.node_names)):
            got = self._victims_at_least(ni)
            assert got == plain_victims_at_least(self, ni), (self.ask, ni)
            bounds.append((got, self.ix.span_max[ni]))
        return run(self)

    monkeypatch.setattr(VictimSearch, "run", checked)
    for st, rng in churned_states(seed, {"node": "fgd", "gpu": "binpack"}, 10, 200):
        r = random_request(rng, 60_000)
        if rng.random() < 0.5:
            r = dataclasses.replace(r, count=rng.choice([2, 4, 8]), whole=rng.random() < 0.3)
        st.decide(r, now=1e6)
    # bounds of several values, where victims hold one card each and where some hold more
    assert len({b for b, span in bounds if span == 1}) > 3 and len({b for b, span in bounds if span > 1}) > 3


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_a_one_model_request_short_of_cpu_takes_the_cheapest_victim_on_any_card_of_the_node(budget, monkeypatch):
    # the node's CPU is all taken; its A100 holds a default kernel, its T4 a lowest one. A high
    # request for an A100 slice needs 2 cores: evicting the lowest kernel gives them and costs
    # less than the default one, though it holds a card of another model. The walk (a large scan
    # budget) once looked only at the A100's kernels and evicted the default one; the index did not.
    from dataclasses import replace

    from .builders import alloc, node, pool, req, state

    n = replace(node("n", 1, model="A100-80GB"), cpu_millicores=4_000)
    n = replace(n, gpus=(*n.gpus, replace(node("n", 1, model="T4-16GB", memory_mib=16 * 1024).gpus[0],
                                          uuid="n-gpu1", index=1)))
    st = state(pool(n), allocations=[
        alloc("dflt", "n-gpu0", 70, 90, pc="default", cpu_millicores=2_000),
        alloc("cheap", "n-gpu1", 4, 25, pc="lowest", cpu_millicores=2_000),
    ])
    monkeypatch.setattr(VictimSearch, "scan_budget", budget)
    d = st.decide(req(memory_gib=10, cores=10, model="A100-80GB", priority_class="high", rid="r",
                      cpu_millicores=2_000), now=1e6)
    assert d.kind == "preempt", d.reason
    assert [v.id for v in d.victims] == ["cheap"]
