"""The two contracts a mode implements: a pool backend and a kernel launcher.

A *mode* (Kubernetes, one machine) is a :class:`PoolBackend` (where the GPUs are, where the
ledger of allocations lives) plus the :class:`KernelLauncher` that makes GPU kernels exist
in that mode. The pool names its launcher (``PoolBackend.launcher_class``), and the pool is
chosen by entry point (group ``elastic_gpu.pools``: ``kubernetes``, ``local``), as JupyterHub
chooses its proxy, so no caller ever tests a class or its name.

Callers see these ABCs only. Each method's docstring names who calls it.
"""

from __future__ import annotations

import enum
from abc import ABCMeta, abstractmethod
from collections.abc import Awaitable, Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from traitlets import Dict, List, Unicode
from traitlets.config import LoggingConfigurable

from libvgpu.checkpoint import CheckpointError
from quotas import Allocation, GPURequest, Pool

if TYPE_CHECKING:
    from .kernels import KernelRecord

#: entry point group of pool backends (pyproject.toml registers 'kubernetes' and 'local')
POOL_ENTRY_POINTS = "elastic_gpu.pools"


class ReleaseCause(str, enum.Enum):
    """Why a slice went back to the pool (the allocator's listeners and the logs read it)."""

    STOPPED = "stopped"  # its server or kernel stopped normally
    PREEMPTED = "preempted"  # taken for a higher-priority request
    HOLDER_GONE = "holder-gone"  # its process or pod disappeared
    FAILED = "failed"  # a spawn or launch failed before the holder ran
    CANCELLED = "cancelled"  # the request was cancelled while it was being granted
    CULLED = "culled"  # reclaimed by the culler
    SWAPPED = "swapped"  # its kernel's GPU state went to host memory, the kernel lives on; its resume is a new grant


#: called by a backend when the holder of an allocation is gone (pod deleted, process died)
GoneCallback = Callable[[str, str], Awaitable[None]]


class _ConfigurableABCMeta(ABCMeta, type(LoggingConfigurable)):  # type: ignore[misc]
    """Abstract methods + traitlets (as jupyter_client's KernelProvisionerBase does)."""


class LaunchError(Exception):
    """A kernel could not be created; ``message`` is a sentence for the user, ``status`` the HTTP status."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class ClaimConflict(Exception):
    """``PoolBackend.record`` could not take the claim: another hub holds the capacity (the
    cluster-wide ledger refused it). ``message`` says which card and why. The allocator takes
    the grant back; the request waits, or is refused if it may not wait."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Capability:
    """Whether a mode (or one card of it) can do one thing; ``why_not`` says why not, as a clause
    a sentence can end with ("the GPUs are simulated: ...")."""

    able: bool
    why_not: str = ""

    def __bool__(self) -> bool:
        return self.able

    def as_dict(self) -> dict[str, Any]:
        return {"able": self.able, **({"why_not": self.why_not} if not self.able else {})}


@dataclass(frozen=True)
class Capabilities:
    """What a mode can do with a holder's GPU state (``KernelLauncher.capabilities``)."""

    #: swap a kernel out keeping its state (GPU memory to host memory, the slice back to the pool)
    checkpoint: Capability
    #: restore a swapped-out kernel onto another card than its own (the queue may move it)
    move: Capability
    #: let a slice use more than its request while the card is free
    burst: Capability

    def as_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint.as_dict(), "move": self.move.as_dict(), "burst": self.burst.as_dict()}


#: a mode that declares nothing
NO_CAPABILITIES = Capabilities(
    checkpoint=Capability(False, "this mode cannot swap kernels out"),
    move=Capability(False, "this mode cannot move kernels"),
    burst=Capability(False, "slices of this mode cannot burst"),
)


class HostMemoryFull(CheckpointError):
    """A suspend refused because the host memory kept for swapped-out kernels is full: the
    kernel's ``needed_mib`` would not fit under ``cap_mib`` with ``held_mib`` held. The broker may
    make room by stopping swapped-out kernels of users over their share, then ask again."""

    def __init__(self, message: str, needed_mib: int, held_mib: int, cap_mib: int) -> None:
        super().__init__(message, 0, "suspend", 0)
        self.needed_mib, self.held_mib, self.cap_mib = needed_mib, held_mib, cap_mib


@dataclass(frozen=True)
class SuspendAsk:
    """What the broker asks of a suspend (``KernelLauncher.suspend``)."""

    #: milliseconds the driver may take to lock the kernel's CUDA processes
    lock_timeout_ms: int
    #: share of the machine's (node's) RAM all swapped-out kernels may hold in host memory
    host_memory_percent: float
    #: what swapped-out kernels on the kernel's machine hold in host memory now, MiB (as the hub knows it)
    swapped_here_mib: int = 0
    #: why it is swapped out (kept with the kernel), and the model of its card
    why: str = ""
    model: str = ""
    #: a move of the queue's, which may pause a running cell: the broker resumes such a kernel at
    #: once, elsewhere (a live move); every other suspend is refused in a cell
    live: bool = False


@dataclass
class ServerRef:
    """The user's server a kernel belongs to (its lifetime bounds the kernel's)."""

    user: str
    name: str = ""
    #: what identifies this run of the server: a pid (local), or pod uid + restart count (Kubernetes)
    identity: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    namespace: str = ""
    pod_labels: dict[str, str] = field(default_factory=dict)
    #: local: the unix account to run the kernel as ('' = the hub's own account)
    unix_user: str = ""
    home: str = ""
    #: Kubernetes: how the server's pod receives its slice (``objects.PodDelivery``), for its
    #: kernels' pods alike; None where the server's spawner says none
    delivery: Any = None
    #: Kubernetes: the server pod as read (its volumes, working directory), for the kernel pod to share
    pod: Any = None


class KernelLauncher(LoggingConfigurable, metaclass=_ConfigurableABCMeta):
    """Makes GPU kernels exist and reports on them. Implementations do the I/O.

    The broker (``hubext.broker.GPUBroker``) is the only caller: it decides *whether* a kernel
    may have a slice (through the allocator); a launcher only makes the kernel exist with the
    slice it was given, and answers what became of it.
    """

    kernel_cmd = List(
        Unicode(),
        config=True,
        help="""The kernel's command line; '{connection_file}' is replaced by the path of the
        connection file. Default: the Python of the launcher ('python' in pods) running
        ipykernel_launcher with the swap's resume hook (--ext=kernelprovider.resume locally,
        --ext=elastic_gpu_resume in pods: keep it in a command of your own; a pod without it
        is never swapped out, a local kernel without it waits for a resume through the API).""",
    )
    environment = Dict(
        Unicode(),
        config=True,
        help="Extra environment variables of GPU kernels (local processes or kernel containers). Default: none.",
    )

    def __init__(
        self,
        pool: PoolBackend | None = None,
        priority_value: Callable[[str | None], int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        #: the pool backend of this mode (the launcher writes what holders need through it)
        self.pool = pool
        self._priority_value = priority_value

    def priority_value(self, priority_class: str | None) -> int:
        """The numeric priority the shim enforces for an admission priority class (0 when unknown)."""
        return self._priority_value(priority_class) if self._priority_value is not None else 0

    @abstractmethod
    async def start(self) -> list[KernelRecord]:
        """Connect, and return the kernels that exist (the ledger), so a restarted hub keeps them.

        Called once by ``GPUBroker._start``."""

    @abstractmethod
    async def server_ref(self, spawner: Any) -> ServerRef:
        """Describe the user's running server (``spawner``) that will own a kernel.

        Called by ``GPUBroker.create`` and ``GPUBroker.restart``."""

    @abstractmethod
    async def server_alive(self, record: KernelRecord, spawner: Any | None) -> bool:
        """Whether the server instance that owns ``record`` still exists (None: no spawner).

        Called by ``GPUBroker.reconcile``."""

    @abstractmethod
    async def launch(self, record: KernelRecord, allocation: Allocation, key: str, server: ServerRef) -> None:
        """Create the kernel; fill ``record`` (ip, ports, holder, state). Leaves nothing behind on error.

        Called by ``GPUBroker.create`` after admission granted ``allocation``."""

    @abstractmethod
    async def restart(self, record: KernelRecord, allocation: Allocation, server: ServerRef | None) -> None:
        """Start a new kernel process in the same allocation (new ports), then stop the old one.

        Called by ``GPUBroker.restart``."""

    @abstractmethod
    async def refresh(self, record: KernelRecord) -> None:
        """Update ``record.state``/``reason``/``ip`` from what really runs.

        Called by ``GPUBroker.status`` and ``GPUBroker.reconcile``."""

    @abstractmethod
    async def delete(self, record: KernelRecord) -> None:
        """Stop the kernel and remove everything made for it. Idempotent.

        Called by ``GPUBroker.delete``, on a failed launch, and when the kernel's slice is preempted."""

    async def interrupt(self, record: KernelRecord) -> bool:
        """Interrupt by signal where possible; False when this launcher cannot (use the control channel).

        Called by ``GPUBroker.interrupt``."""
        return False

    @abstractmethod
    async def sweep(self, known: Container[str]) -> list[str]:
        """Delete kernels (processes, pods and their objects) whose id is not in ``known``; return their ids.

        ``known`` is live (the broker's own keys): ask it about each kernel when deciding, after any
        listing, never copy it before one. Called by ``GPUBroker.reconcile``."""

    def capabilities(self) -> Capabilities:
        """What this mode can do with a holder's GPU state, each with the reason where it cannot
        (known before anything is promised: the culler's warnings and the pages read it). May probe
        the driver once (the answer is kept). Default: nothing.

        Called by ``GPUBroker`` (at start, in kernel models, before a suspend and for the queue's moves)."""
        return NO_CAPABILITIES

    def node_checkpoint_capability(self, node: str) -> Capability:
        """Whether kernels on ``node`` can be swapped out, and why not (the pool API shows it per
        node). Default: the mode's ``capabilities().checkpoint``. Called by ``GPUBroker``."""
        return self.capabilities().checkpoint

    def checkpoint_capability(self, record: KernelRecord) -> Capability:
        """Whether *this* kernel's GPU state can be swapped out (its card, its node, how it was
        started), and why not. Default: the mode's ``capabilities().checkpoint``.

        Called by ``GPUBroker`` for each kernel model and before its suspend."""
        return self.capabilities().checkpoint

    async def suspend(self, record: KernelRecord, ask: SuspendAsk) -> tuple[list[int], int]:
        """Checkpoint the kernel's CUDA processes (all or none): (their pids, MiB moved to host
        memory), unless that brings what is swapped out on the kernel's machine over the cap of
        ``ask``. Raises ``libvgpu.checkpoint.CheckpointError`` (``stuck``: it could not be undone).
        Default: refused with ``checkpoint_capability``'s reason.

        Called by ``GPUBroker.suspend``."""
        why_not = self.checkpoint_capability(record).why_not or "this mode cannot swap kernels out"
        raise CheckpointError(why_not, 0, "suspend", 0)

    async def resume(self, record: KernelRecord, allocation: Allocation, remap: dict[str, str]) -> None:
        """Restore the swapped-out kernel's processes onto ``allocation`` (``remap``: old GPU uuid ->
        new) and unlock them; raises ``CheckpointError``. Default: refused (nothing is ever suspended).

        Called by ``GPUBroker.resume``."""
        raise CheckpointError("this mode cannot restore kernels", 0, "resume", 0, True)

    def restorable_on(self, record: KernelRecord, allocation: Allocation) -> str:
        """Why the swapped-out kernel cannot be restored onto ``allocation`` ("" when it can): the
        resume gives the slice back and the kernel stays swapped out. Called by ``GPUBroker.resume``."""
        return ""

    def resume_pins(self, record: KernelRecord) -> tuple[str, ...]:
        """The cards (uuids) a swapped-out kernel can only be restored onto; empty: any card of its
        model that the driver can restore onto. Called by ``GPUBroker.resume``."""
        return ()

    def resume_remap(self, record: KernelRecord) -> Capability:
        """Whether a kernel with ``resume_pins`` may also be restored onto the other cards of its
        node of the same model (the driver's device map). Called by ``GPUBroker.resume``.
        Default: no."""
        return Capability(False, "this mode restores a kernel only onto the cards it names")

    def mark_swapped(self, record: KernelRecord, swapped: bool) -> None:
        """Tell the kernel whether its GPU state is in host memory (its next cell asks for a
        resume first). Called by ``GPUBroker.suspend`` and ``GPUBroker.resume``."""

    def in_cell(self, record: KernelRecord) -> bool:
        """Whether the kernel is running a cell now, as its resume hook says. A cell already running
        when its kernel is swapped out does not ask for its GPU back, so its next GPU call waits
        on the locked driver: such a kernel is swapped out only by a move (``SuspendAsk.live``),
        which the broker follows with its resume at once (the queue moves one only where no place
        needs fewer: ``GPUBroker.cells_running``); every other suspend of it is refused. Default:
        False (the mode cannot tell; it does not move kernels)."""
        return False

    def tell_moved(self, record: KernelRecord, sentence: str) -> None:
        """Leave the kernel the sentence its paused cell prints when it ends (a live move:
        kernelprovider/resume.py). Called by ``GPUBroker.resume``. Default: nothing (the mode
        does not move kernels)."""

    def resumed(self, record: KernelRecord, previous_allocation_id: str, allocation: Allocation) -> None:
        """A swapped-out kernel got ``allocation``: what its processes were started with for
        ``previous_allocation_id`` becomes the new allocation's. Called by ``GPUBroker.resume``
        after ``resume`` succeeded."""

    def node_resources(self, size: str = "") -> tuple[int, int]:
        """What one kernel of ``size`` asks of its node: (CPU millicores, host memory MiB), so admission
        places it where they fit. Called by ``GPUBroker`` for every kernel request. Default: (0, 0)."""
        return 0, 0

    async def stop(self) -> None:
        """Release connections. Called by ``GPUBroker.stop``."""

    def persist(self, records: Iterable[KernelRecord]) -> None:
        """Save the kernel ledger where the mode keeps one (local); no-op where the pods are the ledger.

        Called by the broker after every change of a kernel record."""


class PoolBackend(LoggingConfigurable, metaclass=_ConfigurableABCMeta):
    """Inventory + ledger of one mode. Implementations do the I/O; admission stays in ``quotas``.

    The allocator (``hubext.allocator.GPUAllocator``) is the only caller of the ledger methods.
    """

    #: the mode's name ('kubernetes', 'local'): spawners check that they run with their mode's pool
    mode: ClassVar[str] = ""
    #: the kernel launcher of this mode (the broker's default ``launcher_class``)
    launcher_class: ClassVar[type[KernelLauncher]]

    #: True when the inventory is simulated (no real GPU); pages and the spawn form say so.
    simulated: bool = False

    #: set by the allocator before ``start``: a backend calls it when the capacity this hub may use
    #: changed without a node coming or going (another hub took or released cards)
    capacity_changed: Callable[[], Awaitable[None]] | None = None

    @abstractmethod
    async def start(self, on_gone: GoneCallback) -> None:
        """Connect, and begin noticing holders that disappear (``on_gone(allocation_id, why)``).

        Called once by ``GPUAllocator._start`` (retried with backoff when it fails)."""

    @abstractmethod
    async def inventory(self) -> Pool:
        """The GPUs that can be allocated now. Called by ``GPUAllocator`` at start and on refresh."""

    def out_of_service(self) -> Mapping[str, str]:
        """Cards that take no new slice, and why (gpu uuid -> sentence): on Kubernetes, a card
        whose node agent saw a fatal Xid (libvgpu/health.py). Called by the pool view."""
        return {}

    def explain_wait(self, request: GPURequest, pool: Pool, reason: str) -> str:
        """The wait sentence of ``request`` (``reason``, admission's) with the cards out of service
        that could have held it named. Called by the allocator for each request that waits."""
        return reason

    async def claimed_inventory(self) -> Pool | None:
        """The inventory as last read, with what other claimants hold now: cheap (no listing of
        nodes), for the allocator to decide again after a :class:`ClaimConflict`. None where
        the mode shares no cards (the allocator then reads ``inventory()``)."""
        return None

    @abstractmethod
    async def allocations(self) -> list[Allocation]:
        """The ledger: allocations whose holder still exists. Called once by ``GPUAllocator._start``."""

    @abstractmethod
    async def record(self, allocation: Allocation) -> None:
        """Persist a newly granted allocation (before its holder exists). Called by ``GPUAllocator``.

        Raises :class:`ClaimConflict` (and records nothing) when a ledger shared with other
        hubs refuses it."""

    @abstractmethod
    async def bind(self, allocation_id: str, holder: str) -> None:
        """Tie an allocation to its holder (a pod name, a process id).

        Called by ``GPUAllocator.bind`` (spawners after start, the broker after a launch)."""

    @abstractmethod
    async def forget(self, allocation_id: str, cause: ReleaseCause = ReleaseCause.STOPPED) -> None:
        """Drop an allocation from the ledger (its holder has stopped). Called by ``GPUAllocator``.

        ``cause`` SWAPPED: the holder lives on without the GPU (its kernel was suspended); what
        it was started with (its limits file, its region) stays for its resume."""

    @abstractmethod
    async def evict(self, allocation: Allocation, reason: str) -> None:
        """Stop the holder of ``allocation`` because it is preempted; record ``reason`` where admins look.

        Called by ``GPUAllocator`` when a decision names victims."""

    def server_running(self, pid: int, user: str) -> None:
        """A user's server runs as process ``pid`` (GPU or not): the account it runs as is one the
        hub answers for. Called by the local spawner after start and on every poll; the local pool
        then stops GPU processes of that account that belong to no slice. A no-op elsewhere."""

    async def stop(self) -> None:
        """Release connections and watches. Called when the hub shuts down."""

    def events(self, limit: int = 20) -> list[dict[str, Any]]:
        """Events the pool keeps itself (the local ledger's preemptions and backstop stops, across
        restarts), newest first; the admin page adds the slice events this hub heard. [] where
        the mode keeps none."""
        return []

    def held_elsewhere(self) -> list[dict[str, Any]]:
        """Slices other hubs hold on this pool's cards ({hub, node, gpu_uuids, memory_mib,
        cores_percent, whole, allocation_id}); [] where the mode shares no cards (the admin page)."""
        return []

    def activity(self) -> dict[str, dict[str, int]]:
        """Per GPU uuid: utilization_percent and memory_used_mib where the hub can read them ({} else)."""
        return {}

    def slice_activity(self, allocation_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Per allocation id, the GPU activity record of a running slice: ``{last_launch: unix s
        or None, memory_used_mib[, launches]}`` (``libvgpu.contract.gpu_activity``'s form). A
        slice with no record yet (no process of it initialised CUDA; a simulated pool without
        the shim) is left out, so it is never counted idle on no evidence. An elastic slice's
        entry also has ``burst_gpu_seconds``, the running total of card-seconds above its request
        that the mode measured from the driver (``libvgpu.burst``; never from the slice's own
        files), alone when its record is unread.

        Called by the usage meter's sampler (``UsageMeter.sample``). Default: {} (the mode sees
        no activity of its slices)."""
        return {}

    def pending_reclaims(self) -> list[Any]:
        """Slices waiting for memory within their request that other slices' bursts hold:
        ``libvgpu.elastic.Reclaim`` records (owner and burster as allocation ids), as the shims
        on the cards report them. Their word only: the caller checks each against the ledger.

        Called by the broker's reclaim loop (``GPUBroker.reclaim_bursts``, every
        ``reclaim_interval_seconds``). Default: [] (the mode cannot see them)."""
        return []
