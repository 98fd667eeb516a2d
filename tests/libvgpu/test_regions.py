"""libvgpu.regions: the reader agrees with the C layout, names what is wrong with a file, and
lists the GPUs of a node with the containers on them."""

from __future__ import annotations

import os
import struct
import subprocess

import pytest

from libvgpu.regions import (
    LAYOUT,
    RegionError,
    read_activity,
    read_container_region,
    read_node_region,
    read_node_regions,
)

from .harness import HERE, cc, kill

MiB = 1 << 20


def test_python_layout_matches_the_c_structs(tmp_path):
    exe = tmp_path / "offsets"
    cc("-I", HERE.parents[1] / "libvgpu" / "src", "-o", exe, HERE / "progs" / "offsets.c")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    c_layout = {name: int(value) for name, value in (line.split() for line in out.splitlines())}
    assert c_layout == LAYOUT


def test_reader_names_what_is_wrong_with_a_file(node, tmp_path):
    box = node.container("c", "memory_mib=64")
    box.run("init", "ctx")
    good = box.region.read_bytes()

    junk = tmp_path / "junk"
    junk.write_bytes(b"hello" * 100)
    with pytest.raises(RegionError, match=r"junk: not a libvgpu container region"):
        read_container_region(junk)

    newer = tmp_path / "newer"
    newer.write_bytes(good[:8] + struct.pack("<I", 2) + good[12:])
    with pytest.raises(RegionError, match=r"layout version 2; this reader knows version 1"):
        read_container_region(newer)

    short = tmp_path / "short"
    short.write_bytes(good[:5000])
    with pytest.raises(RegionError, match=r"truncated \(5000 of 331776 bytes\)"):
        read_container_region(short)

    with pytest.raises(RegionError, match=r"is a container region, not a activity file"):
        read_activity(box.region)

    with pytest.raises(FileNotFoundError):
        read_container_region(tmp_path / "missing.region")
    with pytest.raises(FileNotFoundError):
        read_activity(tmp_path / "missing")


def test_node_regions_list_each_gpu_and_its_containers(make_node):
    node = make_node(CUDA_DOUBLE_DEVICES=2)
    a = node.container("a", "memory_mib=1024\ncores_percent=25\npriority=5\nname=alloc-a",
                       node_regions=True)
    b = node.container("b", "priority=7\nname=alloc-b", node_regions=True)
    pa = a.start("init", "ctx:1", "alloc:64M", "launch:2:10", "wait")
    b.start("init", "ctx:1", "alloc:32M", "ctx:0", "alloc:16M", "launch:1:10", "wait")
    gpus = read_node_regions(node.node_dir)
    assert len(gpus) == 2
    g0, g1 = (gpus[u] for u in sorted(gpus))
    assert [c.name for c in g0.containers] == ["alloc-b"]
    by_name = {c.name: c for c in g1.containers}
    ca, cb = by_name["alloc-a"], by_name["alloc-b"]
    assert (ca.priority, ca.cores_percent, ca.memory_limit_bytes) == (5, 25, 1024 * MiB)
    assert (cb.priority, cb.cores_percent, cb.memory_limit_bytes) == (7, None, None)
    assert (ca.memory_used_bytes, cb.memory_used_bytes) == (64 * MiB, 32 * MiB)
    assert ca.last_launch_at is not None and cb.last_launch_at is None
    assert g0.containers[0].memory_used_bytes == 16 * MiB
    assert g0.containers[0].last_launch_at is not None
    kill(pa)
    after = read_node_region(g1.path)
    assert [c.name for c in after.containers] == ["alloc-b"]
    dead = [c for c in read_node_region(g1.path, include_dead=True).containers if not c.alive]
    assert [c.name for c in dead] == ["alloc-a"]


def test_a_dead_containers_node_entry_is_reused(make_node):
    node = make_node()
    boxes = [node.container(f"c{i}", f"name=c{i}", node_regions=True) for i in range(3)]
    for box in boxes:  # one after the other: each exits before the next starts
        assert box.run("init", "ctx", "launch:1:10").returncode == 0
    (gpu,) = read_node_regions(node.node_dir, include_dead=True).values()
    assert [c.index for c in gpu.containers] == [0]
    assert gpu.containers[0].name == "c2"
    assert os.stat(gpu.path).st_size == LAYOUT["node.size"]
