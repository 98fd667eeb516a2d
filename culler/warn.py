"""Warning a kernel before it is reclaimed: the notice printed in the kernel, and the grace it starts."""

from __future__ import annotations

import asyncio
import time

from .model import GPUKernel, GraceWarning, JupyterState, Verdict
from .words import gib, human


class WarnMixin:
    """Warnings of :class:`culler.app.GPUCuller`."""

    # ---- warn -----------------------------------------------------------------------------

    def warning_text(self, v: Verdict, now: float, waiting: int = 0) -> str:
        """The notice printed in the kernel: the real reason, the time left, and whether anyone
        waits for the slice (``waiting``: requests in the hub's GPU queue)."""
        k = v.kernel
        policy = self.rules.book.for_kernel(k)
        due = v.due_at or now
        when = time.strftime("%H:%M:%S UTC", time.gmtime(due))
        if v.reason == "max-age":
            why = (
                f"has run for {human(now - k.created_at)}, and a GPU kernel may run for at most "
                f"{human(policy.max_age_seconds)} here"
            )
        else:
            why = (
                f"has been idle for {human(v.idle_seconds)} (no cell running, no GPU work), and idle "
                f"GPU kernels are shut down after {human(policy.idle_timeout_seconds)} here"
            )
        need = ""
        if waiting:
            need = f" {waiting} GPU request{'s are' if waiting != 1 else ' is'} waiting for room in the pool."
        if self.will_swap(k):
            return (
                f"[elastic-gpu] This kernel {why.replace('are shut down after', 'are swapped out after')}. "
                f"At {when}, in {human(round(due - now))}, its GPU memory will be moved to host memory and its "
                f"GPU slice of {gib(k.freed_memory_mib)} given back.{need} Your variables stay; the next cell "
                "takes a GPU again first (it may wait for one). Should the host memory kept for swapped-out "
                "kernels be full then, it is shut down instead and its variables are lost. Run any cell to keep "
                "it on the GPU now."
            )
        cannot = ""
        if self.swap_idle_kernels and not k.swapped_since and k.swap_why_not:
            cannot = f" It cannot be swapped out here ({k.swap_why_not})."
        return (
            f"[elastic-gpu] This kernel {why}. It will be shut down at {when}, in {human(round(due - now))}, "
            f"and its GPU slice of {gib(k.freed_memory_mib)} given back; its variables will be lost.{cannot}{need} "
            "Run any cell to keep it; your notebook file is not affected."
        )

    def will_swap(self, k: GPUKernel) -> bool:
        """Whether ``k`` is swapped out (state kept) at its timeout rather than shut down: swapping is
        on and the broker says this kernel can be (a broker that does not say is not trusted to)."""
        return self.swap_idle_kernels and not k.swapped_since and k.swap_why_not == ""

    async def _warn(self, v: Verdict, waiting: int = 0) -> bool:
        k = v.kernel
        now = time.time()
        text = self.warning_text(v, now, waiting)
        if self.dry_run:
            self.log.info("[dry run] would warn kernel %s of %s: %s", k.kernel_id, k.user, text)
            return False
        ok = await self._print(v, text)
        # the page's countdown: when and how, as data (the words above may change)
        await self.client.tell_idle(k.id, "swap" if self.will_swap(k) else "stop", v.due_at or now)
        if not ok:
            # could not warn (not a Python kernel, or no answer): record it anyway, so the cull
            # goes ahead after the grace period instead of waiting for a warning that cannot come
            self.metrics.warnings.labels("failed").inc()
        else:
            self.metrics.warnings.labels("sent").inc()
        before = v.view.jupyter.last_activity if v.view.jupyter else now
        activity_after = await self._settled_activity(k, before)
        self.store.put(
            k.kernel_id,
            GraceWarning(warned_at=now, activity_before=before, activity_after=activity_after, due_at=v.due_at or now),
        )
        self.store.save()  # at once: a culler killed now must not warn again after its restart
        self.log.info(
            "Warned kernel %s of %s (server '%s', %s): %s idle, cull due at %s%s",
            k.kernel_id,
            k.user,
            k.server_name,
            k.priority_class,
            human(v.idle_seconds),
            time.strftime("%H:%M:%S", time.localtime(v.due_at or now)),
            "" if ok else " (warning not delivered)",
        )
        return ok

    async def _settled_activity(self, k: GPUKernel, default: float) -> float:
        """The kernel's last_activity once the server has seen all of the warning's messages (its
        activity watcher reads the kernel's output apart from our websocket, so it may lag)."""
        last = None
        for _ in range(6):
            model = await self.client.kernel_model(k.user, k.server_name, k.kernel_id, k.server_url)
            value = JupyterState.from_model(model).last_activity if model else default
            if value == last:
                break
            last = value
            await asyncio.sleep(0.2)
        return last if last is not None else default

    async def _print(self, v: Verdict, text: str) -> bool:
        k = v.kernel
        spec = v.view.jupyter.name if v.view.jupyter else ""
        language = await self.client.kernel_language(k.user, k.server_name, spec, k.server_url) if spec else ""
        if language.lower() != "python":
            self.log.debug("Not warning kernel %s: kernelspec %r is %r, not Python", k.kernel_id, spec, language)
            return False
        code = f"print({text!r}, file=__import__('sys').stderr)"
        return await self.client.print_in_kernel(k.user, k.server_name, k.kernel_id, code, k.server_url)
