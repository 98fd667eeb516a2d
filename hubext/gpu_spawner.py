"""GPU logic shared by the Kubernetes and the local spawner (one copy, mixed into both).

A profile's ``gpu`` section (its format, its check, the request it makes) is
:mod:`hubext.requests`, shared with the broker's kernel sizes.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from tornado import web
from traitlets import Callable as CallableTrait
from traitlets import Dict, Float, Union, default
from traitlets.config import LoggingConfigurable

from quotas import AdmissionError, Allocation, GPURequest, Owner

from .allocator import GPUAllocator
from .requests import node_resources, profile_gpu_section, request_from_section


class GPUSpawnError(web.HTTPError):
    """A spawn refused for a reason the user can act on.

    An HTTPError below 500 is, for JupyterHub, a handled rejection (it does not count towards
    ``consecutive_failure_limit``); ``jupyterhub_message`` is what the spawn page and the
    progress API show, without the "HTTP 403: Forbidden" prefix.
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(status, "%s", message)
        self.message = message
        self.status = status
        self.jupyterhub_message = message

    def __str__(self) -> str:
        return self.message


def check_forged_options(profile: Mapping[str, Any], user_options: Mapping[str, Any]) -> None:
    """Refuse choices that are not offered (a forged form or REST request), naming what is allowed."""
    slug = profile.get("slug", "?")
    for option_name, option in (profile.get("profile_options") or {}).items():
        choices = option.get("choices") or {}
        choice = user_options.get(option_name)
        if choice is None or not choices:
            continue
        if not isinstance(choice, str) or choice not in choices:
            raise GPUSpawnError(
                f"Profile '{slug}' has no choice {choice!r} for '{option_name}'. "
                f"Choose one of: {', '.join(choices)}."
            )


def options_applied_at_start(spawner: Any, user_options: Mapping[str, Any]) -> None:
    """JupyterHub's ``Spawner.apply_user_options`` for our spawners: nothing to do here, since the
    profile and its options are applied, and checked (unknown or forged ones refused with a
    sentence), when the server starts. Without a hook JupyterHub 5.3+ warns 'Received unhandled
    user_options' on every spawn with a profile."""


class GPUSpawnerMixin(LoggingConfigurable):
    """Admission, queueing and release of a notebook's GPU slice, for any Spawner.

    A traitlets class so its traits are configurable on the concrete spawner
    (``c.ElasticGPUSpawner.gpu_owner_mapping``); mixed in before the Spawner base.
    """

    @default("apply_user_options")
    def _options_applied_at_start(self) -> Any:
        return options_applied_at_start

    gpu_owner_mapping = Union(
        [Dict(), CallableTrait()],
        default_value={},
        config=True,
        help="""Which workspace/namespace a user's GPU usage counts against.
        A dict: keys are user names or 'group:<name>', values 'workspace' or
        'workspace/namespace' (user first, then groups in sorted order); or a callable
        (spawner) -> 'workspace/namespace'. Unmapped users count against 'default/default'.""",
    )
    gpu_max_wait_seconds = Float(
        0.0,
        config=True,
        help="""Seconds a GPU spawn may wait in the queue before it fails with the reason.
        0 (default): the allocator's max_wait_seconds, capped 30 s below start_timeout so the
        message reaches the user before JupyterHub gives up on the spawn.""",
    )

    gpu_allocation: Allocation | None = None
    _gpu_allocation_id: str = ""

    # ---- pieces the concrete spawner provides ---------------------------------------------

    def gpu_selected_profile(self) -> dict | None:
        """The profile the user chose (already validated), or None when there are no profiles."""
        raise NotImplementedError

    def gpu_user_ids(self) -> tuple[int | None, int | None]:
        """The uid/gid the server runs as (local mode: who owns the slice's region), or
        (None, None) for the hub's own account."""
        return None, None

    # ---- shared logic ---------------------------------------------------------------------

    @property
    def gpu_allocator(self) -> GPUAllocator:
        return GPUAllocator.instance(config=self.config, log=self.log)

    def gpu_profile_visible(self, profile: Mapping[str, Any]) -> bool:
        """Whether this user may see/use ``profile`` (its ``allowed_groups``, if any)."""
        allowed = profile.get("allowed_groups")
        if not allowed:
            return True
        groups = {g.name for g in getattr(self.user, "groups", [])}
        return bool(groups & set(allowed))

    def gpu_owner(self) -> Owner:
        """The quota owner of this user's GPU usage."""
        mapping = self.gpu_owner_mapping
        target = ""
        if callable(mapping):
            target = mapping(self) or ""
        else:
            target = mapping.get(self.user.name, "")
            if not target:
                for group in sorted(g.name for g in getattr(self.user, "groups", [])):
                    target = mapping.get(f"group:{group}", "")
                    if target:
                        break
        workspace, _, namespace = (target or "default/default").partition("/")
        return Owner(user=self.user.name, workspace=workspace or "default", namespace=namespace or "default")

    def gpu_request(self, section: Mapping[str, Any]) -> GPURequest:
        server = self.name or ""
        request_id = f"nb-{self.user.name}-{server or 'default'}-{secrets.token_hex(3)}"
        cpu, memory = node_resources(self)
        return request_from_section(section, self.gpu_owner(), request_id, kind="notebook",
                                    cpu_millicores=cpu, host_memory_mib=memory)

    def _gpu_wait_seconds(self) -> float:
        if self.gpu_max_wait_seconds > 0:
            return self.gpu_max_wait_seconds
        return max(5.0, min(self.gpu_allocator.max_wait_seconds, self.start_timeout - 30))

    def gpu_progress(self, message: str, progress: int | None = None) -> None:
        """Queue a spawn-page progress event."""
        events = self.__dict__.setdefault("_gpu_events", [])
        event: dict[str, Any] = {"message": message}
        if progress is not None:
            event["progress"] = progress
        events.append(event)
        self._gpu_progress_notify()

    def gpu_admission_finished(self) -> None:
        """Admission is over (granted, refused or failed): ``gpu_progress_events`` ends once it has sent
        every queued event."""
        self.__dict__["_gpu_admission_done"] = True
        self._gpu_progress_notify()

    def _gpu_progress_changed(self) -> asyncio.Event:
        """The event the next change sets. A reader takes it *before* looking at the events, so a
        change made after it looked always wakes it (each change sets the current event and starts
        a new one: no reader clears what another is waiting on)."""
        return self.__dict__.setdefault("_gpu_progress_event", asyncio.Event())

    def _gpu_progress_notify(self) -> None:
        self.__dict__.pop("_gpu_progress_event", asyncio.Event()).set()

    def gpu_reset_progress(self) -> None:
        """Start a new spawn's event list (call at the top of start())."""
        self.__dict__["_gpu_events"] = []
        self.__dict__["_gpu_admission_done"] = False

    async def gpu_admit(self) -> Allocation | None:
        """Ask admission for the chosen profile's GPU; wait in the queue if needed.

        Returns the allocation (also kept on ``self.gpu_allocation``), None for a CPU profile.
        Raises GPUSpawnError with the admission message when it is refused or times out.
        """
        self.__dict__.setdefault("_gpu_events", [])
        try:
            profile = self.gpu_selected_profile()
            try:
                section = profile_gpu_section(profile, self.user_options or {}) if profile else None
            except ValueError as e:
                raise GPUSpawnError(
                    f"The server profiles are misconfigured ({e}). Ask an admin to fix them.", 500
                ) from None
            if section is None:
                return None
            if self.gpu_allocation is not None:  # restart within the same spawner: keep the slice
                return self.gpu_allocation
            request = self.gpu_request(section)
            self.gpu_progress("Checking GPU quota", 5)

            def on_queue(reason: str, position: int | None) -> None:
                ahead = "no requests" if not position else f"{position} request{'s' if position != 1 else ''}"
                self.gpu_progress(f"Queued: {ahead} ahead. Waiting for: {reason}", 10)

            try:
                allocation = await self.gpu_allocator.allocate(
                    request, progress=on_queue, timeout=self._gpu_wait_seconds(), server_name=self.name
                )
            except AdmissionError as e:
                self.log.info("GPU spawn refused for %s: %s", self._log_name, e.message)
                raise GPUSpawnError(e.message, e.status) from None
            self.gpu_allocation = allocation
            self._gpu_allocation_id = allocation.id
            gpus = ", ".join(allocation.gpu_uuids)
            self.gpu_progress(f"Placed on {allocation.node} / {gpus}", 20)
            return allocation
        finally:
            self.gpu_admission_finished()

    async def stop(self, now: bool = False) -> None:
        """The spawner's own stop, then the slice goes back (whatever the stop raised)."""
        allocation_id = self._gpu_allocation_id or (self.gpu_allocation.id if self.gpu_allocation else "")
        if allocation_id:  # the pool may see the pod or process gone before the release below
            self.gpu_allocator.expect_stop(allocation_id, "server stopped")
        try:
            await super().stop(now=now)
        finally:
            await self.gpu_release("server stopped")

    async def gpu_release(self, why: str = "server stopped") -> None:
        """Give the slice back (idempotent)."""
        allocation_id = self._gpu_allocation_id or (self.gpu_allocation.id if self.gpu_allocation else "")
        self.gpu_allocation = None
        self._gpu_allocation_id = ""
        if allocation_id:
            await self.gpu_allocator.release(allocation_id, why)

    async def gpu_progress_events(self) -> AsyncIterator[dict]:
        """Yield queued GPU events until admission is done (then the spawner's own events follow)."""
        sent = 0
        deadline = time.monotonic() + self.start_timeout
        while True:
            changed = self._gpu_progress_changed()
            events = self.__dict__.get("_gpu_events", [])
            while sent < len(events):
                yield events[sent]
                sent += 1
            if self.__dict__.get("_gpu_admission_done", False) and sent >= len(events):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def gpu_get_state(self, state: dict) -> dict:
        if self._gpu_allocation_id:
            state["gpu_allocation_id"] = self._gpu_allocation_id
        return state

    def gpu_load_state(self, state: Mapping[str, Any]) -> None:
        allocation_id = state.get("gpu_allocation_id", "")
        if allocation_id:
            self._gpu_allocation_id = allocation_id
