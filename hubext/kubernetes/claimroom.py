"""What room the cluster-wide claims leave on a card: one claim (:class:`Claim`), whether claims
together overbook a card (:func:`overbooked`), which of this hub's lapsed claims it may write back
(:func:`lapsed_out`), and the nodes as this hub may use them beside other hubs' claims
(:func:`without`). Pure functions; the ledger that reads and writes the claims is :mod:`.claims`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from quotas import GPU, Node
from quotas.messages import claim_lapsed, claims_full
from quotas.placement import capacity


@dataclass(frozen=True)
class Claim:
    """One allocation's hold on cards of one node (memory and cores per card)."""

    hub: str
    allocation_id: str
    node: str
    gpu_uuids: tuple[str, ...]
    memory_mib: int
    cores_percent: int
    whole: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": list(self.gpu_uuids),
            "memory_mib": self.memory_mib,
            "cores_percent": self.cores_percent,
            "whole": self.whole,
        }


def overbooked(gpus: Mapping[str, GPU], claims: list[Claim], new: Claim) -> str | None:
    """A sentence naming the first card of claim ``new`` that ``claims`` (``new`` among them)
    together overbook; None if all fit."""
    for uuid in new.gpu_uuids:
        on = [c for c in claims if uuid in c.gpu_uuids]
        whole = [c for c in on if c.whole and c != new]
        if whole:
            holders = ", ".join(sorted({c.hub for c in whole}))
            return f"GPU {uuid} is held whole by hub {holders}."
        if new.whole and len(on) > 1:
            holders = ", ".join(sorted({c.hub for c in on if c != new}))
            return f"GPU {uuid} holds slices of hub {holders}, so it cannot be given out whole."
        gpu = gpus.get(uuid)
        if gpu is None:
            continue
        memory, cores = sum(c.memory_mib for c in on), sum(c.cores_percent for c in on)
        cap_m, cap_c = capacity(gpu.memory_mib * gpu.memory_oversub), capacity(100 * gpu.cores_oversub)
        if memory > cap_m or cores > cap_c:
            hubs = ", ".join(sorted({c.hub for c in on}))
            return claims_full(uuid, hubs, memory, cap_m, cores, cap_c)
    return None


def without(nodes: list[Node], others: list[Claim]) -> list[Node]:
    """The nodes as this hub may use them: each card carries what other hubs hold of it
    (``GPU.held_*``), so the admission core leaves that room alone without counting it against
    any quota or offering it to preemption, and a request that fits the card still waits."""
    held: dict[str, list[Claim]] = {}
    for claim in others:
        for uuid in claim.gpu_uuids:
            held.setdefault(uuid, []).append(claim)
    if not held:
        return nodes
    result = []
    for node in nodes:
        gpus = []
        for gpu in node.gpus:
            claims = held.get(gpu.uuid)
            if claims:
                gpu = replace(
                    gpu,
                    held_whole=any(c.whole for c in claims),
                    held_memory_mib=sum(c.memory_mib for c in claims if not c.whole),
                    held_cores_percent=sum(c.cores_percent for c in claims if not c.whole),
                )
            gpus.append(gpu)
        result.append(replace(node, gpus=tuple(gpus)))
    return result


def lapsed_out(
    gpus: Mapping[str, GPU], others: list[Claim], mine: list[Claim], held: Collection[str], ttl: float
) -> dict[str, str]:
    """This hub's claims that lapsed and no longer fit, each with the sentence that says why.

    ``held``: the allocation ids this hub's entry holds in the object as just read. A claim of
    ``mine`` missing there lapsed (another hub dropped it when this one had not renewed it for the
    TTL: a hub whose loop stalled looks dead) or was never written (a restarted hub's pods): it is
    checked again like a new claim, in allocation-id order, against ``others`` and the claims of
    ``mine`` already kept. Where it no longer fits, another hub took its room meanwhile: the grant
    is lost, and writing it back would overbook the card."""
    kept = [c for c in mine if c.allocation_id in held]
    lost = {}
    for claim in sorted((c for c in mine if c.allocation_id not in held), key=lambda c: c.allocation_id):
        why = overbooked(gpus, others + kept + [claim], claim)
        if why:
            lost[claim.allocation_id] = claim_lapsed(claim.allocation_id, ttl, why)
        else:
            kept.append(claim)
    return lost
