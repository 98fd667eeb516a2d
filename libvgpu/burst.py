"""Burst as the driver sees it: the card-seconds each elastic slice used above its request,
from NVML's per-process samples, for metering.

The shim counts a slice's burst too (``compute_burst_ns`` of its activity file), but that file is
the slice's own: its processes can write it. What is billed is measured here instead, by the
hub (one machine, :mod:`hubext.local.burst`) or the node agent (Kubernetes,
:mod:`libvgpu.agent.app`), from what no process of a slice writes:

* **compute**: ``nvmlDeviceGetProcessUtilization`` gives one sample per process per driver
  sample period in which it used the card (integer percent of that period; none for periods it
  idled). A slice's share of a period is the sum of its processes' samples; what is above its
  ``cores_percent`` is burst, times the period (learnt as the shim learns it: the shortest gap
  between two samples' timestamps);
* **memory**: ``nvmlDeviceGetComputeRunningProcesses`` gives the memory each process holds; what
  the slice's processes hold above its ``memory_mib``, over the card's memory, is burst for the
  time since the last look.

Per card and look the larger of the two is added (a card-share, as a slice's guarantee is the
larger of its memory and compute shares). Which slice a process belongs to is the caller's
answer, from the kernel (its cgroup, its ancestry from the holder), never from what the process
says. The counter is pure: plain data in, running totals out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quotas import Allocation

MIB = 1 << 20


@dataclass(frozen=True)
class Request:
    """What an elastic slice is guaranteed on each of its cards, and one card's memory."""

    memory_mib: int
    cores_percent: int
    card_mib: int


@dataclass(frozen=True)
class Sample:
    """One of NVML's per-process utilisation samples (host pid, the period's end in µs, SM %)."""

    pid: int
    timestamp_us: int
    sm_percent: int


@dataclass
class _Card:
    since_us: int  # the newest sample timestamp counted (the next look asks for newer ones)
    at: float  # when the card was last looked at (unix seconds)
    period_us: int = 0  # the driver's sample period, learnt; 0 until two samples were seen
    stamp_us: int = 0  # the newest sample timestamp seen (0: none yet)


@dataclass
class BurstCounter:
    """Running totals of burst card-seconds per allocation id (never decreasing)."""

    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _cards: dict[str, _Card] = field(default_factory=dict)

    def since_us(self, uuid: str, now: float) -> int:
        """The timestamp to ask NVML for samples newer than, on card ``uuid``."""
        card = self._cards.get(uuid)
        return card.since_us if card is not None else int(now * 1e6)

    def observe(
        self,
        uuid: str,
        samples: Iterable[Sample],
        memory: Mapping[int, int],
        owner: Mapping[int, str],
        requests: Mapping[str, Request],
        now: float,
    ) -> None:
        """Count one look at card ``uuid``: ``samples`` newer than :meth:`since_us`, ``memory``
        (pid -> bytes the driver charges it), ``owner`` (pid -> allocation id, from the kernel),
        ``requests`` (allocation id -> its request on this card; slices not named are not
        metered: they cannot burst)."""
        samples = [s for s in samples if s.timestamp_us > self.since_us(uuid, now)]
        card = self._cards.get(uuid)
        if card is None:  # the first look: samples from before it are not counted
            self._cards[uuid] = _Card(max((s.timestamp_us for s in samples), default=int(now * 1e6)), now)
            return
        compute = self._compute(card, samples, owner, requests)
        used: dict[str, int] = defaultdict(int)
        for pid, used_bytes in memory.items():
            if owner.get(pid) in requests:
                used[owner[pid]] += used_bytes
        seconds = max(0.0, now - card.at)
        for allocation_id, request in requests.items():
            over_mib = used.get(allocation_id, 0) / MIB - request.memory_mib
            memory_burst = over_mib / request.card_mib * seconds if over_mib > 0 and request.card_mib else 0.0
            burst = max(memory_burst, compute.get(allocation_id, 0.0))
            if burst > 0:
                self.totals[allocation_id] += burst
        card.at = now

    def _compute(
        self, card: _Card, samples: list[Sample], owner: Mapping[int, str], requests: Mapping[str, Request]
    ) -> dict[str, float]:
        """Card-seconds above each slice's compute request in ``samples`` (and move the card on)."""
        if not samples:
            return {}
        stamps = sorted({s.timestamp_us for s in samples})
        for before, after in pairwise([card.stamp_us or stamps[0], *stamps]):
            gap = after - before
            if gap >= 1000 and (not card.period_us or gap < card.period_us):  # not two of one pass
                card.period_us = gap
        window = stamps[-1] - card.since_us
        period = card.period_us
        if not period or period * len(stamps) > window:  # not learnt yet: the samples cover the window
            period = window // len(stamps)
        share: dict[tuple[str, int], int] = defaultdict(int)
        for s in samples:
            allocation_id = owner.get(s.pid)
            if allocation_id in requests:
                share[(allocation_id, s.timestamp_us)] += s.sm_percent
        out: dict[str, float] = defaultdict(float)
        for (allocation_id, _), percent in share.items():
            above = min(percent, 100) - requests[allocation_id].cores_percent
            if above > 0:
                out[allocation_id] += above / 100 * period / 1e6
        card.since_us = card.stamp_us = stamps[-1]
        return out

    def forget(self, live: Iterable[str]) -> None:
        """Drop the totals of allocations no longer held."""
        keep = set(live)
        for allocation_id in [a for a in self.totals if a not in keep]:
            del self.totals[allocation_id]


def elastic_slices(allocations: Iterable[Allocation]) -> list[Allocation]:
    """Those of ``allocations`` that can burst (elastic, not whole cards): the ones metered."""
    return [a for a in allocations if a.elastic and not a.whole]


def requests_on(uuid: str, allocations: Iterable[Allocation], card_mib: int) -> dict[str, Request]:
    """Allocation id -> its :class:`Request` on card ``uuid`` (``card_mib`` of memory), for the
    elastic slices of ``allocations`` on that card."""
    return {
        a.id: Request(a.memory_mib, a.cores_percent, card_mib)
        for a in elastic_slices(allocations)
        if uuid in a.gpu_uuids
    }


def pids_seen(looks: Iterable[tuple[Iterable[Sample], Mapping[int, int]]]) -> set[int]:
    """The processes named in looks' (samples, memory): those whose slice the caller must find."""
    return {pid for samples, memory in looks for pid in (*(s.pid for s in samples), *memory)}


@dataclass
class Owners:
    """Which slice each process belongs to, remembered a while after the process exits: a
    driver's last samples of a process come after it is gone, when the kernel no longer says."""

    keep_seconds: float = 10.0
    _seen: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (its slice, when last linked)

    def resolve(
        self, linked: Mapping[int, str], pids: Iterable[int], alive: Callable[[int], bool], now: float
    ) -> dict[int, str]:
        """``linked`` (pid -> slice, from the kernel now) and, for those of ``pids`` not in it that
        exited (not ``alive``), the slice they were last linked to."""
        out = dict(linked)
        for pid, allocation_id in linked.items():
            self._seen[pid] = (allocation_id, now)
        for pid in pids:
            if pid not in out and pid in self._seen and not alive(pid):
                out[pid] = self._seen[pid][0]
        for pid, (_, at) in list(self._seen.items()):
            if now - at > self.keep_seconds:
                del self._seen[pid]
        return out
