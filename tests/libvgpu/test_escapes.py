"""Memory and work that would escape the limits: what a stream-ordered pool keeps reserved
after frees (PyTorch sets the release threshold to UINT64_MAX), VMM memory released while
still mapped, legacy launch entry points, and NVML's process and utilisation queries."""

from __future__ import annotations

import pytest

MiB = 1 << 20
OOM = 2


def test_memory_a_pool_keeps_after_frees_counts_until_it_is_given_back(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "keeppool", "async:600M", "free", "sync", "alloc:600M",
                "devused", "trim", "alloc:600M", "devused", mode="getproc")
    assert r.returncode == 0, r.stderr
    assert r.rcs("alloc") == [OOM, 0]  # the pool still holds the 600 MiB; after the trim not
    assert [int(kv["used"]) for kv in r.all("devused")] == [600 * MiB, 600 * MiB]


def test_a_pool_reuses_what_it_keeps_without_counting_it_twice(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "keeppool", "async:600M", "free", "async:600M", "info",
                mode="dlopen")
    assert r.rcs("async") == [0, 0]
    assert int(r.one("info")["free"]) == 424 * MiB


def test_a_pool_with_the_default_threshold_gives_back_at_a_synchronisation(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "async:600M", "free", "info", "sync", "info", "alloc:1G")
    assert [int(kv["free"]) for kv in r.all("info")] == [424 * MiB, 1024 * MiB]
    assert r.rcs("alloc") == [0]


def test_vmm_memory_released_while_mapped_counts_until_unmapped(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "vmmmap:600M", "alloc:600M", "devused", "unmap", "alloc:600M",
                "info", mode="getproc")
    assert r.rcs("vmmmap") == [0] and r.rcs("unmap") == [0]
    assert r.rcs("alloc") == [OOM, 0]  # the mapping kept the memory; after the unmap not
    assert int(r.one("devused")["used"]) == 600 * MiB
    assert int(r.one("info")["free"]) == 424 * MiB


def test_legacy_launches_are_held_to_the_cores_limit(node):
    box = node.container("c", "cores_percent=30")
    r = box.run("init", "ctx", "util:1:2:500:legacy", mode="getproc")
    assert r.returncode == 0, r.stderr
    assert 20 <= r.num("util", "util") <= 40


def test_nvml_lists_only_the_containers_own_processes(node):
    other = node.container("other", "memory_mib=1024")
    held = other.start("init", "ctx", "alloc:64M", "wait")
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "alloc:32M", "nvmlprocs", mode="dlopen")
    seen = r.one("nvmlprocs")
    assert seen["rc"] == "0" and seen["pids"] == seen["self"]  # not the other container's
    observer = node.container("observer", "", regions=False)
    everyone = observer.run("init", "nvmlprocs", shim=False).one("nvmlprocs")
    assert str(held.pid) in everyone["pids"].split(",")  # the card does run it


def test_nvml_utilisation_is_the_containers_own(node):
    busy = node.container("busy", "")
    busy.start("init", "ctx", "ready", "util:0:20:1000:kernel", wait_for="ready")
    observer = node.container("observer", "", regions=False)
    whole = observer.run("sleep:300", "nvmlutil", shim=False).one("nvmlutil")
    assert int(whole["gpu"]) >= 80  # the card is busy ...
    box = node.container("c", "memory_mib=1024")
    mine = box.run("init", "ctx", "nvmlutil").one("nvmlutil")
    assert mine["rc"] == "0" and int(mine["gpu"]) <= 5  # ... but not with this container's work


def test_graph_memory_counts_until_trimmed(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "graphmem:600M", "alloc:600M", "devused", "graphtrim",
                "alloc:600M", mode="getproc")
    assert r.rcs("graphmem") == [0] and r.rcs("graphtrim") == [0]
    assert r.rcs("alloc") == [OOM, 0]  # the graph's memory stays reserved until the trim
    assert int(r.one("devused")["used"]) == 600 * MiB


NOT_SUPPORTED = 801


@pytest.mark.parametrize("mode", ["link", "dlopen", "getproc"])
def test_the_v1_abi_neither_allocates_past_the_slice_nor_shows_the_card(node, mode):
    """cuMemAlloc, cuMemAllocPitch, cuMemGetInfo, cuDeviceTotalMem without _v2 (CUDA before
    3.2, still exported by drivers): allocations are refused, queries show the slice."""
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "alloc:600M", "alloc1:600M", "pitch1:1024:600K", "info1", "total1",
                mode=mode)
    assert r.returncode == 0, r.stderr
    assert r.rcs("alloc1") == [NOT_SUPPORTED] and r.rcs("pitch1") == [NOT_SUPPORTED]
    assert int(r.one("info1")["total"]) == 1024 * MiB and int(r.one("info1")["free"]) == 424 * MiB
    assert int(r.one("total1")["total"]) == 1024 * MiB
