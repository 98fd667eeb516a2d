"""The quota tree (workspace ⊇ namespaces ⊇ users) and the running usage of each level."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .errors import InvalidRequest
from .model import Owner

#: the three resources a level may cap, in the order messages report them
RESOURCES = ("memory_mib", "cores_percent", "gpus")


@dataclass(frozen=True)
class Limits:
    """Caps of one level; ``None`` means unlimited. ``gpus`` counts vGPUs (slices)."""

    memory_mib: int | None = None
    cores_percent: int | None = None
    gpus: int | None = None

    def get(self, resource: str) -> int | None:
        return getattr(self, resource)

    def merged(self, override: Limits) -> Limits:
        """``override``'s set keys win over ours."""
        return Limits(
            *(
                override.get(r) if override.get(r) is not None else self.get(r)
                for r in RESOURCES
            )
        )

    @property
    def unlimited(self) -> bool:
        return all(self.get(r) is None for r in RESOURCES)

    def to_dict(self) -> dict[str, int | None]:
        return {r: self.get(r) for r in RESOURCES}


UNLIMITED = Limits()


@dataclass(frozen=True)
class NamespaceQuota:
    """A namespace: its own cap, the default cap per user, and per-user overrides (merged over
    ``user_limits`` key by key)."""

    name: str
    limits: Limits = UNLIMITED
    user_limits: Limits = UNLIMITED
    users: Mapping[str, Limits] = field(default_factory=dict)

    def limits_for(self, user: str) -> Limits:
        own = self.users.get(user)
        return self.user_limits.merged(own) if own is not None else self.user_limits


@dataclass(frozen=True)
class WorkspaceQuota:
    name: str
    limits: Limits = UNLIMITED
    namespaces: Mapping[str, NamespaceQuota] = field(default_factory=dict)


@dataclass(frozen=True)
class Level:
    """One level a request must fit: ``key`` is (workspace,), (workspace, namespace) or
    (workspace, namespace, user)."""

    key: tuple[str, ...]
    limits: Limits

    @property
    def kind(self) -> str:
        return ("workspace", "namespace", "user")[len(self.key) - 1]

    @property
    def label(self) -> str:
        if len(self.key) == 1:
            return f"workspace '{self.key[0]}'"
        if len(self.key) == 2:
            return f"namespace '{self.key[1]}' of workspace '{self.key[0]}'"
        return f"user '{self.key[2]}'"


def level_keys(owner: Owner) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """User, namespace and workspace keys of an owner (narrowest first)."""
    ws, ns = owner.workspace, owner.namespace
    return (ws, ns, owner.user), (ws, ns), (ws,)


@dataclass(frozen=True)
class QuotaTree:
    workspaces: Mapping[str, WorkspaceQuota] = field(default_factory=dict)

    @classmethod
    def unlimited(cls) -> QuotaTree:
        """One workspace 'default' with one namespace 'default', no caps."""
        ns = NamespaceQuota("default")
        return cls({"default": WorkspaceQuota("default", UNLIMITED, {"default": ns})})

    def levels(self, owner: Owner) -> tuple[Level, Level, Level]:
        """The user, namespace and workspace levels of ``owner`` (narrowest first).

        Raises InvalidRequest for an unknown workspace or namespace, naming the known ones.
        """
        ws = self.workspaces.get(owner.workspace)
        if ws is None:
            known = ", ".join(f"'{w}'" for w in sorted(self.workspaces)) or "none"
            raise InvalidRequest(
                f"Workspace '{owner.workspace}' is not configured for GPUs (known workspaces: "
                f"{known}). Ask an admin to add it or to map your account to one of these."
            )
        ns = ws.namespaces.get(owner.namespace)
        if ns is None:
            known = ", ".join(f"'{n}'" for n in sorted(ws.namespaces)) or "none"
            raise InvalidRequest(
                f"Namespace '{owner.namespace}' is not configured in workspace '{ws.name}' "
                f"(known namespaces: {known}). Ask an admin to add it or to map your account "
                "to one of these."
            )
        user_key, ns_key, ws_key = level_keys(owner)
        return (
            Level(user_key, ns.limits_for(owner.user)),
            Level(ns_key, ns.limits),
            Level(ws_key, ws.limits),
        )

    def limits_of(self, key: tuple[str, ...]) -> Limits:
        """Limits of a level key; unlimited where the tree does not know it."""
        ws = self.workspaces.get(key[0])
        if ws is None:
            return UNLIMITED
        if len(key) == 1:
            return ws.limits
        ns = ws.namespaces.get(key[1])
        if ns is None:
            return UNLIMITED
        return ns.limits if len(key) == 2 else ns.limits_for(key[2])


class Usage:
    """Totals of one level: all allocations, and the borrowed part of them."""

    __slots__ = ("memory_mib", "cores_percent", "gpus", "borrowed_memory_mib",
                 "borrowed_cores_percent", "borrowed_gpus", "allocations")

    def __init__(self) -> None:
        self.memory_mib = self.cores_percent = self.gpus = 0
        self.borrowed_memory_mib = self.borrowed_cores_percent = self.borrowed_gpus = 0
        self.allocations = 0

    def get(self, resource: str) -> int:
        return getattr(self, resource)

    def to_dict(self) -> dict[str, int]:
        return {s: getattr(self, s) for s in self.__slots__}


class QuotaLedger:
    """Usage per level, kept up to date as allocations come and go (O(1) per change).

    ``charge`` is what one allocation counts: (memory MiB, cores %, vGPUs), summed over its GPUs.
    """

    def __init__(self) -> None:
        self._usage: dict[tuple[str, ...], Usage] = {}
        self._members: dict[tuple[str, ...], set[str]] = {}

    def apply(
        self, alloc_id: str, owner: Owner, charge: tuple[int, int, int], borrowed: bool, sign: int
    ) -> None:
        mem, cores, gpus = charge
        for key in level_keys(owner):
            u = self._usage.get(key)
            if u is None:
                u = self._usage[key] = Usage()
                self._members[key] = set()
            u.memory_mib += sign * mem
            u.cores_percent += sign * cores
            u.gpus += sign * gpus
            u.allocations += sign
            if borrowed:
                u.borrowed_memory_mib += sign * mem
                u.borrowed_cores_percent += sign * cores
                u.borrowed_gpus += sign * gpus
            if sign > 0:
                self._members[key].add(alloc_id)
            else:
                self._members[key].discard(alloc_id)
                if u.allocations == 0:
                    del self._usage[key], self._members[key]

    def used(self, key: tuple[str, ...], resource: str) -> int:
        """All usage of a level, borrowed included."""
        u = self._usage.get(key)
        return u.get(resource) if u is not None else 0

    def own(self, key: tuple[str, ...], resource: str) -> int:
        """Usage of a level that counts against its quota: borrowed allocations run on idle
        capacity beyond the quota, so they do not."""
        u = self._usage.get(key)
        return u.get(resource) - u.get("borrowed_" + resource) if u is not None else 0

    def usage(self, key: tuple[str, ...]) -> Usage:
        return self._usage.get(key) or Usage()

    def members(self, key: tuple[str, ...]) -> frozenset[str] | set[str]:
        return self._members.get(key, frozenset())

    def keys(self) -> Iterator[tuple[str, ...]]:
        return iter(list(self._usage))

    def snapshot(self) -> Mapping[tuple[str, ...], Usage]:
        return MappingProxyType(self._usage)
