"""Card health: a fatal Xid takes a card out of placement until it recovers or an admin clears it.

The node agent counts every Xid (``elastic_gpu_xid_errors_total``) and records a card that
reported a fatal one on its Node, as the annotation ``contract.NODE_GPU_HEALTH_ANNOTATION``:
JSON ``{gpu_uuid: {"xid": 79, "since": <epoch s>, "index": 0}}``. The hub's pool reads it and
places no new slice on that card; slices already there stay (their processes meet the driver's
error themselves). The agent removes an entry itself when the card recovers (:class:`Recovery`:
seen lost, then answering NVML again with no fatal Xid for a hold-down time); an admin clears a
card, once it is reset or replaced, by removing its entry, or the whole annotation
(``kubectl annotate node <node> elastic-gpu.jupyter.org/gpu-health-``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from .contract import NODE_GPU_HEALTH_ANNOTATION

#: the Xids after which NVIDIA's guide says the card needs a reset (or replacement) before use
FATAL_XIDS: dict[int, str] = {
    48: "a double-bit ECC error",
    63: "an ECC page retirement or row remapping recording event",
    64: "an ECC page retirement or row remapping failure",
    74: "an NVLink error",
    79: "the GPU has fallen off the bus",
    94: "a contained ECC error",
    95: "an uncontained ECC error",
}


@dataclass(frozen=True)
class OutOfService:
    """Why one card takes no new slices: the fatal Xid it reported, and when."""

    xid: int
    since: float
    index: int = 0

    def meaning(self) -> str:
        """'Xid 79 (the GPU has fallen off the bus)'."""
        return f"Xid {self.xid} ({FATAL_XIDS.get(self.xid, 'a fatal error')})"

    def since_utc(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.since))

    def why(self, node: str = "") -> str:
        """The sentence the pages, the CLI and the logs show (with how to clear it, given its node)."""
        text = f"out of service since {self.since_utc()}: {self.meaning()}; "
        return text + (f"an admin clears it, once the card is reset, with `{clear_command(node)}`" if node
                       else "an admin clears it once the card is reset")


def clear_command(node: str) -> str:
    """How an admin clears the cards of ``node`` (the agent publishes a card again on its next fatal Xid)."""
    return f"kubectl annotate node {node} {NODE_GPU_HEALTH_ANNOTATION}-"


@dataclass
class Recovery:
    """When a card out of service comes back by itself: the node agent saw it lost (NVML answered
    nothing for it: fallen off the bus, or gone while it was reset) and then answering again, with
    no new fatal Xid, for ``hold_down_seconds``. A card never seen lost (an ECC Xid on a card that
    kept answering) is not taken as reset: an admin clears it. ``hold_down_seconds`` 0: only an
    admin clears cards."""

    hold_down_seconds: float
    lost: set[str] = field(default_factory=set)
    #: gpu uuid -> when it answered again after it was seen lost (its hold-down's start)
    answering_since: dict[str, float] = field(default_factory=dict)

    def probed(self, uuid: str, answers: bool, now: float) -> str:
        """Take one probe of a card out of service: 'lost', 'answering' (its hold-down starts
        now), 'holding', 'recovered' (back in service) or '' (nothing to say)."""
        if self.hold_down_seconds <= 0:
            return ""
        if not answers:
            self.answering_since.pop(uuid, None)
            new = uuid not in self.lost
            self.lost.add(uuid)
            return "lost" if new else ""
        if uuid not in self.lost:
            return ""
        if uuid not in self.answering_since:
            self.answering_since[uuid] = now
            return "answering"
        return "recovered" if now - self.answering_since[uuid] >= self.hold_down_seconds else "holding"

    def fatal(self, uuid: str) -> bool:
        """A new fatal Xid of a card out of service: whether it restarts a running hold-down."""
        return self.answering_since.pop(uuid, None) is not None

    def forget(self, uuid: str) -> None:
        """The card is back in service (or an admin cleared it)."""
        self.lost.discard(uuid)
        self.answering_since.pop(uuid, None)


def parse(text: str | None) -> dict[str, OutOfService]:
    """The cards an annotation names; raises ValueError on text the agent never writes."""
    if not text:
        return {}
    data = json.loads(text)
    if not isinstance(data, Mapping):
        raise ValueError("not a JSON object of GPU uuids")
    cards = {}
    for uuid, entry in data.items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("xid"), int):
            raise ValueError(f"{uuid}: not an object with an integer 'xid'")
        cards[str(uuid)] = OutOfService(int(entry["xid"]), float(entry.get("since", 0)), int(entry.get("index", 0)))
    return cards


def dump(cards: Mapping[str, OutOfService]) -> str | None:
    """The annotation's text (None: no card out of service, the annotation is removed)."""
    if not cards:
        return None
    return json.dumps(
        {u: {"xid": c.xid, "since": round(c.since, 3), "index": c.index} for u, c in sorted(cards.items())},
        separators=(",", ":"),
    )
