"""Taking an elastic slice's burst back when a slice on its card needs memory it was guaranteed.

An elastic slice (``Allocation.memory_limit_mib`` above its request) may hold memory past its
request while no other slice's request needs it. When another slice on that card then asks for
memory *within its request* and the card is short because of the burst, its shim waits (bounded
by ``reclaim_wait_ms``) and says so in the card's node region; the pool reports these waits
(``PoolBackend.pending_reclaims``). Every ``reclaim_interval_seconds`` the broker reads them and
takes the burst back from the burster, never from the owner:

- a GPU kernel is swapped out through the swap path (its state kept in host memory, its slice
  released as ``swapped``); its next cell asks admission again and it resumes when there is room;
- a kernel that cannot be swapped out (the card cannot checkpoint, swapping is off, or its
  process cannot be checkpointed) is stopped with a sentence that says why, as a preempted one
  is: its state is ``failed`` with that reason, which its notebook shows;
- a notebook server cannot be swapped out: the hub stops it (its processes, kernels included,
  as a preempted server's), with a sentence that says why; the sentence is in the hub's log, in
  the pool's events and on the user's /hub/home (``hubext.pages.user_gpu``).

The shims' word is checked against the ledger first: both slices must hold the card, and the
burster must be an elastic slice (a fixed slice cannot burst, whatever a region says).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from traitlets import Float
from traitlets.config import Configurable

from quotas import Allocation
from quotas.messages import mib

from ..backends import ReleaseCause
from .sizes import BrokerError


@dataclass(frozen=True)
class Take:
    """One burst to take back: from ``burster`` on ``card``, for ``owner`` (both in the ledger)."""

    burster: Allocation
    owner: Allocation
    card: str
    burst_mib: int
    wanted_mib: int


def plan_takes(reclaims: Iterable[Any], allocations: Mapping[str, Allocation]) -> list[Take]:
    """The bursts to take back, one per burster, checked against the ledger (pure).

    ``reclaims``: ``libvgpu.elastic.Reclaim`` records (largest burst first within a card). A
    record whose owner or burster the ledger does not hold on that card, or whose burster is not
    elastic, is dropped. For each waiting owner, bursters are taken until their bursts cover what
    it wants."""
    takes: list[Take] = []
    taken: set[str] = set()
    covered: dict[tuple[str, str], int] = {}
    for r in reclaims:
        owner, burster = allocations.get(r.owner), allocations.get(r.burster)
        if owner is None or burster is None or owner.id == burster.id:
            continue
        if r.card_uuid not in owner.gpu_uuids or r.card_uuid not in burster.gpu_uuids:
            continue
        if burster.memory_ceiling_mib <= burster.memory_mib:
            continue  # a fixed slice cannot burst: the region's word is not the ledger's
        key = (r.card_uuid, owner.id)
        if covered.get(key, 0) >= r.wanted_mib:
            continue
        covered[key] = covered.get(key, 0) + r.burst_mib
        if burster.id in taken:
            continue
        taken.add(burster.id)
        takes.append(Take(burster, owner, r.card_uuid, r.burst_mib, r.wanted_mib))
    return takes


def reclaim_reason(take: Take) -> str:
    """Why the burst is taken back (the swap-out's reason; the stop sentence starts with it)."""
    owner = take.owner
    return (
        f"it held {mib(take.burst_mib)} of GPU memory above its {mib(take.burster.memory_mib)} guarantee on "
        f"{take.card}, and {owner.owner.user}'s {owner.kind} on that GPU needs memory within its own guarantee"
    )


def stop_sentence(why: str, lost: str, choice: str, what: str) -> str:
    """The sentence of a burster stopped because it could not be swapped out: why, what was
    lost, and what the user can do (``choice``: the size or profile to pick; ``what``: kernel or
    server)."""
    return (
        f"stopped: {why}. {lost}. Stay within the guaranteed memory, or pick a {choice} that guarantees "
        f"more, to keep a {what} from being stopped"
    )


class ReclaimMixin(Configurable):
    """The broker's reaction to bursts a card must give back (mixed into ``GPUBroker``)."""

    reclaim_interval_seconds = Float(
        1.0,
        config=True,
        help="""Seconds between reads of the cards' reclaim requests: an elastic slice's burst
        (memory above its request) that another slice on its card needs within its own request is
        taken back from the burster: a GPU kernel is swapped out (its state kept; it resumes when
        there is room), or stopped with the reason where it cannot be swapped out; a notebook
        server (never swapped out) is stopped with the reason, which its user's home page shows. Keep it well
        under the shim's reclaim_wait_ms (30 s by default), which bounds how long the owner's
        allocation waits. 0: never take bursts back. Default: 1.""",
    )

    kernels: dict[str, Any]
    log: Any
    allocator: Any

    async def reclaim_bursts(self) -> list[str]:
        """One pass: take back every burst the cards report waiting owners for. Returns the
        allocation ids taken back (swapped out or stopped)."""
        backend = self.allocator.backend
        if backend is None or self.allocator.state is None:
            return []
        reclaims = await asyncio.to_thread(backend.pending_reclaims)
        if not reclaims:
            return []
        done = []
        for take in plan_takes(reclaims, self.allocator.state.allocations):
            if await self._take_back(take):
                done.append(take.burster.id)
        return done

    async def _take_back(self, take: Take) -> bool:
        burster = take.burster
        why = reclaim_reason(take)
        record = next(
            (r for r in self.kernels.values() if r.allocation_id == burster.id and r.state == "running" and not r.swap),
            None,
        )
        if record is None:
            if burster.kind == "notebook":
                await self._stop_server_burster(burster, why)
                return True
            warned = self.__dict__.setdefault("_reclaim_warned", set())
            if burster.id not in warned:
                warned.add(burster.id)
                self.log.warning(
                    "GPU burst of %s (%s %s) not taken back: %s; its GPU kernel is not running",
                    burster.id, burster.owner.user, burster.kind, why,
                )
            return False
        self.log.warning("GPU burst reclaim: kernel %s of %s: %s", record.id, record.user, why)
        able = self.swap_capability(record)
        if able:
            try:
                await self.suspend(record, f"{why}; it resumes when there is room")
                return True
            except BrokerError as e:
                cannot = e.message
        else:
            cannot = f"This GPU kernel cannot be swapped out: {able.why_not}."
        if record.swap or record.state != "running":  # stopped by the swap path already
            return True
        await self._stop_burster(record, why, cannot)
        return True

    async def _stop_burster(self, record: Any, why: str, cannot: str) -> None:
        """Stop a kernel whose burst must go back and that cannot be swapped out, saying why (as a
        preempted kernel: failed, with the reason its notebook shows)."""
        sentence = stop_sentence(why, f"{cannot.rstrip('.')}, so its state was lost", "size", "kernel")
        record.state, record.reason = "failed", sentence
        self.log.warning("GPU kernel %s of %s %s", record.id, record.user, sentence)
        await self._stop_holder(record)
        await self._release(record.allocation_id, sentence, ReleaseCause.PREEMPTED)
        self._persist()

    async def _stop_server_burster(self, burster: Allocation, why: str) -> None:
        """Stop a notebook server whose burst must go back (a server cannot be swapped out), as a
        preempted server is stopped: the pool stops its processes and keeps the sentence as an
        event, which the user's home page shows; JupyterHub sees the server gone when it polls."""
        sentence = stop_sentence(
            why, "A notebook server cannot be swapped out, so it was stopped and the state of its kernels was lost",
            "profile", "server",
        )
        self.log.warning("GPU notebook server %s of %s %s", burster.id, burster.owner.user, sentence)
        self.allocator.expect_stop(burster.id, sentence, ReleaseCause.PREEMPTED)
        await self.allocator.backend.evict(burster, sentence)
        await self._release(burster.id, sentence, ReleaseCause.PREEMPTED)

    async def _reclaim_forever(self) -> None:
        while self.reclaim_interval_seconds > 0:
            await asyncio.sleep(self.reclaim_interval_seconds)
            try:
                await self.reclaim_bursts()
            except Exception:
                self.log.exception("GPU burst reclaim failed; retrying")
