"""The node agent publishes each GPU pod's GPU activity (the shim's last launch and memory) on the
pod as the ``elastic-gpu.jupyter.org/gpu-activity`` annotation, for the culler in Kubernetes mode.

One simulated GPU node (the helpers of :mod:`tests.libvgpu.agent.test_agent`: CUDA/NVML doubles, the
Kubernetes emulator, the agent as a subprocess) with two pods under the shim on GPU 0:

* ``act-a`` allocates 300 MiB and launches 3 kernels, then waits;
* ``act-b`` allocates 100 MiB and launches nothing until the test says so (a second process of the
  pod, started when the test touches a file).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest

from libvgpu import contract as L
from libvgpu.agent.activity import ActivityPublisher, PodActivity, needs_patch
from libvgpu.agent.pods import PodInfo
from libvgpu.regions import LAYOUT, read_node_regions
from quotas import Allocation, Owner
from tests.kubeemu import KubeEmulator, NodeSpec
from tests.kubeemu.helpers import create_host_claim
from tests.kubeemu.images import Image
from tests.libvgpu.agent.test_agent import (
    GPU0,
    HOST_PROC,
    MIB,
    NODE,
    NS,
    Node,
    add_default_priority_class,
    allocation,
    gpu_node_root,
    gpu_pod,
    run_pod,
    start_agent,
    stop_agent,
    wait_for,
)

SHIM = "/usr/local/lib/elastic-gpu/libvgpu.so"  # the pod's hostPath mount of the node's lib dir


def activity_of(node: Node, pod: str) -> dict | None:
    raw = (node.emu.get("pods", pod, NS)["metadata"].get("annotations") or {}).get(L.A_GPU_ACTIVITY)
    return json.loads(raw) if raw else None


@pytest.fixture(scope="module")
def anode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root, build, gpu_env = gpu_node_root(tmp_path_factory, "activity-node", CONTEXT_MIB="0")
    emu = KubeEmulator(nodes=[NodeSpec(NODE, labels={"nvidia.com/gpu.present": "true"})], namespaces=[NS],
                       pod_env={**gpu_env, "CUDA_DOUBLE_HOST_PROC": HOST_PROC}, restart_backoff_seconds=1.0,
                       node_mounts=[str(root), f"/proc:{HOST_PROC}"],  # see test_agent.node
                       images={"jupyter/gpu*": Image()})  # root: the probe is in a 0700 tmp dir
    emu.start()
    add_default_priority_class(emu)
    create_host_claim(emu, NS, root / "host")
    n = Node(root, build, emu, root / "host", root / "proc", root / "xid", gpu_env)
    n.proc_root.mkdir()
    try:
        n.started_at = time.time()
        # the backstop never runs here (the second process of act-b has no cgroup file)
        start_agent(n, f"""
NodeAgent:
  proc_root: {n.proc_root}
  pod_namespace: {NS}
  metrics_ip: 127.0.0.1
  refresh_interval_seconds: 0.3
  inventory_interval_seconds: 60
  pod_refresh_seconds: 0.3
Backstop:
  interval_seconds: 3600
""")
        run_pod(n, "act-a", allocation("a-act", "alice", 1024),
                ["init", "ctx", "alloc:300M", "launch:3:100", "wait"], {"LD_PRELOAD": SHIM})
        go2 = root / "act-b.go2"
        probe = str(build.probe)
        script = (f'"{probe}" init ctx alloc:100M wait & '
                  f'while [ ! -e "{go2}" ]; do sleep 0.05; done; exec "{probe}" init ctx launch:1:100 wait')
        n.emu.create(gpu_pod(n, "act-b", allocation("b-act", "bob", 1024), ["/bin/sh", "-c", script],
                             {"LD_PRELOAD": SHIM}), "pods", NS)
        n.emu.wait_for_pod_phase("act-b", "Running", NS, timeout=20)
        # its shell's cgroup, through which the agent reads the pod's region (libvgpu.agent.relay)
        pid = wait_for(lambda: n.emu.pod_pid("act-b", NS), 10, "the process of act-b")
        n.write_cgroup(pid, n.emu.get("pods", "act-b", NS)["metadata"]["uid"], "sh")
        yield n
    finally:
        stop_agent(n)
        emu.stop()


def test_agent_publishes_the_shims_activity_on_the_pod(anode):
    value = wait_for(lambda: (lambda a: a if a and a["last_launch"] and a["memory_used_mib"] == 300 else None)(
        activity_of(anode, "act-a")), 20, "act-a's gpu-activity annotation")
    assert set(value) == {"last_launch", "memory_used_mib", "updated_at"}  # a fixed slice: no burst figure
    # the same figures as the shim's entry of allocation a-act in GPU 0's node region
    gpu = read_node_regions(anode.host_dir / "regions")[GPU0]
    [entry] = [e for e in gpu.containers if e.name == "a-act"]
    assert entry.memory_used_bytes == 300 * MIB
    assert entry.last_launch_at is not None and abs(value["last_launch"] - entry.last_launch_at) < 0.01
    assert anode.started_at <= value["last_launch"] <= value["updated_at"] <= time.time()
    raw = anode.emu.get("pods", "act-a", NS)["metadata"]["annotations"][L.A_GPU_ACTIVITY]
    assert " " not in raw  # compact JSON


def test_an_unchanged_activity_is_not_patched_again(anode):
    wait_for(lambda: (activity_of(anode, "act-a") or {}).get("memory_used_mib") == 300, 20, "act-a's annotation")
    before = anode.emu.get("pods", "act-a", NS)["metadata"]["resourceVersion"]
    time.sleep(2.0)  # about 6 refreshes
    assert anode.emu.get("pods", "act-a", NS)["metadata"]["resourceVersion"] == before


def test_a_pod_that_never_launched_reads_as_idle_and_its_first_launch_is_published_at_once(anode):
    idle = wait_for(lambda: (lambda a: a if a and a["memory_used_mib"] == 100 else None)(
        activity_of(anode, "act-b")), 20, "act-b's annotation before any launch")
    assert idle["last_launch"] is None
    go = time.time()
    (anode.root / "act-b.go2").touch()
    # well before the 30 s republish interval: a first launch is patched at once
    launched = wait_for(lambda: (lambda a: a if a and a["last_launch"] else None)(activity_of(anode, "act-b")),
                        8, "act-b's first launch in its annotation")
    assert go - 1 <= launched["last_launch"] <= time.time()
    assert launched["memory_used_mib"] == 100


def in_root(root: str, path: str) -> str:
    """``path`` as the pod sees it, on this host (the image's /var/run is a link to /run, which
    resolves against the pod's root, not the host's)."""
    at = "/"
    for part in path.strip("/").split("/"):
        here = os.path.join(root, at.lstrip("/"), part)
        target = os.readlink(here) if os.path.islink(here) else part
        at = os.path.normpath(target if target.startswith("/") else os.path.join(at, target))
    return os.path.join(root, at.lstrip("/"))


def test_an_elastic_pods_burst_is_what_nvml_saw_however_the_pod_rewinds_its_activity_file(anode):
    """Attack: an elastic pod (request 25 % and 1 GiB, limit the whole card) runs alone at full
    speed, so most of its GPU time is burst, while its activity file's burst counters (the shim's
    ``compute_burst_ns``, in a file the pod's processes write; written here through the pod's root)
    are rewound to zero every few milliseconds. What the agent publishes for metering
    (``burst_gpu_seconds``, what the hub bills) is measured from NVML's per-process samples of the
    pod's processes, found by their cgroup: the rewinding changes nothing."""
    elastic = Allocation(id="c-act", owner=Owner(user="mallory", namespace="default", workspace="vision"),
                         node=NODE, gpu_uuids=(GPU0,), memory_mib=1024, cores_percent=25, memory_limit_mib=2048,
                         cores_limit_percent=100, priority_class="default", kind="kernel", created_at=time.time())
    began = time.time()
    pid = run_pod(anode, "act-c", elastic, ["init", "ctx", "alloc:300M", "timeline:3:2000", "wait"],
                  {"LD_PRELOAD": SHIM})
    stop = threading.Event()

    def rewind() -> None:  # what code in the pod can do to its own activity file
        path = in_root(f"/proc/{pid}/root", "/var/run/libvgpu/activity")
        while not stop.is_set():
            try:
                with open(path, "r+b") as f:
                    while not stop.wait(0.005):
                        f.seek(LAYOUT["activity.compute_burst_ns"])
                        f.write(bytes(8 * 16))
                        f.flush()
            except OSError:  # not made yet (the shim makes it at CUDA initialisation)
                stop.wait(0.01)

    rewinder = threading.Thread(target=rewind, daemon=True)
    rewinder.start()
    try:
        # 3 s at about the whole card, 25 % of it guaranteed: about 2.2 card-seconds of burst
        published = wait_for(
            lambda: (lambda a: a if a.get("burst_gpu_seconds", 0) >= 1.2 else None)(activity_of(anode, "act-c") or {}),
            60, "act-c's burst in its gpu-activity annotation (small changes wait for the 30 s interval)",
        )
    finally:
        stop.set()
        rewinder.join(5)
    assert published["burst_gpu_seconds"] <= 0.75 * (time.time() - began) * 1.05, published
    # what the hub reads of it (the broker's record, metering's samples)
    assert L.gpu_activity(json.dumps(published))["burst_gpu_seconds"] == published["burst_gpu_seconds"]


def test_a_burst_figure_the_agent_did_not_write_is_ignored():
    base = {"last_launch": 1.0, "memory_used_mib": 2}
    assert L.gpu_activity(json.dumps({**base, "burst_gpu_seconds": 1.5}))["burst_gpu_seconds"] == 1.5
    for bad in (-1, True, "3", float("nan"), None):
        assert "burst_gpu_seconds" not in L.gpu_activity({**base, "burst_gpu_seconds": bad}), bad
    # the shim's own count, which older agents published, is not a figure the hub bills
    assert "compute_burst_seconds" not in L.gpu_activity({**base, "compute_burst_seconds": 9.0})


# ---- the publisher's rules, without a node -----------------------------------------------------------


def test_a_launch_a_shim_stamped_ahead_of_time_is_published_no_later_than_now():
    """A shim sleeping off its limiter's debt stamps its node entry with the launch it will make at
    wake (so its neighbours count it busy meanwhile): the annotation says what happened. Twice a
    whole-suite CI run published a launch 36 ms after the test's own clock read."""
    from libvgpu.agent.activity import pod_activity
    from libvgpu.agent.usage import AllocationUsage

    pod = PodInfo("act-x", NS, "uid-x", "Running", allocation("x-act", "alice", 1024))
    ahead = AllocationUsage(gpu_uuid=GPU0, allocation_id="x-act", user="alice", workspace="vision",
                            namespace="default", kind="kernel", pod="act-x", used_bytes=0, limit_bytes=None,
                            last_activity=1000.2, source="shim")
    [(_, published)] = pod_activity([pod], [ahead], {}, now=1000.0).values()
    assert published.last_launch == 1000.0


def test_small_changes_wait_for_the_interval_big_ones_go_at_once():
    old = PodActivity(last_launch=1000.0, memory_used_mib=300)
    rules = {"interval_seconds": 30.0, "memory_step_mib": 256}
    assert needs_patch(None, old, 0, **rules)
    assert not needs_patch(old, old, 3600, **rules)
    assert not needs_patch(old, PodActivity(1010.0, 300), 5, **rules)  # a busy kernel: at most every 30 s
    assert needs_patch(old, PodActivity(1010.0, 300), 30, **rules)
    assert needs_patch(old, PodActivity(1031.0, 300), 5, **rules)  # active again after a pause
    assert needs_patch(PodActivity(None, 300), PodActivity(1001.0, 300), 1, **rules)
    assert not needs_patch(old, PodActivity(1000.0, 400), 5, **rules)
    assert needs_patch(old, PodActivity(1000.0, 600), 5, **rules)
    assert needs_patch(old, PodActivity(1000.0, 0), 5, **rules)


def test_a_failing_patch_is_logged_once_per_pod_and_never_raises(caplog):
    calls = []

    async def patch(namespace: str, name: str, value: str) -> None:
        calls.append(name)
        raise RuntimeError("403 pods is forbidden")

    pod = PodInfo(name="p", namespace=NS, uid="u1", phase="Running", allocation=None)
    pub = ActivityPublisher(patch, logging.getLogger("test-activity"), interval_seconds=0.0)
    current = {"u1": (pod, PodActivity(1.0, 10))}
    with caplog.at_level(logging.WARNING, "test-activity"):
        for _ in range(3):
            assert asyncio.run(pub.publish(current)) == 0
    assert calls == ["p", "p", "p"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"{NS}/p" in warnings[0] and "403 pods is forbidden" in warnings[0]


def test_a_pod_being_deleted_gets_its_last_burst_total_at_once():
    """Kubernetes bills an elastic slice's burst from this annotation; once the pod is deleted it
    cannot change. A burst that grew a little waits for the interval while the pod runs, but the
    pod being deleted (deletionTimestamp) gets its current total at once (issue 27)."""
    from libvgpu.agent.pods import pod_info

    elastic = dataclasses.replace(allocation("e-act", "erin", 1024), memory_limit_mib=2048, cores_limit_percent=100)
    elastic_meta = {"labels": L.allocation_labels(elastic), "annotations": L.allocation_annotations(elastic)}
    meta = {"name": "act-e", "namespace": NS, "uid": "uid-e", **elastic_meta}
    running = pod_info({"metadata": meta, "status": {"phase": "Running"}})
    deleted = {**meta, "deletionTimestamp": "2026-11-30T00:00:00Z"}
    deleting = pod_info({"metadata": deleted, "status": {"phase": "Running"}})
    sent: list[dict] = []

    async def patch(namespace: str, name: str, value: str) -> None:
        sent.append(json.loads(value))

    pub = ActivityPublisher(patch, logging.getLogger("test-activity"), interval_seconds=30.0)
    assert asyncio.run(pub.publish({"uid-e": (running, PodActivity(1.0, 300, burst_gpu_seconds=10.0))})) == 1
    assert asyncio.run(pub.publish({"uid-e": (running, PodActivity(1.0, 300, burst_gpu_seconds=12.0))})) == 0
    assert asyncio.run(pub.publish({"uid-e": (deleting, PodActivity(1.0, 300, burst_gpu_seconds=14.0))})) == 1
    assert [s["burst_gpu_seconds"] for s in sent] == [10.0, 14.0]
    assert asyncio.run(pub.publish({"uid-e": (deleting, PodActivity(1.0, 300, burst_gpu_seconds=14.0))})) == 0
