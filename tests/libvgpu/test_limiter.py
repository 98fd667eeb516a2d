"""The cores limiter without multi-second transients: within 1 s of a cold start, and of a
resume after idle, a container's share of the simulated GPU is within ±5 points of its limit,
for kernels and for 200 ms graphs, inside a pid namespace too; a short burst of tiny kernels
after a pause is not throttled to a probe rate."""

from __future__ import annotations

import pytest

from .harness import limiter_rates

LIMIT = 30


def utils(result) -> list[float]:
    assert result.returncode == 0, result.stderr
    return [float(kv["util"]) for kv in result.all("util")]


# util:WARM:MEASURE:US:KIND  (graphs: 4 nodes of US/4 each)
CASES = {"kernels": "500:kernel", "graphs-200ms": "200000:graph"}


# (kernels inside a pid namespace: test_pidns.py)
@pytest.mark.parametrize(("work", "in_pidns"), [(CASES["kernels"], False),
                                                (CASES["graphs-200ms"], False),
                                                (CASES["graphs-200ms"], True)],
                         ids=["kernels", "graphs-200ms", "graphs-200ms-pidns"])
def test_the_share_is_within_5_points_1s_after_a_cold_start(node, work, in_pidns, request):
    pidns = request.getfixturevalue("pidns") if in_pidns else False
    box = node.container("c", f"cores_percent={LIMIT}")
    r = box.run("init", "ctx", f"util:1:2:{work}", pidns=pidns)
    (measured,) = utils(r)
    assert LIMIT - 5 <= measured <= LIMIT + 5


@pytest.mark.parametrize("work", [CASES["graphs-200ms"]], ids=["graphs-200ms"])
def test_the_share_is_within_5_points_1s_after_idle(node, work):
    box = node.container("c", f"cores_percent={LIMIT}")
    r = box.run("init", "ctx", "util:1:1:500:kernel", "sleep:3500", f"util:1:2:{work}")
    measured = utils(r)[-1]
    assert LIMIT - 5 <= measured <= LIMIT + 5


def test_tiny_kernels_after_a_pause_are_not_throttled(node):
    box = node.container("c", f"cores_percent={LIMIT}")
    r = box.run("init", "ctx", "util:0.5:0.5:500:kernel", "sleep:3500", "burst:100:10")
    assert r.rcs("burst") == [0]
    # 100 launches of 10 us: 1 ms of GPU time, well inside the bucket; a probe rate of a few
    # launches per 50 ms window would take 300 ms
    assert r.num("burst", "ms") < 120


def test_long_kernels_are_held_within_5_points_from_a_cold_start(node):
    box = node.container("c", f"cores_percent={LIMIT}")
    (measured,) = utils(box.run("init", "ctx", "util:1:2:50000:kernel"))  # 50 ms kernels
    assert LIMIT - 5 <= measured <= LIMIT + 5


def test_two_processes_share_the_limit_from_a_cold_start_with_big_graphs(node):
    box = node.container("c", f"cores_percent={LIMIT}")
    first = box.start("init", "ctx", "ready", "util:1:3:200000:graph:all", wait_for="ready")
    second = box.run("init", "ctx", "util:1:3:200000:graph:all")
    out, _ = first.communicate(timeout=60)
    both = [utils(second)[0], float(out.split("util=")[1].split()[0])]
    for measured in both:  # each sees the container's total on the card
        assert LIMIT - 5 <= measured <= LIMIT + 5


# The NVML double samples per-process utilisation as a driver does: one integer percent per
# process per 167 ms period (CUDA_DOUBLE_UTIL_SAMPLE_MS), newer than lastSeenTimeStamp.
@pytest.mark.parametrize(("limit", "work"), [(30, "20000:kernel"), (30, "200000:kernel"),
                                             (50, "100000:graph"), (20, "200000:graph"),
                                             (80, "200000:kernel")],
                         ids=["30-20ms", "30-200ms", "50-graph100ms", "20-graph200ms", "80-200ms"])
def test_long_launches_hold_the_limit_against_sampled_utilisation(node, limit, work):
    box = node.container("c", f"cores_percent={limit}")
    r = box.run("init", "ctx", f"util:1:2:{work}", "sleep:3200", f"util:1:2:{work}")
    cold, after_idle = utils(r)
    assert limit - 5 <= cold <= limit + 5
    assert limit - 5 <= after_idle <= limit + 5


def test_a_slice_beside_a_neighbour_that_keeps_work_queued_is_held_at_its_limit_not_below(node):
    """A 25 % slice of 2 ms kernels beside a slice with no cores limit (a memory-only profile)
    that keeps 80 ms of kernels queued on the card: each of its launches waits behind that work
    and runs 80 ms after the limiter let it through, so a window of NVML samples holds launches
    let through in the one before, and the first windows after a change of rate mislead (too
    few launches ran while the rate rose, too many while it fell). Its limiter must still settle
    at the launch's real cost (2 ms: 25 %), not ratchet its estimate up while the card is busy
    (it set 3.5-4.9 ms, 10-14 %, and kept it as long as the neighbour ran). Asserted on the
    limiter's decisions (its LIBVGPU_DEBUG lines): every estimate it set from 2 s on, over the
    4 s it runs, within 5 points of its 25 % (it settles in 1.5-1.7 s here; alone on the card,
    within 1 s: test_the_share_is_within_5_points_1s_after_a_cold_start)."""
    neighbour = node.container("hog", "memory_mib=1024")
    hog = neighbour.start("init", "ctx", "ready", "util:0:30:2000:kernel", wait_for="ready",
                          env={"CUDA_DOUBLE_QUEUE": "40"})
    r = node.container("c", "cores_percent=25").run("init", "ctx", "util:1:3:2000:kernel",
                                                      env={"LIBVGPU_DEBUG": "1"})
    hog.kill()
    assert r.rcs("util") == [0], r.stderr
    rates = limiter_rates(r.stderr, 25, 2000)
    print("the rate each window set (ms, %):", rates)
    settled = [rate for ms, rate in rates if ms >= 2000]
    assert len(settled) >= 8 and all(20 <= share <= 30 for share in settled), (settled, r.stderr)
