"""One culling cycle: gather both signals for each GPU kernel, decide, then warn and reclaim (``_act``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .activity import GPUTimeCheck
from .hub import HubUnavailable, ServerKernels
from .model import GPUKernel, JupyterState, KernelView, RecordError, Verdict, Waiter
from .policy import decide, needs_jupyter_state
from .reclaim import CullResult
from .words import human


@dataclass
class CycleReport:
    """What one cycle saw and did (returned by :meth:`GPUCuller.run_cycle`, for tests and the bench)."""

    started: float
    seconds: float = 0.0
    kernels: int = 0
    servers_asked: int = 0
    waiting: int = 0
    verdicts: list[Verdict] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)
    culls: list[CullResult] = field(default_factory=list)
    error: str = ""


class CycleMixin:
    """The cycle of :class:`culler.app.GPUCuller` (its traits, client, rules and store)."""

    # ---- one cycle ------------------------------------------------------------------------

    def _parse(self, records: Sequence[Any]) -> list[GPUKernel]:
        kernels = []
        for record in records:
            try:
                if isinstance(record, Mapping) and not _has_activity(record) and self.gpu_activity_hook:
                    activity = self.gpu_activity_hook(record)
                    if activity is not None:
                        record = {**record, "activity": dict(activity)}
                kernels.append(self._believable(GPUKernel.from_record(record), record))
            except (RecordError, TypeError, ValueError) as e:
                key = str(e)
                if key not in self._bad_records:  # once per distinct problem, not every cycle
                    self._bad_records.add(key)
                    self.log.warning("Skipping a GPU kernel record the culler cannot read: %s", e)
                self.metrics.errors.labels("record").inc()
        now = time.time()

        def due(k: GPUKernel) -> bool:  # a swapped-out kernel is judged once it may be culled
            after = self.swapped_limit(k)
            return after > 0 and now - k.swapped_since >= after

        #: swapped out (by anyone) with a cull time the broker does not know yet: the pages show it
        self._untimed = [k for k in kernels if k.swapped_since and k.swap_cull_at is None and self.swapped_limit(k)]

        # pending, stopped, failed: not ours to judge
        return [k for k in kernels if k.state == "running" and (not k.swapped_since or due(k))]

    def swapped_limit(self, k: GPUKernel) -> float:
        """Seconds ``k`` may stay swapped out before it is culled (0: no limit)."""
        return self.rules.book.for_kernel(k).cull_swapped_after_seconds if self.rules else 0.0

    async def _tell_cull_times(self) -> None:
        """Tell the broker when each swapped-out kernel will be culled (once per kernel)."""
        untimed, self._untimed = self._untimed, []
        if untimed and not self.dry_run:
            await self._bounded(
                [self.client.suspend_gpu_kernel(k.id, "", cull_after=self.swapped_limit(k)) for k in untimed]
            )

    def _believable(self, kernel: GPUKernel, record: Mapping[str, Any]) -> GPUKernel:
        """The kernel with its GPU activity clamped to what the culler has seen.

        The activity record is written from inside the user's processes (the shim runs there), so
        a user can write any time into it, e.g. a launch a year from now, once. A last launch is
        believed no later than the moment the culler first saw that value: a record that does not
        change ages like any other. Where NVML can tell (:class:`GPUTimeCheck`), it is also
        believed no later than NVML last saw a process of the slice use SM time: a record that
        keeps changing without GPU work is not activity. Forgotten when the kernel is gone.
        """
        launch = kernel.gpu_last_launch
        if launch is None:
            self._launch_seen.pop(kernel.id, None)
            return kernel
        now = time.time()
        seen = self._launch_seen.get(kernel.id)
        if seen is None or seen[0] != launch:
            seen = (launch, now)
            self._launch_seen[kernel.id] = seen
            if launch > now + 60:
                self.log.warning(
                    "GPU kernel %s of %s: its activity record claims a GPU launch %s in the future; "
                    "counted from now instead",
                    kernel.kernel_id or kernel.id,
                    kernel.user,
                    human(launch - now),
                )
        believed = min(launch, seen[1])
        nvml = self._nvml_last_busy(kernel, record)
        if nvml is not None:
            believed = min(believed, nvml + self.nvml_sample_seconds)
        return kernel if believed == launch else replace(kernel, gpu_last_launch=believed)

    def _nvml_last_busy(self, kernel: GPUKernel, record: Mapping[str, Any]) -> float | None:
        if not self.nvml_cross_check or not kernel.allocation_id:
            return None
        allocation = record.get("allocation")
        uuids = allocation.get("gpu_uuids") if isinstance(allocation, Mapping) else None
        if not isinstance(uuids, list) or not uuids:
            return None
        if self._gpu_time is None:
            self._gpu_time = GPUTimeCheck(self.nvml_library)
        uuids = [str(u) for u in uuids]
        self._gpu_time.watch(uuids)
        return self._gpu_time.last_busy(kernel.allocation_id, uuids)

    def sample_gpu_time(self) -> None:
        """One NVML look at the watched GPUs (the service does this every nvml_sample_seconds)."""
        if self._gpu_time is not None:
            self._gpu_time.sample()

    async def _sample_forever(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.to_thread(self.sample_gpu_time)
            except Exception:  # a broken driver must not stop reclaiming
                self.log.exception("NVML sample failed")
            try:
                await asyncio.wait_for(self._stop.wait(), self.nvml_sample_seconds)
            except asyncio.TimeoutError:
                pass

    def _waiting(self, pool: Mapping[str, Any] | None) -> list[Waiter]:
        if not pool:
            return []
        classes = pool.get("priority_classes")
        if isinstance(classes, Mapping) and self.rules is not None:
            values = {}
            for name, pc in classes.items():
                value = pc.get("value") if isinstance(pc, Mapping) else pc
                if isinstance(value, int) and not isinstance(value, bool):
                    values[str(name)] = value
            if values and values != dict(self.rules.priority_values):
                self.rules = replace(self.rules, priority_values={**self.rules.priority_values, **values})
        queue = pool.get("queue", pool.get("waiting"))
        if not isinstance(queue, list):
            return []
        out = []
        for entry in queue:
            if isinstance(entry, Mapping):
                try:
                    out.append(Waiter.from_entry(entry))
                except (TypeError, ValueError):
                    self.metrics.errors.labels("queue").inc()
        return out

    async def run_cycle(self) -> CycleReport:
        """Gather, decide, warn, reclaim. Never raises for a failed call: the report says what failed."""
        assert self.client is not None and self.rules is not None and self.store is not None
        report = CycleReport(started=time.time())
        t0 = time.monotonic()
        try:
            await self._cycle(report)
        except HubUnavailable as e:
            report.error = str(e)
            self.metrics.errors.labels("broker").inc()
            self.log.warning("Culling cycle skipped: the GPU broker did not answer (%s)", e)
        report.seconds = time.monotonic() - t0
        self.metrics.cycle.observe(report.seconds)
        self.metrics.last_cycle.set(time.time())
        return report

    async def _cycle(self, report: CycleReport) -> None:
        client, store = self.client, self.store
        records, pool = await asyncio.gather(client.gpu_kernels(), client.gpu_pool())
        if not self._swap_said:  # the broker had not started when the culler did
            self._swap_said = self.note_swap(pool)
        kernels = self._parse(records)
        await self._tell_cull_times()
        waiting = self._waiting(pool)
        report.kernels, report.waiting = len(kernels), len(waiting)
        self.metrics.waiting.set(len(waiting))
        live = {w.request_id for w in waiting}
        self.pressure_credit = {r: v for r, v in self.pressure_credit.items() if r in live}
        store.keep_only(k.kernel_id for k in kernels)
        live_ids = {k.id for k in kernels}
        self._launch_seen = {i: v for i, v in self._launch_seen.items() if i in live_ids}

        views, report.servers_asked = await self._gather(kernels, pressure=bool(waiting))
        verdicts = decide(
            views,
            self.rules,
            time.time(),
            waiting=waiting,
            warnings=store.warnings,
            pressure_credit=self.pressure_credit,
        )
        report.verdicts = verdicts
        counts: dict[str, int] = {}
        for v in verdicts:
            counts[v.reason] = counts.get(v.reason, 0) + 1
        self.log.debug(
            "Cycle: %d GPU kernels, %d servers asked, %d waiting; verdicts %s",
            len(kernels),
            report.servers_asked,
            len(waiting),
            ", ".join(f"{r}={n}" for r, n in sorted(counts.items())) or "-",
        )
        self.metrics.kernels.clear()
        for reason, n in counts.items():
            self.metrics.kernels.labels(reason).set(n)
        self._checks = {}
        await self._act(verdicts, report, horizon=report.started + self.interval_seconds)
        if report.warned or report.culls:
            self.log.info(
                "Culling cycle: %d GPU kernels, %d servers asked, %d waiting requests, %d warned, %d culled in %.2f s",
                len(kernels),
                report.servers_asked,
                len(waiting),
                len(report.warned),
                sum(1 for c in report.culls if c.freed),
                time.time() - report.started,
            )

    async def _gather(self, kernels: list[GPUKernel], pressure: bool) -> tuple[list[KernelView], int]:
        """Join each kernel's Jupyter state, asking only the servers of kernels the GPU signal does not rule out."""
        now = time.time()
        wanted: dict[tuple[str, str, str], list[GPUKernel]] = {}
        for k in kernels:
            warned = self.store.get(k.kernel_id) is not None
            if needs_jupyter_state(k, self.rules, now, pressure=pressure, warned=warned):
                wanted.setdefault((k.user, k.server_name, k.server_url), []).append(k)
        answers = await self._bounded([self.client.server_kernels(user, server, url) for (user, server, url) in wanted])
        by_server: dict[tuple[str, str, str], ServerKernels] = dict(zip(wanted, answers, strict=True))
        views = []
        for k in kernels:
            answer = by_server.get((k.user, k.server_name, k.server_url))
            if answer is None:
                views.append(KernelView(k))
            elif answer.status == "ok":
                model = answer.kernels.get(k.kernel_id)
                if model is None:
                    views.append(KernelView(k, None, "gone"))
                else:
                    views.append(KernelView(k, JupyterState.from_model(model), "ok"))
            else:
                if answer.status == "unknown":
                    self.metrics.errors.labels("server").inc()
                views.append(KernelView(k, None, answer.status))
        return views, len(wanted)

    async def _act(self, verdicts: list[Verdict], report: CycleReport, horizon: float) -> None:
        """Warn and cull as decided; remember kernels that fall due before ``horizon`` (the next cycle)."""
        store = self.store
        void = [v.kernel for v in verdicts if v.extra.get("warning_void")]
        for k in void:
            store.drop(k.kernel_id)
        if void and not self.dry_run:  # used since its warning: the page's countdown ends
            await self._bounded([self.client.tell_idle(k.id, None) for k in void])
        for v in verdicts:
            check_at = v.extra.get("check_at", v.due_at)
            if v.action == "keep" and check_at is not None and check_at < horizon:
                self._checks[v.kernel.id] = (max(check_at, time.time() + 0.5), v.kernel)
        to_warn = [v for v in verdicts if v.action == "warn"]
        to_cull = [v for v in verdicts if v.action == "cull"]
        if to_warn:
            results = await self._bounded([self._warn(v, report.waiting) for v in to_warn])
            report.warned += [v.kernel.kernel_id for v, ok in zip(to_warn, results, strict=True) if ok]
            for v in to_warn:  # look again when its grace period ends
                if v.due_at is not None and v.due_at < horizon:
                    self._checks[v.kernel.id] = (v.due_at, v.kernel)
            store.save()
        if to_cull:
            culls = list(await self._bounded([self._cull(v) for v in to_cull]))
            report.culls += culls
            for result in culls:
                request_id = result.verdict.extra.get("request_id")
                if request_id and result.freed:
                    self.pressure_credit[request_id] = (
                        self.pressure_credit.get(request_id, 0) + result.verdict.kernel.freed_memory_mib
                    )
                if result.freed:
                    store.drop(result.verdict.kernel.kernel_id)
        store.save()

    async def run_due_checks(self) -> CycleReport:
        """Between cycles: look again at the kernels that fall due now (their timeout or grace ends),
        so a slice comes back within moments of its timeout rather than at the next cycle."""
        report = CycleReport(started=time.time())
        now = report.started
        due = [k for (at, k) in self._checks.values() if at <= now]
        for k in due:
            self._checks.pop(k.id, None)
        horizon = self._next_cycle_at
        answers = await self._bounded([self.client.gpu_kernel(k.id) for k in due])
        kernels = self._parse([record for status, record in answers if status == "present"])
        if kernels:
            views, report.servers_asked = await self._gather(kernels, pressure=False)
            verdicts = decide(views, self.rules, time.time(), warnings=self.store.warnings)
            report.kernels, report.verdicts = len(kernels), verdicts
            await self._act(verdicts, report, horizon=horizon)
        report.seconds = time.time() - report.started
        return report

    async def _bounded(self, coros: list) -> list:
        sem = asyncio.Semaphore(max(1, self.concurrency))

        async def one(c):
            async with sem:
                return await c

        return await asyncio.gather(*(one(c) for c in coros))


def _has_activity(record: Mapping[str, Any]) -> bool:
    return "activity" in record or any(
        k in record for k in ("last_launch", "gpu_last_launch", "memory_used_mib", "gpu_memory_used_mib")
    )
