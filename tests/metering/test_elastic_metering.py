"""Metering of elastic slices (issue 27): GPU-hours count the request (what was guaranteed), and
what the slice used above it is recorded apart as burst, from the shim's activity record; through
a real GPUAllocator on a LocalPool with simulated GPUs, the usage store and the report."""

from __future__ import annotations

import pytest

from hubext.metering.report import report_csv, usage_report
from quotas import GPURequest, Owner
from tests.culler.shimrecord import write_activity

from .test_meter import make


async def test_an_elastic_slices_burst_is_recorded_apart_from_its_guaranteed_hours(tmp_path):
    allocator, meter = make(tmp_path)
    try:
        a = await allocator.allocate(GPURequest(
            owner=Owner(user="alice", workspace="vision"), memory_mib=20480, cores_percent=25, request_id="el",
            memory_limit_mib=61440, cores_limit_percent=100,
        ))
        fixed = await allocator.allocate(GPURequest(
            owner=Owner(user="bob", workspace="vision"), memory_mib=20480, cores_percent=25, request_id="fx",
        ))
        for allocation in (a, fixed):
            allocator.backend.holder_env(allocation, priority_value=0)
        t0 = a.created_at
        path, fixed_path = allocator.backend.activity_path(a.id), allocator.backend.activity_path(fixed.id)
        write_activity(path, last_launch=t0 + 5, used_mib=(61440,), launches=1)  # 40 GiB above its 20
        write_activity(fixed_path, last_launch=t0 + 5, used_mib=(20480,), launches=1)
        await meter.sample(now=t0 + 1800)
        write_activity(path, last_launch=t0 + 5, used_mib=(10240,), launches=1)  # within its request
        await meter.sample(now=t0 + 3600)
        await allocator.release(a.id, "server stopped")
        await allocator.release(fixed.id, "server stopped")
        assert meter.recorder.flush()
        records = {r.id: r for r in meter.store.records()}
        r = records[a.id]
        assert (r.memory_mib, r.memory_limit_mib, r.cores_percent, r.cores_limit_percent) == (20480, 61440, 25, 100)
        # 40 GiB of an 80 GiB card for the first 1800 s: half a card for half an hour
        assert r.burst_gpu_seconds == pytest.approx(900.0)
        assert records[fixed.id].burst_gpu_seconds == 0.0 and records[fixed.id].memory_limit_mib == 0
        report = usage_report(meter.store.records(), t0, t0 + 7200, by=("user",))
        rows = {row["user"]: row for row in report.rows}
        assert rows["alice"]["burst_gpu_hours"] == pytest.approx(0.25, rel=0.01)
        held = r.released_at - r.granted_at
        assert rows["alice"]["gpu_hours"] == pytest.approx(held / 3600 * 0.25)  # the guarantee: 1/4 card
        assert rows["bob"]["burst_gpu_hours"] == 0.0
        assert "burst_gpu_hours" in report_csv(report).splitlines()[0].split(",")
    finally:
        meter.close()
        await allocator.backend.stop()


async def test_an_elastic_slices_compute_burst_is_recorded_apart_too(tmp_path):
    """The shim counts the GPU time a slice ran above its compute request (its activity record);
    the meter adds what each sample interval adds to it, in card-seconds. Where the slice bursts
    in memory too in one interval, the larger of the two counts (a card-share, as its guarantee's
    share is the larger of its memory and compute shares)."""
    allocator, meter = make(tmp_path)
    try:
        a = await allocator.allocate(GPURequest(
            owner=Owner(user="carol", workspace="vision"), memory_mib=20480, cores_percent=25, request_id="cb",
            memory_limit_mib=61440, cores_limit_percent=100,
        ))
        allocator.backend.holder_env(a, priority_value=0)
        t0, path = a.created_at, allocator.backend.activity_path(a.id)
        # the first half hour: 600 s of GPU time above its 25 %, memory within its request
        write_activity(path, last_launch=t0 + 5, used_mib=(10240,), launches=9, compute_burst_s=(600.0,))
        await meter.sample(now=t0 + 1800)
        # the second: 300 s more above its compute request, and 40 GiB above its memory request
        # (half the card for 1800 s: 900 card-seconds, the larger)
        write_activity(path, last_launch=t0 + 1805, used_mib=(61440,), launches=20, compute_burst_s=(900.0,))
        await meter.sample(now=t0 + 3600)
        await allocator.release(a.id, "server stopped")
        assert meter.recorder.flush()
        (r,) = meter.store.records()
        assert r.burst_gpu_seconds == pytest.approx(600.0 + 900.0)
        report = usage_report(meter.store.records(), t0, t0 + 7200, by=("user",))
        assert report.rows[0]["burst_gpu_hours"] == pytest.approx(1500 / 3600, rel=0.01)
    finally:
        meter.close()
        await allocator.backend.stop()
