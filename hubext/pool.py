"""The pool backend contract: where the GPUs are and where the ledger of allocations lives.

Callers (the allocator) see only :class:`PoolBackend`. Two implementations:
``hubext.kube_pool.KubernetesPool`` (GPU nodes and labelled pods) and
``hubext.local_pool.LocalPool`` (NVML or a simulated inventory, SQLite ledger).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Awaitable, Callable

from traitlets.config import LoggingConfigurable

from quotas import Allocation, Pool

#: called by a backend when the holder of an allocation is gone (pod deleted, process died)
GoneCallback = Callable[[str, str], Awaitable[None]]


class _PoolBackendMeta(ABCMeta, type(LoggingConfigurable)):  # type: ignore[misc]
    """Abstract methods + traitlets (as jupyter_client's KernelProvisionerBase does)."""


class PoolBackend(LoggingConfigurable, metaclass=_PoolBackendMeta):
    """Inventory + ledger. Implementations do the I/O; admission stays in ``quotas``."""

    #: True when the inventory is simulated (no real GPU); pages and the spawn form say so.
    simulated: bool = False

    @abstractmethod
    async def start(self, on_gone: GoneCallback) -> None:
        """Connect, and begin noticing holders that disappear (``on_gone(allocation_id, why)``)."""

    @abstractmethod
    async def inventory(self) -> Pool:
        """The GPUs that can be allocated now."""

    @abstractmethod
    async def allocations(self) -> list[Allocation]:
        """The ledger: allocations whose holder still exists. Called once at start-up."""

    @abstractmethod
    async def record(self, allocation: Allocation) -> None:
        """Persist a newly granted allocation (before its holder exists)."""

    @abstractmethod
    async def bind(self, allocation_id: str, holder: str) -> None:
        """Tie an allocation to its holder (a pod name, a process id)."""

    @abstractmethod
    async def forget(self, allocation_id: str) -> None:
        """Drop an allocation from the ledger (its holder has stopped)."""

    @abstractmethod
    async def evict(self, allocation: Allocation, reason: str) -> None:
        """Stop the holder of ``allocation`` because it is preempted; record ``reason`` where admins look."""

    async def stop(self) -> None:
        """Release connections and watches."""
