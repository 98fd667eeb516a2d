"""Inside a pid namespace (a pod): NVML reports host pids, getpid() does not return one. The
shim finds its host pid, so the cores limit still sees the container's own utilisation and
the driver's own memory (contexts, lazily loaded modules) is measured, not guessed."""

from __future__ import annotations

from pathlib import Path

import pytest

from libvgpu.regions import read_container_region

MiB = 1 << 20


def util(result) -> float:
    assert result.returncode == 0, result.stderr
    return result.num("util", "util")


def child_pid(pid: int) -> int:
    """The probe under an `unshare -f`: the only child of the process we started."""
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(child)


@pytest.mark.parametrize("kind", ["kernel", "graph"])
def test_cores_limit_holds_inside_a_pid_namespace(node, pidns, kind):
    box = node.container("c", "cores_percent=30")
    r = box.run("init", "ctx", f"util:1:2:500:{kind}", pidns=pidns)
    assert 20 <= util(r) <= 40


def test_the_host_pid_is_found_and_recorded(node, pidns):
    box = node.container("c", "memory_mib=1024")
    proc = box.start("init", "ctx", "alloc:8M", "wait", pidns=pidns)
    (p,) = read_container_region(box.region).processes
    assert p.pid == 1  # the namespace's view
    assert p.host_pid == child_pid(proc.pid)  # the host's, found by the shim itself


def test_context_memory_is_measured_inside_a_pid_namespace(make_node, pidns):
    node = make_node(CUDA_DOUBLE_CONTEXT_MIB=500)  # more than the fallback estimate
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "info", "alloc:524M", "alloc:1", pidns=pidns)
    assert r.returncode == 0, r.stderr
    assert int(r.one("info")["free"]) == 524 * MiB
    assert r.rcs("alloc") == [0, 2]


@pytest.mark.parametrize("in_pidns", [False, True], ids=["host", "pidns"])
def test_lazily_loaded_module_memory_is_trued_up_from_nvml(make_node, pidns, in_pidns):
    node = make_node(CUDA_DOUBLE_CONTEXT_MIB=300, CUDA_DOUBLE_LAZY_MODULE_MIB=40)
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "module", "info", "launch:1:10", "info", "alloc:684M",
                "alloc:1", pidns=in_pidns and pidns)
    assert r.returncode == 0, r.stderr
    free = [int(kv["free"]) for kv in r.all("info")]
    assert free == [724 * MiB, 684 * MiB]  # the code loaded at first use counts too
    assert r.rcs("alloc") == [0, 2]


def test_host_pids_are_told_apart_when_two_pods_start_at_once(make_node, pidns, tmp_path):
    # contexts take 300 ms to create, as on a real card: both processes appear in NVML's list
    # while the other is looking, so the list alone cannot tell which one is whose
    node = make_node(CUDA_DOUBLE_CONTEXT_CREATE_MS=300)
    go = tmp_path / "go"
    boxes = [node.container(name, "memory_mib=1024") for name in ("a", "b")]
    procs = [box.start("init", "ready", f"waitfile:{go}", "ctx", "alloc:8M", "wait",
                       wait_for="ready", pidns=pidns) for box in boxes]
    go.touch()
    for box, proc in zip(boxes, procs, strict=True):
        line = proc.stdout.readline()
        while line and "waiting" not in line:
            line = proc.stdout.readline()
        (p,) = read_container_region(box.region).processes
        assert p.host_pid == child_pid(proc.pid)
