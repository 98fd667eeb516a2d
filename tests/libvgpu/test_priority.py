"""Priority: on a shared GPU a low-priority container holds its launches while a
higher-priority one has launched within the window, and resumes when it goes quiet; with or
without a cores limit, graph launches included."""

from __future__ import annotations

import mmap
import os
import struct
import time

import pytest

from libvgpu.priorities import write_priority_table
from libvgpu.regions import LAYOUT, NODE_ENTRIES, read_node_regions

WINDOW_MS = 200


def gaps(out: str) -> list[tuple[float, float]]:
    """(start_ms, end_ms) of every pause longer than 50 ms in a 'timeline' line."""
    found = []
    for word in out.split():
        if word.startswith("gap="):
            a, b = word[4:].split("-")
            found.append((float(a), float(b)))
    return found


def field(out: str, key: str) -> float:
    return float(out.split(f"{key}=")[1].split()[0])


def run_pair(node, low_limits: str, high_priority: int, *, high_kind: str = "timeline:1:1000",
             table: dict[str, int] | None = None):
    # the high one stays alive past its window after its last launch (a dead container's
    # entry holds nobody)
    common = f"node_region_dir={node.node_dir}\npriority_window_ms={WINDOW_MS}"
    if table is not None:  # as the hub / node agent writes it
        node.node_dir.mkdir(parents=True)
        node.node_dir.chmod(0o1777)
        write_priority_table(node.node_dir, table)
    low = node.container("low", f"priority=1\nname=low\n{low_limits}\n{common}")
    high = node.container("high", f"priority={high_priority}\nname=high\n{common}")
    low_proc = low.start("init", "ctx", "ready", "timeline:3:1000", wait_for="ready")
    time.sleep(1.0)
    started = time.time() * 1000
    h = high.run("init", "ctx", high_kind, "sleep:400")
    ended = time.time() * 1000
    out, err = low_proc.communicate(timeout=30)
    assert low_proc.returncode == 0, err
    assert h.returncode == 0, h.stderr
    return out, started, ended, h


@pytest.mark.parametrize(("low_limits", "table"), [("", None), ("cores_percent=50", None),
                                                  ("", {"low": 1, "high": 100})],
                         ids=["no-cores-limit", "cores-limit", "priorities-from-the-table"])
def test_low_priority_holds_while_high_priority_runs_and_resumes_after(make_node, low_limits, table):
    node = make_node(CUDA_DOUBLE_QUEUE=2)  # launches pace at the kernels' speed
    out, started, ended, high = run_pair(node, low_limits, 100, table=table)
    high_start, high_end = field(high.stdout, "start_ms"), field(high.stdout, "end_ms")
    held = [g for g in gaps(out) if g[1] - g[0] > 500]
    assert len(held) == 1, out
    begin, end = held[0]
    assert begin <= high_start + 60  # held from (nearly) the high one's first launch ...
    assert high_end + WINDOW_MS - 60 <= end <= high_end + WINDOW_MS + 250  # ... to a window after
    assert field(out, "end_ms") - end > 500  # and it ran again afterwards
    assert field(out, "launches") > 500


def test_equal_priority_does_not_hold(make_node):
    node = make_node(CUDA_DOUBLE_QUEUE=2)
    out, *_ = run_pair(node, "", 1)
    assert [g for g in gaps(out) if g[1] - g[0] > 300] == []


def test_graph_launches_of_a_low_priority_container_are_held(make_node):
    node = make_node(CUDA_DOUBLE_QUEUE=2)
    common = f"node_region_dir={node.node_dir}\npriority_window_ms={WINDOW_MS}"
    low = node.container("low", f"priority=1\n{common}")
    high = node.container("high", f"priority=100\n{common}")
    busy = high.start("init", "ctx", "ready", "timeline:1.5:1000", "sleep:400", wait_for="ready")
    time.sleep(0.3)
    started = time.monotonic()
    r = low.run("init", "ctx", "graph:1:4:100")  # waits until high has been quiet for a window
    held = time.monotonic() - started
    out, _ = busy.communicate(timeout=30)
    assert r.rcs("graph") == [0]
    assert held >= 1.5 - 0.3 + WINDOW_MS / 1000 - 0.15, out


def test_node_region_shows_priorities_and_who_is_held(make_node):
    node = make_node(CUDA_DOUBLE_QUEUE=2)
    common = f"node_region_dir={node.node_dir}\npriority_window_ms=2000"
    low = node.container("low", f"priority=1\nname=alloc-low\nmemory_mib=512\n{common}")
    high = node.container("high", f"priority=100\nname=alloc-high\n{common}")
    high.start("init", "ctx", "alloc:64M", "launch:3:10", "wait")
    low.start("init", "ctx", "ready", "launch:1:10", wait_for="ready")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        (gpu,) = read_node_regions(node.node_dir).values()
        by_name = {c.name: c for c in gpu.containers}
        if by_name.get("alloc-low") and by_name["alloc-low"].held_since:
            break
        time.sleep(0.05)
    assert gpu.uuid.startswith("GPU-")
    lo, hi = by_name["alloc-low"], by_name["alloc-high"]
    assert (lo.priority, hi.priority) == (1, 100)
    assert lo.held_since is not None and hi.held_since is None
    assert hi.last_launch_at is not None and time.time() - hi.last_launch_at < 10
    assert hi.memory_used_bytes == 64 << 20 and lo.memory_limit_bytes == 512 << 20
    assert lo.alive and hi.alive


def _forge_priority(node_dir, name: str, priority: int, new_name: str = "") -> None:
    """What a hostile process of a live container can do: raise its own entry's priority in
    the (writable) node region, and give it another allocation's name. The entry is waited for
    (up to 10 s): the region file exists before the shim has written the entry's name."""
    deadline = time.monotonic() + 10
    while True:
        for path in node_dir.glob("*.region"):
            with open(path, "r+b") as f:
                if os.fstat(f.fileno()).st_size < LAYOUT["node.size"]:
                    continue
                with mmap.mmap(f.fileno(), 0) as m:
                    for i in range(NODE_ENTRIES):
                        base = LAYOUT["node.size"] - (NODE_ENTRIES - i) * LAYOUT["entry.size"]
                        raw = m[base + LAYOUT["entry.name"]:base + LAYOUT["entry.name"] + 64]
                        if raw.split(b"\0", 1)[0] == name.encode():
                            m[base + LAYOUT["entry.priority"]:base + LAYOUT["entry.priority"] + 4] = (
                                struct.pack("<i", priority))
                            if new_name:
                                m[base + LAYOUT["entry.name"]:base + LAYOUT["entry.name"] + 64] = (
                                    new_name.encode().ljust(64, b"\0"))
                            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no entry named {name}")
        time.sleep(0.05)


@pytest.mark.parametrize("table", ["the-hubs", "planted", "named-after-an-allocation-of-another-card"])
def test_a_priority_forged_in_the_node_region_does_not_hold_other_containers(make_node, table):
    node = make_node(CUDA_DOUBLE_QUEUE=2)
    common = f"node_region_dir={node.node_dir}\npriority_window_ms={WINDOW_MS}"
    node.node_dir.mkdir(parents=True)
    node.node_dir.chmod(0o1777)
    if table == "the-hubs":  # what the hub / node agent wrote (read-only for containers)
        write_priority_table(node.node_dir, {"alloc-evil": 1, "alloc-good": 10})
    elif table == "named-after-an-allocation-of-another-card":
        write_priority_table(node.node_dir, {"alloc-evil": 1, "alloc-good": 10, "alloc-vip": 1_000_000},
                             {"alloc-vip": ["GPU-00000000-0000-0000-0000-000000000001"]})
    else:  # a table the directory's owner did not write, agreeing with the forgery
        if os.geteuid() != 0:
            pytest.skip("planting a file of another owner needs root")
        write_priority_table(node.node_dir, {"alloc-evil": 1_000_000, "alloc-good": 10})
        os.chown(node.node_dir / "priorities", 65534, 65534)
    evil = node.container("evil", f"priority=1\nname=alloc-evil\n{common}")
    good = node.container("good", f"priority=10\nname=alloc-good\n{common}")
    hog = evil.start("init", "ctx", "ready", "timeline:4:1000", wait_for="ready")
    _forge_priority(node.node_dir, "alloc-evil", 1_000_000, "alloc-vip" if table.startswith("named") else "")
    time.sleep(0.3)
    r = good.run("init", "ctx", "timeline:1:1000")
    hog.communicate(timeout=30)
    assert r.returncode == 0, r.stderr
    assert [g for g in gaps(r.stdout) if g[1] - g[0] > 300] == [], r.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount of the node regions needs root")
def test_priority_holds_through_the_agents_relay_where_the_node_regions_are_read_only(make_node):
    """As in a GPU pod: the node regions are mounted read-only, so each container's shim writes
    its entry's fields into its own container region and the node agent's relay
    (libvgpu.agent.relay) copies them into the card's node region every 50 ms. The low one is
    still held from (nearly) the high one's first launch to a window after its last."""
    from .harness import CARD0, relaying

    node = make_node(CUDA_DOUBLE_QUEUE=2)
    common = f"node_region_dir={node.node_dir}\npriority_window_ms={WINDOW_MS}"
    low = node.container("low", f"priority=1\nname=low\n{common}")
    high = node.container("high", f"priority=100\nname=high\n{common}")
    with relaying(node, low, high):
        low_proc = low.start("init", "ctx", "ready", "timeline:3:1000", wait_for="ready", read_only_node=True)
        time.sleep(1.0)
        h = high.run("init", "ctx", "timeline:1:1000", "sleep:400", read_only_node=True)
        out, err = low_proc.communicate(timeout=30)
        gpu = read_node_regions(node.node_dir, include_dead=True)[CARD0]
    assert low_proc.returncode == 0, err
    assert h.returncode == 0, h.stderr
    assert "node region" not in err + h.stderr, err + h.stderr  # both read it
    assert {c.name for c in gpu.containers} <= {"low", "high"}
    high_start, high_end = field(h.stdout, "start_ms"), field(h.stdout, "end_ms")
    held = [g for g in gaps(out) if g[1] - g[0] > 500]
    assert len(held) == 1, out
    begin, end = held[0]
    # held from (nearly) the high one's first launch, to a window after its last: each a relay
    # period (50 ms) later at most than where the shims write their entries themselves
    assert begin <= high_start + 60 + 50, (begin, high_start)
    assert high_end + WINDOW_MS - 60 <= end <= high_end + WINDOW_MS + 250 + 50, (end, high_end)
