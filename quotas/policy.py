"""Policy: priority classes, placement strategy, and the whole admission config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from .errors import InvalidRequest
from .tree import QuotaTree

#: default wait after which the head of a priority class gets capacity reserved (seconds): well
#: inside the 30 s p95 wait a notebook pool is sized for, so that the moves the reservation
#: brings can still meet it (at 60 s a whole-card request behind idle kernels waited 60 s, a card
#: over the pool that cannot fragment; bench/density.py, docs/admission.md, issue 25)
RESERVE_AFTER_SECONDS = 20.0

Strategy = Literal["binpack", "spread", "fgd"]
STRATEGIES = ("binpack", "spread", "fgd")


@dataclass(frozen=True)
class PriorityClass:
    """``value``: higher wins. ``preempt``: may evict allocations of strictly lower value.
    ``borrow``: may go over quota while the pool has idle capacity (such grants are marked
    borrowed and are the first to be preempted). ``movable``: its GPU kernels' slices may be
    swapped out to make room for an overdue head of the queue (see quotas.moving)."""

    name: str
    value: int
    preempt: bool = False
    borrow: bool = False
    movable: bool = False


@dataclass(frozen=True)
class Placement:
    """Where slices go: ``binpack`` fills the fullest node/card that fits first, ``spread`` the
    emptiest, ``fgd`` the one whose fragmentation grows least for the expected mix of
    requests; chosen separately for nodes and for cards within the node."""

    node: Strategy = "fgd"  # chosen by bench/placement.py (docs/admission.md)
    gpu: Strategy = "binpack"


DEFAULT_PRIORITY_CLASSES: Mapping[str, PriorityClass] = {
    "high": PriorityClass("high", 1000, preempt=True, borrow=False),
    "default": PriorityClass("default", 100, preempt=False, borrow=False, movable=True),
    "low": PriorityClass("low", 10, preempt=False, borrow=True, movable=True),
}


@dataclass(frozen=True)
class MovePolicy:
    """How the queue moves slices for an overdue head (quotas.moving): at most ``max_slices``
    slices for one head (0: never move), at most ``per_hour`` slices in an hour in the whole
    pool, and never the same session again within ``same_session_after_seconds``."""

    max_slices: int = 8
    per_hour: int = 60
    same_session_after_seconds: float = 1800.0


@dataclass(frozen=True)
class Policy:
    priority_classes: Mapping[str, PriorityClass] = field(
        default_factory=lambda: dict(DEFAULT_PRIORITY_CLASSES)
    )
    default_priority_class: str = "default"
    placement: Placement = field(default_factory=Placement)
    #: preemption looks for victims on at most this many nodes (in placement order), as
    #: kube-scheduler bounds its candidate nodes; the best single victim is always found.
    max_preemption_nodes: int = 100
    #: seconds the head of a priority class may wait for capacity before the queue reserves
    #: capacity for it (None: never; see quotas.queue)
    reserve_after_seconds: float | None = RESERVE_AFTER_SECONDS
    #: on how many nodes at once capacity is reserved for an overdue head (the first to
    #: clear wins; more spots: shorter waits for the head, less capacity for the others)
    reserve_spots: int = 1
    #: once the head of a class is overdue, requests of its class and lower are not granted on
    #: nodes where it could be placed (quotas.moving.held_nodes); None: only where slices can be
    #: moved for it too (holding alone makes everyone wait)
    hold_for_overdue_head: bool | None = None
    #: moving movable kernels' slices for an overdue head
    moves: MovePolicy = field(default_factory=MovePolicy)

    def priority_class(self, name: str | None) -> PriorityClass:
        """The class of a request (``None`` -> the default); InvalidRequest if unknown."""
        key = self.default_priority_class if name is None else name
        pc = self.priority_classes.get(key)
        if pc is None:
            known = ", ".join(f"'{n}'" for n in sorted(self.priority_classes))
            raise InvalidRequest(
                f"Priority class '{key}' does not exist (known: {known}). Pick one of these."
            )
        return pc

    def value_of(self, name: str) -> int:
        """Priority value of an allocation's class; a class no longer configured counts as the
        default class."""
        pc = self.priority_classes.get(name) or self.priority_classes.get(
            self.default_priority_class
        )
        return pc.value if pc else 0


@dataclass(frozen=True)
class AdmissionConfig:
    """Everything admission needs besides the pool and the allocations."""

    policy: Policy = field(default_factory=Policy)
    quotas: QuotaTree = field(default_factory=QuotaTree.unlimited)

    @property
    def priority_classes(self) -> Mapping[str, PriorityClass]:
        return self.policy.priority_classes

    @property
    def default_priority_class(self) -> str:
        return self.policy.default_priority_class

    @property
    def placement(self) -> Placement:
        return self.policy.placement

    @property
    def workspaces(self) -> Mapping:
        return self.quotas.workspaces
