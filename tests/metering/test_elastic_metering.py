"""Metering of elastic slices (issue 27): GPU-hours count the request (what was guaranteed), and
what the slice used above it is recorded apart as burst, as the pool measured it from the
driver's per-process samples (``burst_gpu_seconds``: the hub's on one machine, the node agent's
on Kubernetes), never from the slice's own activity record, which its processes can write.

The measurement itself, on the NVML double with a slice that rewinds its record, is
tests/libvgpu/test_burst_billing.py; here the meter's side: a real GPUAllocator on a LocalPool
with simulated GPUs and the usage store, and the running totals' arithmetic (pure)."""

from __future__ import annotations

import json
import time

import pytest

from hubext.metering.activity import ActivityTotals
from quotas import GPURequest, Owner
from tests.culler.shimrecord import write_activity

from .test_meter import make


async def test_the_burst_a_slices_own_activity_record_claims_is_not_billed(tmp_path):
    """Simulated GPUs have no driver to measure burst: whatever the slice's record says (memory far
    above its request, GPU time above its compute request), its record bills no burst; its busy
    time and memory are still recorded from it."""
    allocator, meter = make(tmp_path)
    try:
        a = await allocator.allocate(
            GPURequest(
                owner=Owner(user="alice", workspace="vision"),
                memory_mib=20480,
                cores_percent=25,
                request_id="el",
                memory_limit_mib=61440,
                cores_limit_percent=100,
            )
        )
        allocator.backend.holder_env(a, priority_value=0)
        t0, path = a.created_at, allocator.backend.activity_path(a.id)
        write_activity(path, last_launch=t0 + 5, used_mib=(61440,), launches=1, compute_burst_s=(600.0,))
        await meter.sample(now=t0 + 1800)
        write_activity(path, last_launch=t0 + 1805, used_mib=(61440,), launches=2, compute_burst_s=(900.0,))
        await meter.sample(now=t0 + 3600)
        await allocator.release(a.id, "server stopped")
        assert meter.recorder.flush()
        (r,) = meter.store.records()
        assert (r.memory_mib, r.memory_limit_mib, r.cores_percent, r.cores_limit_percent) == (20480, 61440, 25, 100)
        assert r.burst_gpu_seconds == 0.0
        assert r.busy_seconds == 3600 and r.memory_used_peak_mib == 61440  # the record's own figures
    finally:
        meter.close()
        await allocator.backend.stop()


def test_each_sample_adds_what_the_pools_burst_total_grew_by():
    totals = ActivityTotals.at(1000.0)
    record = {"last_launch": 1005.0, "memory_used_mib": 100, "launches": 1}
    totals.add({**record, "burst_gpu_seconds": 600.0}, 2800.0)
    totals.add({**record, "burst_gpu_seconds": 900.0, "compute_burst_seconds": 1e9}, 4600.0)  # the shim's: ignored
    assert totals.burst_gpu_seconds == 900.0
    totals.add({**record, "burst_gpu_seconds": 50.0}, 6400.0)  # a new count (the agent restarted): all of it new
    assert totals.burst_gpu_seconds == 950.0
    for bad in (-1.0, float("nan"), True, "3"):
        totals.add({**record, "burst_gpu_seconds": bad}, 8200.0)
    assert totals.burst_gpu_seconds == 950.0


def test_a_burst_total_without_the_slices_record_is_counted_and_nothing_else_is():
    """A slice whose record is unreadable (deleted or garbled by its own processes) is still
    billed the burst the pool measured; its busy time is not made up."""
    totals = ActivityTotals.at(1000.0)
    totals.add({"burst_gpu_seconds": 0.0}, 1030.0)
    totals.add({"burst_gpu_seconds": 12.5}, 1060.0)
    assert totals.burst_gpu_seconds == 12.5
    assert (totals.samples, totals.activity_seconds, totals.busy_seconds) == (0, 0.0, 0.0)


def test_after_a_hub_restart_the_first_total_only_sets_where_counting_resumes():
    totals = ActivityTotals(last_sample_at=1000.0, granted_at=900.0, burst_gpu_seconds=40.0, burst_seen=None)
    totals.add({"burst_gpu_seconds": 700.0}, 1030.0)
    totals.add({"burst_gpu_seconds": 710.0}, 1060.0)
    assert totals.burst_gpu_seconds == 50.0


async def test_the_burst_a_deleted_pods_agent_publishes_after_the_release_is_billed_to_that_record_only(tmp_path):
    """Kubernetes: the hub hears the release before the pod has finished terminating, and the node
    agent publishes the pod's last burst total (its gpu-activity annotation) after it. The meter
    bills that late total to the record it just closed, only what it grew by, within
    LATE_BURST_SECONDS of the release; a lower total (the agent restarted), a total past the window
    and a total of another allocation bill nothing."""
    from hubext.metering.meter import LATE_BURST_SECONDS
    from tests.metering.test_meter import request

    allocator, meter = make(tmp_path)
    annotations: dict[str, dict] = {}  # allocation id -> the agent's gpu-activity, as the pod shows it
    allocator.backend.slice_activity = lambda ids: {i: annotations[i] for i in ids if i in annotations}
    try:
        a = await allocator.allocate(request("alice", 20, "a"))
        b = await allocator.allocate(request("bob", 20, "b"))
        annotations[a.id] = {"burst_gpu_seconds": 10.0}
        t0 = time.time()
        await meter.sample(t0)
        await allocator.release(a.id, "server stopped")  # the pod is terminating; the hub hears it first
        annotations[a.id] = {"burst_gpu_seconds": 14.0}  # the agent's last annotation of the pod
        await meter.sample(t0 + 1)
        annotations[a.id] = {"burst_gpu_seconds": 3.0}  # not a new count for a closed record
        await meter.sample(t0 + 2)
        annotations[a.id] = {"burst_gpu_seconds": 99.0}
        await meter.sample(t0 + 3 + LATE_BURST_SECONDS)  # too late: not billed
        annotations[b.id] = {"burst_gpu_seconds": 0.0}
        await meter.sample(t0 + 4 + LATE_BURST_SECONDS)
        assert meter.recorder.flush()
        records = {r.user: r for r in meter.store.records()}
        assert records["alice"].released_at is not None
        assert records["alice"].burst_gpu_seconds == pytest.approx(14.0)
        assert not records["bob"].burst_gpu_seconds
    finally:
        meter.close()
        await allocator.backend.stop()


async def test_the_kubernetes_pool_still_answers_a_deleted_pods_last_activity(monkeypatch):
    """The agent's last gpu-activity annotation of a pod arrives (a watch MODIFIED) just before the
    pod is deleted (DELETED): the pool still answers it for that allocation, so the meter's late
    look bills it; a pod of another allocation answers nothing for this one."""
    from hubext.kubernetes.pool import KubernetesPool, ManagedPodReflector
    from libvgpu import contract as C

    # no API is called here: a reflector's shared client made without a cluster's configuration
    # would be cached for the session's loop and fail every later test of this worker that lists
    monkeypatch.setattr("kubespawner.reflector.shared_client", lambda *args, **kwargs: None)
    pool = KubernetesPool(namespace="jhub")
    pool.reflector = reflector = ManagedPodReflector(parent=pool, namespace="jhub")

    def pod(name: str, allocation_id: str, burst: float) -> dict:
        activity = json.dumps(
            {"burst_gpu_seconds": burst, "last_launch": None, "memory_used_mib": 0, "updated_at": 1.0}
        )
        annotations = {C.ALLOCATION_ID: allocation_id, C.A_GPU_ACTIVITY: activity}
        return {"metadata": {"name": name, "namespace": "jhub", "annotations": annotations}}

    reflector.resources = {"jhub/a": pod("a", "alloc-a", 10.0), "jhub/b": pod("b", "alloc-b", 1.0)}  # a (re)list
    reflector.resources["jhub/a"] = pod("a", "alloc-a", 14.0)  # the agent's last annotation of it
    reflector.resources.pop("jhub/a", None)  # the watch's DELETED, as kubespawner applies it
    assert pool.slice_activity(["alloc-a", "alloc-b", "alloc-c"]) == {
        "alloc-a": {"burst_gpu_seconds": 14.0, "last_launch": None, "memory_used_mib": 0},
        "alloc-b": {"burst_gpu_seconds": 1.0, "last_launch": None, "memory_used_mib": 0},
    }
