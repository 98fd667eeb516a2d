"""The admin's pool view lists what happened to slices (culled, swapped out, preempted, resumed)
from the slice events, whatever the mode, beside what the pool keeps itself."""

from __future__ import annotations

from traitlets.config import Config

from hubext.admin import hub_pool_view
from hubext.allocator import GPUAllocator
from hubext.backends import ReleaseCause
from quotas import GPURequest, Owner


def _allocator(tmp_path) -> GPUAllocator:
    c = Config()
    c.GPUAllocator.pool_backend_class = "local"
    c.LocalPool.simulate_gpus = "1xH100-80GB"
    c.LocalPool.data_dir = str(tmp_path / "data")
    return GPUAllocator(config=c)


def _request(user: str, rid: str) -> GPURequest:
    return GPURequest(owner=Owner(user=user), memory_mib=10240, cores_percent=25, request_id=rid, kind="kernel")


async def test_the_pool_view_lists_culled_and_swapped_slices_newest_first(tmp_path):
    allocator = _allocator(tmp_path)
    try:
        culled = await allocator.allocate(_request("alice", "a"), queue=False)
        swapped = await allocator.allocate(_request("bob", "b"), queue=False)
        stopped = await allocator.allocate(_request("carol", "c"), queue=False)
        await allocator.release(culled.id, "culled: idle for 1 h on both Jupyter and GPU", ReleaseCause.CULLED)
        await allocator.release(swapped.id, "swapped out: idle 10 min", ReleaseCause.SWAPPED)
        await allocator.release(stopped.id, "kernel shut down")  # a plain stop is not news
        view = await hub_pool_view(allocator)
    finally:
        await allocator.backend.stop()
    events = [(e["user"], e["kind"], e["reason"]) for e in view["events"]]
    assert events == [
        ("bob", "swapped", "swapped out: idle 10 min"),
        ("alice", "culled", "culled: idle for 1 h on both Jupyter and GPU"),
    ], view["events"]
