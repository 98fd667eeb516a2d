"""The cores limit: a container's share of the simulated GPU stays within ±10 points of its
limit, for kernel, extended, cooperative and graph launches, shared by its processes."""

from __future__ import annotations

import time

import pytest

from libvgpu.regions import read_container_region

WARM, MEASURE = "1", "2"  # seconds


def util(result) -> float:
    assert result.returncode == 0, result.stderr
    return result.num("util", "util")


@pytest.mark.parametrize("kind", ["kernel", "graph", "ex", "coop"])
def test_cores_limit_holds_the_measured_share_near_the_limit(node, kind):
    box = node.container("c", "cores_percent=30")
    r = box.run("init", "ctx", f"util:{WARM}:{MEASURE}:500:{kind}", mode="getproc")
    assert 20 <= util(r) <= 40


def test_long_kernels_are_limited_too(node):
    box = node.container("c", "cores_percent=50")
    r = box.run("init", "ctx", f"util:{WARM}:{MEASURE}:5000:kernel")
    assert 40 <= util(r) <= 60


def test_without_a_cores_limit_launches_are_not_held_back(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "util:0.2:1:500:kernel")
    assert util(r) >= 95


def test_processes_of_a_container_share_its_cores_limit(node):
    box = node.container("c", "cores_percent=40")
    first = box.start("init", "ctx", "ready", f"util:{WARM}:{MEASURE}:500:kernel:all",
                      wait_for="ready")
    second = box.run("init", "ctx", f"util:{WARM}:{MEASURE}:1000:graph:all")
    out, _ = first.communicate(timeout=30)
    both = [util(second), float(out.split("util=")[1].split()[0])]
    for measured in both:  # each sees the container's total on the card
        assert 30 <= measured <= 50


def test_two_containers_get_their_own_shares(node):
    small = node.container("small", "cores_percent=20")
    big = node.container("big", "cores_percent=60")
    # two limiters adapt to each other on one card: let both settle before measuring
    warm = "3"
    proc = big.start("init", "ctx", "ready", f"util:{warm}:{MEASURE}:500:kernel", wait_for="ready")
    r = small.run("init", "ctx", f"util:{warm}:{MEASURE}:500:kernel")
    out, _ = proc.communicate(timeout=30)
    big_util = float(out.split("util=")[1].split()[0])
    assert 10 <= util(r) <= 30
    assert 50 <= big_util <= 70


def test_measured_utilisation_is_published_in_the_region(node):
    box = node.container("c", "cores_percent=30")
    box.start("init", "ctx", "ready", "util:5:5:500:kernel", wait_for="ready")
    deadline = time.monotonic() + 10
    seen = None
    while time.monotonic() < deadline:
        seen = read_container_region(box.region).utilisation_percent[0]
        if seen is not None and 20 <= seen <= 40:
            break
        time.sleep(0.1)
    assert seen is not None and 20 <= seen <= 40
    assert read_container_region(box.region).cores_percent[0] == 30
