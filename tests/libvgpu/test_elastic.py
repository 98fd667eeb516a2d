"""Elastic slices inside the card: a request the slice is guaranteed and a limit it may burst
to while the card has room (memory) or idle share (compute), given back in time."""

from __future__ import annotations

import re

from libvgpu import contract
from quotas import Allocation, Owner

from .harness import limiter_rates

MiB = 1 << 20
OOM = 2


def _allocation(memory_mib: int, cores: int, memory_limit: int = 0, cores_limit: int = 0) -> Allocation:
    return Allocation(
        id="a-1", owner=Owner(user="ann", namespace="default", workspace="default"), node="n",
        gpu_uuids=("GPU-0",), memory_mib=memory_mib, cores_percent=cores, priority_class="normal",
        memory_limit_mib=memory_limit, cores_limit_percent=cores_limit,
    )


def test_the_limits_file_of_an_elastic_allocation_names_its_burst_limits_and_the_shim_takes_it(node):
    text = contract.limits_file_text(_allocation(512, 25, 2048, 100), 0)
    assert "memory_limit_mib.0=2048\n" in text and "cores_limit_percent.0=100\n" in text
    fixed = contract.limits_file_text(_allocation(512, 25, 512, 25), 0)
    assert "limit" not in fixed.replace("limits", "")  # a limit equal to the request: not written
    box = node.container("c", text)
    r = box.run("init", "ctx", "alloc:256M")
    assert r.rcs("init") == [0] and r.rcs("alloc") == [0], r.stderr
    assert "invalid configuration" not in r.stderr


# ---- compute: work-conserving ----------------------------------------------------------------

def _elastic(node, name: str, limits: str):
    return node.container(name, f"name={name}\n{limits}", node_regions=True)


def test_an_elastic_slice_alone_on_the_card_runs_past_its_request_up_to_its_limit(node):
    elastic = _elastic(node, "e", "cores_percent=25\ncores_limit_percent=80")
    r = elastic.run("init", "ctx", "util:1:2:2000:kernel")
    assert r.rcs("util") == [0], r.stderr
    assert 70 <= r.num("util", "util") <= 88, r.stdout  # its limit, not its 25 % request
    fixed = _elastic(node, "f", "cores_percent=25")
    assert 20 <= fixed.run("init", "ctx", "util:1:2:2000:kernel").num("util", "util") <= 30


def _shares(stderr: str) -> list[int]:
    """The compute shares an elastic slice's limiter set, in turn (its LIBVGPU_DEBUG lines)."""
    return [int(m) for m in re.findall(r"compute share ([0-9]+)%", stderr)]


def test_a_busy_neighbour_gets_at_least_its_request_while_an_elastic_slice_bursts(node):
    burster = _elastic(node, "b", "cores_percent=25\ncores_limit_percent=100")
    proc = burster.start("init", "ctx", "ready", "util:1:8:2000:kernel", wait_for="ready",
                         env={"LIBVGPU_DEBUG": "1"})
    neighbour = _elastic(node, "n", "cores_percent=50")
    r = neighbour.run("init", "ctx", "util:1:3:2000:kernel")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "util rc=0" in out
    # the burster gave the busy neighbour its 50 %: its own 25 % and a third of the idle 25 %
    # (25 + 50 guaranteed: 25 x 25 / 75); alone it runs at its limit, 100 % (which of the two it
    # decides first depends on which process launches first)
    assert 33 in _shares(err) and set(_shares(err)) <= {33, 100}, err
    # the neighbour's share of the card over wall time, from one second after it started: its
    # floor, or near it (a starved 2-core machine can keep any process from its share: the
    # limiter's decision above is what the test holds it to)
    assert r.num("util", "util") >= 35, r.stdout


def test_two_busy_elastic_slices_split_the_idle_share_in_proportion_to_their_requests(node):
    one = _elastic(node, "one", "cores_percent=20\ncores_limit_percent=100")
    two = _elastic(node, "two", "cores_percent=40\ncores_limit_percent=100")
    proc = one.start("init", "ctx", "ready", "util:1.5:3:2000:kernel", wait_for="ready")
    r = two.run("init", "ctx", "util:1.5:3:2000:kernel")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    share_one = float(out.split("util=")[1].split()[0])
    # 20 + 40 guaranteed, the idle 40 split 1:2 -> about 33 % and 67 %
    assert 25 <= share_one <= 42, out
    assert 55 <= r.num("util", "util") <= 75, r.stdout


def test_priority_wins_over_burst(node):
    low = _elastic(node, "low", "priority=1\ncores_percent=25\ncores_limit_percent=100\n"
                   "priority_window_ms=200")
    high = _elastic(node, "high", "priority=100\ncores_percent=25\ncores_limit_percent=100\n"
                    "priority_window_ms=200")
    proc = low.start("init", "ctx", "ready", "util:1:4:2000:kernel", wait_for="ready")
    r = high.run("init", "ctx", "util:1:2:2000:kernel", env={"LIBVGPU_DEBUG": "1"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # the high one bursts to the card: once the low one is held (it is not counted busy) its
    # limiter sets its limit, 100 %; given its floor, the low one would have left it
    # 25 + 50 x 25 / 50 = 50 %
    shares = _shares(r.stderr)
    assert 100 in shares and set(shares) <= {50, 100}, r.stderr
    # and over wall time it got most of the card (a starved machine takes some of it: the
    # decision above is what the test holds the limiter to)
    assert r.num("util", "util") >= 65, r.stdout


def test_the_gpu_time_an_elastic_slice_runs_above_its_request_is_recorded_for_metering(node):
    from libvgpu.regions import read_activity

    elastic = _elastic(node, "e", "cores_percent=25\ncores_limit_percent=100")
    r = elastic.run("init", "ctx", "util:1:3:2000:kernel")
    share = r.num("util", "util") / 100
    assert share >= 0.7, r.stdout
    burst = read_activity(elastic.activity).compute_burst_seconds
    # 1 s warming up, then 3 s measured at `share`; 25 % of the card is guaranteed, the rest is
    # burst (counted over the NVML windows the limiter reads: the first ones are not), and never
    # more than the whole card past the request for the 4 s it ran
    assert 0.6 * (share - 0.25) * 3 <= burst <= 0.75 * 4 * 1.05, (burst, share)
    fixed = _elastic(node, "f", "cores_percent=25")
    assert fixed.run("init", "ctx", "util:1:2:2000:kernel").rcs("util") == [0]
    assert read_activity(fixed.activity).compute_burst_seconds == 0.0  # a fixed slice never bursts


# ---- memory: burst, the view, reclaim ------------------------------------------------------------

def test_an_elastic_slice_allocates_past_its_request_up_to_its_limit_and_sees_the_limit(node):
    box = _elastic(node, "e", "memory_mib=512\nmemory_limit_mib=2048")
    r = box.run("init", "ctx", "info", "alloc:1500M", "info", "alloc:600M", "nvml")
    assert r.rcs("alloc") == [0, OOM], r.stderr  # past the request, not past the limit
    first, second = r.all("info")
    assert int(first["total"]) == 2048 * MiB and int(first["free"]) == 2048 * MiB
    assert int(second["free"]) == (2048 - 1500) * MiB
    assert int(r.one("nvml")["total"]) == 2048 * MiB


def test_pitched_array_and_managed_allocations_burst_up_to_the_limit_and_no_further(node):
    # every allocation path past the request is held to what the card allows now, as cuMemAlloc is
    box = _elastic(node, "e", "memory_mib=512\nmemory_limit_mib=2048")
    steps = ("pitch:1024:1500000", "array:16384:24000", "managed:1500M")  # ~1.4 GiB each
    for step in steps:
        r = box.run("init", "ctx", step, "info", step)
        assert r.rcs(step.split(":")[0]) == [0, OOM], (step, r.stdout, r.stderr)  # past 512 MiB; not past 2 GiB
        assert int(r.one("info")["free"]) < 1024 * MiB, (step, r.stdout)


def test_a_burst_takes_only_memory_no_other_slices_request_needs(node):
    # the card has 4096 MiB; the neighbour is guaranteed 2048 of it and uses 100
    neighbour = _elastic(node, "n", "memory_mib=2048")
    neighbour.start("init", "ctx", "alloc:100M", "wait")
    box = _elastic(node, "e", "memory_mib=1024\nmemory_limit_mib=4096")
    r = box.run("init", "ctx", "info", "nvml", "alloc:2100M", "alloc:2000M", "info", "nvml")
    assert r.rcs("alloc") == [OOM, 0], r.stderr
    before, after = r.all("info")
    assert int(before["total"]) == 4096 * MiB  # the limit is the total it sees...
    assert int(before["free"]) == 2048 * MiB  # ...and what it may use now is free
    assert int(after["free"]) == 48 * MiB
    smi_before, smi_after = r.all("nvml")  # what nvidia-smi in the slice reads
    assert [int(smi_before[k]) for k in ("total", "used", "free")] == [4096 * MiB, 0, 2048 * MiB]
    assert [int(smi_after[k]) for k in ("total", "used", "free")] == [4096 * MiB, 2000 * MiB, 48 * MiB]


def _wait_for(what, timeout: float = 30.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not reached within {timeout} s")


def test_an_owner_asking_within_its_request_gets_it_once_the_burst_is_given_back(node):
    from libvgpu.elastic import pending_reclaims

    burster = _elastic(node, "burster", "memory_mib=1024\nmemory_limit_mib=4096")
    owner = _elastic(node, "owner", "memory_mib=2048")
    _burst_given_back(node, burster, owner)
    assert pending_reclaims(node.node_dir) == []


def _burst_given_back(node, burster, owner, **how) -> None:
    """The burster holds 3,500 MiB of the card (1,024 requested); the owner asks for 2,000 MiB
    within its request of 2,048, waits, the hub sees the wait, and the burst given back (the
    burster stopped) the owner gets its memory."""
    from libvgpu.elastic import pending_reclaims

    held = burster.start("init", "ctx", "alloc:3500M", "wait", **how)
    proc = owner.start("init", "ctx", "alloc:2000M", "ready", "wait", wait_for=None, **how)
    reclaims = _wait_for(lambda: pending_reclaims(node.node_dir))
    assert [(r.owner, r.burster, r.wanted_mib) for r in reclaims] == [("owner", "burster", 2000)]
    assert reclaims[0].burst_mib == 3500 - 1024
    held.kill()  # the hub takes the burst back (stops or swaps out the burster)
    held.wait(timeout=10)
    lines = iter(proc.stdout.readline, "")
    assert next(line for line in lines if line.startswith("alloc")).strip() == "alloc rc=0"


def test_the_burst_is_given_back_through_the_agents_relay_where_the_node_regions_are_read_only(node):
    """The same, as in GPU pods: each shim writes its entry (memory in use, the owner's wait)
    into its own container region, the node agent's relay into the card's node region."""
    import os

    import pytest

    from libvgpu.elastic import pending_reclaims

    from .harness import relaying

    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount of the node regions needs root")
    burster = _elastic(node, "burster", "memory_mib=1024\nmemory_limit_mib=4096")
    owner = _elastic(node, "owner", "memory_mib=2048")
    with relaying(node, burster, owner):
        _burst_given_back(node, burster, owner, read_only_node=True)
        _wait_for(lambda: pending_reclaims(node.node_dir) == [], 5)  # the relay clears the wait


def test_an_owner_whose_burst_is_not_given_back_in_time_gets_out_of_memory_with_a_sentence(node):
    burster = _elastic(node, "burster", "memory_mib=1024\nmemory_limit_mib=4096")
    burster.start("init", "ctx", "alloc:3500M", "wait")
    owner = _elastic(node, "owner", "memory_mib=2048\nreclaim_wait_ms=300")
    r = owner.run("init", "ctx", "alloc:2000M")
    assert r.rcs("alloc") == [OOM]
    assert "held by other slices' bursts; waiting up to 300 ms" in r.stderr
    assert "the bursts were not given back within 300 ms; the allocation fails" in r.stderr


def _bursting(boxes, before: list[float]):
    """A check that each box ran above its compute request (per its limiter) since ``before``."""
    from libvgpu.regions import read_activity

    return lambda: all(read_activity(b.activity).compute_burst_seconds > s + 0.05
                       for b, s in zip(boxes, before, strict=True))


def test_a_newcomers_floor_comes_back_at_the_first_nvml_window_while_three_slices_burst(node):
    """Issue 27: when other slices of the card become busy each gets at least its request within
    1 s. Three elastic slices (25 % guaranteed, up to 100 %) burst over the whole card; newcomers
    (25 % guaranteed, 2 ms kernels), one after another, start launching. A newcomer's limiter
    starts by timing one launch with events, and on a card full of the bursters' queued work
    that launch waits behind it (2 ms measured as 3.5-117 ms): the limiter must set its rate from the
    windows of NVML samples it reads (the double samples as a driver does, every 167 ms) to
    within 5 points of the request, busy card or not, by 1 s after its first launch (issue 27's
    figure): the estimate in force at 1 s and every later one (usually from the second window,
    about 0.5 s in; where a slow start leaves too few launches to tell from NVML's 1 % rounding
    the most they can have cost stands until a window says more: a CI run saw a newcomer whose
    first launch waited 83 ms, its estimate set from one launch, double at its second window,
    and kept there while the card was busy, 7.5 %, its floor back after 1.46 s).
    Asserted on the limiter's decisions (its LIBVGPU_DEBUG lines), not on wall time: on a loaded
    2-core machine a starved process misses its share for reasons no limiter can mend;
    ``bench/elastic.py`` measures the floor's return in seconds (``floor_back_p95_s``)."""
    import re

    from libvgpu.regions import read_activity

    elastic = "cores_percent=25\ncores_limit_percent=100"
    bursters = [_elastic(node, f"b{i}", elastic) for i in range(3)]
    procs = [b.start("init", "ctx", "ready", "util:0:30:2000:kernel", wait_for="ready") for b in bursters]
    firsts, backs = [], []
    for i in range(3):
        # the bursters hold the card: each one's limiter has read NVML windows where it ran above
        # its request since the last newcomer left
        _wait_for(_bursting(bursters, [read_activity(b.activity).compute_burst_seconds for b in bursters]))
        r = _elastic(node, f"new{i}", elastic).run("init", "ctx", "floorback:2:2000:20", timeout=60,
                                                    env={"LIBVGPU_DEBUG": "1"})
        assert r.rcs("floorback") == [0], r.stderr
        shares = limiter_rates(r.stderr, 25, 2000)  # (ms since its first window, the rate set)
        assert shares and shares[0][0] <= 1000, r.stderr
        firsts.append((re.search(r"a launch measured ([0-9.]+) ms", r.stderr).group(1), shares))
        backs.append(r.num("floorback", "back_ms"))
    for proc in procs:
        proc.kill()
    print("timed launch (ms), the windows' (ms, rate %):", firsts, "floor back (ms):", backs)
    # the rate an estimate sets: 25 % x 2 ms / estimate; never above 30 %, and the one in force at
    # 1 s and every later one within 5 points of 25 %
    assert all(share <= 30 for _, shares in firsts for _, share in shares), firsts
    for _, shares in firsts:
        at_1s = max(i for i, (ms, _) in enumerate(shares) if ms <= 1000)
        assert all(20 <= share <= 30 for _, share in shares[at_1s:]), firsts


def test_two_slices_bursting_at_once_never_promise_the_card_twice(hooks_node):
    # the card has 4096 MiB; an idle owner is guaranteed 2048 of it; two slices of 512 MiB may
    # each burst into the 1536 MiB no request needs, but not both at once
    from libvgpu.regions import read_container_region

    owner = _elastic(hooks_node, "owner", "memory_mib=2048")
    owner.start("init", "ctx", "alloc:10M", "wait")
    one = _elastic(hooks_node, "one", "memory_mib=512\nmemory_limit_mib=4096")
    two = _elastic(hooks_node, "two", "memory_mib=512\nmemory_limit_mib=4096")
    go = hooks_node.root / "go"
    # one has read what the card allows (1536 MiB) and is held before it counts its burst...
    held = one.start("init", "ctx", "alloc:1500M", "wait", env={"LIBVGPU_TEST_HOLD_BURST_UNTIL": str(go)},
                     wait_for=None, stderr_line="holding a burst")
    # ...while two bursts into the same spare memory and keeps it
    other = two.start("init", "ctx", "alloc:1500M", "wait")
    go.touch()
    lines = iter(held.stdout.readline, "")
    first = next(line for line in lines if line.startswith("alloc")).strip()
    assert other.poll() is None
    used = {c.name: read_container_region(c.region).memory_used_bytes[0] // MiB for c in (one, two)}
    promised = 2048 + max(512, used["one"]) + max(512, used["two"])
    assert promised <= 4096, (first, used)  # the owner's 2048 MiB are still there for it
    assert first == f"alloc rc={OOM}" and used == {"one": 0, "two": 1500}, used
