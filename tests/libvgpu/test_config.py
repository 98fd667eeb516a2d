"""Configuration: a read-only limits file, env vars only as a fallback that can never raise a
limit, nothing the container can write read as a limit, and a broken config refusing CUDA
with one clear line instead of running unlimited."""

from __future__ import annotations

import os
import struct

import pytest

from .harness import Node

MiB = 1 << 20
OOM = 2
NOT_INITIALIZED = 3

BAD = [
    ("memory_mib=lots", "line 1: memory_mib must be a whole number of MiB (0 or more), got 'lots'"),
    ("# ok\nmemroy_mib=5", "line 2: unknown key 'memroy_mib' (allowed: memory_mib[.N]"),
    ("cores_percent=0", "cores_percent must be an integer 1..100, got '0'"),
    ("cores_percent.3=101", "cores_percent.3 must be an integer 1..100, got '101'"),
    ("memory_mib.99=5", "GPU index in 'memory_mib.99' must be an integer 0..15"),
    ("limits for alice", "line 1: expected key=value, got 'limits for alice'"),
    ("memory_mib=5\n\nmemory_mib=6", "line 3: key 'memory_mib' is given twice"),
    ("container_region=var/run/x", "container_region must be an absolute path"),
    ("priority.1=3", "key 'priority' takes no GPU index"),
    ("memory_mib=512\nmemory_limit_mib.0=256",
     "for GPU 0: memory_limit_mib (256) is below memory_mib (512): the limit is what the slice "
     "may burst to, at least its request"),
    ("memory_limit_mib=1024", "for GPU 0: memory_limit_mib needs a memory_mib"),
    ("cores_percent=50\ncores_limit_percent=25", "for GPU 0: cores_limit_percent (25) is below"),
    ("cores_limit_percent.1=101", "cores_limit_percent.1 must be an integer 1..100, got '101'"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[b[0].split("=")[0][-12:] for b in BAD])
def test_a_broken_limits_file_refuses_cuda_with_one_clear_line(node, text, message):
    box = node.container("c", text)
    r = box.run("init", "ctx", "alloc:1M", mode="dlopen")
    assert r.returncode == 0
    assert r.rcs("init") == [NOT_INITIALIZED]
    assert r.rcs("alloc") == [NOT_INITIALIZED]
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert f"invalid configuration: {box.limits} " in lines[0]
    assert message in lines[0]
    assert lines[0].endswith("CUDA is disabled until it is fixed")


def test_a_broken_environment_variable_refuses_cuda(node):
    box = node.container("c", "")
    r = box.run("init", env={"LIBVGPU_MEMORY_MIB": "1G", "LIBVGPU_CONFIG": ""})
    assert r.rcs("init") == [NOT_INITIALIZED]
    assert "environment variable LIBVGPU_MEMORY_MIB: memory_mib must be a whole number" in r.stderr


def test_env_cannot_raise_a_limit_from_the_file_but_can_lower_it(node):
    box = node.container("c", "memory_mib=512\ncores_percent=50\npriority=10")
    raised = box.run("init", "ctx", "alloc:1G", "info",
                     env={"LIBVGPU_MEMORY_MIB": "4096", "LIBVGPU_MEMORY_MIB_0": "4096"})
    assert raised.rcs("alloc") == [OOM]
    assert int(raised.one("info")["total"]) == 512 * MiB
    lowered = box.run("init", "ctx", "alloc:300M", "info", env={"LIBVGPU_MEMORY_MIB_0": "256"})
    assert lowered.rcs("alloc") == [OOM]
    assert int(lowered.one("info")["total"]) == 256 * MiB


def test_env_is_the_fallback_when_there_is_no_limits_file(node, tmp_path):
    box = node.container("c", "")
    env = {"LIBVGPU_MEMORY_MIB": "256", "LIBVGPU_CONTAINER_REGION": str(tmp_path / "r.region"),
           "LIBVGPU_CONFIG": ""}
    r = box.run("init", "ctx", "alloc:300M", "alloc:200M", env=env)
    assert r.rcs("alloc") == [OOM, 0]
    assert (tmp_path / "r.region").exists()


def test_the_default_limits_file_wins_over_libvgpu_config(default_path_build, tmp_path):
    node = Node(default_path_build, tmp_path / "node")
    default = default_path_build.root / "etc" / "limits.conf"
    default.parent.mkdir(exist_ok=True)
    default.write_text(f"memory_mib=256\ncontainer_region={tmp_path / 'c.region'}\n")
    try:
        box = node.container("c", "memory_mib=4096")  # what a user points LIBVGPU_CONFIG at
        r = box.run("init", "ctx", "alloc:300M", "info")
        assert r.rcs("alloc") == [OOM]
        assert int(r.one("info")["total"]) == 256 * MiB
    finally:
        default.unlink()
        node.cleanup()


def test_nothing_written_in_the_region_is_read_as_a_limit(node):
    box = node.container("c", "memory_mib=256")
    assert box.run("init", "ctx").rcs("ctx") == [0]
    fd = os.open(box.region, os.O_RDWR)
    try:  # what a user in the container could do: write "unlimited" into the region
        os.pwrite(fd, struct.pack("<16Q", *[2**64 - 1] * 16), 320)
        os.pwrite(fd, struct.pack("<16I", *[0] * 16), 448)
    finally:
        os.close(fd)
    r = box.run("init", "ctx", "alloc:300M", "info")
    assert r.rcs("alloc") == [OOM]
    assert int(r.one("info")["total"]) == 256 * MiB


def test_per_gpu_limits_apply_to_each_gpu(make_node):
    node = make_node(CUDA_DOUBLE_DEVICES=2)
    box = node.container("c", "memory_mib=1024\nmemory_mib.1=256")
    r = box.run("init", "ctx:1", "alloc:300M", "info", "ctx:0", "alloc:300M", "info", "total:1")
    assert r.one("init")["devices"] == "2"
    assert r.rcs("alloc") == [OOM, 0]
    assert [int(kv["total"]) for kv in r.all("info")] == [256 * MiB, 1024 * MiB]
    assert int(r.one("total")["total"]) == 256 * MiB


def test_a_missing_limits_file_named_by_libvgpu_config_refuses_cuda(node):
    box = node.container("c", "memory_mib=64")
    box.limits.chmod(0o644)
    box.limits.unlink()  # e.g. the volume with the limits was not mounted
    r = box.run("init", "ctx", "alloc:1G", env={"LIBVGPU_MEMORY_MIB": "4096"})
    assert r.rcs("init") == [NOT_INITIALIZED]
    assert r.rcs("alloc") == [NOT_INITIALIZED]
    assert f"{box.limits} (named by LIBVGPU_CONFIG) cannot be read" in r.stderr
