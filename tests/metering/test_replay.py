"""The replay engine of `elastic-gpu simulate` and bench/density.py: idle timeouts split a session
into holds around its bursts, the placement policy is the admission core's, and the density
benchmark's generated trace is what it claims (sessions of hours, ~20 % busy at the median)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import statistics
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from hubext.metering.replay import Scenario, Session, requests_of, run_scenario, slice_profiles
from quotas import Placement
from quotas.moving import MOVE_RETRY_SECONDS
from tests.hubrunner import REPO


def test_an_idle_timeout_splits_a_session_into_holds_around_its_bursts():
    s = Session("s", 1000.0, 3600.0, 0.25, bursts=((0.0, 60.0), (300.0, 60.0), (2000.0, 100.0)))
    # held from the start until 600 s after the burst ending at 360 s; culled; asked again at 2000 s
    assert s.holds(600.0) == [(0.0, 960.0), (2000.0, 700.0)]
    assert s.holds(None) == [(0.0, 3600.0)]
    assert Session("idle", 0.0, 3600.0, 0.25, bursts=()).holds(600.0) == [(0.0, 600.0)]  # never used the GPU
    assert Session("unknown", 0.0, 3600.0, 0.25).holds(600.0) == [(0.0, 3600.0)]  # no timeline: held throughout
    requests = requests_of([s], Scenario(profiles=(0.5, 1.0), idle_timeout_seconds=600.0))
    assert [(r.arrival, r.duration, r.label) for r in requests] == [(1000.0, 960.0, "1/2"), (3000.0, 700.0, "1/2")]


def test_the_placement_policy_of_a_scenario_is_the_admission_cores():
    """Two half-card sessions then a whole-card one on a 2-GPU node: binpack puts the halves on one
    card and the whole card starts at once; spread puts them on both cards and it waits an hour."""
    sessions = [Session("a", 0.0, 7200.0, 0.5), Session("b", 1.0, 3600.0, 0.5), Session("c", 2.0, 600.0, 1.0)]
    waits = {}
    for policy in ("binpack", "spread"):
        scenario = Scenario(name=policy, placement=Placement(node=policy, gpu=policy), gpus=2, gpus_per_node=2)
        result = run_scenario(sessions, scenario, model="H100-80GB", memory_mib=81920)
        waits[policy] = result.class_waits
    assert waits["binpack"] == {"1/2": 0.0, "whole": 0.0}
    assert waits["spread"] == {"1/2": 0.0, "whole": 3599.0}  # until b leaves at 3601 s


def _density():
    spec = importlib.util.spec_from_file_location("density", REPO / "bench" / "density.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_density_trace_is_sessions_of_hours_about_20_percent_busy_and_seeded():
    density = _density()
    trace = density.notebook_trace(seed=7)
    assert trace == density.notebook_trace(seed=7) and trace != density.notebook_trace(seed=8)
    assert 1.5 < statistics.median(s.duration for s in trace) / 3600 < 4
    assert 0.15 < statistics.median(density.utilisation(s) for s in trace) < 0.25
    assert max(length for s in trace for _, length in s.bursts) < 0.5 * 3600  # bursts are short


def test_the_density_bench_prints_its_line():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _density().main(
            ["--users", "25", "--days", "1", "--seed", "3", "--timeouts", "600", "--reserve-after", "60,20"]
        )
    lines = out.getvalue().splitlines()
    # each queue pool size also shows first-come and the default where nothing can fragment
    ideal = [re.fullmatch(r"queue gpus=(\d+) queue='(first-come|default)' ideal_pool: (.*) worst=(\d+)s", x)
             for x in lines if "ideal_pool" in x]
    sizes = sorted({int(x.split()[1].split("=")[1]) for x in lines if x.startswith("queue gpus=")})
    assert len(ideal) == 2 * len(sizes) == 4 and all(ideal), lines
    for m in ideal:
        assert int(m[4]) == max(int(w.split("=")[1]) for w in m[3].split()), m[0]
    swaps = [line.split(":")[0] for line in lines if line.startswith("swap ")]
    assert swaps == ["swap idle_timeout=600s reserve_after=60s", "swap idle_timeout=600s reserve_after=20s"], swaps
    line = out.getvalue().splitlines()[-1]
    m = re.fullmatch(
        r"density whole_card_gpus=(\d+) fractional_gpus=(\d+) kernels_culled_gpus=(\d+) ratio=([\d.]+)", line
    )
    assert m, line
    whole, fractional, culled, ratio = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    assert whole >= fractional >= culled >= 1 and ratio == round(whole / culled, 2)


sessions_strategy = st.lists(
    st.builds(
        lambda i, arrival, duration, share, count: Session(f"s{i}", arrival, duration, share, count),
        st.integers(0, 10**6),
        st.floats(0, 20_000, allow_nan=False),
        st.floats(1, 8_000, allow_nan=False),
        st.sampled_from([0.1, 0.125, 0.25, 0.3, 0.5, 0.6, 1.0]),
        st.sampled_from([1, 1, 1, 2]),
    ),
    min_size=1,
    max_size=25,
    unique_by=lambda s: s.id,
)


@settings(max_examples=40, deadline=None)
@given(sessions=sessions_strategy, slice_=st.sampled_from([None, 0.25, 0.5, 1.0]))
def test_the_pool_found_is_the_smallest_whose_waits_fit(sessions, slice_):
    """Property: the answer keeps every size class's p95 wait within 30 s, one GPU fewer does not
    (checked by replaying both sizes in full), and a card per GPU asked never makes anyone wait."""
    scenario = Scenario(profiles=slice_profiles(slice_) if slice_ else (), gpus_per_node=4)
    found = run_scenario(sessions, scenario, model="H100-80GB", memory_mib=81920)
    assert found.gpus is not None

    def worst(n: int) -> float:
        fixed = replace(scenario, gpus=n)
        return run_scenario(sessions, fixed, model="H100-80GB", memory_mib=81920).wait

    assert worst(found.gpus) <= 30
    if found.gpus > 1:
        assert worst(found.gpus - 1) > 30
    plenty = sum(s.count for s in sessions) + 4  # every GPU asked on its own card, nodes of 4
    assert worst(plenty) == 0.0


def test_the_density_benchs_ideal_pool_cannot_fragment():
    """The no-fragmentation reference of bench/density.py's swap lines is a pool run through the
    same queue with the same criterion: four half-card servers fill two cards, one on each card
    leaves, and a whole-card server waits for a card on the real pool (so it needs three cards)
    while the ideal pool (one card of both cards' memory and compute) starts it at once."""
    hubqueue = _density().hubqueue
    halves = [("a", 0.0, 100.0), ("b", 1.0, 10_000.0), ("c", 2.0, 100.0), ("d", 3.0, 10_000.0)]
    uses = [hubqueue.Use(i, i, at, length, 0.5, False, ()) for i, at, length in halves]
    uses.append(hubqueue.Use("e", "e", 200.0, 100.0, 1.0, False, ()))
    default = hubqueue.QUEUES["default"]
    assert hubqueue.run(uses, 2, default, 60.0).p95("whole") == 10_001.0 - 200.0
    assert hubqueue.run(uses, 2, default, 60.0, pooled=True).p95("whole") == 0.0
    assert hubqueue.smallest_pool(uses, default, 60.0)[0] == 3
    assert hubqueue.smallest_pool(uses, default, 60.0, pooled=True)[0] == 2


def test_fragmentation_by_idle_kernels_costs_no_card_over_the_ideal_pool_with_the_default_queue():
    """Issue 25's density goal on a pool small enough to reason about: four half-card GPU kernels
    fill two cards, one on each card leaves, and a whole-card kernel asks. The default queue must
    move one of the two idle kernels left in time for the 30 s wait target, so the real pool needs
    no more cards than the ideal one (one card of both cards' memory, where nothing fragments).
    A reservation made only after 60 s left the whole-card kernel waiting 60 s: a third card."""
    hubqueue = _density().hubqueue
    halves = [("a", 0.0, 100.0), ("b", 1.0, 10_000.0), ("c", 2.0, 100.0), ("d", 3.0, 10_000.0)]
    uses = [hubqueue.Use(i, i, at, length, 0.5, True, ((0.0, 10.0),)) for i, at, length in halves]
    uses.append(hubqueue.Use("e", "e", 200.0, 100.0, 1.0, True, ((0.0, 10.0),)))
    default, idle_timeout = hubqueue.QUEUES["default"], 10_000.0
    on_two = hubqueue.run(uses, 2, default, idle_timeout)
    assert on_two.moves == 1 and on_two.p95("whole") <= 30, (on_two.moves, on_two.waits)
    assert hubqueue.smallest_pool(uses, default, idle_timeout, pooled=True)[0] == 2
    assert hubqueue.smallest_pool(uses, default, idle_timeout)[0] == 2


def test_the_density_bench_moves_a_kernel_in_its_burst_live_as_the_broker_does_and_prefers_one_between_bursts():
    """The broker moves a kernel running a cell too (a live move: it resumes it at once elsewhere,
    its cell paused meanwhile), and tells the queue which run one so that it moves those only
    where no place needs fewer. The two idle half-card kernels of the test above now run a cell
    from 196 s and 198 s to 261 s and 263 s: the whole-card request that asked at 200 s is served
    at its 20 s reservation by a live move, the moved kernel back at once on the other card
    (before live moves it waited for the first cell to end: 61 s). With only one of them in a
    cell, the other moves, between its bursts."""
    hubqueue = _density().hubqueue
    burst = ((195.0, 65.0),)
    for cells, live in (("bd", 1), ("b", 0)):
        halves = [
            ("a", 0.0, 100.0, ()),
            ("b", 1.0, 10_000.0, burst if "b" in cells else ()),
            ("c", 2.0, 100.0, ()),
            ("d", 3.0, 10_000.0, burst if "d" in cells else ()),
        ]
        uses = [hubqueue.Use(i, i, at, length, 0.5, True, ((0.0, 10.0), *more)) for i, at, length, more in halves]
        uses.append(hubqueue.Use("e", "e", 200.0, 100.0, 1.0, True, ((0.0, 10.0),)))
        on_two = hubqueue.run(uses, 2, hubqueue.QUEUES["default"], 10_000.0)
        (waited,) = on_two.waits["whole"]
        assert (on_two.moves, on_two.live_moves) == (1, live) and 20 <= waited <= 20 + MOVE_RETRY_SECONDS + 1, (
            cells,
            on_two.moves,
            on_two.live_moves,
            waited,
        )
        assert on_two.pauses == [0.0] * live  # room for it elsewhere: asked again and granted at once


def test_loading_the_density_bench_shadows_no_package():
    """bench/ holds culler.py, a benchmark: a bench that puts bench/ first on sys.path made a later
    ``import culler`` (the package) find the benchmark instead, in whatever test ran next."""
    import importlib
    import sys

    _density()
    before = sys.modules.pop("culler", None)
    try:
        culler = importlib.import_module("culler")
        assert hasattr(culler, "__path__"), culler.__file__
    finally:
        if before is not None:
            sys.modules["culler"] = before
