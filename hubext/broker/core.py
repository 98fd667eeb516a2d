"""The GPU broker: creates, watches and deletes GPU kernels for users' servers.

A user's server (its ``$JUPYTERHUB_API_TOKEN``) asks the broker's REST API
(``hubext.broker.handlers``) for a kernel with a GPU slice; the broker runs admission through
the hub's one :class:`~hubext.allocator.GPUAllocator` (same ledger and quotas as the spawners)
and has the mode's :class:`~hubext.backends.KernelLauncher` make the kernel: a local process
or a pod. Servers get no Kubernetes rights, so no one bypasses quotas.

Endpoints (under ``/hub/api``)::

    GET    /gpu/kernel-sizes                  the sizes this hub offers (for kernelspecs)
    GET    /gpu/kernels[?user=name]           own kernels; admins: all, or one user's
    POST   /gpu/kernels                       create {size | gpu, server_name, key, signature_scheme}
    GET    /gpu/kernels/<id>[?wait=seconds]   state: pending | running | stopped | failed (+ reason)
    DELETE /gpu/kernels/<id>                  stop it and give the slice back
    POST   /gpu/kernels/<id>/restart          a new kernel process in the same slice (new ports)
    POST   /gpu/kernels/<id>/interrupt        SIGINT (local kernels only; else use the control channel)
    POST   /gpu/kernels/<id>/stopping         its server is shutting it down (the release is a stop)

Authorization: see ``hubext.broker.handlers``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

from traitlets import Bool, Dict, Float, List, Type, Unicode, default
from traitlets.config import SingletonConfigurable

from quotas import AdmissionError, GPURequest, Owner

from ..allocator import GPUAllocator
from ..backends import KernelLauncher, LaunchError, ReleaseCause, ServerRef
from ..events import SliceEvent, SliceEventKind
from ..gpu_spawner import GPUSpawnerMixin
from ..hubstart import when_hub_is_up
from ..kernels import KernelRecord
from ..requests import request_from_section
from .admit import AdmitMixin
from .reclaim import ReclaimMixin
from .sizes import SIGNATURE_SCHEMES, BrokerError, SizesMixin, is_unicode, validate_sizes
from .swap import SwapMixin, key_digest

#: how many deleted kernels' reasons the broker keeps for their servers to read
STOPPED_KEPT = 1000


class GPUBroker(AdmitMixin, SizesMixin, SwapMixin, ReclaimMixin, SingletonConfigurable):
    """The hub's GPU kernel broker: one per hub process, next to the one GPUAllocator."""

    kernel_sizes = List(
        Dict(),
        default_value=[
            {"name": "gpu-5g", "display_name": "GPU 5 GiB", "memory_mib": 5120, "cores_percent": 10},
            {"name": "gpu-10g", "display_name": "GPU 10 GiB", "memory_mib": 10240, "cores_percent": 25},
            {"name": "gpu-20g", "display_name": "GPU 20 GiB", "memory_mib": 20480, "cores_percent": 50},
        ],
        config=True,
        help="""GPU kernel sizes the hub offers; each becomes a kernelspec ("Python 3 (GPU 10 GiB)")
        through `python -m kernelprovider install-kernelspecs`. Each size: {name (lowercase,
        digits, '-'), display_name, memory_mib (per GPU), cores_percent (per GPU, 1..100),
        memory_limit_mib and cores_limit_percent (optional, per GPU: how far the kernel's slice
        may grow into what its card leaves idle; at least the request, compute at most 100;
        quotas and admission count only the request), count (default 1), priority_class, model,
        whole, allowed_groups (who may use it; default everyone)}.""",
    )
    allow_custom_gpu = Bool(
        False,
        config=True,
        help="""Whether a kernel request may carry its own gpu section instead of a size name
        (quotas still apply). Such a section may set only memory_mib, cores_percent, their
        limits (memory_limit_mib, cores_limit_percent) and model:
        a priority class, whole cards, a count or a MIG profile come only from a size the user may
        see. Default: False (sizes only).""",
    )
    custom_gpu_allowed_groups = List(
        Unicode(),
        config=True,
        help="""With allow_custom_gpu: the groups whose members may send a custom gpu section
        (empty: every user). Admins always may.""",
    )
    claim_timeout_seconds = Float(
        30.0,
        config=True,
        help="""Seconds a GPU kernel started by a user's server may go without that server asking
        about it (its provisioner does at once, then every few seconds) before it counts as an
        orphan and is deleted at the next reconciliation: the answer to its start was lost (say,
        the hub was killed before answering), so no server will ever use or stop it. After a hub
        restart every running kernel must be asked about again within this time. 0: never.
        Default: 30.""",
    )
    server_token_seconds = Float(
        600.0,
        config=True,
        help="""Lifetime of the per-server tokens the culler asks for (POST /hub/api/gpu/server-token):
        a token of the server's user that opens only that server. Default: 600.""",
    )
    launcher_class = Type(
        klass=KernelLauncher,
        allow_none=True,
        default_value=None,
        config=True,
        help="""Where kernels run: a KernelLauncher subclass. Default: the launcher of the
        mode's pool (GPUAllocator.pool_backend_class: 'kubernetes' -> kernel pods,
        'local' -> local processes).""",
    )
    max_queue_seconds = Float(
        0.0,
        config=True,
        help="""Seconds a kernel request may wait in the GPU queue. 0 (default): a kernel that
        does not fit now is refused at once with the reason, so the notebook shows it.""",
    )
    reconcile_interval_seconds = Float(
        10.0,
        config=True,
        help="""Seconds between reconciliations: kernels whose server is gone are deleted,
        kernels nobody knows about are swept, states are refreshed. Default: 10.""",
    )
    max_wait_seconds = Float(
        30.0,
        config=True,
        help="Longest `?wait=` a GET of a kernel may block waiting for it to leave 'pending'. Default: 30.",
    )

    @default("launcher_class")
    def _default_launcher_class(self) -> type:
        return GPUAllocator.instance(config=self.config).pool_backend_class.launcher_class

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kernels: dict[str, KernelRecord] = {}
        #: kernels deleted lately: id -> (user, why), so their server learns why (an admin's reason)
        self.stopped: dict[str, tuple[str, str]] = {}
        self.launcher: KernelLauncher | None = None
        self.users: Any = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._own_releases: set[str] = set()
        self._started: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._reclaim_task: asyncio.Task | None = None
        self._sizes: list[dict[str, Any]] | None = None
        #: kernel id -> monotonic deadline by which its server must ask about it (see claim_timeout_seconds)
        self._unclaimed: dict[str, float] = {}
        #: kernel id -> why the culler is reclaiming it (mark_culled): its release is a cull
        self._culled: dict[str, str] = {}
        #: kernels waiting in the GPU queue for their first start (listed with their place, ``queue``)
        self.starting: dict[str, KernelRecord] = {}

    # ---- start-up ---------------------------------------------------------------------------

    @property
    def allocator(self) -> GPUAllocator:
        return GPUAllocator.instance(config=self.config, log=self.log)

    def sizes(self) -> list[dict[str, Any]]:
        if self._sizes is None:
            self._sizes = validate_sizes(self.kernel_sizes)
        return self._sizes

    async def ensure_started(self, users: Any = None) -> None:
        """Start once per hub process: allocator, launcher ledger, first reconciliation, the periodic task."""
        if users is not None and self.users is None:
            self.users = users
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        try:
            await asyncio.shield(self._started)
        except Exception:
            self._started = None  # let the next request retry (and say why)
            raise

    async def _start(self) -> None:
        self.sizes()
        await self.allocator.ensure_started()
        self.launcher = self.launcher_class(
            parent=self, log=self.log, pool=self.allocator.backend, priority_value=self.allocator.priority_value
        )
        for record in await self.launcher.start():
            self.kernels[record.id] = record
            if record.state in ("pending", "running"):
                self._expect_claim(record)
        self.allocator.slice_events.subscribe(self._on_slice_event)
        self.allocator.mover = self  # the queue's moves swap kernels out (hubext/moves.py)
        await self.reconcile()
        self.resume_paused_cells()  # a live move the hub stopped in the middle of (moving.py)
        self._task = asyncio.ensure_future(self._reconcile_forever())
        self._reclaim_task = asyncio.ensure_future(self._reclaim_forever())  # elastic bursts (reclaim.py)
        checkpoint = (await asyncio.to_thread(self.launcher.capabilities)).checkpoint  # probed once, here
        self.log.info(
            "GPU broker ready: %s, %d kernels, sizes %s; %s",
            type(self.launcher).__name__,
            len(self.kernels),
            ", ".join(s["name"] for s in self.sizes()),
            "idle kernels can be swapped out" if checkpoint else f"kernels cannot be swapped out: {checkpoint.why_not}",
        )

    async def stop(self) -> None:
        for task in (self._task, self._reclaim_task):
            if task:
                task.cancel()
        if self.launcher:
            await self.launcher.stop()

    def _expect_claim(self, record: KernelRecord) -> None:
        if self.claim_timeout_seconds > 0:
            self._unclaimed[record.id] = time.monotonic() + self.claim_timeout_seconds

    def claim(self, record: KernelRecord) -> None:
        """The kernel's own server asked about it: it knows the kernel (not an orphan)."""
        self._unclaimed.pop(record.id, None)

    async def _delete_orphans(self) -> None:
        """Delete kernels no server took up within claim_timeout_seconds (see there)."""
        now = time.monotonic()
        for kernel_id, deadline in list(self._unclaimed.items()):
            record = self.kernels.get(kernel_id)
            if record is None or record.state not in ("pending", "running"):
                self._unclaimed.pop(kernel_id, None)
            elif deadline <= now and not self._lock(kernel_id).locked():
                self._unclaimed.pop(kernel_id, None)
                await self.delete(
                    record,
                    f"no server took it up within {self.claim_timeout_seconds:g} s "
                    "(the answer to its start was lost, e.g. the hub stopped before answering)",
                )

    def _lock(self, kernel_id: str) -> asyncio.Lock:
        return self._locks.setdefault(kernel_id, asyncio.Lock())

    def _persist(self) -> None:
        if self.launcher is not None:
            self.launcher.persist(self.kernels.values())
        self.keep_resume_room()  # placement keeps room for the swapped-out kernels (swap.py)

    # ---- servers ---------------------------------------------------------------------------

    def spawner_for(self, user_name: str, server_name: str) -> Any | None:
        """The hub's Spawner of ``user_name``'s server ``server_name``, or None."""
        if self.users is None:
            return None
        try:
            user = self.users[user_name]
        except KeyError:
            return None
        if server_name not in user.orm_spawners:
            return None
        return user.spawners[server_name]

    # ---- requests ----------------------------------------------------------------------

    def owner_for(self, spawner: Any, user_name: str) -> Owner:
        if isinstance(spawner, GPUSpawnerMixin):  # a GPU spawner maps its user to a quota owner
            return spawner.gpu_owner()
        return Owner(user=user_name)

    def _request(self, record: KernelRecord, owner: Owner) -> GPURequest:
        request_id = f"kernel-{record.user}-{record.id[:8]}-{record.generation}"
        cpu, memory = self.launcher.node_resources(record.size) if self.launcher is not None else (0, 0)
        return request_from_section(
            record.section, owner, request_id, kind="kernel", cpu_millicores=cpu, host_memory_mib=memory
        )

    # ---- the operations --------------------------------------------------------------------

    async def create(
        self,
        user_name: str,
        server_name: str,
        body: Mapping[str, Any],
        groups: set[str] | None,
        expect_claim: bool = True,
    ) -> KernelRecord:
        """Admission, then the kernel. Nothing is left allocated or created when this raises.

        ``expect_claim``: the caller is the user's server, which must ask about the kernel within
        claim_timeout_seconds (False for an admin starting a kernel by hand)."""
        key = body.get("key")
        if not isinstance(key, str) or not 16 <= len(key) <= 512 or not is_unicode(key):
            raise BrokerError(
                "'key' must be the kernel's connection key: a string of 16 to 512 characters of valid Unicode."
            )
        scheme = body.get("signature_scheme", "hmac-sha256")
        if scheme not in SIGNATURE_SCHEMES or scheme.split("-", 1)[1] not in hashlib.algorithms_available:
            raise BrokerError(f"'signature_scheme' must be one of {', '.join(SIGNATURE_SCHEMES)}, got {scheme!r}.")
        cwd, kernel_name = body.get("cwd", ""), body.get("kernel_name", "")
        jupyter_kernel_id = body.get("kernel_id", "")
        if not all(isinstance(v, str) for v in (cwd, kernel_name, jupyter_kernel_id)):
            raise BrokerError("'cwd', 'kernel_name' and 'kernel_id' must be strings.")
        size_name, section = self.resolve_section(body, groups)
        spawner = self.spawner_for(user_name, server_name)
        label = f"{user_name}/{server_name}" if server_name else user_name
        if spawner is None or not spawner.ready:
            raise BrokerError(
                f"The server {label!r} is not running; GPU kernels belong to a running server. Start it first.", 409
            )
        try:
            server: ServerRef = await self.launcher.server_ref(spawner)
        except LaunchError as e:  # its pod gone, the API too slow: nothing was made yet
            raise BrokerError(e.message, e.status) from None
        record = KernelRecord(
            id=uuid.uuid4().hex,
            user=user_name,
            server_name=server_name,
            size=size_name,
            allocation_id="",
            section=section,
            signature_scheme=scheme,
            server_identity=server.identity,
            created_at=time.time(),
            cwd=cwd,
            kernel_name=kernel_name,
            jupyter_kernel_id=jupyter_kernel_id,
            key_sha256=key_digest(key),
        )
        api_url = getattr(getattr(spawner, "hub", None), "api_url", "")
        record.resume_url = f"{api_url.rstrip('/')}/gpu/kernels/{record.id}/resume" if api_url else ""
        request = self._request(record, self.owner_for(spawner, user_name))
        try:
            allocation = await self._admit(request, record.server_name, record)
        except AdmissionError as e:
            self.log.info("GPU kernel for %s refused: %s", label, e.message)
            raise BrokerError(e.message, e.status) from None
        record.set_allocation(allocation)
        self.kernels[record.id] = record  # known before anything exists, so a sweep never takes it
        try:
            async with self._lock(record.id):
                await self.launcher.launch(record, allocation, key, server)
                await self.allocator.bind(allocation.id, record.holder)
        except BaseException as e:
            self.kernels.pop(record.id, None)
            await self._release(allocation.id, "kernel launch failed", ReleaseCause.FAILED)
            try:
                await self.launcher.delete(record)
            except Exception:
                self.log.exception("Cleaning up failed GPU kernel %s", record.id)
            if isinstance(e, LaunchError):
                raise BrokerError(e.message, e.status) from None
            if isinstance(e, Exception):
                self.log.exception("GPU kernel launch for %s failed", label)
                raise BrokerError(f"The GPU kernel could not be started: {e}", 500) from None
            raise
        if expect_claim:
            self._expect_claim(record)
        self._persist()
        self.log.info(
            "GPU kernel %s for %s: %s (%s) on %s %s",
            record.id,
            label,
            size_name,
            allocation.id,
            allocation.node,
            ",".join(allocation.gpu_uuids),
        )
        return record

    async def status(self, record: KernelRecord, wait_seconds: float = 0.0) -> KernelRecord:
        """Refresh ``record``; with ``wait_seconds`` (a finite number, at least 0; cut to
        ``max_wait_seconds``), wait for it to leave 'pending'. Raises ValueError for another wait."""
        if not isinstance(wait_seconds, int | float) or not math.isfinite(wait_seconds) or wait_seconds < 0:
            raise ValueError(f"wait_seconds must be a finite number of seconds, at least 0; got {wait_seconds!r}")
        deadline = time.monotonic() + min(wait_seconds, self.max_wait_seconds)
        delay = 0.05
        while True:
            await self._refresh(record)
            if record.state != "pending" or time.monotonic() >= deadline or record.id not in self.kernels:
                return record
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.2)

    async def _refresh(self, record: KernelRecord) -> None:
        before = record.state
        try:
            await self.launcher.refresh(record)
        except Exception as e:
            self.log.warning("Could not refresh GPU kernel %s: %s", record.id, e)
            return
        if record.state not in ("stopped", "failed"):
            return
        if record.state != before:
            self.log.info("GPU kernel %s of %s is %s: %s", record.id, record.user, record.state, record.reason)
        if record.state == "failed" and record.exit_code is None and record.holder:
            # it never ran (unschedulable, image): delete its pod now
            try:
                await self.launcher.delete(record)
            except Exception:
                self.log.exception("Deleting failed GPU kernel %s", record.id)
            record.holder = ""
        if self.allocator.get(record.allocation_id) is not None:  # a stopped kernel holds no slice
            # a kernel the culler shut down through its server may exit before the server deletes it
            await self._release(
                record.allocation_id, *self._stop_cause(record, f"kernel {record.state}: {record.reason}")
            )
        if record.state != before:
            self._persist()

    async def restart(self, record: KernelRecord) -> KernelRecord:
        """A new kernel process in the same slice (re-admitted only if the slice was lost)."""
        async with self._lock(record.id), self.allocator.handover(record.allocation_id):
            if record.id not in self.kernels:
                raise BrokerError("This GPU kernel was deleted.", 404)
            spawner = self.spawner_for(record.user, record.server_name)
            server = None
            if spawner is not None and spawner.ready:
                try:
                    server = await self.launcher.server_ref(spawner)
                except LaunchError as e:
                    raise BrokerError(e.message, e.status) from None
                if record.server_identity and server.identity and server.identity != record.server_identity:
                    raise BrokerError("This GPU kernel belongs to a server that no longer runs.", 409)
            # stopped by the hub (a preemption, a burst it could not swap out): the user's page says so
            record.last_stop = {"at": time.time(), "reason": record.reason} if record.state == "failed" else {}
            if record.swap:  # swapped out: its process (and the files it kept) go, a fresh one takes a slice
                await self.allocator.backend.forget(record.allocation_id)
                self._swap_ended(record, "restarted while swapped out")
                record.swap = {}
                self.launcher.mark_swapped(record, False)
            allocation = self.allocator.get(record.allocation_id)
            if allocation is None:
                record.generation += 1
                request = self._request(record, self.owner_for(spawner, record.user))
                record.generation -= 1
                try:
                    allocation = await self._admit(request, record.server_name)
                except AdmissionError as e:
                    record.state, record.reason = (
                        "failed",
                        f"its GPU slice was lost and cannot be had again: {e.message}",
                    )
                    raise BrokerError(
                        f"The kernel's GPU slice was released when it stopped, and a new one is refused: {e.message}",
                        e.status,
                    ) from None
                old_allocation = record.allocation_id
                record.set_allocation(allocation)
                self.log.info("GPU kernel %s re-admitted: %s (was %s)", record.id, allocation.id, old_allocation)
            try:
                await self.launcher.restart(record, allocation, server)
                await self.allocator.bind(allocation.id, record.holder)
            except LaunchError as e:
                record.state, record.reason = "failed", e.message
                raise BrokerError(e.message, e.status) from None
            self._persist()
            return record

    async def interrupt(self, record: KernelRecord) -> None:
        if not await self.launcher.interrupt(record):
            raise BrokerError(
                "This GPU kernel cannot be signalled by the hub; interrupt it through its control channel "
                "(kernelspec interrupt_mode 'message').",
                409,
            )

    def mark_culled(self, record: KernelRecord, reason: str) -> None:
        """The culler is reclaiming this kernel (called by ``POST /gpu/kernels/<id>/cull`` before it
        shuts the kernel down through its server, and by its ``DELETE ?cause=culled``): whoever
        deletes it next, its slice is released as culled (the usage record says so)."""
        self._culled[record.id] = reason
        self.allocator.expect_stop(record.allocation_id, *self._stop_cause(record, ""))

    def mark_stopping(self, record: KernelRecord) -> None:
        """The kernel's server is shutting it down (``POST /gpu/kernels/<id>/stopping``, from the
        provisioner's ``shutdown_requested``): the kernel may exit before the server deletes it,
        and the pool's holder check then releases its slice as stopped (or culled), not as gone."""
        why = f"kernel shut down by {record.user}"
        self.allocator.expect_stop(record.allocation_id, *self._stop_cause(record, why))

    def _stop_cause(self, record: KernelRecord, why: str, forget: bool = False) -> tuple[str, ReleaseCause]:
        """Why and how a stopped kernel's slice is released: culled when the culler said so."""
        culled = self._culled.pop(record.id, None) if forget else self._culled.get(record.id)
        if culled is None:
            return why, ReleaseCause.STOPPED
        return (f"culled: {culled}" if culled else "culled"), ReleaseCause.CULLED

    async def delete(self, record: KernelRecord, why: str = "kernel shut down") -> None:
        why, cause = self._stop_cause(record, why, forget=True)
        async with self._lock(record.id):
            self.kernels.pop(record.id, None)
            self.stopped[record.id] = (record.user, why)
            while len(self.stopped) > STOPPED_KEPT:
                self.stopped.pop(next(iter(self.stopped)))
            try:
                await self.launcher.delete(record)
            finally:
                if record.swap:  # its slice was released when it was swapped out: only its files are left
                    await self.allocator.backend.forget(record.allocation_id)
                    self._swap_ended(record, why)
                await self._release(record.allocation_id, why, cause)
                self._persist()
                self._locks.pop(record.id, None)
        self.log.info("GPU kernel %s of %s deleted: %s", record.id, record.user, why)

    async def _release(self, allocation_id: str, why: str, cause: ReleaseCause = ReleaseCause.STOPPED) -> None:
        if not allocation_id:
            return
        self._own_releases.add(allocation_id)
        try:
            await self.allocator.release(allocation_id, why, cause)
        finally:
            self._own_releases.discard(allocation_id)

    def _swap_ended(self, record: KernelRecord, why: str) -> None:
        """Publish that the kernel swapped out of its slice stopped before it resumed (metering
        ends its swapped period)."""
        self.allocator.slice_events.publish(SliceEvent(SliceEventKind.SWAP_ENDED, record.allocation_id, why=why))

    def _on_slice_event(self, event: SliceEvent) -> None:
        """A kernel's slice released by someone else (preemption, holder gone): say so on the kernel."""
        allocation, why, cause = event.allocation, event.why, event.cause
        if event.kind is not SliceEventKind.RELEASED or allocation is None:
            return
        if allocation.kind != "kernel" or allocation.id in self._own_releases:
            return
        for record in self.kernels.values():
            if record.allocation_id == allocation.id and record.state in ("pending", "running"):
                if cause is ReleaseCause.PREEMPTED:
                    record.state, record.reason = "failed", f"its GPU slice was taken back: {why}"
                    self.log.warning("GPU kernel %s of %s: %s", record.id, record.user, record.reason)
                    asyncio.ensure_future(self._stop_holder(record))

    async def _stop_holder(self, record: KernelRecord) -> None:
        async with self._lock(record.id):
            try:
                await self.launcher.delete(record)
            except Exception:
                self.log.exception("Stopping preempted GPU kernel %s", record.id)
            record.holder = ""
            self._persist()

    # ---- reconciliation --------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Delete kernels whose server is gone or that no server took up, refresh states, sweep strays."""
        await self._delete_orphans()
        for record in list(self.kernels.values()):
            if record.id not in self.kernels or self._lock(record.id).locked():
                continue
            spawner = self.spawner_for(record.user, record.server_name)
            try:
                alive = await self.launcher.server_alive(record, spawner)
            except Exception as e:
                self.log.warning("Could not check the server of GPU kernel %s: %s", record.id, e)
                continue
            if not alive:
                label = f"{record.user}/{record.server_name}" if record.server_name else record.user
                await self.delete(record, f"its server {label} is gone")
                continue
            await self._refresh(record)
        try:
            # the live view: a kernel recorded while the launcher lists its pods is known, not a stray
            swept = await self.launcher.sweep(self.kernels.keys())
            if swept:
                self.log.warning("Swept %d GPU kernel(s) nobody knew about: %s", len(swept), ", ".join(swept))
        except Exception as e:
            self.log.warning("GPU kernel sweep failed: %s", e)
        self._persist()

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_interval_seconds)
            try:
                await self.reconcile()
            except Exception:
                self.log.exception("GPU kernel reconciliation failed; retrying")


def start_with_hub(hub_start_timeout: float = 600.0) -> None:
    """Start the broker as soon as the hub is up (call from jupyterhub_config.py).

    Without this the broker starts on its first request, so kernels orphaned while the hub was
    down would wait for that request. A failed start is retried with backoff here, and again by
    every request until it succeeds.
    """

    async def start(app: Any) -> None:
        from jupyterhub.utils import exponential_backoff

        broker = GPUBroker.instance(config=app.config, log=app.log)

        async def broker_started() -> bool:
            try:
                await broker.ensure_started(app.users)
            except Exception as e:
                app.log.warning("GPU broker did not start (%s); retrying", e)
                return False
            return True

        try:
            await exponential_backoff(
                broker_started, "GPU broker did not start", start_wait=1, max_wait=30, timeout=hub_start_timeout
            )
        except asyncio.TimeoutError:
            app.log.error("GPU broker failed to start; it will retry on its next request")

    when_hub_is_up(start, hub_start_timeout)
