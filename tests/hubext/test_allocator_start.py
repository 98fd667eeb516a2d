"""The allocator starts its pool once, retries a transient failure, and decides in one place."""

from __future__ import annotations

import pytest
from traitlets.config import Config

from hubext.allocator import GPUAllocator
from hubext.backends import ReleaseCause
from hubext.local.pool import LocalPool
from quotas import GPURequest, Owner, PoolFull, QuotaExceeded


class FlakyPool(LocalPool):
    """A pool whose first start fails as a transient error would (an API server not up yet)."""

    failures_left = 1

    async def start(self, on_gone):  # type: ignore[override]
        if FlakyPool.failures_left > 0:
            FlakyPool.failures_left -= 1
            raise ConnectionRefusedError("the API server is not up yet")
        await super().start(on_gone)


def _allocator(tmp_path, pool_class: str = "local", **admission) -> GPUAllocator:
    c = Config()
    c.GPUAllocator.pool_backend_class = pool_class
    c.GPUAllocator.admission_config = admission
    c.LocalPool.simulate_gpus = "1xH100-80GB"
    c.LocalPool.data_dir = str(tmp_path)
    c.LocalPool.check_interval_seconds = 60
    return GPUAllocator(config=c)


def _request(user: str, memory_mib: int, rid: str) -> GPURequest:
    return GPURequest(owner=Owner(user=user), memory_mib=memory_mib, cores_percent=10, request_id=rid, kind="kernel")


async def test_a_transient_failure_at_start_does_not_break_later_requests(tmp_path):
    FlakyPool.failures_left = 1
    allocator = _allocator(tmp_path, f"{__name__}.FlakyPool")
    try:
        allocation = await allocator.allocate(_request("alice", 1024, "a"))
        assert allocation.owner.user == "alice"
        assert FlakyPool.failures_left == 0
    finally:
        await allocator.backend.stop()


async def test_the_pool_is_chosen_by_entry_point_name(tmp_path):
    allocator = _allocator(tmp_path, "local")
    assert allocator.pool_backend_class is LocalPool
    assert allocator.pool_backend_class.launcher_class.__name__ == "LocalKernelLauncher"


async def test_no_queue_request_is_decided_once_with_the_queue_and_refused_with_its_reason(tmp_path):
    allocator = _allocator(tmp_path, "local")
    released = []
    allocator.slice_events.subscribe(lambda e: released.append(e.cause) if e.kind == "released" else None)
    try:
        first = await allocator.allocate(_request("alice", 70 * 1024, "a"), queue=False)
        with pytest.raises((PoolFull, QuotaExceeded)) as refused:
            await allocator.allocate(_request("bob", 20 * 1024, "b"), queue=False)
        assert "waited" not in refused.value.message.lower()
        assert allocator.queue() == []  # nothing left waiting
        await allocator.release(first.id, "kernel shut down")
        assert released == [ReleaseCause.STOPPED]
    finally:
        await allocator.backend.stop()


async def test_a_holder_gone_during_a_handover_keeps_the_slice_unless_the_handover_fails(tmp_path):
    """A kernel restart replaces the holder: the old one's end is not the slice's end, unless no new
    holder comes (then the slice is released as its holder's, when the handover fails)."""
    allocator = _allocator(tmp_path, "local")
    released = []

    def listen(event):
        if event.kind == "released":
            released.append((event.allocation_id, event.cause))

    allocator.slice_events.subscribe(listen)
    try:
        kept = await allocator.allocate(_request("alice", 1024, "a"), queue=False)
        async with allocator.handover(kept.id):
            await allocator._holder_gone(kept.id, "process 1 exited")
            assert allocator.get(kept.id) is not None
        assert allocator.get(kept.id) is not None and released == []

        lost = await allocator.allocate(_request("alice", 1024, "b"), queue=False)
        with pytest.raises(RuntimeError):
            async with allocator.handover(lost.id):
                await allocator._holder_gone(lost.id, "process 2 exited")
                raise RuntimeError("the new kernel process did not start")
        assert allocator.get(lost.id) is None and released == [(lost.id, ReleaseCause.HOLDER_GONE)]

        await allocator._holder_gone(kept.id, "process 3 exited")  # no handover: the slice goes
        assert allocator.get(kept.id) is None
    finally:
        await allocator.backend.stop()
