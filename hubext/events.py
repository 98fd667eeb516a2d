"""What happens to a slice, published to whoever keeps account of it.

The allocator publishes grants and releases (with their :class:`~hubext.backends.ReleaseCause`:
a culled kernel's slice is released with ``CULLED``, a swapped-out kernel's with ``SWAPPED``);
the broker publishes what only it knows: a swapped-out kernel resumed on a new slice, or
stopped while swapped out. Subscribers (the usage meter, the broker itself) read the event and
never ask which mode the slice lives in.

``GPUAllocator.slice_events`` is the one publisher of a hub process.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quotas import Allocation

from .backends import ReleaseCause


class SliceEventKind(str, enum.Enum):
    GRANTED = "granted"  # a request got its slice (the allocator)
    RELEASED = "released"  # the slice went back to the pool; ``cause`` says why (the allocator)
    RESUMED = "resumed"  # a swapped-out kernel got a new slice; ``previous_id`` is the one it left (the broker)
    SWAP_ENDED = "swap-ended"  # a swapped-out kernel stopped before it resumed (the broker)


@dataclass(frozen=True)
class SliceEvent:
    """One thing that happened to a slice. ``allocation`` is None only for ``SWAP_ENDED`` (its
    slice was released when the kernel was swapped out)."""

    kind: SliceEventKind
    allocation_id: str
    allocation: Allocation | None = None
    why: str = ""
    cause: ReleaseCause | None = None
    #: RESUMED: the allocation the kernel was swapped out of
    previous_id: str = ""
    at: float = field(default_factory=time.time)

    @property
    def culled(self) -> bool:
        return self.kind is SliceEventKind.RELEASED and self.cause is ReleaseCause.CULLED

    @property
    def suspended(self) -> bool:
        return self.kind is SliceEventKind.RELEASED and self.cause is ReleaseCause.SWAPPED


Subscriber = Callable[[SliceEvent], None]


class SliceEvents:
    """The publisher: subscribers are called in order, on the event loop, and must not block;
    one that raises is logged and the others still hear the event."""

    def __init__(self, log: logging.Logger | None = None) -> None:
        self.log = log or logging.getLogger(__name__)
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        """Hear every event from now on (once, however often it subscribes)."""
        if subscriber not in self._subscribers:
            self._subscribers.append(subscriber)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    def clear(self) -> None:
        """Forget every subscriber (a hub about to stop records nothing more)."""
        self._subscribers.clear()

    def publish(self, event: SliceEvent) -> None:
        for subscriber in list(self._subscribers):
            try:
                subscriber(event)
            except Exception:  # a broken subscriber must not break allocation
                self.log.exception("GPU slice event subscriber failed on %s %s", event.kind.value, event.allocation_id)


#: the releases an admin looks for on the pool page (a stop or a failed start is not news)
NOTABLE_CAUSES = frozenset(
    {ReleaseCause.PREEMPTED, ReleaseCause.CULLED, ReleaseCause.SWAPPED, ReleaseCause.HOLDER_GONE}
)


class RecentSliceEvents:
    """A subscriber that keeps the last ``size`` notable events (a slice preempted, culled, swapped
    out or lost with its holder; a swapped-out kernel resumed), newest first, for the admin page
    and ``/hub/api/gpu/pool`` in either mode. In memory: the local ledger keeps its own events
    across restarts (``PoolBackend.events``)."""

    def __init__(self, size: int = 50) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=size)

    def __call__(self, event: SliceEvent) -> None:
        released = event.kind is SliceEventKind.RELEASED and event.cause in NOTABLE_CAUSES
        if not released and event.kind is not SliceEventKind.RESUMED:
            return
        kind = event.cause.value if released and event.cause is not None else event.kind.value
        self._events.appendleft(
            {
                "at": event.at,
                "allocation_id": event.allocation_id,
                "user": event.allocation.owner.user if event.allocation is not None else "",
                "kind": kind,
                "reason": event.why or (f"resumes {event.previous_id}" if event.previous_id else kind),
            }
        )

    def latest(self, limit: int = 20) -> list[dict[str, Any]]:
        return list(self._events)[:limit]


def recent_events(kept: list[dict[str, Any]], heard: list[dict[str, Any]], limit: int = 20) -> list[dict[str, Any]]:
    """The pool page's events, newest first: what the pool keeps (the local ledger's, across
    restarts) and what this hub heard as slice events (both modes), each once."""
    seen = {(e.get("allocation_id"), e.get("kind")) for e in kept}
    merged = kept + [e for e in heard if (e.get("allocation_id"), e.get("kind")) not in seen]
    return sorted(merged, key=lambda e: e.get("at") or 0.0, reverse=True)[:limit]
