"""How busy a slice was: samples of its GPU activity record, summed per allocation.

The activity record is what the culler reads (``libvgpu.contract.gpu_activity``): the time of
the last kernel launch and the memory in use. The pool answers it for each running slice
(``PoolBackend.slice_activity``: each mode knows where its slices' records are). A slice with
no record yet (no process of it initialised CUDA; a simulated pool without the shim) is not
sampled: its record stays unmetered rather than counted idle.

An interval between two samples counts as *busy* when a kernel was launched in it (the last
launch is later than the previous sample, or the launch counter grew), so busy seconds are
exact to one sample interval. Memory used is sampled: peak and mean over the samples. The busy
intervals are kept too, merged, as seconds from the grant (``busy_periods``, at most
:data:`MAX_PERIODS`; beyond that the two closest are joined): capacity planning replays them as
the session's bursts under another idle timeout.

An elastic slice's burst (what it used above its request, billed apart) is not read from that
record, which the slice's own processes can write: the pool measures it from the driver's
per-process samples (``burst_gpu_seconds``, a running total: the hub's on one machine, the node
agent's on Kubernetes; :mod:`libvgpu.burst`) and each sample adds what the total grew by.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .record import UsageRecord

#: most busy periods kept per record (a sample every 30 s alternating busy and idle for 33 h)
MAX_PERIODS = 2000


def format_periods(periods: list[list[float]]) -> str:
    return ",".join(f"{round(a)}-{round(b)}" for a, b in periods)


@dataclass
class ActivityTotals:
    """The running totals of one allocation (restored from its record after a hub restart)."""

    last_sample_at: float
    busy_seconds: float = 0.0
    activity_seconds: float = 0.0
    memory_used_peak_mib: int = 0
    memory_used_mean_mib: float = 0.0
    samples: int = 0
    launches: int | None = None
    #: when the slice was granted (busy periods are seconds from then)
    granted_at: float = 0.0
    busy_periods: list[list[float]] = field(default_factory=list)
    #: card-seconds used above the request, as the pool measured them (libvgpu.burst)
    burst_gpu_seconds: float = 0.0
    #: the pool's running total of the slice's burst at the last sample (None: not known since
    #: this process took the totals over, so the next sample only sets it)
    burst_seen: float | None = 0.0

    @classmethod
    def at(cls, granted_at: float) -> ActivityTotals:
        """The totals of a slice granted at ``granted_at`` (nothing sampled yet)."""
        return cls(last_sample_at=granted_at, granted_at=granted_at)

    @classmethod
    def from_record(cls, record: UsageRecord) -> ActivityTotals:
        return cls(
            last_sample_at=max(record.granted_at, record.last_seen),
            busy_seconds=record.busy_seconds or 0.0,
            activity_seconds=record.activity_seconds or 0.0,
            memory_used_peak_mib=record.memory_used_peak_mib or 0,
            memory_used_mean_mib=record.memory_used_mean_mib or 0.0,
            samples=record.activity_samples,
            granted_at=record.granted_at,
            busy_periods=[[float(x) for x in p.split("-")] for p in (record.busy_periods or "").split(",") if p],
            burst_gpu_seconds=record.burst_gpu_seconds or 0.0,
            burst_seen=None,
        )

    def add(self, activity: dict[str, Any], now: float) -> None:
        """Count the interval since the last sample as busy or idle, this sample's memory, and the
        burst the pool measured since the last sample (``burst_gpu_seconds``, its running total).
        A sample with the burst alone (the slice's record unread) adds only that."""
        self.burst_gpu_seconds += self._burst(activity.get("burst_gpu_seconds"))
        if "memory_used_mib" not in activity:
            return
        interval = max(0.0, now - self.last_sample_at)
        last_launch = activity.get("last_launch")
        launches = activity.get("launches")
        launched = (last_launch is not None and last_launch > self.last_sample_at) or (
            launches is not None and self.launches is not None and launches > self.launches
        )
        self.activity_seconds += interval
        if launched:
            self.busy_seconds += interval
            self._busy(self.last_sample_at - self.granted_at, now - self.granted_at)
        used = int(activity.get("memory_used_mib") or 0)
        self.memory_used_peak_mib = max(self.memory_used_peak_mib, used)
        self.memory_used_mean_mib = (self.memory_used_mean_mib * self.samples + used) / (self.samples + 1)
        self.samples += 1
        self.launches = launches
        self.last_sample_at = now

    def add_late_burst(self, total: Any) -> bool:
        """Add what the pool's running total grew by after the slice's release (its record is
        closed: a lower total is no new count, only a higher one adds). Whether it added."""
        if not isinstance(total, (int, float)) or isinstance(total, bool) or not total >= 0:
            return False
        if self.burst_seen is None or not total > self.burst_seen:
            return False
        self.burst_gpu_seconds += total - self.burst_seen
        self.burst_seen = float(total)
        return True

    def _burst(self, total: Any) -> float:
        """The card-seconds of burst since the last sample, from the pool's running total (a total
        lower than the last one is a new count, the hub's or node agent's after a restart: all of
        it is new)."""
        if not isinstance(total, (int, float)) or isinstance(total, bool) or not total >= 0:
            return 0.0
        seen, self.burst_seen = self.burst_seen, float(total)
        if seen is None:
            return 0.0
        return total - seen if total >= seen else float(total)

    def _busy(self, start: float, end: float) -> None:
        periods = self.busy_periods
        if periods and start <= periods[-1][1] + 1e-6:
            periods[-1][1] = max(periods[-1][1], end)
        else:
            periods.append([start, end])
        if len(periods) > MAX_PERIODS:  # join the two closest periods
            i = min(range(len(periods) - 1), key=lambda k: periods[k + 1][0] - periods[k][1])
            periods[i : i + 2] = [[periods[i][0], periods[i + 1][1]]]

    def event(self, allocation_id: str) -> dict[str, Any]:
        """The store event that sets the record's activity columns to these totals."""
        return {
            "event": "activity",
            "id": allocation_id,
            "busy_seconds": self.busy_seconds,
            "activity_seconds": self.activity_seconds,
            "memory_used_peak_mib": self.memory_used_peak_mib,
            "memory_used_mean_mib": self.memory_used_mean_mib,
            "activity_samples": self.samples,
            "busy_periods": format_periods(self.busy_periods),
            "burst_gpu_seconds": self.burst_gpu_seconds,
        }
