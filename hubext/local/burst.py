"""The burst of elastic slices on one machine, as the driver sees it (what metering bills).

The local pool looks every ``LocalPool.burst_sample_seconds`` at each card through NVML (the
per-process SM samples and the memory each process holds), finds each process's slice from the
kernel as the backstop does (:func:`hubext.local.backstop.link_pids`: the holder's session, group
or descendants; an allocation id in the environment only from the holder's account) and adds
what each elastic slice used above its request to its running total
(:class:`libvgpu.burst.BurstCounter`). :meth:`LocalPool.slice_activity` hands the totals to the
usage meter as ``burst_gpu_seconds``, the totals of the thread's last look (the meter's sample
makes no NVML call on the hub's loop). Nothing a slice's processes write (its activity file, its
regions) is read. A driver keeps its samples for a short while only (a second or so): the looks
must come more often than that, so they run on a thread of their own timer, not the meter's. A
release looks once more before the slice leaves the ledger (``LocalPool.forget``) and the total
stays readable a while after, so the meter bills the burst up to the release.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from libvgpu.agent.nvml import BurstLooks
from libvgpu.burst import BurstCounter, Owners, elastic_slices, pids_seen, requests_on
from quotas import Allocation

from .backstop import link_pids

#: how long a released slice's final burst total stays readable (the meter reads it as it hears
#: the release, at once; a while more for a hub whose loop lags)
KEEP_RELEASED_SECONDS = 60.0


class LocalBurst:
    """The burst counter of this machine's cards (the pool calls :meth:`look`)."""

    def __init__(self, nvml: Any, cards: Sequence[tuple[str, int]], log: Any) -> None:
        """``nvml``: a started :class:`libvgpu.agent.nvml.NVML`; ``cards``: (uuid, memory MiB)."""
        self.nvml = nvml
        self.cards = dict(cards)
        self.log = log
        self.counter = BurstCounter()
        self._lock = threading.Lock()
        self.owners = Owners()
        self.looks = BurstLooks(nvml, log)
        self._held: set[str] = set()  # the elastic slices of the last look
        self._released: dict[str, tuple[float, float]] = {}  # id -> (its final total, when released)

    def look(
        self, allocations: Sequence[Allocation], holders: Mapping[str, int], aliases: Mapping[str, str]
    ) -> dict[str, float]:
        """One look at every card holding an elastic slice; returns the running totals
        (allocation id -> burst card-seconds) of the elastic slices held now."""
        elastic = elastic_slices(allocations)
        with self._lock:
            now = time.time()
            self._keep_released({a.id for a in elastic}, now)
            self.counter.forget(a.id for a in elastic)
            if not elastic:
                return {}
            cards = sorted({u for a in elastic for u in a.gpu_uuids} & set(self.cards))
            looks = {u: seen for u in cards if (seen := self.looks.look(u, self.counter.since_us(u, now)))}
            pids = pids_seen(looks.values())
            owner = self.owners.resolve(link_pids(pids, dict(holders), aliases)[0], pids, _alive, now)
            for uuid, (samples, memory) in looks.items():
                self.counter.observe(uuid, samples, memory, owner, requests_on(uuid, elastic, self.cards[uuid]), now)
            return {a.id: self.counter.totals.get(a.id, 0.0) for a in elastic}

    def totals(self, allocation_ids: Iterable[str], held: Container[str] = ()) -> dict[str, float]:
        """The running totals as of the last look (no NVML call) of those of ``allocation_ids``
        that were elastic slices then or are ``held`` now (0 until looked at), or were released
        in the last ``KEEP_RELEASED_SECONDS``."""
        with self._lock:
            out = {}
            for allocation_id in allocation_ids:
                if allocation_id in self._held or allocation_id in held:
                    out[allocation_id] = self.counter.totals.get(allocation_id, 0.0)
                elif allocation_id in self._released:
                    out[allocation_id] = self._released[allocation_id][0]
            return out

    def _keep_released(self, elastic: set[str], now: float) -> None:
        """Keep the totals of the slices released since the last look (``elastic``: those held
        now) a while, for the meter's release; forget those kept long enough."""
        for allocation_id in self._held - elastic:
            self._released[allocation_id] = (self.counter.totals.get(allocation_id, 0.0), now)
        for allocation_id, (_, at) in list(self._released.items()):
            if now - at > KEEP_RELEASED_SECONDS:
                del self._released[allocation_id]
        self._held = elastic


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def start_burst(
    nvml: Any,
    cards: Sequence[tuple[str, int]],
    interval: float,
    state: Callable[[], tuple[Sequence[Allocation], Mapping[str, int], Mapping[str, str]]],
    log: Any,
) -> tuple[LocalBurst, threading.Event]:
    """A :class:`LocalBurst` looked through every ``interval`` seconds on a daemon thread (the
    event loop may be busy longer than the driver keeps its samples); set the event to stop it.
    ``state()``: (held allocations, allocation id -> holder pid, aliases), read by the thread."""
    burst = LocalBurst(nvml, cards, log)
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval):
            try:
                burst.look(*state())
            except Exception:  # noqa: BLE001 - the next look tries again
                log.exception("GPU burst metering: a look failed")

    threading.Thread(target=run, name="gpu-burst", daemon=True).start()
    return burst, stop
