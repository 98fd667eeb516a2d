"""All processes of a container share one limit; dead processes (SIGKILL included, even while
holding the region lock) never keep memory or wedge the region; readers see it."""

from __future__ import annotations

import struct
import time

from libvgpu.regions import LAYOUT, read_activity, read_container_region

from .harness import kill

MiB = 1 << 20
OOM = 2


def test_processes_of_a_container_share_one_limit(node):
    box = node.container("c", "memory_mib=1024")
    box.start("init", "ctx", "alloc:600M", "wait")
    r = box.run("init", "ctx", "alloc:600M", "alloc:400M", "info", mode="dlopen")
    assert r.rcs("alloc") == [OOM, 0]
    assert int(r.one("info")["free"]) == 24 * MiB


def test_containers_do_not_share_limits(node):
    a = node.container("a", "memory_mib=1024")
    b = node.container("b", "memory_mib=1024")
    a.start("init", "ctx", "alloc:1000M", "wait")
    r = b.run("init", "ctx", "alloc:1000M")
    assert r.rcs("alloc") == [0]


def test_a_killed_process_stops_counting(node):
    box = node.container("c", "memory_mib=1024")
    proc = box.start("init", "ctx", "alloc:900M", "wait")
    assert read_container_region(box.region).memory_used_bytes[0] == 900 * MiB
    kill(proc)
    # the reader sees it at once, before anyone cleared the slot
    usage = read_container_region(box.region)
    assert usage.memory_used_bytes[0] == 0 and usage.processes == ()
    (dead,) = read_container_region(box.region, include_dead=True).processes
    assert (dead.pid, dead.alive, dead.memory_bytes[0]) == (proc.pid, False, 900 * MiB)
    # and the shim itself reaps it when the memory is needed; a process that exits normally
    # gives its slot back itself
    r = box.run("init", "ctx", "alloc:1G")
    assert r.rcs("alloc") == [0]
    assert read_container_region(box.region, include_dead=True).processes == ()


def test_sigkill_while_holding_the_region_lock_does_not_wedge_the_container(hooks_node):
    box = hooks_node.container("c", "memory_mib=1024")
    stuck = box.start("init", "ctx", "alloc:700M", env={"LIBVGPU_TEST_SLEEP_IN_LOCK_MS": "600000"},
                      wait_for=None, stderr_line="holding the accounting lock")
    kill(stuck)  # dies with the lock held and its usage half-written (slot yes, total no)
    started = time.monotonic()
    r = box.run("init", "ctx", "info", "alloc:1G", timeout=20)
    assert time.monotonic() - started < 5
    assert r.returncode == 0, r.stderr
    assert int(r.one("info")["free"]) == 1024 * MiB
    assert r.rcs("alloc") == [0]
    assert "died holding the accounting lock" in r.stderr
    assert r.stderr.count("\n") == 1  # one line, and nothing else


def test_activity_records_last_launch_and_memory_for_the_culler(node):
    box = node.container("c", "memory_mib=1024")
    before = time.time()
    proc = box.start("init", "ctx", "alloc:64M", "launch:5:10", "wait")
    usage = read_container_region(box.region)
    (p,) = usage.processes
    assert p.launches == 5
    assert before - 0.01 <= p.last_launch_at <= time.time()
    assert usage.last_launch_at == p.last_launch_at
    assert usage.idle_seconds() < 5
    act = read_activity(box.activity)
    assert act.memory_used_mib == 64 and act.memory_used_bytes[0] == 64 * MiB
    assert act.launches == 5
    assert act.last_launch is not None and before - 0.01 <= act.last_launch <= time.time()
    assert act.container_id == usage.container_id
    kill(proc)
    # the container's last launch outlives the process that made it
    assert read_container_region(box.region).last_launch_at == p.last_launch_at


def test_a_process_that_never_launched_has_no_last_launch(node):
    box = node.container("c", "memory_mib=1024")
    box.start("init", "ctx", "wait")
    usage = read_container_region(box.region)
    assert usage.last_launch_at is None and usage.idle_seconds() is None
    assert usage.processes[0].last_launch_at is None


def test_the_card_never_holds_more_than_the_sum_of_its_slices(make_node):
    node = make_node(CUDA_DOUBLE_CONTEXT_MIB=300, CUDA_DOUBLE_MODULE_MIB=20)
    slices = {"a": 1024, "b": 1536}
    for name, mib in slices.items():
        box = node.container(name, f"memory_mib={mib}")
        for _ in range(2):  # two greedy processes per container
            box.start("init", "ctx", "module", *["alloc:128M"] * 16, "vmm:64M", "array:2048:2048",
                      "wait")
    outside = node.container("observer", "", regions=False)
    used = int(outside.run("init", "devused", shim=False).one("devused")["used"])
    assert used <= sum(slices.values()) * MiB
    assert used >= (sum(slices.values()) - 256) * MiB  # and the slices were really used


def _raw_total(region) -> int:
    """The container's total as the shim keeps it (offset 192), not recounted by a reader."""
    return struct.unpack_from("<Q", region.read_bytes(), LAYOUT["container.used"])[0]


def _until(proc, needle: str) -> list[str]:
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, f"{needle!r} not seen: {''.join(lines)}{proc.stderr.read()}"
        lines.append(line)
        if needle in line:
            return lines


def test_processes_hammering_one_limit_never_exceed_it_and_leave_exact_counts(make_node, tmp_path):
    """Allocations and frees update the counters without the lock: four processes of four
    threads each allocating and freeing at the limit at once must never put more on the card
    than the limit, and must leave every count exact."""
    box = make_node(CUDA_DOUBLE_CONTEXT_MIB=16).container("c", "memory_mib=320")
    go = tmp_path / "go"
    procs = [box.start("init", "ctx", f"waitfile:{go}", "hammer:4:300:40M", "wait",
                       wait_for="ctx rc=0") for _ in range(4)]
    go.touch()
    results = []
    for proc in procs:
        (line,) = [x for x in _until(proc, "waiting") if x.startswith("hammer")]
        results.append(dict(kv.split("=") for kv in line.split()[1:]))
    assert [r["errors"] for r in results] == ["0"] * 4
    assert all(int(r["ok"]) > 0 for r in results)
    assert sum(int(r["refused"]) for r in results) > 0  # they did meet at the limit
    assert max(int(r["peak"]) for r in results) <= 320 * MiB  # the card's own count
    usage = read_container_region(box.region)
    assert len(usage.processes) == 4
    for p in usage.processes:  # every allocation was freed: only context memory is left
        assert p.memory_bytes[0] == p.overhead_bytes[0] > 0
    assert _raw_total(box.region) == sum(p.memory_bytes[0] for p in usage.processes)


def test_a_process_killed_between_the_total_and_its_own_count_leaves_nothing_behind(hooks_node):
    box = hooks_node.container("c", "memory_mib=1024")
    stuck = box.start("init", "ctx", "alloc:700M",
                      env={"LIBVGPU_TEST_SLEEP_MID_UPDATE_MS": "600000"}, wait_for=None,
                      stderr_line="between the total and the slot")
    assert _raw_total(box.region) >= 700 * MiB  # counted in the total, not yet in its slot
    kill(stuck)
    r = box.run("init", "ctx", "info", "alloc:1G", timeout=20)
    assert r.returncode == 0, r.stderr
    assert int(r.one("info")["free"]) == 1024 * MiB
    assert r.rcs("alloc") == [0]
    assert r.stderr == ""
