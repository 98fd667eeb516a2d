"""Swapping GPU kernels out and back in: the broker's suspend and resume.

*Suspend* (the culler, an admin or the kernel's owner: ``POST
/hub/api/gpu/kernels/<id>/suspend``): the kernel's CUDA processes are checkpointed through the
driver (``libvgpu.checkpoint``: their GPU memory goes to host memory, the GPU is released),
then the slice goes back to the pool (``ReleaseCause.SWAPPED``) while the kernel process runs
on; its REST model says ``"gpu_swapped": true``. It is all or nothing: a kernel that cannot be
checkpointed (a driver without the API, a checkpoint that fails, the host-memory cap) is
refused with the reason and left as it was, running on its slice; the culler then culls it as
before. A kernel whose checkpoint could not even be undone is stopped (it could never run
again).

*Resume* (the kernel itself, before its next cell runs: ``POST .../resume`` with its connection
key; or its owner or an admin; or the hub itself at once, after a *live move*: the queue moved
the kernel while it ran a cell, whose GPU calls wait on the locked driver): admission grants
the same size again (a new allocation that
takes over the limits file and region its shim was started with: never a smaller slice; the
metering links it to the swapped one), on a card of the same model, queued behind higher
priorities and within quotas like any request; the processes are restored (remapped onto the
new card when it is another) and unlocked, and the cell runs. While the request waits, the
model's ``swap.position`` is its place in the GPU queue (the kernel prints it in the notebook).
A live move's resume that fails is asked again (every ``LIVE_RETRY_SECONDS``) for as long as its
cell waits; the cell then prints how long it paused (``KernelLauncher.tell_moved``, written
just before its processes are restored and go on).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import re
import time
import uuid
from typing import Any

from traitlets import Float, Integer
from traitlets.config import Configurable

from libvgpu.checkpoint import CheckpointError
from quotas import AdmissionError, SoftReservation
from quotas.messages import mib

from ..backends import Capability, HostMemoryFull, ReleaseCause, SuspendAsk
from ..events import SliceEvent, SliceEventKind
from ..kernels import KernelRecord
from ..requests import request_from_section
from .moving import MoveMixin
from .sizes import BrokerError

#: seconds between two asks of a live move's resume that failed while its cell waits on it
LIVE_RETRY_SECONDS = 5.0


def key_digest(key: str) -> str:
    """What the broker keeps of a kernel's connection key: enough to recognise the kernel asking
    for its own resume, nothing to sign its messages with."""
    return hashlib.sha256(key.encode()).hexdigest()


class SwapMixin(MoveMixin, Configurable):
    """Suspend and resume of GPU kernels, for :class:`hubext.broker.GPUBroker`."""

    swap_host_memory_percent = Float(
        50.0,
        config=True,
        help="""Share of the machine's RAM, in percent, that swapped-out kernels' GPU memory may
        take in host memory, all of them together: a suspend past it is refused (the kernel is
        culled instead) so that swapping never runs the node out of memory. Kubernetes mode: of
        each node's RAM, for the kernel pods swapped out on that node (the node agent checks it).
        0: never swap. Default: 50.""",
    )
    swap_user_share_percent = Float(
        0.0,
        config=True,
        help="""Share of the host memory for swapped-out kernels (swap_host_memory_percent) that one
        user's swapped-out kernels may hold, in percent of it, before they yield to others'. When
        it is full, a suspend (the culler's, or a user's own) of a user within their share stops
        swapped-out kernels of users over theirs, newest first, each owner told why; a suspend
        of a user over their share is refused (the kernel is culled as before). 0: the cap
        divided equally among the users with kernels swapped out on that machine, the one asking
        included. A user's first swapped-out kernel is always within their share. Default: 0.""",
    )
    resume_queue_seconds = Float(
        600.0,
        config=True,
        help="""Seconds a swapped-out kernel's resume may wait in the GPU queue before its cell
        gets the refusal (the kernel stays swapped out; the next cell tries again). Default: 600.""",
    )
    swap_lock_timeout_ms = Integer(
        10000,
        config=True,
        help="""Milliseconds the driver may take to lock a kernel's CUDA processes (their
        running CUDA calls finish first) before the suspend is given up. Default: 10000.""",
    )

    _resumes: dict[str, asyncio.Task] | None = None
    #: kernel id -> events of the resume requests waiting now: set when its place in the queue changes
    _resume_news: dict[str, set[asyncio.Event]] | None = None

    # ---- helpers ---------------------------------------------------------------------------

    def swapped_host_mib(self, node: str | None = None) -> int:
        """GPU memory swapped-out kernels hold in host memory now (on ``node``, or everywhere)."""
        return sum(
            int(r.swap.get("host_mib", 0))
            for r in self.kernels.values()
            if r.swap and (node is None or r.allocation.get("node") == node)
        )

    def pool_swap_capability(self) -> Capability:
        """Whether kernels of this hub can be swapped out at all (the mode, its driver, the
        host-memory cap being on), with the reason where they cannot."""
        if self.launcher is None:
            return Capability(False, "the GPU broker has not started")
        if self.swap_host_memory_percent <= 0:
            return Capability(False, "swapping is off on this hub (GPUBroker.swap_host_memory_percent is 0)")
        return self.launcher.capabilities().checkpoint

    def node_swap_capability(self, node: str) -> Capability:
        """Whether kernels on ``node`` can be swapped out: swapping on in this hub, then the node's answer."""
        if self.launcher is None or self.swap_host_memory_percent <= 0:
            return self.pool_swap_capability()
        return self.launcher.node_checkpoint_capability(node)

    def swap_capability(self, record: KernelRecord) -> Capability:
        """Whether this kernel can be swapped out (the pool's answer, then its card and how it was
        started), with the reason where it cannot: what the culler's warning and the pages
        promise comes from here."""
        pool = self.pool_swap_capability()
        return self.launcher.checkpoint_capability(record) if pool else pool

    def model(self, record: KernelRecord) -> dict[str, Any]:
        """The kernel's REST model with what this hub can do with it: ``swap_capability``
        ({able, why_not}) says whether it can be swapped out instead of stopped."""
        return {**record.model(), "swap_capability": self.swap_capability(record).as_dict()}

    def swapped_kernels(self, user: str | None = None) -> list[dict[str, Any]]:
        """The swapped-out kernels (of ``user``), oldest first, as the pages, the CLI and the pool
        API show them: who, the size they come back to, the host memory they hold, since when,
        and when they will be culled (``cull_at``: None when the culler did not say)."""
        out = []
        for r in self.kernels.values():
            if not r.swap or (user is not None and r.user != user):
                continue
            out.append(
                {
                    "id": r.id,
                    "kernel_id": r.jupyter_kernel_id,
                    "user": r.user,
                    "server_name": r.server_name,
                    "size": r.size,
                    "memory_mib": r.allocation.get("memory_mib", 0),
                    "gpu_count": len(r.swap.get("gpu_uuids") or []) or 1,
                    "node": r.allocation.get("node", ""),
                    "model": r.swap.get("model", ""),
                    "host_mib": int(r.swap.get("host_mib", 0)),
                    "since": r.swap.get("since"),
                    "cull_at": r.swap.get("cull_at"),
                    "state": r.swap.get("state", "swapped"),
                    "position": r.swap.get("position"),
                }
            )
        return sorted(out, key=lambda k: k["since"] or 0.0)

    def kernel_key_matches(self, record: KernelRecord, key: str) -> bool:
        return bool(record.key_sha256) and hmac.compare_digest(record.key_sha256, key_digest(key))

    # ---- suspend ---------------------------------------------------------------------------

    async def suspend(
        self, record: KernelRecord, why: str, cull_after: float | None = None, move: bool = False
    ) -> KernelRecord:
        """Checkpoint the kernel's CUDA processes and release its slice; BrokerError (409) when it
        cannot be, with the kernel left running on its slice. ``cull_after`` (the culler's policy):
        seconds it may stay swapped out before it is culled, kept as ``swap.cull_at`` for the pages
        (set on a kernel swapped out already, too). ``move``: the queue's move (its resume is not
        held behind an overdue request); one that finds the kernel in a cell is live (``swap.live``:
        when its cell's GPU calls began to wait), and the caller resumes it at once."""
        async with self._lock(record.id):
            if record.swap:
                if cull_after is not None and record.swap.get("state") == "swapped":
                    record.swap["cull_at"] = record.swap["since"] + cull_after
                    self._persist()
                return record
            if record.id not in self.kernels or record.state != "running":
                raise BrokerError(f"Only a running GPU kernel can be swapped out; this one is {record.state}.", 409)
            started, locked_at = time.monotonic(), time.time()
            model = self._model_of(record.allocation.get("gpu_uuids", []))
            ask = SuspendAsk(
                lock_timeout_ms=self.swap_lock_timeout_ms,
                host_memory_percent=self.swap_host_memory_percent,
                swapped_here_mib=self.swapped_host_mib(record.allocation.get("node")),
                why=why,
                model=model,
                live=move,
            )
            try:
                cuda, host_mib = await self._suspend_fairly(record, ask)
            except CheckpointError as e:
                if not e.stuck:
                    raise BrokerError(f"This GPU kernel cannot be swapped out: {e.message}.", 409) from None
                stuck = f"its GPU state could not be swapped out nor kept: {e.message}"
                record.state, record.reason = "failed", stuck
                asyncio.ensure_future(self.delete(record, stuck))
                raise BrokerError(f"The GPU kernel was stopped: {stuck}.", 409) from None
            record.last_stop = {}  # what the page says now is the swap-out
            record.swap = {
                "state": "swapped",
                "since": time.time(),
                "host_mib": host_mib,
                "processes": cuda,
                "gpu_uuids": list(record.allocation.get("gpu_uuids", [])),
                "model": model,
                "position": None,
                "reason": why,
            }
            if cull_after is not None:
                record.swap["cull_at"] = record.swap["since"] + cull_after
            if move:  # made room for another: its resume is not held behind an overdue request
                record.swap["moved"] = True
                if self.launcher.in_cell(record):  # its cell waits on the locked GPU: it comes back now
                    record.swap["live"] = locked_at
            self.launcher.mark_swapped(record, True)
            await self._release(record.allocation_id, f"swapped out: {why}", ReleaseCause.SWAPPED)
            self._persist()
        self.log.info(
            "GPU kernel %s of %s swapped out in %.2f s (%s to host memory, processes %s): %s",
            record.id,
            record.user,
            time.monotonic() - started,
            mib(host_mib),
            ",".join(map(str, cuda)) or "none with CUDA state",
            why,
        )
        return record

    async def _suspend_fairly(self, record: KernelRecord, ask: SuspendAsk) -> tuple[list[int], int]:
        """The launcher's suspend; when host memory is full, make room by stopping swapped-out
        kernels of users over their share (``swap_user_share_percent``) and ask once more."""
        try:
            return await self.launcher.suspend(record, ask)
        except HostMemoryFull as full:
            victims, share = self._over_share(record, full)
            if victims is None:
                held = self._held_by(record)[record.user]
                raise CheckpointError(
                    f"{full.message}; {record.user}'s swapped-out kernels hold {mib(held)} of it already, and "
                    f"{mib(held + full.needed_mib)} would be over their share of {mib(int(share))}"
                    if held
                    else full.message,
                    0,
                    "suspend",
                    0,
                ) from None
            for victim in victims:
                await self._stop_over_share(victim, record, full.cap_mib, share)
            ask = dataclasses.replace(ask, swapped_here_mib=self.swapped_host_mib(record.allocation.get("node")))
            return await self.launcher.suspend(record, ask)

    def _held_by(self, record: KernelRecord) -> dict[str, int]:
        """Host memory each user's swapped-out kernels hold on ``record``'s machine, MiB."""
        held: dict[str, int] = {record.user: 0}
        for r in self.kernels.values():
            if r.swap and r.allocation.get("node") == record.allocation.get("node"):
                held[r.user] = held.get(r.user, 0) + int(r.swap.get("host_mib", 0))
        return held

    def _over_share(self, record: KernelRecord, full: HostMemoryFull) -> tuple[list[KernelRecord] | None, float]:
        """(The swapped-out kernels to stop so that ``record`` fits, newest first, only of users over
        their share and never a user's last one; None when the asker is over their own share or
        stopping those would not make room), and the share."""
        held = self._held_by(record)
        users = {u for u, mib_held in held.items() if mib_held} | {record.user}
        fraction = self.swap_user_share_percent / 100 if self.swap_user_share_percent > 0 else 1 / len(users)
        share = full.cap_mib * fraction
        if held[record.user] and held[record.user] + full.needed_mib > share:
            return None, share  # the asker is over their own share (their first kernel always fits it)
        node = record.allocation.get("node")
        swapped = [r for r in self.kernels.values() if r.swap and r.allocation.get("node") == node]
        count = {u: sum(1 for r in swapped if r.user == u) for u in held}
        need = full.held_mib + full.needed_mib - full.cap_mib
        victims = []
        for r in sorted(swapped, key=lambda r: -float(r.swap.get("since") or 0)):
            if need <= 0:
                break
            if r.user == record.user or r.swap.get("state") != "swapped":
                continue  # one's own, or on its way back to a GPU
            if held[r.user] > share and count[r.user] > 1:
                victims.append(r)
                host = int(r.swap.get("host_mib", 0))
                held[r.user] -= host
                count[r.user] -= 1
                need -= host
        return (victims, share) if need <= 0 else (None, share)

    async def _stop_over_share(self, victim: KernelRecord, record: KernelRecord, cap_mib: int, share: float) -> None:
        """Stop a swapped-out kernel whose owner is over their share, telling them why."""
        held = self._held_by(victim)[victim.user]
        why = (
            f"your swapped-out GPU kernel on server '{victim.server_name or 'default'}' was stopped and its "
            f"variables lost: the host memory kept for swapped-out kernels ({mib(cap_mib)}) was full, and your "
            f"swapped-out kernels held {mib(held)}, over your share of {mib(int(share))}; another user's idle "
            "kernel was swapped out in its place"
        )
        self.log.warning(
            "GPU kernel %s of %s stopped for %s's swap (over its share): %s", victim.id, victim.user, record.user, why
        )
        self.mark_culled(victim, why)
        await self.delete(victim, why)

    def _resume_reason(self, record: KernelRecord, admission: str, pins: tuple[str, ...]) -> str:
        """Why a resume waits, written for a resume: what must free (its own size, on its model of
        card, on its own card where only that can take it back), then admission's facts without
        its advice to new requests (a resume cannot pick a smaller profile: its state is that size)."""
        memory = int(record.allocation.get("memory_mib") or 0)
        count = len(record.swap.get("gpu_uuids") or []) or 1
        size = f"{mib(memory)} of GPU memory" + (f" on each of {count} cards" if count > 1 else "")
        model = record.swap.get("model")
        where = f" on a card of model {model}" if model and count == 1 else (f" of model {model}" if model else "")
        node = record.allocation.get("node")
        own = (
            f" (only its own card{'s' if len(pins) > 1 else ''} {', '.join(pins)} can take its state back)"
            if pins and len(pins) == count
            else f" (its own card {pins[0]} or another of node {node} of that model: {', '.join(pins[1:])})"
            if pins
            else ""
        )
        facts = " ".join(filter(None, (_for_a_resume(sentence) for sentence in _sentences(admission))))
        return f"It comes back at its own size: {size}{where}{own} must be free." + (f" {facts}" if facts else "")

    def _resume_cards(self, record: KernelRecord) -> tuple[str, ...]:
        """The cards a resume may land on: none named (anywhere of its model), else its own, then,
        where the launcher says the driver can restore onto another card of the node
        (``resume_remap``), the node's other cards of the same model and mode (one-card kernels)."""
        pins = self.launcher.resume_pins(record)
        state = self.allocator.state
        if not pins or len(pins) > 1 or state is None or not self.launcher.resume_remap(record):
            return pins
        node = next((n for n in state.pool.nodes if n.name == record.allocation.get("node")), None)
        own = next((g for g in node.gpus if g.uuid == pins[0]), None) if node is not None else None
        if own is None:
            return pins
        alike = [g.uuid for g in node.gpus if g.uuid != own.uuid and (g.model, g.mode) == (own.model, own.mode)]
        return (*pins, *alike)

    def _model_of(self, uuids: list[str]) -> str:
        state = self.allocator.state
        for node in state.pool.nodes if state is not None else ():
            for gpu in node.gpus:
                if gpu.uuid in uuids:
                    return gpu.model
        return ""

    # ---- resume ----------------------------------------------------------------------------

    async def resume(self, record: KernelRecord, wait_seconds: float = 0.0) -> KernelRecord:
        """Start (or join) the kernel's resume; wait up to ``wait_seconds`` for it to end."""
        if not record.swap and self._lock(record.id).locked():
            # a suspend in flight (its processes may be locked already): the kernel asking now
            # must not run its cell into the lock, so the answer waits for the suspend's end
            async with self._lock(record.id):
                pass
        if not record.swap:
            return record
        task = self._resume_task(record)
        # the answer comes when the resume ends or its place in the queue changes, whichever is first
        if self._resume_news is None:
            self._resume_news = {}
        news = asyncio.Event()
        listeners = self._resume_news.setdefault(record.id, set())
        listeners.add(news)
        heard = asyncio.ensure_future(news.wait())
        try:
            timeout = max(0.0, min(wait_seconds, self.max_wait_seconds))
            await asyncio.wait({task, heard}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            heard.cancel()
            listeners.discard(news)
        if task.done() and task.exception() is not None:
            error = task.exception()
            if isinstance(error, BrokerError):
                raise error
            raise BrokerError(f"The GPU kernel could not be resumed: {error}", 500)
        return record

    def resume_room(self) -> dict[str, SoftReservation]:
        """The room each swapped-out kernel that is not asking for its resume yet needs on its
        card(s) to come back, by kernel id (kept soft in placement: ``quotas/reserve.py``)."""
        room = {}
        for record in self.kernels.values():
            if record.swap.get("state") == "swapped" and record.swap.get("gpu_uuids"):
                room[record.id] = SoftReservation(
                    tuple(record.swap["gpu_uuids"]),
                    int(record.allocation.get("memory_mib") or 0),
                    int(record.allocation.get("cores_percent") or 0),
                )
        return room

    def keep_resume_room(self) -> None:
        """Placement keeps the room of the swapped-out kernels (called whenever the records change)."""
        self.allocator.reserve_for_resumes(self.resume_room())

    def _resume_task(self, record: KernelRecord) -> asyncio.Task:
        """The kernel's one resume under way, started if there is none (every ask joins it)."""
        if self._resumes is None:
            self._resumes = {}
        task = self._resumes.get(record.id)
        if task is None or task.done():
            task = self._resumes[record.id] = asyncio.ensure_future(self._resume(record))
        return task

    def _cell_waits(self, record: KernelRecord) -> bool:
        """A live move's kernel still swapped out whose cell waits on its GPU."""
        swap = record.swap
        return (
            bool(swap.get("live"))
            and swap.get("state") == "swapped"
            and self.kernels.get(record.id) is record
            and self.launcher.in_cell(record)
        )

    async def _resume(self, record: KernelRecord) -> None:
        try:
            while True:
                try:
                    return await self._resume_asked(record)
                except BrokerError as e:
                    if not self._cell_waits(record):
                        raise
                    self.log.warning(
                        "GPU kernel %s of %s: the resume after its live move failed while its cell waits on it; "
                        "asking again in %.0f s: %s",
                        record.id,
                        record.user,
                        LIVE_RETRY_SECONDS,
                        e.message,
                    )
                await asyncio.sleep(LIVE_RETRY_SECONDS)
                if not self._cell_waits(record):  # its cell ended: its next cell asks
                    return
        finally:  # resumed: its room is its slice; still swapped out: its room is kept again
            self.keep_resume_room()

    async def _resume_asked(self, record: KernelRecord) -> None:
        swap = record.swap
        swap["state"], swap["position"] = "queued", None
        self.keep_resume_room()  # its own room is no longer kept: its request, first in line, asks for it
        section = dict(record.section)
        if swap.get("model"):
            section["model"] = swap["model"]  # its state can only go back onto the same kind of card
        spawner = self.spawner_for(record.user, record.server_name)
        cpu, memory = self.launcher.node_resources(record.size)
        previous = record.allocation_id
        request = request_from_section(
            section,
            self.owner_for(spawner, record.user),
            f"kernel-{record.user}-{record.id[:8]}-{record.generation}-s{uuid.uuid4().hex[:6]}",
            kind="kernel",
            cpu_millicores=cpu,
            host_memory_mib=memory,
        )
        pins = self._resume_cards(record)
        if pins:  # only these cards can take its state back (its own first)
            request = dataclasses.replace(request, pinned_uuids=pins)

        def progress(reason: str, position: int | None) -> None:
            reason = self._resume_reason(record, reason, pins)
            if (swap.get("position"), swap.get("waiting_reason")) == (position, reason):
                return
            swap["position"], swap["waiting_reason"] = position, reason
            for news in (self._resume_news or {}).get(record.id, ()):
                news.set()  # the kernel waiting for its resume hears it now

        started = time.monotonic()
        try:
            allocation = await self.allocator.allocate(
                request,
                progress=progress,
                timeout=self.resume_queue_seconds,
                server_name=record.server_name,
                moved=bool(swap.get("moved")),
            )
        except AdmissionError as e:
            swap["state"], swap["position"] = "swapped", None
            waited = time.monotonic() - started
            after = f" after {waited:.0f} s in the GPU queue" if waited >= 1 else ""
            raise BrokerError(
                f"The GPU of this kernel is still swapped out{after}. "
                f"{self._resume_reason(record, e.message, pins)} Its variables are kept; the next cell asks again.",
                e.status,
            ) from None
        why_not = self.launcher.restorable_on(record, allocation)
        if why_not:
            await self._release(allocation.id, f"resume not possible here: {why_not}", ReleaseCause.CANCELLED)
            swap["state"], swap["position"] = "swapped", None
            raise BrokerError(f"The GPU kernel is still swapped out: {why_not}.", 409)
        async with self._lock(record.id):
            if self.kernels.get(record.id) is not record:  # shut down while its resume waited
                await self._release(allocation.id, "the kernel was shut down", ReleaseCause.CANCELLED)
                raise BrokerError("The GPU kernel was shut down while it waited for its GPU.", 409)
            remap = {old: new for old, new in zip(swap["gpu_uuids"], allocation.gpu_uuids, strict=False) if old != new}
            if swap.get("live"):  # the cell it paused says so when it ends (written before it goes on)
                self.launcher.tell_moved(
                    record,
                    f"This cell paused {time.time() - swap['live']:.1f} s while its kernel was moved to another GPU "
                    f"to make room for a waiting request ({swap.get('reason', '')}); its GPU memory was then "
                    "restored there.",
                )
            try:
                await self.launcher.resume(record, allocation, remap)
            except CheckpointError as e:
                message = getattr(e, "message", str(e))
                if not e.stuck:  # the driver refused it and left its GPU state in host memory
                    await self._release(allocation.id, f"resume refused: {message}", ReleaseCause.CANCELLED)
                    swap["state"], swap["position"] = "swapped", None
                    if remap:  # from now on it comes back to its own card only
                        swap["remap_refused"] = f"the driver refused to restore it onto {allocation.gpu_uuids[0]}"
                    self._persist()
                    raise BrokerError(
                        f"The GPU of this kernel is still swapped out: the driver refused to restore it on "
                        f"{','.join(allocation.gpu_uuids)} ({message}). Its variables are kept; the next cell "
                        f"asks again{', for its own card' if remap else ''}.",
                        409,
                    ) from None
                await self._release(allocation.id, f"resume failed: {message}", ReleaseCause.FAILED)
                record.swap = {}
                record.state, record.reason = "failed", f"its GPU state could not be restored: {message}"
                asyncio.ensure_future(self.delete(record, record.reason))
                raise BrokerError(f"The GPU kernel could not be resumed: {message}.", 500) from None
            # the new slice takes over the files its shim was started with (limits, region, activity)
            self.launcher.resumed(record, previous, allocation)
            record.set_allocation(allocation)
            await self.allocator.bind(allocation.id, record.holder)
            self.allocator.slice_events.publish(  # metering: the swapped period ends
                SliceEvent(SliceEventKind.RESUMED, allocation.id, allocation, previous_id=previous)
            )
            record.swap = {}
            self.launcher.mark_swapped(record, False)
            self._persist()
        self.log.info(
            "GPU kernel %s of %s resumed in %.2f s on %s%s",
            record.id,
            record.user,
            time.monotonic() - started,
            ",".join(allocation.gpu_uuids),
            f" (moved from {','.join(remap)})" if remap else "",
        )


def _sentences(text: str) -> list[str]:
    """``text`` cut into sentences (a full stop followed by a space and a capital ends one; '1.5 GiB' does not)."""
    return [part.strip() for part in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text.strip()) if part.strip()]


def _for_a_resume(sentence: str) -> str:
    """An admission sentence as it applies to a resume: advice a resume cannot take (a smaller
    profile: its state is its size; "try again later": the next cell does) taken out, the rest
    kept ("Stop one of your kernels."); '' when nothing is left."""
    smaller = r"a smaller (?:profile|GPU kernel size)"  # quotas.messages.smaller
    if sentence.startswith("Waited ") or re.match(rf"Pick {smaller}\.", sentence):
        return ""
    sentence = re.sub(rf"Pick {smaller} or ask an admin", "Ask an admin", sentence)
    sentence = re.sub(rf", (wait for [^.]*?), or pick {smaller}\.", r", or \1.", sentence)
    sentence = re.sub(rf",? or pick {smaller}\.", ".", sentence)
    return "" if re.search(smaller, sentence) else sentence
