"""Fragmentation-aware placement (FGD): the card whose leftover still fits the expected mix."""

from __future__ import annotations

import random
from dataclasses import replace

from quotas.mix import Mix

from .builders import GIB, alloc, grant, node, pool, req, state

FGD = {"node": "fgd", "gpu": "fgd"}


def test_fgd_keeps_the_leftover_usable_where_binpack_takes_the_tightest_card():
    # card 0 has 40 GiB free, card 1 60 GiB; most recent requests were 30 GiB
    held = [alloc("x", "a-gpu0", 40), alloc("y", "a-gpu1", 20)]
    for placement, card in (({"node": "binpack", "gpu": "binpack"}, "a-gpu0"), (FGD, "a-gpu1")):
        st = state(pool(node("a", 2)), allocations=held, placement=placement)
        for i in range(8):  # the recent past the mix learns from
            st.add(alloc(f"h{i}", "a-gpu1", 30))
            st.remove(f"h{i}")
        # binpack: 40 -> 10 GiB left, too small for the next 30 GiB; fgd: 60 -> 30, still fits
        assert grant(st, req(memory_gib=30, rid="new")).gpu_uuids == (card,), placement


def test_fgd_puts_a_small_slice_beside_others_not_on_an_empty_card_kept_for_whole_requests():
    st = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 60)], placement=FGD)
    for i in range(3):  # recent whole-card requests elsewhere make empty cards valuable
        st.apply(st.decide(req(whole=True, rid=f"w{i}")))
        st.remove(f"w{i}")
    assert grant(st, req(memory_gib=10, rid="s")).gpu_uuids == ("a-gpu0",)


def test_the_ledger_is_the_recent_past_fgd_learns_from():
    st = state(pool(node("a", 1), node("b", 1)), allocations=[alloc("x", "a-gpu0", 50),
                                                               alloc("y", "b-gpu0", 30)],
               placement=FGD)
    # expected: 50 and 30 GiB slices, half each. a has 30 GiB free, b 50. A 25 GiB slice on b
    # leaves 25 GiB, too small for either kind (b loses its 50 and its 30 GiB spot); on a it
    # only costs the 30 GiB spot a had. Binpack agrees here; spread would take b.
    assert grant(st, req(memory_gib=25)).node == "a"


def test_with_nothing_seen_yet_fgd_keeps_room_for_more_of_the_same():
    st = state(pool(node("a", 2)), placement=FGD)
    assert len(st._index.mix) == 0
    assert grant(st, req(memory_gib=50, rid="one")).gpu_uuids == ("a-gpu0",)
    # another 50 GiB does not fit beside the first, and a 30 GiB one would take the 30 GiB left
    # on gpu0 rather than break the empty card that 50 GiB requests need
    assert grant(st, req(memory_gib=30, rid="two")).gpu_uuids == ("a-gpu0",)


def test_the_mix_is_the_most_frequent_recent_shapes():
    mix = Mix(window=4, top=2)
    for shape in [(1, 1, 1, False, 0, 0)] * 3 + [(2, 2, 1, False, 0, 0), (3, 3, 1, False, 0, 0)]:
        mix.add(shape)
    # the window keeps the last 4: (1)x2, (2), (3); the top 2 are (1) and the first other seen
    types = dict(mix.types())
    assert types[(1, 1, 1, False, 0, 0)] == 2 / 3 and len(types) == 2 and len(mix) == 4


def test_the_mixs_shapes_are_counter_most_common_ones_with_its_ties():
    # Mix.types sorts the counts once instead of Counter.most_common's heap (issue 25: it runs on
    # every decision after a grant); ties go to the shape counted first, as most_common's do, so
    # fgd weighs the same shapes as before
    rng = random.Random(5)
    mix = Mix(window=24, top=4)
    for _ in range(600):
        mix.add((rng.choice([1, 2, 3, 4, 5, 6, 7]), 10, rng.choice([1, 1, 2]), rng.random() < 0.1, 0, 0))
        expected = sorted(mix._counts.most_common(4))
        assert [(t[:4], p) for t, p in mix.types()] == [(gpu, n / sum(k for _, k in expected)) for gpu, n in expected]


def test_fgd_keeps_cpu_for_the_gpus_of_a_node_short_of_cpu():
    # two nodes of two cards; "poor" has 4 CPU cores a card, "rich" 16. Half-card kernels
    # arrive, heavy (7 cores) and light (1 core) in turn: all eight fit if the light ones go to
    # the poor node. Sent to the rich node beside the heavy ones, the light ones leave the poor
    # node's cards to heavy kernels its CPU can serve two of, and the last heavy ones are refused
    # with a card and a half free there.
    nodes = [replace(node("poor", 2), cpu_millicores=8_000, host_memory_mib=512 * GIB),
             replace(node("rich", 2), cpu_millicores=32_000, host_memory_mib=512 * GIB)]
    st = state(pool(*nodes), placement={"node": "fgd", "gpu": "binpack"})
    refused = []
    for i in range(8):
        d = st.decide(req(memory_gib=40, cores=50, rid=f"k{i}", cpu_millicores=7_000 if i % 2 == 0 else 1_000))
        if d.kind == "grant":
            st.apply(d)
        else:
            refused.append(f"k{i}")
    assert refused == []
    assert {a.node for a in st.allocations.values() if a.cpu_millicores == 1_000} == {"poor"}
