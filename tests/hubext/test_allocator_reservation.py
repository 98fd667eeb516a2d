"""Through the hub's allocator: small slices cannot pass a waiting whole-card request for ever;
once it waited queue.reserve_after_seconds its card is held and it gets it when the card empties."""

from __future__ import annotations

import asyncio

from traitlets.config import Config

from hubext.allocator import GPUAllocator
from quotas import GPURequest, Owner


def _allocator(tmp_path, reserve_after: float | None, gpus: str = "1xH100-80GB") -> GPUAllocator:
    c = Config()
    c.GPUAllocator.pool_backend_class = "local"
    c.GPUAllocator.admission_config = {"queue": {"reserve_after_seconds": reserve_after}}
    c.LocalPool.simulate_gpus = gpus
    c.LocalPool.data_dir = str(tmp_path)
    c.LocalPool.check_interval_seconds = 60
    return GPUAllocator(config=c)


def _slice(user: str, gib: int, rid: str, whole: bool = False) -> GPURequest:
    return GPURequest(owner=Owner(user=user), memory_mib=gib * 1024, cores_percent=10, whole=whole,
                      request_id=rid, kind="kernel")


async def _churn(allocator: GPUAllocator, rounds: int) -> asyncio.Task:
    """Two 40 GiB slices hold the card; each round a new slice starts waiting and the oldest
    held one leaves. Returns the whole-card request's task."""
    held = [await allocator.allocate(_slice(f"s{i}", 40, f"s{i}")) for i in range(2)]
    whole = asyncio.ensure_future(allocator.allocate(_slice("w", 80, "whole", whole=True), timeout=30))
    pending: list[asyncio.Task] = []
    await asyncio.sleep(0.05)
    for i in range(rounds):
        pending.append(asyncio.ensure_future(allocator.allocate(_slice(f"n{i}", 40, f"n{i}"), timeout=30)))
        await asyncio.sleep(0.05)
        if held:
            await allocator.release(held.pop(0).id)
        await asyncio.sleep(0.05)
        held.extend(t.result() for t in pending if t.done())
        pending = [t for t in pending if not t.done()]
        if whole.done():
            break
    for t in pending:
        t.cancel()
    return whole


async def test_without_reservation_the_whole_card_request_is_passed_every_time(tmp_path):
    allocator = _allocator(tmp_path, None)
    try:
        whole = await _churn(allocator, 6)
        assert not whole.done()  # six slices left and six others took their place
        assert [q["request_id"] for q in allocator.queue()] == ["whole"]
        whole.cancel()
    finally:
        await allocator.backend.stop()


async def test_with_reservation_it_gets_the_card_once_the_slices_before_it_left(tmp_path):
    allocator = _allocator(tmp_path, 0)
    try:
        whole = await _churn(allocator, 6)
        # the two slices that held the card when it was reserved left: the card is its
        allocation = await asyncio.wait_for(whole, 5)
        assert allocation.whole and allocation.owner.user == "w"
    finally:
        await allocator.backend.stop()


async def test_the_queue_proposes_the_slice_to_move_for_a_request_waiting_on_fragmentation(tmp_path):
    allocator = _allocator(tmp_path, 0, gpus="2xH100-80GB")
    try:
        first = await allocator.allocate(_slice("a", 50, "a"))
        await allocator.allocate(_slice("b", 40, "b"))  # does not fit beside a: the other card
        await allocator.allocate(_slice("c", 20, "c"))  # beside a (the fuller card)
        await allocator.release(first.id)  # 20 GiB and 40 GiB used: 100 GiB free, no card free
        whole = asyncio.ensure_future(allocator.allocate(_slice("w", 80, "whole", whole=True), timeout=30))
        await asyncio.sleep(0.05)
        (q,) = allocator.queue()
        assert q["request_id"] == "whole" and q["reserved_node"] is not None
        (mv,) = q["move_proposal"]
        assert (mv["allocation_id"], mv["user"], mv["to_gpu"]) == ("c", "c", allocator.get("b").gpu_uuids[0])
        assert allocator.get("c").gpu_uuids[0] == mv["from_gpu"]  # proposed, not moved
        await allocator.release("c")  # the admin stopped it: the card is free
        assert (await asyncio.wait_for(whole, 5)).whole
    finally:
        await allocator.backend.stop()
