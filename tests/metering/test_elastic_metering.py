"""Metering of elastic slices (issue 27): GPU-hours count the request (what was guaranteed), and
what the slice used above it is recorded apart as burst, as the pool measured it from the
driver's per-process samples (``burst_gpu_seconds``: the hub's on one machine, the node agent's
on Kubernetes), never from the slice's own activity record, which its processes can write.

The measurement itself, on the NVML double with a slice that rewinds its record, is
tests/libvgpu/test_burst_billing.py; here the meter's side: a real GPUAllocator on a LocalPool
with simulated GPUs and the usage store, and the running totals' arithmetic (pure)."""

from __future__ import annotations

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
        a = await allocator.allocate(GPURequest(
            owner=Owner(user="alice", workspace="vision"), memory_mib=20480, cores_percent=25, request_id="el",
            memory_limit_mib=61440, cores_limit_percent=100,
        ))
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
