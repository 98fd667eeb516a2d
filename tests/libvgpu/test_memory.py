"""Memory limits: every allocation path counted at the exact byte, frees released, queries
report the slice, and the driver's own memory (contexts, modules) counted too."""

from __future__ import annotations

import pytest

from libvgpu.regions import read_container_region

MiB = 1 << 20
OOM = 2
MODES = ["link", "dlopen", "getproc"]


@pytest.mark.parametrize("mode", MODES)
def test_limit_is_enforced_at_the_exact_byte_and_oom_allocates_nothing(node, mode):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "alloc:1G", "free", f"alloc:{1024 * MiB + 1}", "devused",
                "alloc:512M", "alloc:512M", "alloc:1", "info", "devused", mode=mode)
    assert r.returncode == 0, r.stderr
    assert r.rcs("alloc") == [0, OOM, 0, 0, OOM]
    assert r.rcs("free") == [0]
    assert int(r.one("devused", 0)["used"]) == 0  # the refused call never reached the driver
    assert int(r.one("devused", 1)["used"]) == 1024 * MiB
    assert (int(r.one("info")["free"]), int(r.one("info")["total"])) == (0, 1024 * MiB)


# (step, bytes the driver really takes for it: pitch rows are 1 KiB-aligned and arrays are
# 64 KiB-rounded by the double, which the shim learns from the driver)
PATHS = [
    ("alloc:3M", 3 * MiB),
    ("managed:3M", 3 * MiB),
    ("async:3M", 3 * MiB),
    ("pool:3M", 3 * MiB),
    ("vmm:4M", 4 * MiB),
    ("pitch:1100:1000", 2048 * 1000),
    ("array:1000:100", 458752),
    ("array3d:64:64:64", 64 * 64 * 64 * 4),
    ("mipmap:256:256:3", 393216),
]


@pytest.mark.parametrize("step,size", PATHS, ids=[p[0].split(":")[0] for p in PATHS])
def test_every_allocation_path_is_counted_and_its_free_released(node, step, size):
    box = node.container("c", "memory_mib=64")
    # sync: a stream-ordered pool (default release threshold) gives freed memory back at a
    # synchronisation, not at the free; the slice counts it until then
    r = box.run("init", "ctx", "info", step, "info", "free", "sync", "info", mode="dlopen")
    assert r.returncode == 0, r.stderr
    assert r.rcs(step.split(":")[0]) == [0]
    assert r.rcs("free") == [0]
    free = [int(kv["free"]) for kv in r.all("info")]
    assert free == [64 * MiB, 64 * MiB - size, 64 * MiB]


TOO_BIG = ["alloc:2M", "managed:2M", "async:2M", "pool:2M", "vmm:2M", "pitch:2000:1000",
           "array:1000:1000", "array3d:64:64:128", "mipmap:1024:1024:2"]


@pytest.mark.parametrize("step", TOO_BIG, ids=[p.split(":")[0] for p in TOO_BIG])
def test_every_allocation_path_is_refused_past_the_limit(node, step):
    box = node.container("c", "memory_mib=1")
    r = box.run("init", "ctx", step, "devused", "info", mode="getproc")
    assert r.returncode == 0, r.stderr
    assert r.rcs(step.split(":")[0]) == [OOM]
    assert int(r.one("devused")["used"]) == 0
    assert int(r.one("info")["free"]) == 1 * MiB


def test_queries_report_the_slice_shared_by_the_container(node):
    box = node.container("c", "memory_mib=1024")
    holder = box.start("init", "ctx", "alloc:100M", "wait")
    r = box.run("init", "ctx", "alloc:24M", "info", "total", "nvml", mode="dlopen")
    assert r.returncode == 0, r.stderr
    info, nvml = r.one("info"), r.one("nvml")
    assert (int(info["total"]), int(info["free"])) == (1024 * MiB, 900 * MiB)
    assert int(r.one("total")["total"]) == 1024 * MiB  # cuDeviceTotalMem_v2
    for suffix in ("", "2"):  # nvmlDeviceGetMemoryInfo and _v2
        assert int(nvml[f"total{suffix}"]) == 1024 * MiB
        assert int(nvml[f"used{suffix}"]) == 124 * MiB
        assert int(nvml[f"free{suffix}"]) == 900 * MiB
    holder.kill()


def test_without_a_limit_queries_report_the_whole_card(node):
    box = node.container("c", "")
    r = box.run("init", "ctx", "info", "nvml")
    assert int(r.one("info")["total"]) == 4096 * MiB
    assert int(r.one("nvml")["total"]) == 4096 * MiB


def test_context_memory_counts_against_the_slice(make_node):
    node = make_node(CUDA_DOUBLE_CONTEXT_MIB=300)
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "info", "alloc:724M", "alloc:1", "ctxcreate", "info", "ctxdestroy",
                "ctx", "info")
    assert r.returncode == 0, r.stderr
    free = [int(kv["free"]) for kv in r.all("info")]
    assert free[0] == 724 * MiB  # the primary context's 300 MiB, measured through NVML
    assert r.rcs("alloc") == [0, OOM]
    assert r.rcs("ctxcreate") == [OOM]  # a second context no longer fits: not created
    assert int(free[1]) == 0


def test_configured_context_size_is_charged_instead_of_measured(make_node):
    node = make_node(CUDA_DOUBLE_CONTEXT_MIB=300)
    box = node.container("c", "memory_mib=1024\ncontext_mib=100")
    r = box.run("init", "ctx", "info")
    assert int(r.one("info")["free"]) == 924 * MiB


def test_a_context_that_does_not_fit_is_refused_and_destroyed(make_node):
    node = make_node(CUDA_DOUBLE_CONTEXT_MIB=300)
    box = node.container("c", "memory_mib=200")
    r = box.run("init", "ctx", "devused")
    assert r.rcs("ctx") == [OOM]
    assert int(r.one("devused")["used"]) == 0


def test_module_memory_counts_until_unload(make_node):
    node = make_node(CUDA_DOUBLE_MODULE_MIB=50)
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "info", "module", "info", "unload", "info")
    assert r.returncode == 0, r.stderr
    assert [int(kv["free"]) for kv in r.all("info")] == [1024 * MiB, 974 * MiB, 1024 * MiB]


def test_destroying_a_context_releases_what_was_allocated_in_it(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctxcreate", "alloc:100M", "alloc:200M", "ctxdestroy", "ctx", "info",
                "alloc:100M", "release", "ctxcreate", "info")
    assert r.returncode == 0, r.stderr
    free = [int(kv["free"]) for kv in r.all("info")]
    assert free == [1024 * MiB, 1024 * MiB]  # both contexts' allocations went with them


def test_memory_in_use_is_recorded_per_process_with_overhead_apart(make_node):
    node = make_node(CUDA_DOUBLE_CONTEXT_MIB=300)
    box = node.container("c", "memory_mib=2048")
    proc = box.start("init", "ctx", "alloc:100M", "wait")
    usage = read_container_region(box.region)
    assert usage.memory_limit_bytes[0] == 2048 * MiB
    assert usage.memory_used_bytes[0] == 400 * MiB
    (p,) = usage.processes
    assert (p.pid, p.alive, p.name) == (proc.pid, True, "probe")
    assert p.memory_bytes[0] == 400 * MiB and p.overhead_bytes[0] == 300 * MiB


def test_a_forked_child_is_accounted_as_its_own_process(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "alloc:100M", "fork:900M", "fork:1000M", "info")
    assert r.returncode == 0, r.stderr
    child_rcs = [int(kv["rc"]) for s, kv in r.lines if s == "child"]
    assert child_rcs == [0, OOM]  # the parent's 100 MiB still counts for the child's check
    assert int(r.one("info")["free"]) == 924 * MiB  # the exited child's 900 MiB were reaped


def test_threads_allocating_and_freeing_at_once_leave_exact_accounts(node):
    box = node.container("c", "memory_mib=1024\ncores_percent=90")
    r = box.run("init", "ctx", "threads:16:300:1M", "sync", "info", mode="getproc", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.one("threads")["failures"] == "0"
    assert int(r.one("info")["free"]) == 1024 * MiB  # every reservation was released


def test_tens_of_thousands_of_live_allocations_are_tracked_and_released(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "allocs:20000:4K", "info", "freeall", "info", "allocs:20000:4K",
                "release", "ctxcreate", "info")
    assert r.returncode == 0, r.stderr
    assert [kv["ok"] for kv in r.all("allocs")] == ["20000", "20000"]
    free = [int(kv["free"]) for kv in r.all("info")]
    assert free == [1024 * MiB - 20000 * 4096, 1024 * MiB, 1024 * MiB]


def test_allocating_in_a_loop_asks_nvml_for_the_process_list_at_most_every_100_ms(node):
    """What the container's other processes hold (the floor against zeroed counters) and what
    the driver holds for this process (the true-up) are each asked of NVML at most every
    100 ms: a process listing is a driver round trip, so asking on every allocation would make
    the allocations cost several times what the driver charges."""
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "pairs:1.0")
    assert r.returncode == 0, r.stderr
    kv = r.one("pairs")
    assert kv["rc"] == "0" and int(kv["n"]) > 100, kv
    periods = int(kv["elapsed_ms"]) / 100 + 1  # started 100 ms periods
    assert int(kv["queries"]) <= 2 * (periods + 1), kv  # floor + true-up, each once a period
