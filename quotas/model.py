"""Domain types: requests, the pool of GPUs, allocations and decisions. Plain frozen data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from .errors import AdmissionError, InvalidRequest


class Mode(str, Enum):
    """How a card is handed out: ``shared`` slices, ``whole`` cards only, or ``mig`` (managed by
    the MIG device plugin; admission never places on it)."""

    SHARED = "shared"
    WHOLE = "whole"
    MIG = "mig"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Owner:
    """Whose quota a request counts against."""

    user: str
    namespace: str = "default"
    workspace: str = "default"


@dataclass(frozen=True)
class GPURequest:
    """A request for ``count`` GPU slices on one node; memory and cores are PER GPU.

    ``cpu_millicores`` and ``host_memory_mib`` are what the pod or process needs of the node
    itself, for the whole request (Kubernetes' CPU and memory requests); 0 means it asks for
    none and fits any node's CPU and memory.

    ``memory_limit_mib`` and ``cores_limit_percent`` (per GPU; 0: the request) make the slice
    elastic: it may grow to them while the card has room nobody's request needs. Admission,
    quotas and placement count only the request; a limit is bounded by the card."""

    owner: Owner
    memory_mib: int
    cores_percent: int
    count: int = 1
    model: str | None = None
    priority_class: str | None = None
    whole: bool = False
    request_id: str = ""
    kind: str = "notebook"
    cpu_millicores: int = 0
    host_memory_mib: int = 0
    #: only on these cards (uuids, of one node; ``count`` of them, the first with room in this
    #: order): a swapped-out kernel pod's resume, onto its own card or, where its node's driver can
    #: restore there, another of that node. Empty: anywhere that fits. A pinned request waits
    #: for its cards; it never preempts.
    pinned_uuids: tuple[str, ...] = ()
    memory_limit_mib: int = 0
    cores_limit_percent: int = 0

    @classmethod
    def split(
        cls,
        owner: Owner,
        total_memory_mib: int,
        total_cores_percent: int,
        count: int,
        **kw: Any,
    ) -> GPURequest:
        """Spread a total evenly over ``count`` GPUs: 18 GiB and 240 % over 3 -> 6 GiB and 80 %
        each. Remainders are rounded down so the total is never exceeded."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidRequest(f"A request needs at least 1 GPU; got count={count!r}.")
        return cls(
            owner=owner,
            memory_mib=total_memory_mib // count,
            cores_percent=total_cores_percent // count,
            count=count,
            **kw,
        )


@dataclass(frozen=True)
class GPU:
    """One card. Capacity for slices is ``memory_mib * memory_oversub`` MiB and
    ``100 * cores_oversub`` % of its SMs."""

    uuid: str
    model: str
    memory_mib: int
    sm_count: int = 0
    memory_oversub: float = 1.0
    cores_oversub: float = 1.0
    mode: Mode = Mode.SHARED
    mig_profiles: tuple[str, ...] = ()
    index: int = 0
    #: memory, compute and whole-card holds of claimants outside this ledger (other hubs): the
    #: card has that much less room, counted neither against quotas nor as preemption victims
    held_memory_mib: int = 0
    held_cores_percent: int = 0
    held_whole: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The inventory format that :func:`quotas.load_pool` reads back."""
        return {
            "uuid": self.uuid,
            "model": self.model,
            "memory_mib": self.memory_mib,
            "sm_count": self.sm_count,
            "memory_oversub": self.memory_oversub,
            "cores_oversub": self.cores_oversub,
            "mode": Mode(self.mode).value,
            "mig_profiles": list(self.mig_profiles),
            "index": self.index,
        }


@dataclass(frozen=True)
class Node:
    """One machine. ``cpu_millicores`` and ``host_memory_mib`` are what it can give to pods
    (Kubernetes' allocatable; None: unknown, so never the reason a request does not fit);
    ``*_requested_*`` is what pods and processes outside the GPU ledger already ask of it.
    What the ledger's own allocations ask is counted from the allocations."""

    name: str
    gpus: tuple[GPU, ...]
    cpu_millicores: int | None = None
    host_memory_mib: int | None = None
    cpu_requested_millicores: int = 0
    host_memory_requested_mib: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The inventory format that :func:`quotas.load_pool` reads back."""
        data: dict[str, Any] = {"name": self.name, "gpus": [g.to_dict() for g in self.gpus]}
        for key in ("cpu_millicores", "host_memory_mib"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        for key in ("cpu_requested_millicores", "host_memory_requested_mib"):
            if getattr(self, key):
                data[key] = getattr(self, key)
        return data


@dataclass(frozen=True)
class Pool:
    """The inventory: nodes and their GPUs."""

    nodes: tuple[Node, ...] = ()
    _gpus: dict[str, tuple[Node, GPU]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    _nodes: dict[str, Node] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        for node in self.nodes:
            self._nodes[node.name] = node
            for gpu in node.gpus:
                self._gpus[gpu.uuid] = (node, gpu)

    def gpu(self, uuid: str) -> GPU | None:
        hit = self._gpus.get(uuid)
        return hit[1] if hit else None

    def node(self, name: str) -> Node | None:
        return self._nodes.get(name)

    def node_of(self, uuid: str) -> Node | None:
        hit = self._gpus.get(uuid)
        return hit[0] if hit else None

    def all_gpus(self) -> list[GPU]:
        return [gpu for node in self.nodes for gpu in node.gpus]

    def to_dict(self) -> dict[str, Any]:
        """The inventory format that :func:`quotas.load_pool` reads back (the one pool codec:
        the local ledger, ``/hub/api/gpu/pool`` and the CLI write it)."""
        return {"nodes": [n.to_dict() for n in self.nodes]}


@dataclass(frozen=True)
class Allocation:
    """A granted request: where it runs, its per-GPU limits, and the node CPU and host memory
    it holds (for the whole allocation).

    ``memory_mib`` and ``cores_percent`` are the request, what admission guarantees and counts;
    ``memory_limit_mib`` and ``cores_limit_percent`` are how far the slice may grow into what
    the card leaves idle (0: no further than the request). :attr:`memory_ceiling_mib` and
    :attr:`cores_ceiling_percent` read them with that default applied.
    """

    id: str
    owner: Owner
    node: str
    gpu_uuids: tuple[str, ...]
    memory_mib: int
    cores_percent: int
    priority_class: str
    whole: bool = False
    borrowed: bool = False
    kind: str = "notebook"
    created_at: float = 0.0
    cpu_millicores: int = 0
    host_memory_mib: int = 0
    memory_limit_mib: int = 0
    cores_limit_percent: int = 0

    @property
    def memory_ceiling_mib(self) -> int:
        """The most memory per GPU the slice may use: its limit, or its request when it has none."""
        return max(self.memory_limit_mib, self.memory_mib)

    @property
    def cores_ceiling_percent(self) -> int:
        """The most compute per GPU the slice may use: its limit, or its request when it has none."""
        return max(self.cores_limit_percent, self.cores_percent)

    @property
    def elastic(self) -> bool:
        """True when the slice may grow past its request in memory or compute."""
        return (self.memory_ceiling_mib > self.memory_mib
                or self.cores_ceiling_percent > self.cores_percent)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (the local ledger's, the APIs' and the CLI's) that
        :meth:`from_dict` reads back."""
        return {
            "id": self.id,
            "user": self.owner.user,
            "namespace": self.owner.namespace,
            "workspace": self.owner.workspace,
            "node": self.node,
            "gpu_uuids": list(self.gpu_uuids),
            "memory_mib": self.memory_mib,
            "cores_percent": self.cores_percent,
            "priority_class": self.priority_class,
            "whole": self.whole,
            "borrowed": self.borrowed,
            "kind": self.kind,
            "created_at": self.created_at,
            "cpu_millicores": self.cpu_millicores,
            "host_memory_mib": self.host_memory_mib,
            "memory_limit_mib": self.memory_limit_mib,
            "cores_limit_percent": self.cores_limit_percent,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Allocation:
        """The inverse of :meth:`to_dict`."""
        return cls(
            id=data["id"],
            owner=Owner(user=data["user"], namespace=data["namespace"], workspace=data["workspace"]),
            node=data["node"],
            gpu_uuids=tuple(data["gpu_uuids"]),
            memory_mib=int(data["memory_mib"]),
            cores_percent=int(data["cores_percent"]),
            priority_class=data["priority_class"],
            whole=bool(data.get("whole", False)),
            borrowed=bool(data.get("borrowed", False)),
            kind=data.get("kind", "notebook"),
            created_at=float(data.get("created_at", 0.0)),
            cpu_millicores=int(data.get("cpu_millicores", 0)),
            host_memory_mib=int(data.get("host_memory_mib", 0)),
            memory_limit_mib=int(data.get("memory_limit_mib", 0)),
            cores_limit_percent=int(data.get("cores_limit_percent", 0)),
        )


DecisionKind = Literal["grant", "preempt", "wait", "reject"]


@dataclass(frozen=True)
class Decision:
    """The answer to one request.

    ``grant``: record ``allocation``. ``preempt``: stop and remove ``victims``, then record
    ``allocation``. ``wait``: it would fit if others stopped (``reason``, ``error``). ``reject``:
    it can never fit as asked (``reason``, ``error``).
    """

    kind: DecisionKind
    allocation: Allocation | None = None
    victims: tuple[Allocation, ...] = ()
    reason: str = ""
    error: AdmissionError | None = None

    @property
    def granted(self) -> bool:
        return self.kind in ("grant", "preempt")
