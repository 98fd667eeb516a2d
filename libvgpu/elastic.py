"""Elastic slices, as the shim shows them to the hub and the node agent: who waits for memory
that other slices' bursts hold on a card.

A slice with a burst limit above its request (``memory_limit_mib.N`` in its limits file) may
allocate past its request while the card has memory no other slice's request needs. When a
slice then asks for memory *within its request* and the card cannot give it because bursts
hold it, its shim records the request in its entry of the card's node region (MiB wanted and
since when) and waits, bounded, for the memory to come back (docs/libvgpu.md, *Elastic
slices*). :func:`pending_reclaims` lists those waits with the slices that burst on the same
card, so the broker can take the burst back from the burster (swap it out; stop it where the
card cannot checkpoint), never from the owner.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from libvgpu import contract as C
from libvgpu.regions import NodeGPU, read_node_regions

__all__ = ["Reclaim", "pending_reclaims", "pod_reclaims", "reclaims_in", "reclaim_annotation"]

MiB = 1 << 20


@dataclass(frozen=True)
class Reclaim:
    """One owner waiting on one card for memory that one burster holds beyond its request."""

    card_uuid: str
    owner: str  # the waiting slice's name (its allocation id)
    wanted_mib: int  # what the owner's waiting allocation asks for
    since: float  # unix seconds (whole) when the owner began to wait
    burster: str  # a slice on the same card using more than its request (its allocation id)
    burst_mib: int  # how far the burster is above its request now


def pending_reclaims(node_region_dir: str | os.PathLike[str]) -> list[Reclaim]:
    """Every owner now waiting for burst memory, paired with each slice bursting on its card.

    Reads the node regions in ``node_region_dir`` (the shim's ``node_region_dir``; lock-free
    snapshots, live containers only). One :class:`Reclaim` per (owner, burster) pair on a card,
    largest burst first within a card, so a caller that frees enough from the first burster
    can stop there. Empty when nobody waits. A waiting owner with no burster on its card (the
    card is full of guaranteed memory, or the burst ended a moment ago) yields nothing: its
    allocation succeeds or fails on its own.

    The node region is writable by every container of the node, so an entry's request and
    usage are the shims' word: a caller that acts on a reclaim should check the burster
    against its own ledger (its allocation's request) before taking anything from it.
    """
    return reclaims_in(read_node_regions(node_region_dir))


def reclaims_in(regions: Mapping[str, NodeGPU]) -> list[Reclaim]:
    """:func:`pending_reclaims` of node regions already read (``read_node_regions``)."""
    found: list[Reclaim] = []
    for uuid, gpu in sorted(regions.items()):
        bursting = sorted(
            (
                c
                for c in gpu.containers
                if c.memory_limit_bytes is not None and c.memory_used_bytes > c.memory_limit_bytes
            ),
            key=lambda c: c.memory_used_bytes - (c.memory_limit_bytes or 0),
            reverse=True,
        )
        for owner in gpu.containers:
            if not owner.reclaim_mib or owner.reclaim_since is None:
                continue
            for burster in bursting:
                if burster.index == owner.index:
                    continue
                burst = burster.memory_used_bytes - (burster.memory_limit_bytes or 0)
                found.append(
                    Reclaim(
                        card_uuid=uuid,
                        owner=owner.name,
                        wanted_mib=owner.reclaim_mib,
                        since=owner.reclaim_since,
                        burster=burster.name,
                        burst_mib=-(-burst // MiB),
                    )
                )
    return found


def reclaim_annotation(reclaims: Iterable[Reclaim]) -> str:
    """The ``gpu-reclaim`` annotation of the owner's pod (Kubernetes: the node agent publishes the
    waits of its node's regions on the waiting pods): compact JSON, the owner left out (the pod
    names its allocation itself)."""
    rows = [{k: v for k, v in asdict(r).items() if k not in ("owner", "card_uuid")} | {"gpu_uuid": r.card_uuid}
            for r in reclaims]
    return json.dumps(rows, sort_keys=True, separators=(",", ":"))


def pod_reclaims(pods: Iterable[Mapping[str, Any]]) -> list[Reclaim]:
    """The waits the node agents published on pods (their ``gpu-reclaim`` annotation), as
    :class:`Reclaim` records whose owner is the allocation the pod holds (its own annotation, not
    the published text). Pods as the API returns them (dicts); a damaged annotation is skipped.
    What the hub acts on is checked against its ledger first (``hubext.broker.reclaim``)."""
    found: list[Reclaim] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        owner, text = annotations.get(C.ALLOCATION_ID), annotations.get(C.A_GPU_RECLAIM)
        if not owner or not text or meta.get("deletionTimestamp"):
            continue
        try:
            rows = json.loads(text)
            found += [
                Reclaim(card_uuid=str(r["gpu_uuid"]), owner=owner, wanted_mib=int(r["wanted_mib"]),
                        since=float(r["since"]), burster=str(r["burster"]), burst_mib=int(r["burst_mib"]))
                for r in rows
            ]
        except (ValueError, TypeError, KeyError):
            continue
    return sorted(found, key=lambda r: (r.card_uuid, -r.burst_mib))  # largest burst first, as above
