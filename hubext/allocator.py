"""The one allocator of a hub process: admission + fair queue + ledger.

Spawners and the broker are its only callers, so notebooks and kernels share one ledger and
one set of quotas. Decisions come from ``quotas.AdmissionState`` (pure); this module adds the
waiting, the order, the clock and the I/O through a :class:`~hubext.backends.PoolBackend`.
Every decision is taken here, under one lock, in queue order: a caller that may not wait
(``allocate(queue=False)``) is decided in the same pass as everyone else.

Queue order is priority (higher first), then arrival (``quotas.queue.AdmissionQueue``, pure).
It is best-effort FIFO, as Kueue's default: a later request that fits is granted even while an
earlier, bigger one waits, so one large request cannot block a card for everyone; the earlier
one keeps its place. So that small requests cannot pass a large one for ever, the head of a
priority class that waited ``queue.reserve_after_seconds`` gets capacity reserved, nobody of
its class or lower is granted where it could go, and movable kernels' slices are swapped out
to make room for it (``queue.moves``; carried out by the :class:`~hubext.moves.SliceMover`,
the GPU broker: see hubext/moves.py).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jupyterhub.traitlets import EntryPointType
from jupyterhub.utils import exponential_backoff
from traitlets import Dict, Float, Instance, Integer, Unicode, default
from traitlets.config import SingletonConfigurable

from quotas import (
    AdmissionConfig,
    AdmissionError,
    AdmissionState,
    Allocation,
    ConfigError,
    GPURequest,
    PoolFull,
    SoftReservation,
    load_config,
)
from quotas.messages import mib
from quotas.moving import MOVE_RETRY_SECONDS
from quotas.queue import AdmissionQueue, Waiting, propose_moves

from .backends import POOL_ENTRY_POINTS, ClaimConflict, PoolBackend, ReleaseCause
from .events import RecentSliceEvents, SliceEvent, SliceEventKind, SliceEvents
from .moves import SliceMover, carry_out

#: progress callback: (message, position in queue or None)
ProgressCallback = Callable[[str, "int | None"], None]


@dataclass(eq=False)
class Waiter:
    """A request held in the queue."""

    request: GPURequest
    priority_value: int
    seq: int
    future: asyncio.Future
    progress: ProgressCallback | None = None
    reason: str = ""
    #: the admission error of the last decision that did not grant (what a caller that may not wait gets)
    error: AdmissionError | None = None
    #: the server the request is for ('' = the default server), shown in the queue
    server_name: str = ""
    position: int | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    #: its place in the admission queue (order, and capacity reserved once it is overdue)
    entry: Waiting | None = None


class GPUAllocator(SingletonConfigurable):
    """Admission, queue and ledger for every GPU slice the hub hands out."""

    admission_config_file = Unicode(
        "",
        config=True,
        help="""Path of the admission config (YAML: priority_classes, placement, workspaces).
        The Helm chart mounts it from a ConfigMap; `elastic-gpu init` writes one.
        Empty: use `admission_config`.""",
    )
    admission_config = Dict(
        config=True,
        help="Admission config as a dict (same format as the YAML file). Used when no file is set.",
    )
    pool_backend_class = EntryPointType(
        default_value="hubext.kubernetes.pool.KubernetesPool",
        klass=PoolBackend,
        entry_point_group=POOL_ENTRY_POINTS,
        config=True,
        help="""The mode's pool backend, by entry point name: 'kubernetes' (GPU nodes and
        labelled pods) or 'local' (this machine, SQLite ledger), or an import string of a
        PoolBackend subclass. Default: 'kubernetes'.""",
    )
    start_timeout_seconds = Float(
        60.0,
        config=True,
        help="""Seconds to keep retrying the pool backend's start (with exponential backoff)
        before a request fails with the reason; the next request tries again. Default: 60.""",
    )
    move_proposal_max_slices = Integer(
        8,
        config=True,
        help="""For a request that holds a reservation (it waited queue.reserve_after_seconds),
        the queue page proposes the fewest slices (at most this many) an admin could move to
        other cards so that it starts now; nothing is moved. 0: propose nothing. Default: 8.""",
    )
    max_wait_seconds = Float(
        240.0,
        config=True,
        help="""Seconds a request may wait in the queue before it gives up with the reason it
        waited for. Keep it below the spawner's start_timeout (JupyterHub deletes a spawn that
        outlives start_timeout). Default: 240.""",
    )

    backend = Instance(PoolBackend, allow_none=True)
    config_data = Instance(AdmissionConfig, allow_none=True)

    @default("backend")
    def _default_backend(self) -> PoolBackend:
        return self.pool_backend_class(parent=self, log=self.log)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state: AdmissionState | None = None
        self._resume_room: dict[str, SoftReservation] = {}
        self._queue: AdmissionQueue | None = None
        self._waiters: list[Waiter] = []
        self._seq = itertools.count()
        self._lock = asyncio.Lock()
        self._started: asyncio.Future | None = None
        #: what happens to slices: grants and releases (here), resumes of swapped kernels (the broker)
        self.slice_events = SliceEvents(self.log)
        #: the last notable slice events, for the admin page (both modes)
        self.recent_events = RecentSliceEvents()
        self.slice_events.subscribe(self.recent_events)
        #: allocation id -> (why, cause): holders being stopped on purpose (expect_stop)
        self._stopping: dict[str, tuple[str, ReleaseCause]] = {}
        #: allocation id -> why its old holder went ('' while none was reported): holders being replaced
        self._handovers: dict[str, str] = {}
        #: swaps slices out for the queue's moves (the GPU broker sets itself); None: nothing moves
        self.mover: SliceMover | None = None
        self._moving: set[asyncio.Task] = set()
        self._wake: asyncio.TimerHandle | None = None

    # ---- start-up -------------------------------------------------------------------------

    def load_admission_config(self) -> AdmissionConfig:
        """Read and validate the admission config; raise ConfigError naming the bad key."""
        if self.admission_config_file:
            path = Path(self.admission_config_file)
            try:
                data = yaml.safe_load(path.read_text()) or {}
            except OSError as e:
                raise ConfigError(f"cannot read admission config {path}: {e.strerror}") from None
            except yaml.YAMLError as e:
                raise ConfigError(f"admission config {path} is not valid YAML: {e}") from None
            return load_config(data)
        return load_config(self.admission_config or {})

    async def ensure_started(self) -> None:
        """Load config, inventory and ledger once per process (concurrent callers wait).

        A failed start is not remembered: the next caller tries again (a transient failure at
        hub start must not break every later spawn and kernel)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        try:
            await asyncio.shield(self._started)
        except Exception:
            self._started = None
            raise

    async def _start(self) -> None:
        self.config_data = self.load_admission_config()
        last_error: list[Exception] = []

        self.backend.capacity_changed = self._capacity_changed

        async def backend_started() -> bool:
            try:
                await self.backend.start(self._holder_gone)
            except ConfigError:
                raise  # an admin's mistake: retrying does not help
            except Exception as e:
                if not last_error:
                    self.log.warning("GPU pool did not start (%s); retrying", e)
                last_error[:] = [e]
                return False
            return True

        try:
            await exponential_backoff(
                backend_started,
                "GPU pool did not start",
                start_wait=0.2,
                max_wait=5,
                timeout=self.start_timeout_seconds,
            )
        except asyncio.TimeoutError:
            raise last_error[0] if last_error else RuntimeError("the GPU pool did not start") from None
        pool = await self.backend.inventory()
        ledger = await self.backend.allocations()
        self.state = AdmissionState(self.config_data, pool)
        policy = self.config_data.policy
        self._queue = AdmissionQueue.from_policy(policy)
        for allocation in ledger:
            self.state.add(allocation)
        self.reserve_for_resumes(self._resume_room)
        self.log.info(
            "GPU allocator ready: %d GPUs on %d nodes%s, %d allocations from the ledger",
            sum(len(n.gpus) for n in pool.nodes),
            len(pool.nodes),
            " (simulated)" if self.backend.simulated else "",
            len(ledger),
        )

    def reserve_for_resumes(self, room: Mapping[str, SoftReservation]) -> None:
        """Keep ``room`` (by kernel id: what each swapped-out kernel needs on its cards to come
        back) soft in placement: a new slice takes it only where nothing else fits
        (``quotas/reserve.py``). The broker calls it whenever its records change."""
        self._resume_room = dict(room)
        if self.state is not None:
            self.state.index.soft.replace(self.state.index, self._resume_room)

    async def refresh_inventory(self) -> None:
        """Re-read the inventory (nodes added or removed) and retry waiting requests."""
        await self.ensure_started()
        async with self._lock:
            self.state.set_pool(await self.backend.inventory())
        await self._pump()

    # ---- the public calls -----------------------------------------------------------------

    def priority_value(self, priority_class: str | None) -> int:
        name = priority_class or self.config_data.default_priority_class
        pc = self.config_data.priority_classes.get(name)
        return pc.value if pc else 0

    async def allocate(
        self,
        request: GPURequest,
        progress: ProgressCallback | None = None,
        timeout: float | None = None,
        queue: bool = True,
        server_name: str = "",
        moved: bool = False,
    ) -> Allocation:
        """Grant ``request`` now, or after waiting in the queue; raise AdmissionError otherwise.

        With ``queue=False`` the request is decided once, in the same pass as the queue, and a
        request that does not fit now is refused with the admission sentence alone. ``moved``: a
        kernel the queue moved for another request, asking back: never held behind an overdue one.
        Nothing is left allocated when this raises (a timed-out or cancelled waiter leaves the queue).
        """
        await self.ensure_started()
        self.state.validate(request)
        timeout = self.max_wait_seconds if timeout is None else timeout
        loop = asyncio.get_running_loop()
        waiter = Waiter(
            request=request,
            priority_value=self.priority_value(request.priority_class),
            seq=next(self._seq),
            future=loop.create_future(),
            progress=progress,
            server_name=server_name,
        )
        async with self._lock:
            self._waiters.append(waiter)
            waiter.entry = self._queue.push(request, waiter.priority_value, time.time(), moved=moved)
            waiter.entry.extra["waiter"] = waiter
        await self._pump()  # decides this request in queue order, with everyone else's
        if not queue:
            async with self._lock:
                if not waiter.future.done():
                    self._drop(waiter)
                    raise waiter.error or PoolFull(waiter.reason)
            return waiter.future.result()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except asyncio.TimeoutError:
            async with self._lock:
                if waiter.future.done():  # granted in the last instant: keep it
                    return waiter.future.result()
                self._drop(waiter)
            waited = int(time.monotonic() - waiter.enqueued_at)
            raise PoolFull(
                f"{waiter.reason} Waited {waited} s in the GPU queue; try again later."
            ) from None
        except asyncio.CancelledError:
            async with self._lock:
                if waiter in self._waiters:
                    self._drop(waiter)
                elif waiter.future.done() and not waiter.future.cancelled():
                    await self._forget(waiter.future.result().id, "request cancelled", ReleaseCause.CANCELLED)
            raise

    async def bind(self, allocation_id: str, holder: str) -> None:
        """Tie a granted allocation to the pod or process that holds it."""
        await self.backend.bind(allocation_id, holder)

    async def release(
        self, allocation_id: str, why: str = "stopped", cause: ReleaseCause = ReleaseCause.STOPPED
    ) -> Allocation | None:
        """Return an allocation's slice to the pool and wake the queue. Idempotent."""
        self._stopping.pop(allocation_id, None)
        await self.ensure_started()
        async with self._lock:
            allocation = await self._forget(allocation_id, why, cause)
        if allocation is not None:
            await self._pump()
        return allocation

    async def cancel(self, request_id: str, by: str = "an admin") -> bool:
        """Take a waiting request out of the queue; its caller is refused, with the reason it
        waited for. False when no request of that id is waiting (granted, refused or unknown)."""
        async with self._lock:
            waiter = next((w for w in self._waiters if w.request.request_id == request_id), None)
            if waiter is None or waiter.future.done():
                return False
            self._drop(waiter)
            # why it waited (the reason's first sentence), not the reason's advice: the request is gone
            cause = re.split(r"(?<=[.!?])\s+(?=[A-Z])", waiter.reason.strip(), maxsplit=1)[0] if waiter.reason else ""
            why = f" It waited because: {cause}" if cause else ""
            waiter.future.set_exception(
                AdmissionError(f"The GPU request was cancelled by {by} while it waited in the queue.{why}", 409)
            )
            self.log.info("GPU request %s of %s cancelled by %s", request_id, waiter.request.owner.user, by)
        await self._pump()  # the requests behind it move up
        return True

    def get(self, allocation_id: str) -> Allocation | None:
        return self.state.allocations.get(allocation_id) if self.state else None

    def queue(self) -> list[dict[str, Any]]:
        """Waiting requests in queue order, for status pages."""
        return [
            {
                "request_id": w.request.request_id,
                "user": w.request.owner.user,
                "workspace": w.request.owner.workspace,
                "server_name": w.server_name,
                "kind": w.request.kind,
                "priority_class": w.request.priority_class,
                "memory_mib": w.request.memory_mib,
                "cores_percent": w.request.cores_percent,
                "count": w.request.count,
                "whole": w.request.whole,
                "position": w.position,
                "reason": w.reason,
                "waiting_seconds": round(time.monotonic() - w.enqueued_at, 1),
                # the node capacity is held on for it (it waited past queue.reserve_after_seconds)
                "reserved_node": w.entry.reservation.node if w.entry and w.entry.reservation else None,
                "move_proposal": self._move_proposal(w),
            }
            for w in self._ordered()
        ]

    def _move_proposal(self, w: Waiter) -> list[dict[str, Any]]:
        """What an admin could move so that an overdue (reserved-for) request starts now."""
        if self.state is None or not w.entry or not w.entry.reservation or self.move_proposal_max_slices < 1:
            return []
        p = propose_moves(self.state, w.request, time.time(), self.move_proposal_max_slices)
        return [
            {"allocation_id": mv.allocation.id, "user": mv.allocation.owner.user, "kind": mv.allocation.kind,
             "memory_mib": mv.allocation.memory_mib, "from_gpu": mv.allocation.gpu_uuids[0],
             "to_node": mv.to.node, "to_gpu": mv.to.gpu_uuids[0]}
            for mv in (p.moves if p else ())
        ]

    # ---- internals ------------------------------------------------------------------------

    def _ordered(self) -> list[Waiter]:
        return sorted(self._waiters, key=lambda w: (-w.priority_value, w.seq))

    def _drop(self, waiter: Waiter) -> None:
        """Take a waiter out of line (granted, refused, timed out or cancelled)."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if waiter.entry is not None and self._queue is not None:
            self._queue.discard(waiter.entry)

    async def _forget(self, allocation_id: str, why: str, cause: ReleaseCause) -> Allocation | None:
        allocation = self.state.remove(allocation_id)
        if allocation is None:
            return None
        await self._released(allocation, why, cause)
        return allocation

    async def _released(self, allocation: Allocation, why: str, cause: ReleaseCause) -> None:
        """The I/O of a release the state already recorded: the backend, the log, the subscribers."""
        allocation_id = allocation.id
        await self.backend.forget(allocation_id, cause)
        self.log.info("GPU released: %s (%s, %s) %s", allocation_id, allocation.owner.user, allocation.kind, why)
        self.slice_events.publish(SliceEvent(SliceEventKind.RELEASED, allocation.id, allocation, why, cause))

    async def _capacity_changed(self) -> None:
        """Another claimant took or gave back capacity: decide the waiters again on what is left
        (the pool's claimed inventory: no listing of nodes or pods; the full one if it has none)."""
        if self.state is None:
            return
        pool = await self.backend.claimed_inventory()
        if pool is None:
            await self.refresh_inventory()
            return
        async with self._lock:
            self.state.set_pool(pool)
        await self._pump()

    def expect_stop(self, allocation_id: str, why: str, cause: ReleaseCause = ReleaseCause.STOPPED) -> None:
        """The holder of ``allocation_id`` is being stopped on purpose (called by the spawner's
        stop before it deletes the pod or process, and by the broker when a kernel's server asks
        it to shut down or the culler culls it): if the pool reports the holder gone before the
        stop releases the slice, the release is still that stop (the usage record says so)."""
        self._stopping[allocation_id] = (why, cause)

    @asynccontextmanager
    async def handover(self, allocation_id: str) -> AsyncIterator[None]:
        """The holder of ``allocation_id`` is being replaced by a new one (called by
        ``GPUBroker.restart`` around the launcher's restart and the bind of the new holder).

        jupyter_client asks the old kernel to shut down before it asks for the restart, so the old
        process (or pod) may end before the new one exists or is bound. Until the handover ends, the
        pool's report that the holder is gone is about the old holder and keeps the slice for the
        new one. If the handover fails after such a report, the slice is released then."""
        self._handovers[allocation_id] = ""
        try:
            yield
        except BaseException:
            why = self._handovers.pop(allocation_id, "")
            if why:
                await self.release(allocation_id, why, ReleaseCause.HOLDER_GONE)
            raise
        self._handovers.pop(allocation_id, None)

    async def _holder_gone(self, allocation_id: str, why: str) -> None:
        if allocation_id in self._handovers:  # the old holder of a restart: the new one takes over
            self._handovers[allocation_id] = why
            self.log.info("GPU slice %s: %s; kept for the holder replacing it", allocation_id, why)
            return
        stopping = self._stopping.get(allocation_id)
        if stopping is not None:  # the pod or process went because it was stopped on purpose
            await self.release(allocation_id, *stopping)
        else:
            await self.release(allocation_id, why, ReleaseCause.HOLDER_GONE)

    async def _pump(self) -> None:
        """Grant what fits, in queue order (``quotas.queue``: capacity is reserved for the head of
        a priority class once it waited ``queue.reserve_after_seconds``); tell the others where
        they stand.

        A grant the pool's shared ledger refuses (``ClaimConflict``: another hub claimed the
        capacity first) is taken back and its request stays in line; the pool is then re-read
        in the same hold of the lock (so no other pass decides on the view just refused) and the
        queue decided again, as long as re-reading changed what this hub may use."""
        for _ in range(5):
            if not await self._pump_once():
                return

    def _wake_when_overdue(self) -> None:
        """Pass over the queue again when the next waiting request reaches
        ``queue.reserve_after_seconds`` (it may then hold capacity and have slices moved for it),
        and every ``MOVE_RETRY_SECONDS`` while an overdue one waits where slices can move (a kernel
        becomes movable when its cell ends, which no request or release tells), even if no
        request or release comes by then. Called at the end of each pass."""
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        bound, now = self._queue.reserve_after_seconds, time.time()
        due = [w.entry.enqueued_at + bound for w in self._waiters
               if bound is not None and w.entry and w.entry.reservation is None and w.entry.enqueued_at + bound > now]
        if any(w.entry and w.entry.reservation is not None for w in self._waiters) and (
            self.mover is not None and self.mover.can_move()
        ):
            due.append(now + MOVE_RETRY_SECONDS)
        if due:
            delay = min(due) - now + 0.05
            self._wake = asyncio.get_running_loop().call_later(delay, lambda: asyncio.ensure_future(self._pump()))

    def move_failed(self, entry: Waiting, allocation_id: str) -> None:
        """A move the queue decided could not be carried out (its holder keeps the slice)."""
        if self._queue is not None:
            self._queue.move_failed(entry, allocation_id)

    async def _pump_once(self) -> bool:
        """One pass over the queue; True when a grant was refused by the pool's shared ledger and
        the pool, re-read, changed (then the queue is decided again)."""
        conflicted = False
        async with self._lock:
            for waiter in list(self._waiters):
                if waiter.future.done():
                    self._drop(waiter)
            possible = self.mover is not None and self.mover.can_move()
            sessions = self.mover.movable_sessions() if possible else {}
            cells = self.mover.cells_running(sessions) if possible else set()  # moved live: others first
            # decides everyone in order; grants are already recorded in the state (victims gone)
            steps = self._queue.pump(self.state, time.time(), lambda a: sessions.get(a.id), possible,
                                     lambda a: a.id in cells)
            for step in steps:
                if step.moves:  # swapped out outside the lock: each swap-out releases through it
                    task = asyncio.ensure_future(carry_out(self, step.waiting, step.moves))
                    self._moving.add(task)
                    task.add_done_callback(self._moving.discard)
                waiter, decision = step.waiting.extra["waiter"], step.decision
                if decision.granted and conflicted and not decision.victims:
                    # decided on the view the ledger just refused: decided again on the re-read pool
                    self.state.remove(decision.allocation.id)
                    self._queue.requeue(step.waiting)
                    continue
                if decision.granted:
                    for victim in decision.victims:
                        reason = (
                            f"preempted by a {waiter.request.priority_class or 'default'}-priority "
                            f"request of {waiter.request.owner.user}"
                        )
                        self.log.warning("GPU preemption: %s (%s) %s", victim.id, victim.owner.user, reason)
                        await self.backend.evict(victim, reason)
                        await self._released(victim, reason, ReleaseCause.PREEMPTED)
                    allocation = decision.allocation
                    try:
                        await self.backend.record(allocation)
                    except ClaimConflict as e:
                        # another hub holds it: take the grant back; the request keeps its place
                        self.state.remove(allocation.id)
                        self._queue.requeue(step.waiting)
                        self.log.info("GPU grant %s to %s taken back: %s", allocation.id,
                                      allocation.owner.user, e.message)
                        conflicted = True
                        waiter.reason = f"The GPU chosen for this request could not be claimed: {e.message}"
                        waiter.error = PoolFull(waiter.reason)
                        continue
                    self._drop(waiter)
                    self.log.info(
                        "GPU granted: %s to %s on %s %s (%s, %d %% each)%s",
                        allocation.id,
                        allocation.owner.user,
                        allocation.node,
                        ",".join(allocation.gpu_uuids),
                        mib(allocation.memory_mib),
                        allocation.cores_percent,
                        " borrowed" if allocation.borrowed else "",
                    )
                    self.slice_events.publish(SliceEvent(SliceEventKind.GRANTED, allocation.id, allocation))
                    waiter.future.set_result(allocation)
                    continue
                if decision.kind == "reject" or getattr(decision.error, "own_only", False):
                    # refused, or blocked only by the requester's own slices: waiting cannot help
                    self._drop(waiter)
                    waiter.future.set_exception(decision.error or AdmissionError(decision.reason))
                    continue
                waiter.error, reason = decision.error, decision.reason
                if isinstance(decision.error, PoolFull):  # a card out of service holds it up: say which
                    reason = self.backend.explain_wait(waiter.request, self.state.pool, reason)
                    if reason != decision.reason:
                        waiter.error = PoolFull(reason)
                ahead = step.waiting.position
                if waiter.position != ahead or waiter.reason != reason:
                    waiter.position, waiter.reason = ahead, reason
                    if waiter.progress:
                        waiter.progress(reason, ahead)
            self._wake_when_overdue()
            if not conflicted:
                return False
            before = self.state.pool
            self.state.set_pool(await self.backend.claimed_inventory() or await self.backend.inventory())
            return self.state.pool != before
