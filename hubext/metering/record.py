"""One usage record: a slice's life from grant to release (plain data, no I/O)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

from quotas import Allocation

#: release cause of a record closed by reconciliation: its release happened while nothing recorded it
#: (the hub was down or killed); it is closed at the last time the hub saw the slice held
UNRECORDED = "unrecorded"


@dataclass(frozen=True)
class UsageRecord:
    """Who held what, when, why it was released and (where known) how busy it was.

    ``memory_mib`` and ``cores_percent`` are per GPU, as in :class:`quotas.Allocation`: the
    request, what was guaranteed (``share`` and the GPU-hours come from it); an elastic slice's
    ``memory_limit_mib`` and ``cores_limit_percent`` are how far it could grow (0: no further).
    ``gpu_memory_mib`` is one card's memory (0 when the pool did not know the card)."""

    id: str
    user: str
    namespace: str
    workspace: str
    kind: str
    priority_class: str
    node: str
    gpu_uuids: str
    gpu_model: str
    gpu_memory_mib: int
    count: int
    memory_mib: int
    cores_percent: int
    whole: bool
    borrowed: bool
    granted_at: float
    released_at: float | None = None
    release_cause: str | None = None
    release_why: str | None = None
    last_seen: float = 0.0
    busy_seconds: float | None = None
    activity_seconds: float | None = None
    memory_used_peak_mib: int | None = None
    memory_used_mean_mib: float | None = None
    activity_samples: int = 0
    #: the user's JupyterHub groups when the slice was granted (sorted, comma-separated; revision 0003)
    hub_groups: str = ""
    #: when it was busy: merged busy sample intervals as seconds from the grant, "0-30,90-150"
    #: (None: no activity known; revision 0003). Capacity planning replays them as bursts.
    busy_periods: str | None = None
    #: the record this one continues: its kernel was swapped out (that record's cause is 'swapped')
    #: and resumed in this slice (UsageMeter.resumed; revision 0004). The gap between the two is
    #: the swapped period (swapped_periods()).
    resumes: str | None = None
    #: of a record released as 'swapped': when its swapped period ended, at its resume's grant or
    #: when the kernel was stopped while swapped out (UsageMeter.swap_ended); None: still swapped
    #: out (revision 0005)
    swap_ended_at: float | None = None
    #: an elastic slice's limits, per GPU (0: none; revision 0006)
    memory_limit_mib: int = 0
    cores_limit_percent: int = 0
    #: card-seconds it used above its request: memory in use past the request over one card's
    #: memory, summed over the sampled intervals (None: no activity known; revision 0006)
    burst_gpu_seconds: float | None = None

    @classmethod
    def from_allocation(
        cls,
        allocation: Allocation,
        *,
        gpu_model: str = "",
        gpu_memory_mib: int = 0,
        at: float | None = None,
        hub_groups: Iterable[str] = (),
    ) -> UsageRecord:
        """A new (open) record of a granted allocation; ``at`` defaults to its ``created_at``."""
        granted = allocation.created_at or (at or 0.0)
        return cls(
            id=allocation.id,
            user=allocation.owner.user,
            namespace=allocation.owner.namespace,
            workspace=allocation.owner.workspace,
            kind=allocation.kind,
            priority_class=allocation.priority_class or "",
            node=allocation.node,
            gpu_uuids=",".join(allocation.gpu_uuids),
            gpu_model=gpu_model or "unknown",
            gpu_memory_mib=int(gpu_memory_mib),
            count=max(1, len(allocation.gpu_uuids)),
            memory_mib=allocation.memory_mib,
            cores_percent=allocation.cores_percent,
            whole=allocation.whole,
            borrowed=allocation.borrowed,
            granted_at=granted,
            last_seen=max(granted, at or granted),
            hub_groups=",".join(sorted(set(hub_groups))),
            memory_limit_mib=allocation.memory_limit_mib if allocation.elastic else 0,
            cores_limit_percent=allocation.cores_limit_percent if allocation.elastic else 0,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UsageRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def share(self) -> float:
        """The fraction of one card each of its GPUs holds: 1 for a whole card, else the larger of
        its memory share and its compute share (what keeps others off the card)."""
        if self.whole:
            return 1.0
        memory_share = self.memory_mib / self.gpu_memory_mib if self.gpu_memory_mib > 0 else 0.0
        return min(1.0, max(memory_share, self.cores_percent / 100.0))

    def end(self, now: float) -> float:
        """When it stopped counting: its release, else ``now`` (still held)."""
        return self.released_at if self.released_at is not None else now


#: release cause of a kernel swapped out to host memory (hubext.backends.ReleaseCause.SWAPPED)
SWAPPED = "swapped"


def swapped_periods(records: Iterable[UsageRecord]) -> list[tuple[UsageRecord, float, float | None]]:
    """(record swapped out, from, until or None: still swapped out) for every record released as
    swapped: the kernel held no slice from its release until its resume was granted or it was
    stopped while swapped out (``swap_ended_at``; a resume among ``records`` also ends it)."""
    records = list(records)
    resumed_at = {r.resumes: r.granted_at for r in records if r.resumes}
    return [
        (r, r.released_at, r.swap_ended_at if r.swap_ended_at is not None else resumed_at.get(r.id))
        for r in records
        if r.release_cause == SWAPPED and r.released_at is not None
    ]
