"""Holding capacity for an overdue head, and moving slices to make room for it.

Two rules of the queue (:class:`quotas.queue.AdmissionQueue`), both for the **overdue head** of a
priority class: its first waiting request, waiting for capacity (``PoolFull``, not its quota),
that has waited ``queue.reserve_after_seconds``.

*Holding* (``queue.hold``; default ``with-moves``: only where moves are on and the caller's
edge can move slices, ``pump(moves_possible=...)`` — holding alone makes everyone wait). While
an overdue head waits, no request behind it — its
class and lower — is granted on a node where the head could ever be placed (a node with cards
of its model that can hold its slice, enough of them, and the CPU and host memory it asks for
when empty: :func:`held_nodes`). Such a request waits ("behind an overdue request"); it may
still be granted on a node the head can never use (another model, too small). Higher classes
come before the head in queue order and are not held. Holding only turns grants into waits, so
it never puts more on a card or a node than a decision without it would.

*Moving* (``queue.moves``). When the overdue head holds a reservation and
:func:`quotas.queue.propose_moves` finds the fewest single-card slices whose moving clears a
place for it, and every one of them is *movable*, the pump returns them with the head's step
(``Step.moves``) for the caller to carry out: swap each kernel out (its slice goes back to the
pool, the kernel keeps its state and asks admission again on its next cell, wherever there is
room). A slice is movable when it is a GPU kernel's (``kind == "kernel"``), on one card, of a
priority class with ``movable: true``, the caller's edge can swap it out (``movable`` callback:
the session's key, or None), and that session was not moved within
``queue.moves.same_session_after_seconds``; at most ``queue.moves.per_hour`` slices move in an
hour and ``queue.moves.max_slices`` for one head. Until the moved slices have left the state
(or :data:`MOVE_GRACE_SECONDS` passed), no further move is proposed for that head, and the
queue looks for moves for one head at most every :data:`MOVE_RETRY_SECONDS`.

Pure: the caller passes ``now`` and does the swapping.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from .model import Allocation
from .policy import MovePolicy
from .state import AdmissionState

#: the caller's edge: the key of the session an allocation belongs to, if it can swap it out
#: (the same key across the session's successive allocations), or None
Movable = Callable[[Allocation], "str | None"]

#: seconds the queue waits for moved slices to leave the state before it may move others
MOVE_GRACE_SECONDS = 120.0

#: seconds between two looks for slices to move for the same head (a look walks the pool)
MOVE_RETRY_SECONDS = 5.0


class MoveLimiter:
    """What moved when: the pool-wide hourly budget and each session's last move."""

    def __init__(self, policy: MovePolicy) -> None:
        self.policy = policy
        self._times: deque[float] = deque()
        self._last: dict[str, float] = {}

    def budget(self, now: float) -> int:
        """Slices that may still move in the hour up to ``now``."""
        while self._times and now - self._times[0] >= 3600:
            self._times.popleft()
        return max(0, min(self.policy.max_slices, self.policy.per_hour - len(self._times)))

    def allowed(self, key: str, now: float) -> bool:
        """The session ``key`` was not moved within ``same_session_after_seconds``."""
        last = self._last.get(key)
        return last is None or now - last >= self.policy.same_session_after_seconds

    def record(self, keys: Iterable[str], now: float) -> None:
        for key in keys:
            self._times.append(now)
            self._last[key] = now
        if len(self._last) > 4 * max(self.policy.per_hour, 1):  # forget sessions past the interval
            after = self.policy.same_session_after_seconds
            self._last = {k: t for k, t in self._last.items() if now - t < after}


def move_key(state: AdmissionState, movable: Movable | None) -> Callable[[Allocation], str | None]:
    """The session key of an allocation the policy lets move (kind, cards, class, edge), else None."""
    policy = state.config.policy

    def key(a: Allocation) -> str | None:
        if a.kind != "kernel" or a.whole or len(a.gpu_uuids) != 1:
            return None
        pc = policy.priority_classes.get(a.priority_class) or policy.priority_classes.get(
            policy.default_priority_class)
        if pc is None or not pc.movable:
            return None
        return a.id if movable is None else movable(a)

    return key


def held_nodes(state: AdmissionState, request) -> set[str]:
    """The nodes where ``request`` could ever be placed (its model's cards big enough and enough
    of them, the CPU and host memory it asks for when empty): what an overdue head holds."""
    from .queue import _capable_cards  # the queue's own walk of the index (no import cycle)

    ix = state._index
    k = request.count
    return {ix.node_names[ni] for ni, cards in _capable_cards(ix, request) if len(cards) >= k}
