"""Reclaiming a kernel's slice: swapped out where the broker can, else shut down through its server, else the broker."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from jupyterhub.utils import exponential_backoff

from .metrics import MIB
from .model import GPUKernel, GraceWarning, Verdict
from .words import cull_sentence, gib, human

#: confirmed-free states a broker record may report before it disappears
FREE_STATES = {"stopped", "released", "terminated", "deleted", "culled"}


@dataclass
class CullResult:
    verdict: Verdict
    method: str  # server | broker | failed | dry-run
    freed: bool
    seconds: float


class ReclaimMixin:
    """Reclaim of :class:`culler.app.GPUCuller`."""

    # ---- reclaim --------------------------------------------------------------------------

    async def _cull(self, v: Verdict) -> CullResult:
        k = v.kernel
        t0 = time.monotonic()
        why = cull_sentence(v)
        if self.dry_run:
            self.log.info("[dry run] would cull kernel %s of %s: %s", k.kernel_id, k.user, why)
            return CullResult(v, "dry-run", False, 0.0)
        cannot = ""  # why it is not swapped out instead, when swapping is on
        if self.swap_idle_kernels and not k.swapped_since:
            if k.swap_why_not:  # the broker said so before: no suspend to try, no promise was made
                cannot = k.swap_why_not
            else:
                swapped, refusal = await self.client.suspend_gpu_kernel(k.id, why, self.swapped_limit(k) or None)
                if swapped:
                    return self._swapped(v, why, time.monotonic() - t0)
                cannot = refusal
                self.log.warning(
                    "GPU kernel %s of %s cannot be swapped out (%s): culling it", k.kernel_id, k.user, refusal
                )
        self.log.info(
            "Culling GPU kernel %s of %s (server '%s', %s, %s): %s%s",
            k.kernel_id,
            k.user,
            k.server_name,
            k.priority_class,
            gib(k.freed_memory_mib),
            why,
            f"; it cannot be swapped out ({cannot}), so its state is lost" if cannot else "",
        )
        method = "server"
        if v.view.server_status == "ok":
            j = v.view.jupyter
            if j is not None and j.connections > 0 and self.store.get(k.kernel_id) is None:
                # someone is watching and was not warned (no grace period, or pressure): say why. The
                # notice is activity on the server: recorded like a warning, so that a culler killed
                # before the shutdown does not take it for the user's activity after its restart
                notice = f"[elastic-gpu] Shutting this kernel down to free its GPU slice: {why}."
                await self._print(v, notice + " Its variables are lost; your notebook file is not affected.")
                settled = await self._settled_activity(k, j.last_activity)
                self.store.put(k.kernel_id, GraceWarning(time.time(), j.last_activity, settled, time.time()))
                self.store.save()
            # the broker records the release as a cull whoever deletes it (the server, through its provisioner)
            await self.client.announce_cull(k.id, why)
            answer = await self.client.shutdown_kernel(k.user, k.server_name, k.kernel_id, k.server_url)
            freed = await self._confirm_free(k, self.confirm_timeout_seconds) if answer != "failed" else False
            if answer == "failed":
                self.log.warning(
                    "Kernel %s of %s: its server did not shut it down; asking the broker", k.kernel_id, k.user
                )
                self.metrics.errors.labels("server-shutdown").inc()
        else:
            freed = False
        if not freed:
            method = "broker"
            ok = await self.client.delete_gpu_kernel(k.id, why)
            freed = ok and await self._confirm_free(k, self.confirm_timeout_seconds)
            if not freed:
                method = "failed"
                self.metrics.errors.labels("broker-delete").inc()
        seconds = time.monotonic() - t0
        self.metrics.culls.labels(v.reason, k.priority_class, method).inc()
        if freed:
            self.metrics.freed_memory.labels(v.reason, k.priority_class, "culled").inc(k.freed_memory_mib * MIB)
            self.metrics.idle_at_cull.labels(v.reason).observe(v.idle_seconds)
            self.metrics.reclaim.observe(seconds)
            used = k.gpu_memory_used_mib
            self.log.info(
                "Culled GPU kernel %s of %s (server '%s', %s, allocation %s): %s; idle %s; freed %s of GPU "
                "memory (%s in use) via %s in %.2f s",
                k.kernel_id,
                k.user,
                k.server_name,
                k.priority_class,
                k.allocation_id or k.id,
                why,
                human(v.idle_seconds),
                gib(k.freed_memory_mib),
                "?" if used is None else gib(used),
                method,
                seconds,
            )
        else:
            self.log.error(
                "Could not free the GPU slice of kernel %s of %s (%s): neither its server nor the broker confirmed "
                "it within %.0f s; will retry next cycle",
                k.kernel_id,
                k.user,
                k.id,
                seconds,
            )
        return CullResult(v, method, freed, seconds)

    def _swapped(self, v: Verdict, why: str, seconds: float) -> CullResult:
        k = v.kernel
        self.metrics.swap_outs.labels(v.reason, k.priority_class).inc()
        self.metrics.freed_memory.labels(v.reason, k.priority_class, "swapped").inc(k.freed_memory_mib * MIB)
        self.log.info(
            "Swapped out GPU kernel %s of %s (server '%s', %s, allocation %s) instead of culling it: %s; "
            "freed %s of GPU memory in %.2f s",
            k.kernel_id,
            k.user,
            k.server_name,
            k.priority_class,
            k.allocation_id or k.id,
            why,
            gib(k.freed_memory_mib),
            seconds,
        )
        return CullResult(v, "swapped", True, seconds)

    async def _confirm_free(self, k: GPUKernel, timeout: float) -> bool:
        """Poll the broker until the kernel's slice is free (record gone or in a stopped state)."""

        async def free() -> bool:
            status, record = await self.client.gpu_kernel(k.id)
            return status == "gone" or (status == "present" and str(record.get("state", "")) in FREE_STATES)

        try:
            await exponential_backoff(
                free, f"the slice of GPU kernel {k.id} is free", start_wait=0.05, max_wait=1.0, timeout=timeout
            )
        except asyncio.TimeoutError:
            return False
        return True
