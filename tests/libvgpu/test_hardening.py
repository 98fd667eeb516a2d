"""What any container can write on a node must not stop the others: planted files where
regions are expected (a FIFO must not block a reader), forged node-region entries of dead
processes or from the future, and a process that takes a region's lock and stalls. The
shipped shim has no test hooks."""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from libvgpu.regions import LAYOUT, RegionError, read_container_region, read_node_regions

MiB = 1 << 20
OOM = 2


def test_readers_skip_a_fifo_or_symlink_planted_where_regions_are_expected(node, tmp_path):
    box = node.container("c", "name=c", node_regions=True)
    assert box.run("init", "ctx", "launch:1:10").returncode == 0
    os.mkfifo(node.node_dir / "GPU-planted-fifo.region")
    (node.node_dir / "GPU-planted-link.region").symlink_to(next(node.node_dir.glob("GPU-*")))
    code = f"from libvgpu.regions import read_node_regions as r; print(len(r({str(node.node_dir)!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"  # the real one; the FIFO neither blocked nor counted
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(RegionError, match=r"fifo: not a regular file"):
        read_container_region(fifo)
    link = tmp_path / "link"
    link.symlink_to(box.region)
    with pytest.raises(RegionError, match=r"link: a symbolic link"):
        read_container_region(link)


def _forge_entry(region, *, priority: int, last_launch_ns: int) -> None:
    """A forged entry, written by a process that then exits (nobody holds its lock)."""
    with open(region, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        base = 256 + 5 * LAYOUT["entry.size"]
        m[base:base + 8] = struct.pack("<Q", 0xBADC0FFEE)
        m[base + LAYOUT["entry.priority"]:base + LAYOUT["entry.priority"] + 4] = struct.pack(
            "<i", priority)
        off = base + LAYOUT["entry.last_launch_ns"]
        m[off:off + 8] = struct.pack("<Q", last_launch_ns)


@pytest.mark.parametrize("when", ["now", "2036"])
def test_forged_entries_of_dead_processes_hold_nobody(node, when):
    common = f"node_region_dir={node.node_dir}\npriority_window_ms=5000"
    box = node.container("low", f"priority=1\n{common}")
    assert box.run("init", "ctx", "launch:1:10").returncode == 0  # creates the node region
    (region,) = node.node_dir.glob("GPU-*.region")
    stamp = time.time_ns() if when == "now" else 2_082_758_400 * 10**9
    _forge_entry(region, priority=1_000_000_000, last_launch_ns=stamp)
    started = time.monotonic()
    r = box.run("init", "ctx", "launch:20:10", timeout=30)
    assert r.rcs("launch") == [0]
    assert time.monotonic() - started < 3  # not held for the forged 5 s window (or forever)


HOLD = textwrap.dedent(
    """
    import ctypes, mmap, sys, time
    f = open(sys.argv[1], "r+b")
    m = mmap.mmap(f.fileno(), 0)
    libc = ctypes.CDLL(None)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m, 128))
    print("locked", libc.pthread_mutex_lock(ctypes.c_void_p(addr)), flush=True)
    time.sleep(600)
    """
)


def _hold_lock(node, region):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(region)], stdout=subprocess.PIPE,
                            text=True)
    node.processes.append(proc)
    assert proc.stdout.readline().strip() == "locked 0"
    return proc


def test_a_stalled_holder_of_the_node_region_lock_does_not_hang_other_containers(node):
    common = f"node_region_dir={node.node_dir}"
    first = node.container("first", f"priority=1\n{common}")
    assert first.run("init", "ctx", "launch:1:10").returncode == 0
    (region,) = node.node_dir.glob("GPU-*.region")
    _hold_lock(node, region)
    other = node.container("other", f"priority=2\n{common}")
    started = time.monotonic()
    r = other.run("init", "ctx", "launch:5:10", timeout=30)
    assert r.rcs("launch") == [0]
    assert time.monotonic() - started < 5
    assert "stalled" in r.stderr


def test_a_stalled_holder_of_the_container_region_lock_does_not_hang_the_container(node):
    box = node.container("c", "memory_mib=1024")
    assert box.run("init", "ctx", "alloc:1M").returncode == 0
    _hold_lock(node, box.region)
    started = time.monotonic()
    r = box.run("init", "ctx", "alloc:100M", "alloc:100M", "info", timeout=30)
    assert r.rcs("alloc") == [0, 0]
    assert int(r.one("info")["free"]) == 824 * MiB
    assert time.monotonic() - started < 5


def test_the_shipped_shim_has_no_test_hook_that_holds_the_lock(node):
    box = node.container("c", "memory_mib=1024")
    started = time.monotonic()
    r = box.run("init", "ctx", "alloc:1M", env={"LIBVGPU_TEST_SLEEP_IN_LOCK_MS": "5000"},
                timeout=30)
    assert r.rcs("alloc") == [0]
    assert "holding the accounting lock" not in r.stderr
    assert time.monotonic() - started < 3


def test_readers_do_not_trust_launch_times_in_the_future(node):
    box = node.container("c", "name=c", node_regions=True)
    box.start("init", "ctx", "launch:1:10", "wait")
    (region,) = node.node_dir.glob("GPU-*.region")
    (gpu,) = read_node_regions(node.node_dir).values()
    (entry,) = gpu.containers
    assert entry.last_launch_at is not None
    with open(region, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:  # what the container can write
        off = 256 + entry.index * LAYOUT["entry.size"] + LAYOUT["entry.last_launch_ns"]
        m[off:off + 8] = struct.pack("<Q", 2_082_758_400 * 10**9)  # 2036
    (gpu,) = read_node_regions(node.node_dir).values()
    assert gpu.containers[0].last_launch_at is None  # not "active until 2036"


QUIESCE = 72  # vgpu.h: the container region's quiesce word follows last_launch_ns
SLOT_BUSY = 12  # vgpu.h: a slot's busy count follows its flags


def test_a_process_keeping_the_counters_busy_neither_stops_the_container_nor_skews_its_counts(node):
    """Allocations update the counters without the lock unless a recount is under way, and a
    recount waits for the live processes' updates to end. A process that raises the quiesce
    word and keeps its own busy count up (what the container can write) makes the others take
    the lock and a recount wait for it at most 2 ms, never forever; the counts stay right."""
    box = node.container("c", "memory_mib=1024")
    box.start("init", "ctx", "alloc:100M", "wait")
    (holder,) = read_container_region(box.region).processes
    with open(box.region, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[QUIESCE:QUIESCE + 4] = struct.pack("<I", 1)
        busy = 4096 + holder.slot * LAYOUT["slot.size"] + SLOT_BUSY
        m[busy:busy + 4] = struct.pack("<I", 7)
    started = time.monotonic()
    r = box.run("init", "ctx", "alloc:500M", "alloc:500M", *["info"] * 50, "alloc:424M",
                timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.rcs("alloc") == [0, OOM, 0]
    assert int(r.one("info")["free"]) == 424 * MiB
    assert time.monotonic() - started < 5


def test_the_shipped_shim_has_no_test_hook_that_holds_a_burst(node):
    box = node.container("c", "memory_mib=512\nmemory_limit_mib=2048", node_regions=True)
    r = box.run("init", "ctx", "alloc:1000M", env={"LIBVGPU_TEST_HOLD_BURST_UNTIL": "/nonexistent"},
                timeout=30)
    assert r.rcs("alloc") == [0], r.stderr  # a burst, not held for a file that never comes
    assert "holding a burst" not in r.stderr
