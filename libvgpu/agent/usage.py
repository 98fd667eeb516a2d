"""Per-allocation GPU usage on this node: the shim's node regions joined with the pods' allocations.

Pure functions of plain data (pods, node regions, NVML processes), so they are tested without a
cluster or a GPU.

Which region entry is which allocation: the shim writes the limits file's ``name=`` into its
entry; the spawner should set it to the allocation id. An entry without a matching name is
matched by what the spawner did write, the memory limit: when exactly one live entry and one
allocation on the card have the same limit, they are the same container. Region contents are
written by the containers themselves, so they are used for reporting only; enforcement
(:mod:`libvgpu.backstop`) compares NVML's per-process figures with the pod's allocation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from libvgpu.regions import NodeContainer, NodeGPU

from .nvml import GPUProcess
from .pods import PodInfo

MIB = 1 << 20


@dataclass(frozen=True)
class AllocationUsage:
    """One allocation's use of one GPU (one metrics series per field)."""

    gpu_uuid: str
    allocation_id: str
    user: str
    workspace: str
    namespace: str
    kind: str
    pod: str
    used_bytes: int
    limit_bytes: int | None  # None: whole card / unlimited
    last_activity: float | None  # unix seconds of the last kernel launch the shim saw
    source: str  # "shim" (node region), "nvml" (per-process usage) or "none"


@dataclass(frozen=True)
class RegionMatch:
    """The region entries of each (allocation id, GPU uuid), and which allocations registered."""

    entries: dict[tuple[str, str], list[NodeContainer]]
    registered: set[tuple[str, str]]  # the shim of that allocation is in that GPU's region
    unmatched: dict[str, list[NodeContainer]]  # live entries no allocation claims, per GPU


def _limit_of(pod: PodInfo) -> int | None:
    a = pod.allocation
    assert a is not None
    return None if a.whole else a.memory_ceiling_mib * MIB  # an elastic slice may grow to its limit


def live_allocations(pods: Iterable[PodInfo]) -> list[PodInfo]:
    """Pods that hold an allocation and have not finished."""
    return [p for p in pods if p.allocation is not None and p.phase not in ("Succeeded", "Failed")]


def match_regions(pods: Sequence[PodInfo], regions: Mapping[str, NodeGPU]) -> RegionMatch:
    entries: dict[tuple[str, str], list[NodeContainer]] = defaultdict(list)
    registered: set[tuple[str, str]] = set()
    unmatched: dict[str, list[NodeContainer]] = {}
    holders = live_allocations(pods)
    for uuid, gpu in regions.items():
        on_card = [p for p in holders if uuid in p.allocation.gpu_uuids]  # type: ignore[union-attr]
        by_id = {p.allocation.id: p for p in on_card}  # type: ignore[union-attr]
        rest: list[NodeContainer] = []
        for entry in gpu.containers:
            if entry.alive is False:
                continue
            if entry.name and entry.name in by_id:
                entries[(entry.name, uuid)].append(entry)
                registered.add((entry.name, uuid))
            else:
                rest.append(entry)
        # by memory limit, for allocations whose entry carries no (known) name
        waiting = [p for p in on_card if (p.allocation.id, uuid) not in registered]  # type: ignore[union-attr]
        by_limit_pods: dict[int | None, list[PodInfo]] = defaultdict(list)
        for p in waiting:
            by_limit_pods[_limit_of(p)].append(p)
        by_limit_entries: dict[int | None, list[NodeContainer]] = defaultdict(list)
        for e in rest:
            by_limit_entries[e.memory_limit_bytes].append(e)
        left: list[NodeContainer] = []
        for limit, es in by_limit_entries.items():
            ps = by_limit_pods.get(limit, [])
            if len(ps) == 1 and len(es) == 1:
                entries[(ps[0].allocation.id, uuid)].append(es[0])  # type: ignore[union-attr]
            else:
                left.extend(es)  # shown by container id: which allocation is whose is unknown
            if es:  # (with fewer entries than allocations, which one lacks its shim is unknown:
                for p in ps:  # none is flagged)
                    registered.add((p.allocation.id, uuid))  # type: ignore[union-attr]
        if left:
            unmatched[uuid] = left
    return RegionMatch(entries=dict(entries), registered=registered, unmatched=unmatched)


def allocation_usage(
    pods: Sequence[PodInfo],
    regions: Mapping[str, NodeGPU],
    processes: Mapping[str, Sequence[GPUProcess]],
    pod_of_pid: Mapping[int, PodInfo | None],
    match: RegionMatch | None = None,
) -> list[AllocationUsage]:
    """Usage per (allocation, GPU) of the allocations held by ``pods`` (and unmatched entries)."""
    match = match or match_regions(pods, regions)
    nvml_used: dict[tuple[str, str], int] = defaultdict(int)
    for uuid, procs in processes.items():
        for proc in procs:
            pod = pod_of_pid.get(proc.pid)
            if pod is not None and pod.allocation is not None and uuid in pod.allocation.gpu_uuids:
                nvml_used[(pod.allocation.id, uuid)] += proc.used_bytes
    out: list[AllocationUsage] = []
    for pod in live_allocations(pods):
        a = pod.allocation
        assert a is not None
        for uuid in a.gpu_uuids:
            key = (a.id, uuid)
            found = match.entries.get(key, [])
            if found:
                used = sum(e.memory_used_bytes for e in found)
                limits = [e.memory_limit_bytes for e in found if e.memory_limit_bytes is not None]
                limit = min(limits) if limits else _limit_of(pod)
                launches = [e.last_launch_at for e in found if e.last_launch_at]
                last = max(launches) if launches else None
                source = "shim"
            else:
                used, limit, last = nvml_used.get(key, 0), _limit_of(pod), None
                source = "nvml" if key in nvml_used else "none"
            out.append(
                AllocationUsage(
                    gpu_uuid=uuid,
                    allocation_id=a.id,
                    user=a.owner.user,
                    workspace=a.owner.workspace,
                    namespace=a.owner.namespace,
                    kind=a.kind,
                    pod=pod.name,
                    used_bytes=used,
                    limit_bytes=limit,
                    last_activity=last,
                    source=source,
                )
            )
    for uuid, es in match.unmatched.items():
        for e in es:
            out.append(
                AllocationUsage(
                    gpu_uuid=uuid,
                    allocation_id=e.name or f"container-{e.container_id:016x}",
                    user="",
                    workspace="",
                    namespace="",
                    kind="",
                    pod="",
                    used_bytes=e.memory_used_bytes,
                    limit_bytes=e.memory_limit_bytes,
                    last_activity=e.last_launch_at,
                    source="shim",
                )
            )
    return out
