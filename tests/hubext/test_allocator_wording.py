"""What a request that waited out its time in the hub's allocator is told: the reason it waited
(with that reason's own advice) and how long, not a second piece of advice about profiles."""

from __future__ import annotations

import pytest
from traitlets.config import Config

from hubext.allocator import GPUAllocator
from hubext.moves import move_reason
from quotas import GPURequest, Owner, PoolFull
from quotas.queue import Waiting


@pytest.fixture()
def allocator(tmp_path):
    c = Config()
    c.GPUAllocator.pool_backend_class = "local"
    c.LocalPool.simulate_gpus = "1xH100-80GB"
    c.LocalPool.data_dir = str(tmp_path)
    c.LocalPool.check_interval_seconds = 60
    yield GPUAllocator(config=c)
    GPUAllocator.clear_instance()


async def test_a_request_that_waited_out_its_time_is_told_why_and_how_long_once(allocator):
    held = await allocator.allocate(
        GPURequest(owner=Owner(user="alice"), memory_mib=80 * 1024, cores_percent=50, request_id="a", kind="notebook")
    )
    try:
        with pytest.raises(PoolFull) as refused:
            await allocator.allocate(
                GPURequest(owner=Owner(user="bob"), memory_mib=10240, cores_percent=10, request_id="b", kind="kernel"),
                timeout=0.3,
            )
        message = refused.value.message
        assert "s in the GPU queue; try again later." in message and message.endswith("try again later."), message
        assert message.count("pick a smaller") <= 1, message  # the reason's advice, not a second one
        assert "profile" not in message, message  # a kernel has no profile (issue 26)
    finally:
        await allocator.release(held.id)


async def test_a_request_an_admin_cancels_is_told_why_it_waited_without_advice_to_pick_a_profile(allocator):
    import asyncio

    held = await allocator.allocate(
        GPURequest(owner=Owner(user="alice"), memory_mib=80 * 1024, cores_percent=50, request_id="a", kind="notebook")
    )
    try:
        waiting = asyncio.ensure_future(
            allocator.allocate(
                GPURequest(owner=Owner(user="bob"), memory_mib=10240, cores_percent=10, request_id="b", kind="kernel"),
                timeout=60,
            )
        )
        while not allocator.queue():
            await asyncio.sleep(0.05)
        assert await allocator.cancel("b", by="an admin (boss)")
        with pytest.raises(Exception) as refused:
            await waiting
        message = refused.value.message
        cancelled = "The GPU request was cancelled by an admin (boss) while it waited in the queue."
        assert message.startswith(cancelled), message
        assert "No GPU has 10 GiB of memory" in message, message  # why it waited
        assert "pick a smaller" not in message and "Wait for" not in message, message  # no advice: it is gone
    finally:
        await allocator.release(held.id)


def test_a_moved_slices_reason_names_the_waiting_requests_whole_size():
    """A kernel swapped out for a request of two 10 GiB slices reads '(2 x 10 GiB)', as the held
    reason writes it, not '(10 GiB)' (one card's share)."""
    request = GPURequest(Owner("carol"), 10240, 25, count=2, request_id="big")
    assert move_reason(Waiting(request, 100, 0, 10.0), 130.0) == (
        "moved to make room for big of carol (2 x 10 GiB) waiting 120 s")
