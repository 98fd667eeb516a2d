"""The culler service: every interval, gather both signals for each GPU kernel, decide, warn, reclaim.

Runs as a JupyterHub service, managed by the hub (single-machine mode) or as its own Deployment
(Kubernetes). It needs the hub API URL and a service token (``JUPYTERHUB_API_URL``,
``JUPYTERHUB_API_TOKEN``, set by the hub for managed services) and the URL of the proxy through
which users' servers are reached (``GPUCuller.proxy_url``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlparse

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import Bool, Dict, Float, Integer, Unicode, default
from traitlets import Callable as CallableTrait
from traitlets.config import Application, Config

from . import HUB_SETTINGS_ENV, __version__
from .activity import GPUTimeCheck, regions_activity
from .hub import HubClient, HubUnavailable, ServerKernels
from .metrics import CullerMetrics
from .model import GPUKernel, GraceWarning, JupyterState, KernelView, RecordError, Verdict, Waiter
from .policy import PolicyBook, PolicyError, Rules, decide, needs_jupyter_state
from .state import WarningStore

#: confirmed-free states a broker record may report before it disappears
FREE_STATES = {"stopped", "released", "terminated", "deleted", "culled"}


@dataclass
class CullResult:
    verdict: Verdict
    method: str  # server | broker | failed | dry-run
    freed: bool
    seconds: float


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


class GPUCuller(Application):
    """Reclaim the GPU slices of idle GPU kernels; never a busy one."""

    name = "elastic-gpu-culler"
    description = __doc__
    version = __version__

    aliases = {
        "config": "GPUCuller.config_file",
        "interval": "GPUCuller.interval_seconds",
        "timeout": "GPUCuller.idle_timeout_seconds",
        "proxy-url": "GPUCuller.proxy_url",
        "metrics-port": "GPUCuller.metrics_port",
        "state-file": "GPUCuller.state_file",
        "log-level": "Application.log_level",
    }
    flags = {
        "dry-run": ({"GPUCuller": {"dry_run": True}}, "Decide and log, but warn and cull nothing."),
        "once": ({"GPUCuller": {"run_once": True}}, "Run one cycle and exit."),
    }

    # ---- where things are -----------------------------------------------------------------

    config_file = Unicode(
        "", config=True, help="A config file (.json or .py) with GPUCuller traits; the Helm chart mounts one."
    )
    api_url = Unicode(config=True, help="The hub's API URL. Default: $JUPYTERHUB_API_URL.")
    api_token = Unicode(config=True, help="The culler's service token. Default: $JUPYTERHUB_API_TOKEN.")
    service_name = Unicode(
        config=True, help="The service's name in the hub. Default: $JUPYTERHUB_SERVICE_NAME or 'gpu-culler'."
    )
    proxy_url = Unicode(
        config=True,
        help="""URL of the proxy through which users' servers are reached, e.g. http://127.0.0.1:8000 or
        http://proxy-public. Default: the origin of $JUPYTERHUB_PUBLIC_URL when the hub sets it.""",
    )
    base_url = Unicode(config=True, help="The hub's base URL prefix. Default: $JUPYTERHUB_BASE_URL or '/'.")

    @default("log_level")
    def _log_level_default(self) -> int:
        return logging.INFO

    @default("api_url")
    def _api_url(self) -> str:
        return os.environ.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api")

    @default("api_token")
    def _api_token(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    @default("service_name")
    def _service_name(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_NAME", "gpu-culler")

    @default("proxy_url")
    def _proxy_url(self) -> str:
        public = os.environ.get("JUPYTERHUB_PUBLIC_URL", "")
        if public:
            u = urlparse(public)
            return f"{u.scheme}://{u.netloc}"
        return ""

    @default("base_url")
    def _base_url(self) -> str:
        return os.environ.get("JUPYTERHUB_BASE_URL", "/")

    # ---- the loop -------------------------------------------------------------------------

    interval_seconds = Float(60.0, config=True, help="Seconds between the starts of two culling cycles. Default: 60.")
    run_once = Bool(False, config=True, help="Run one cycle and exit (for cron-style use and debugging).")
    dry_run = Bool(False, config=True, help="Decide and log what would be culled, but warn and cull nothing.")
    swap_idle_kernels = Bool(
        False,
        config=True,
        help="""Swap an idle GPU kernel out instead of culling it, where the broker can (its GPU
        memory goes to host memory, its slice back to the pool, the kernel and its variables live
        on; its next cell takes a slice again): the idle timeouts then say when a kernel is
        swapped out. A kernel that cannot be swapped out (old driver, checkpoint error, the
        host-memory cap) is culled as without this, with the broker's reason logged. Default: False.""",
    )
    cull_swapped_after_seconds = Float(
        0.0,
        config=True,
        help="""Seconds a kernel may stay swapped out before it is culled (it holds host memory,
        not a slice). 0: never. Per priority class and profile in priority_class_policies and
        profile_policies (key cull_swapped_after_seconds). Default: 0.""",
    )
    concurrency = Integer(
        32, config=True, help="Most HTTP calls in flight at once (server queries, shutdowns). Default: 32."
    )
    request_timeout_seconds = Float(10.0, config=True, help="Timeout of one HTTP call, seconds. Default: 10.")
    confirm_timeout_seconds = Float(
        15.0,
        config=True,
        help="""Seconds to wait, after shutting a kernel down through its server, for the broker to
        report its slice free before falling back to the broker's DELETE. Default: 15.""",
    )
    state_file = Unicode(
        "gpu-culler-state.json",
        config=True,
        help="""JSON file keeping the grace warnings sent, so a restarted culler neither warns twice nor
        takes its own warning for user activity. Relative to the working directory; '' keeps them in
        memory only. Default: gpu-culler-state.json.""",
    )

    # ---- policy: defaults, then per priority class, then per profile ----------------------

    idle_timeout_seconds = Float(
        3600.0,
        config=True,
        help="Cull a GPU kernel idle this long on both signals (Jupyter and GPU); 0 disables. Default: 3600.",
    )
    max_age_seconds = Float(
        0.0, config=True, help="Cull a GPU kernel this old at its first non-busy moment; 0 = no limit. Default: 0."
    )
    cull_connected = Bool(
        True,
        config=True,
        help="""Whether a kernel with an open websocket (a browser tab) but no activity may be culled.
        Default: True (a tab left open must not hold a GPU).""",
    )
    warning_seconds = Float(
        300.0,
        config=True,
        help="""Warn a connected kernel this many seconds before it is culled (a line on its stderr,
        which JupyterLab shows in the notebook's Log Console); 0 = no warning. Default: 300.""",
    )
    pressure_min_idle_seconds = Float(
        600.0,
        allow_none=True,
        config=True,
        help="""When requests wait for a GPU, kernels idle at least this long may be reclaimed before
        their timeout (lower priorities first); None = never early. Default: 600.""",
    )
    priority_class_policies = Dict(
        config=True,
        help="""Per priority class overrides of the policy keys above, e.g.
        {"high": {"idle_timeout_seconds": 14400, "pressure_min_idle_seconds": None},
         "low": {"idle_timeout_seconds": 900}}.""",
    )
    profile_policies = Dict(
        config=True,
        help="""Per profile (kernelspec or size name as the broker reports it) overrides of the policy
        keys; they win over the priority class's, e.g. {"gpu-80g": {"idle_timeout_seconds": 600}}.""",
    )
    gpu_busy_window_seconds = Float(
        60.0,
        config=True,
        help="""A GPU kernel launch within this many seconds makes a kernel busy: it is never culled,
        for any reason. Default: 60.""",
    )
    require_gpu_activity = Bool(
        True,
        config=True,
        help="""For a kernel with no GPU activity record (no shim): True = never cull it; False = judge
        it on its Jupyter activity alone. Default: True.""",
    )
    cull_orphans = Bool(
        True,
        config=True,
        help="""Reclaim, through the broker, GPU kernels whose server is gone or does not know them,
        once idle on the GPU for their timeout. Default: True.""",
    )
    priority_values = Dict(
        {"high": 1000, "default": 100, "low": 10},
        config=True,
        help="""Priority class -> value (higher wins), used to pick lower priorities first in pressure
        mode when the broker's pool answer does not carry them. Default: high 1000, default 100, low 10.""",
    )
    gpu_activity_hook = CallableTrait(
        default_value=regions_activity,
        config=True,
        help="""Callable(record) -> {"last_launch": epoch s or None, "memory_used_mib": int} or None,
        asked for a broker record without GPU activity. Default: read the shim's regions (libvgpu.regions).""",
    )

    nvml_cross_check = Bool(
        True,
        config=True,
        help="""Single machine: believe a kernel's activity record (written from inside the user's
        processes) no later than NVML last saw a process of its slice use SM time, sampled every
        nvml_sample_seconds. Where NVML cannot tell (no driver, simulated GPUs, no per-process
        samples) the record is judged on its own. Default: True.""",
    )
    nvml_sample_seconds = Float(
        5.0, config=True, help="Seconds between NVML looks at the slices' GPU time (nvml_cross_check). Default: 5."
    )
    nvml_library = Unicode(
        "", config=True, help="Path of the NVML library to load (default: libnvidia-ml.so.1 from the driver)."
    )

    # ---- the service's own HTTP endpoint --------------------------------------------------

    metrics_port = Integer(
        0,
        config=True,
        help="""Port serving /metrics (Prometheus) and /health. 0: the port of $JUPYTERHUB_SERVICE_URL when the
        hub gives one, else no endpoint. The Helm chart uses 9401.""",
    )
    metrics_ip = Unicode(
        config=True, help="Address to bind /metrics on. Default: the host of $JUPYTERHUB_SERVICE_URL, else 0.0.0.0."
    )
    authenticate_metrics = Bool(
        True,
        config=True,
        help="""Require a hub token allowed to access this service on /metrics (as JupyterHub's own
        authenticate_prometheus). Set False for a Prometheus scraping the pod directly. Default: True.""",
    )

    @default("metrics_ip")
    def _metrics_ip(self) -> str:
        url = os.environ.get("JUPYTERHUB_SERVICE_URL", "")
        return urlparse(url).hostname or "0.0.0.0" if url else "0.0.0.0"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metrics = CullerMetrics()
        self.store: WarningStore | None = None
        self.client: HubClient | None = None
        self.rules: Rules | None = None
        self.pressure_credit: dict[str, int] = {}
        self.http_server: HTTPServer | None = None
        self._stop: asyncio.Event | None = None  # created in the running loop
        #: kernels falling due before the next cycle: broker id -> (epoch seconds, kernel)
        self._checks: dict[str, tuple[float, GPUKernel]] = {}
        self._next_cycle_at = 0.0
        self._bad_records: set[str] = set()
        #: broker id -> (the last_launch its record gave, when the culler first saw that value)
        self._launch_seen: dict[str, tuple[float, float]] = {}
        self._gpu_time: GPUTimeCheck | None = None

    # ---- start-up -------------------------------------------------------------------------

    def initialize(self, argv: Sequence[str] | None = None) -> None:
        super().initialize(argv)
        from_hub = os.environ.get(HUB_SETTINGS_ENV, "")
        if from_hub:  # hub-managed: the hub's own c.GPUCuller settings (see culler.hub_settings)
            try:
                section = json.loads(from_hub)
            except ValueError:
                section = None
            if not isinstance(section, dict):
                self.exit_with(f"${HUB_SETTINGS_ENV} must be a JSON object of GPUCuller settings, got {from_hub!r}")
            self.update_config(Config({"GPUCuller": section}))
            self.update_config(self.cli_config)  # the command line wins over the hub's config
        if self.config_file:
            if not os.path.exists(self.config_file):
                self.exit_with(f"GPUCuller.config_file: {self.config_file} does not exist")
            self.load_config_file(self.config_file)
            self.update_config(self.cli_config)  # the command line wins over the file
        try:
            self.setup()
        except (PolicyError, ValueError) as e:
            self.exit_with(str(e))

    def exit_with(self, message: str) -> None:
        self.log.critical("%s", message)
        self.exit(2)

    def setup(self) -> None:
        """Check the configuration and build the rules; raise ValueError with a sentence to act on."""
        if not self.api_token:
            raise ValueError(
                "no hub API token: set JUPYTERHUB_API_TOKEN (the hub does for managed services) or GPUCuller.api_token"
            )
        if not self.proxy_url:
            raise ValueError(
                "GPUCuller.proxy_url is not set: give the URL through which users' servers are "
                "reached, e.g. --GPUCuller.proxy_url=http://127.0.0.1:8000"
            )
        if self.interval_seconds <= 0:
            raise ValueError(f"GPUCuller.interval_seconds must be > 0, got {self.interval_seconds}")
        defaults = {
            "idle_timeout_seconds": self.idle_timeout_seconds,
            "max_age_seconds": self.max_age_seconds,
            "cull_connected": self.cull_connected,
            "warning_seconds": self.warning_seconds,
            "pressure_min_idle_seconds": self.pressure_min_idle_seconds,
            "cull_swapped_after_seconds": self.cull_swapped_after_seconds,
        }
        book = PolicyBook.build(defaults, self.priority_class_policies, self.profile_policies)
        for name, value in self.priority_values.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise PolicyError(f"GPUCuller.priority_values.{name} must be an integer, got {value!r}")
        self.rules = Rules(
            book=book,
            gpu_busy_window_seconds=self.gpu_busy_window_seconds,
            require_gpu_activity=self.require_gpu_activity,
            cull_orphans=self.cull_orphans,
            priority_values=dict(self.priority_values),
        )
        self.store = WarningStore(self.state_file, log=self.log)
        self.store.load()

    def make_client(self) -> HubClient:
        return HubClient(
            self.api_url,
            self.proxy_url,
            self.api_token,
            base_url=self.base_url,
            request_timeout=self.request_timeout_seconds,
            concurrency=self.concurrency,
            log=self.log,
        )

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
            after = self.rules.book.for_kernel(k).cull_swapped_after_seconds if self.rules else 0.0
            return after > 0 and now - k.swapped_since >= after

        # pending, stopped, failed: not ours to judge
        return [k for k in kernels if k.state == "running" and (not k.swapped_since or due(k))]

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
                    _human(launch - now),
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
        kernels = self._parse(records)
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
        for v in verdicts:
            if v.extra.get("warning_void"):
                store.drop(v.kernel.kernel_id)
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
                f"has run for {_human(now - k.created_at)}, and a GPU kernel may run for at most "
                f"{_human(policy.max_age_seconds)} here"
            )
        else:
            why = (
                f"has been idle for {_human(v.idle_seconds)} (no cell running, no GPU work), and idle "
                f"GPU kernels are shut down after {_human(policy.idle_timeout_seconds)} here"
            )
        need = ""
        if waiting:
            need = f" {waiting} GPU request{'s are' if waiting != 1 else ' is'} waiting for room in the pool."
        if self.swap_idle_kernels and not k.swapped_since:
            return (
                f"[elastic-gpu] This kernel {why.replace('are shut down after', 'are swapped out after')}. "
                f"At {when}, in {_human(round(due - now))}, its GPU memory will be moved to host memory and its "
                f"GPU slice of {_mib(k.freed_memory_mib)} given back.{need} Your variables stay; the next cell "
                "takes a GPU again first (it may wait for one). Run any cell to keep it on the GPU now."
            )
        return (
            f"[elastic-gpu] This kernel {why}. It will be shut down at {when}, in {_human(round(due - now))}, "
            f"and its GPU slice of {_mib(k.freed_memory_mib)} given back.{need} "
            "Run any cell to keep it; your notebook file is not affected."
        )

    async def _warn(self, v: Verdict, waiting: int = 0) -> bool:
        k = v.kernel
        now = time.time()
        text = self.warning_text(v, now, waiting)
        if self.dry_run:
            self.log.info("[dry run] would warn kernel %s of %s: %s", k.kernel_id, k.user, text)
            return False
        ok = await self._print(v, text)
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
            _human(v.idle_seconds),
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

    # ---- reclaim --------------------------------------------------------------------------

    async def _cull(self, v: Verdict) -> CullResult:
        k = v.kernel
        t0 = time.monotonic()
        why = _cull_sentence(v)
        if self.dry_run:
            self.log.info("[dry run] would cull kernel %s of %s: %s", k.kernel_id, k.user, why)
            return CullResult(v, "dry-run", False, 0.0)
        self.log.info(
            "Culling GPU kernel %s of %s (server '%s', %s, %s): %s",
            k.kernel_id,
            k.user,
            k.server_name,
            k.priority_class,
            _mib(k.freed_memory_mib),
            why,
        )
        if self.swap_idle_kernels and not k.swapped_since:
            swapped, refusal = await self.client.suspend_gpu_kernel(k.id, why)
            if swapped:
                seconds = time.monotonic() - t0
                self.metrics.culls.labels(v.reason, k.priority_class, "swapped").inc()
                self.metrics.freed_memory.labels(v.reason, k.priority_class).inc(k.freed_memory_mib)
                self.log.info(
                    "Swapped out GPU kernel %s of %s (server '%s', %s, allocation %s) instead of culling it: %s; "
                    "freed %s of GPU memory in %.2f s",
                    k.kernel_id,
                    k.user,
                    k.server_name,
                    k.priority_class,
                    k.allocation_id or k.id,
                    why,
                    _mib(k.freed_memory_mib),
                    seconds,
                )
                return CullResult(v, "swapped", True, seconds)
            self.log.warning("GPU kernel %s of %s cannot be swapped out (%s): culling it", k.kernel_id, k.user, refusal)
        method = "server"
        if v.view.server_status == "ok":
            j = v.view.jupyter
            if j is not None and j.connections > 0 and self.store.get(k.kernel_id) is None:
                # someone is watching and was not warned (no grace period, or pressure): say why. The
                # notice is activity on the server: recorded like a warning, so that a culler killed
                # before the shutdown does not take it for the user's activity after its restart
                await self._print(v, f"[elastic-gpu] Shutting this kernel down to free its GPU slice: {why}.")
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
            self.metrics.freed_memory.labels(v.reason, k.priority_class).inc(k.freed_memory_mib)
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
                _human(v.idle_seconds),
                _mib(k.freed_memory_mib),
                "?" if used is None else _mib(used),
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

    async def _confirm_free(self, k: GPUKernel, timeout: float) -> bool:
        """Poll the broker until the kernel's slice is free (record gone or in a stopped state)."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            status, record = await self.client.gpu_kernel(k.id)
            if status == "gone":
                return True
            if status == "present" and str(record.get("state", "")) in FREE_STATES:
                return True
            if time.monotonic() + delay > deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    # ---- the service ----------------------------------------------------------------------

    def start_http(self) -> None:
        port = self.metrics_port
        prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/")
        if not port:
            url = os.environ.get("JUPYTERHUB_SERVICE_URL", "")
            port = urlparse(url).port if url else 0
        if not port:
            return
        routes = {"/metrics", "/health"}
        if prefix.strip("/"):
            routes |= {prefix.rstrip("/") + "/metrics", prefix.rstrip("/") + "/health"}
        handlers = [(r, MetricsHandler if r.endswith("metrics") else HealthHandler, {"culler": self}) for r in routes]
        app = web.Application(handlers)
        self.http_server = HTTPServer(app)
        self.http_server.listen(port, self.metrics_ip)
        self.log.info("Culler metrics on http://%s:%d%smetrics", self.metrics_ip, port, prefix)

    async def main(self) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        self.client = self.make_client()
        self.start_http()
        self._watch_hub_process()
        sampler = asyncio.ensure_future(self._sample_forever()) if self.nvml_cross_check else None
        self.log.info(
            "GPU culler started: every %gs, idle timeout %gs, warning %gs, pressure min idle %s, cull_connected=%s%s; "
            "hub %s, servers via %s",
            self.interval_seconds,
            self.idle_timeout_seconds,
            self.warning_seconds,
            self.pressure_min_idle_seconds,
            self.cull_connected,
            " (dry run)" if self.dry_run else "",
            self.api_url,
            self.proxy_url,
        )
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self._next_cycle_at = time.time() + self.interval_seconds
                try:
                    await self.run_cycle()
                except Exception:  # a bug must not stop reclaiming: log it, try again next interval
                    self.metrics.errors.labels("cycle").inc()
                    self.log.exception("Culling cycle failed")
                if self.run_once:
                    break
                while not self._stop.is_set():
                    left = started + self.interval_seconds - time.monotonic()
                    if left <= 0:
                        break
                    first = min((at for at, _ in self._checks.values()), default=None)
                    wait = left if first is None else min(left, max(0.05, first - time.time()))
                    try:
                        await asyncio.wait_for(self._stop.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                    if not self._stop.is_set() and self._checks and wait < left:
                        try:
                            await self.run_due_checks()
                        except Exception:
                            self.metrics.errors.labels("cycle").inc()
                            self.log.exception("Due check failed")
        finally:
            if sampler is not None:
                sampler.cancel()
            if self.store:
                self.store.save()
            if self.http_server:
                self.http_server.stop()
            self.client.close()
            self.log.info("GPU culler stopped")

    def _watch_hub_process(self) -> None:
        """A hub-managed culler stops when its hub dies (SIGKILL, OOM): it must not outlive it.

        JupyterHub stops managed services on a clean shutdown only; after a crash the next hub
        starts a new culler, and an orphaned one would cull beside it forever.
        """
        parent = os.getppid()
        if not os.environ.get("JUPYTERHUB_SERVICE_NAME") or parent == 1:
            return  # run by hand, or as its own Deployment (pid 1's child): nothing to follow

        async def follow() -> None:
            while not self._stop.is_set():
                if os.getppid() != parent:
                    self.log.warning("The hub (pid %d) is gone; the GPU culler stops with it", parent)
                    self._stop.set()
                    return
                await asyncio.sleep(1)

        self._hub_watch = asyncio.ensure_future(follow())

    def start(self) -> None:
        asyncio.run(self.main())


class _Base(web.RequestHandler):
    def initialize(self, culler: GPUCuller) -> None:
        self.culler = culler


class HealthHandler(_Base):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish({"status": "ok", "dry_run": self.culler.dry_run})


class MetricsHandler(_Base):
    async def get(self) -> None:
        if self.culler.authenticate_metrics and not await self._authorized():
            raise web.HTTPError(403, "a hub token with access to this service is required")
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(self.culler.metrics.registry))

    async def _authorized(self) -> bool:
        auth = self.request.headers.get("Authorization", "")
        token = auth.split(None, 1)[1] if auth.lower().startswith(("token ", "bearer ")) else ""
        if not token:
            return False
        name = self.culler.service_name
        return await _token_may_access(self.culler, token, name)


async def _token_may_access(culler: GPUCuller, token: str, service: str) -> bool:
    """Ask the hub whose token it is and whether its scopes include access to this service."""
    client = culler.client
    if client is None:
        return False
    try:
        resp = await client.http.fetch(
            f"{culler.api_url.rstrip('/')}/user",
            headers={"Authorization": f"token {token}"},
            raise_error=False,
            request_timeout=culler.request_timeout_seconds,
        )
    except (OSError, asyncio.TimeoutError):
        return False
    if resp.code != 200:
        return False
    model = HubClient._json(resp) or {}
    scopes = set(model.get("scopes") or [])
    return bool(scopes & {"access:services", f"access:services!service={service}"})


def _has_activity(record: Mapping[str, Any]) -> bool:
    return "activity" in record or any(
        k in record for k in ("last_launch", "gpu_last_launch", "memory_used_mib", "gpu_memory_used_mib")
    )


def _cull_sentence(v: Verdict) -> str:
    if v.reason == "pressure":
        return f"idle {_human(v.idle_seconds)} while GPU requests are waiting ({v.detail})"
    if v.reason == "max-age":
        return f"reached its maximum age of {_human(time.time() - v.kernel.created_at)}"
    if v.reason == "orphan":
        return f"its server is gone or does not know it, and its GPU was idle for {_human(v.idle_seconds)}"
    return f"idle for {_human(v.idle_seconds)} on both Jupyter and GPU"


def _human(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"


def _mib(mib: int) -> str:
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib} MiB"


main = GPUCuller.launch_instance
