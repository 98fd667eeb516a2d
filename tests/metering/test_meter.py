"""The meter through a real GPUAllocator on a LocalPool with simulated GPUs: a record for every
grant and release with its cause (stopped, preempted, culled, holder gone), activity from the
shim's activity record, and records that survive a hub crash (reconciled with the ledger)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry
from traitlets.config import Config

from hubext.allocator import GPUAllocator
from hubext.backends import ReleaseCause
from hubext.events import SliceEvent, SliceEventKind
from hubext.metering.meter import UsageMeter
from hubext.metering.metrics import UsageMetrics
from hubext.metering.record import UNRECORDED, swapped_periods
from quotas import GPURequest, Owner
from tests.culler.shimrecord import write_activity


def make(tmp_path, **local_pool: object) -> tuple[GPUAllocator, UsageMeter]:
    """A GPUAllocator on a LocalPool (one simulated H100 unless ``local_pool`` says otherwise:
    LocalPool settings) and a UsageMeter attached to it."""
    c = Config()
    c.GPUAllocator.pool_backend_class = "local"
    c.LocalPool.simulate_gpus = "1xH100-80GB"
    for name, value in local_pool.items():
        setattr(c.LocalPool, name, value)
    c.LocalPool.data_dir = str(tmp_path / "data")
    c.LocalPool.check_interval_seconds = 0.1
    c.GPUAllocator.admission_config = {"workspaces": {"vision": {"namespaces": {"default": {}}}}}
    c.UsageMeter.db_url = f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}"
    c.UsageMeter.prices = {"H100-80GB": {"gpu_hour": 4.0}}
    allocator = GPUAllocator(config=c)
    meter = UsageMeter(config=c)
    meter.open()
    meter.attach(allocator)
    return allocator, meter


def request(user: str, memory_gib: int, rid: str, priority: str | None = None, kind: str = "notebook") -> GPURequest:
    return GPURequest(
        owner=Owner(user=user, workspace="vision"),
        memory_mib=memory_gib * 1024,
        cores_percent=25,
        request_id=rid,
        kind=kind,
        priority_class=priority,
    )


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


async def test_every_grant_and_release_is_recorded_with_its_cause(tmp_path):
    allocator, meter = make(tmp_path)
    holder = sleeper()
    try:
        stopped = await allocator.allocate(request("alice", 20, "a"))
        await allocator.release(stopped.id, "server stopped")
        culled = await allocator.allocate(request("bob", 20, "b", kind="kernel"))
        await allocator.release(culled.id, "idle for 3600 s", ReleaseCause.CULLED)
        low = await allocator.allocate(request("carol", 60, "c", priority="low"))
        high = await allocator.allocate(request("dave", 60, "d", priority="high"))  # preempts carol
        gone = await allocator.allocate(request("erin", 10, "e"))
        await allocator.bind(gone.id, str(holder.pid))
        holder.kill()
        holder.wait()
        for _ in range(200):  # the pool's watch notices the holder is gone (it checks every 0.1 s)
            if allocator.get(gone.id) is None:
                break
            await asyncio.sleep(0.05)
        assert meter.recorder.flush()
        records = {r.user: r for r in meter.store.records()}
        assert {u: r.release_cause for u, r in records.items()} == {
            "alice": "stopped",
            "bob": "culled",
            "carol": "preempted",
            "dave": None,
            "erin": "holder-gone",
        }
        assert "preempted by a high-priority request of dave" in records["carol"].release_why
        assert records["dave"].id == high.id and records["carol"].id == low.id
        assert records["bob"].kind == "kernel" and records["bob"].release_why == "idle for 3600 s"
        dave = records["dave"]
        assert (dave.gpu_model, dave.gpu_memory_mib, dave.memory_mib, dave.workspace) == (
            "H100-80GB",
            81920,
            60 * 1024,
            "vision",
        )
        assert dave.granted_at == high.created_at
        assert meter.recorder.dropped == 0
    finally:
        meter.close()
        await allocator.backend.stop()
        if holder.poll() is None:
            holder.kill()


async def test_a_swapped_out_kernel_is_recorded_as_swapped_and_its_resume_continues_it(tmp_path):
    """What the swap code publishes: release with ReleaseCause.SWAPPED, grant again, then the
    broker's RESUMED slice event (new, previous); SWAP_ENDED for a kernel stopped while swapped out."""
    allocator, meter = make(tmp_path)
    try:
        first = await allocator.allocate(request("alice", 20, "k-0", kind="kernel"))
        await allocator.release(first.id, "GPU state swapped out to host memory", ReleaseCause.SWAPPED)
        second = await allocator.allocate(request("alice", 20, "k-1", kind="kernel"))
        allocator.slice_events.publish(SliceEvent(SliceEventKind.RESUMED, second.id, second, previous_id=first.id))
        assert meter.recorder.flush()
        ((swapped, start, ended),) = swapped_periods(meter.store.records())
        resume = meter.store.records()[-1]
        assert (swapped.id, swapped.release_cause, resume.id, resume.resumes) == (
            first.id,
            "swapped",
            second.id,
            first.id,
        )
        assert start == swapped.released_at <= resume.granted_at == ended
        # swapped out again, then shut down while swapped out: the swapped period ends there
        await allocator.release(second.id, "idle again", ReleaseCause.SWAPPED)
        allocator.slice_events.publish(
            SliceEvent(SliceEventKind.SWAP_ENDED, second.id, why="kernel shut down while swapped out")
        )
        assert meter.recorder.flush()
        periods = {r.id: (start, ended) for r, start, ended in swapped_periods(meter.store.records())}
        assert periods[second.id][1] is not None and periods[second.id][1] >= periods[second.id][0]
    finally:
        meter.close()
        await allocator.backend.stop()


async def test_activity_from_the_shims_record_gives_busy_seconds_and_memory(tmp_path):
    allocator, meter = make(tmp_path)
    meter.metrics = UsageMetrics(CollectorRegistry())
    try:
        a = await allocator.allocate(request("alice", 20, "a"))
        allocator.backend.holder_env(a, priority_value=0)  # what the spawner does before the holder starts
        path = allocator.backend.activity_path(a.id)
        t0 = a.created_at
        write_activity(path, last_launch=t0 + 5, used_mib=(3000,), launches=10)
        await meter.sample(now=t0 + 30)  # launched in (t0, t0+30]: busy
        write_activity(path, last_launch=t0 + 5, used_mib=(1000,), launches=10)
        await meter.sample(now=t0 + 60)  # nothing launched since t0+30: idle
        write_activity(path, last_launch=t0 + 70, used_mib=(2000,), launches=11)
        await meter.sample(now=t0 + 90)  # busy again
        await allocator.release(a.id, "server stopped")
        assert meter.recorder.flush()
        (r,) = meter.store.records()
        assert (r.busy_seconds, r.activity_seconds, r.activity_samples) == (60.0, 90.0, 3)
        assert (r.memory_used_peak_mib, r.memory_used_mean_mib) == (3000, 2000.0)
        assert r.busy_periods == "0-30,60-90"  # seconds from the grant: what a replay takes as its bursts
        # Prometheus: a quarter card (20 of 80 GiB, 25 %) busy 60 s, held ~90 s until the last sample
        labels = {"namespace": "default", "workspace": "vision"}
        registry = meter.metrics.registry
        assert registry.get_sample_value("elastic_gpu_usage_busy_gpu_seconds_total", labels) == 15.0
        assert registry.get_sample_value("elastic_gpu_usage_held_gpu_seconds_total", labels) == pytest.approx(
            22.5, abs=0.5
        )
    finally:
        meter.close()
        await allocator.backend.stop()


async def test_records_survive_a_hub_crash_and_are_reconciled_with_the_ledger(tmp_path):
    kept_holder, lost_holder = sleeper(), sleeper()
    try:
        allocator, meter = make(tmp_path)
        kept = await allocator.allocate(request("alice", 20, "kept"))
        lost = await allocator.allocate(request("bob", 20, "lost"))
        await allocator.bind(kept.id, str(kept_holder.pid))
        await allocator.bind(lost.id, str(lost_holder.pid))
        await meter.sample()
        seen = time.time()
        assert meter.recorder.flush()
        meter.allocator.slice_events.clear()  # from here on nothing is recorded: the hub is about to die
        unheard = await allocator.allocate(request("carol", 20, "unheard"))
        await allocator.bind(unheard.id, str(kept_holder.pid))
        meter.recorder.stop()  # the hub is killed; its pool's watch dies with it
        await allocator.backend.stop()
        lost_holder.kill()  # bob's server exits while no hub runs
        lost_holder.wait()

        allocator, meter = make(tmp_path)  # the restarted hub, same database and ledger
        try:
            await allocator.ensure_started()
            await meter.sample()
            assert meter.recorder.flush()
            records = {r.id: r for r in meter.store.records()}
            assert records[kept.id].released_at is None
            assert records[lost.id].release_cause == UNRECORDED
            assert records[lost.id].granted_at <= records[lost.id].released_at <= seen
            assert records[unheard.id].granted_at == unheard.created_at
            assert records[unheard.id].released_at is None
        finally:
            meter.close()
            await allocator.backend.stop()
    finally:
        for p in (kept_holder, lost_holder):
            if p.poll() is None:
                p.kill()
                p.wait()
