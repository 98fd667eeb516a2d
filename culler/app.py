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
from typing import Any
from urllib.parse import urlparse

from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import Bool, Dict, Float, Integer, Unicode, default
from traitlets import Callable as CallableTrait
from traitlets.config import Application, Config

from . import HUB_SETTINGS_ENV, __version__
from .activity import GPUTimeCheck, regions_activity
from .cycle import CycleMixin, CycleReport
from .hub import HubClient
from .metrics import CullerMetrics
from .model import GPUKernel
from .policy import PolicyBook, PolicyError, Rules
from .reclaim import FREE_STATES, CullResult, ReclaimMixin
from .service import HealthHandler, MetricsHandler, make_hub_auth
from .state import WarningStore
from .warn import WarnMixin

__all__ = ["FREE_STATES", "CullResult", "CycleReport", "GPUCuller", "main"]


class GPUCuller(CycleMixin, WarnMixin, ReclaimMixin, Application):
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
        which JupyterLab shows in the notebook's Log Console); 0 = no warning. A kernel that is
        shut down gets the whole grace period after its warning; one swapped out instead (its
        state kept) is swapped at its timeout whatever the warning. Default: 300.""",
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
        #: whether the hub's answer to "can kernels be swapped out?" was logged
        self._swap_said = False
        #: swapped-out kernels whose cull time the broker does not know yet (culler.cycle)
        self._untimed: list[GPUKernel] = []

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
            keeps_state=self.will_swap,
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
        args = {"culler": self, "hub_auth": make_hub_auth(self)}
        handlers = [(r, MetricsHandler if r.endswith("metrics") else HealthHandler, args) for r in routes]
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
        try:
            pool = await self.client.gpu_pool()
        except Exception:  # noqa: BLE001 - the start line says "not known yet"; the cycles ask again
            pool = None
        self._swap_said = self.note_swap(pool, at_start=True)
        self.log.info(
            "GPU culler started: every %gs, idle timeout %gs, warning %gs, pressure min idle %s, cull_connected=%s%s; "
            "at their timeout idle kernels are %s; hub %s, servers via %s",
            self.interval_seconds,
            self.idle_timeout_seconds,
            self.warning_seconds,
            self.pressure_min_idle_seconds,
            self.cull_connected,
            " (dry run)" if self.dry_run else "",
            self.at_timeout(pool),
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

    def at_timeout(self, pool: Mapping[str, Any] | None) -> str:
        """What happens to idle kernels at their timeout, as the hub's pool answer says."""
        if not self.swap_idle_kernels:
            return "shut down (state lost)"
        capability = (pool or {}).get("swap_capability")
        if not isinstance(capability, Mapping):
            return "swapped out where the broker can (not known yet), else shut down"
        if capability.get("able"):
            return "swapped out (state kept), or shut down where a kernel cannot be"
        return f"shut down (state lost): they cannot be swapped out here ({capability.get('why_not')})"

    def note_swap(self, pool: Mapping[str, Any] | None, at_start: bool = False) -> bool:
        """``swap_idle_kernels`` on a hub whose kernels cannot be swapped out: one warning, with the
        reason. True once the hub's answer is known (nothing more to say)."""
        if not self.swap_idle_kernels:
            return True
        capability = (pool or {}).get("swap_capability")
        if not isinstance(capability, Mapping) or not isinstance(capability.get("able"), bool):
            return False
        if not capability["able"]:
            self.log.warning(
                "GPUCuller.swap_idle_kernels is on, but the hub's GPU kernels cannot be swapped out: %s. Idle "
                "kernels are shut down at their timeout and lose their state",
                capability.get("why_not") or "no reason given",
            )
        elif not at_start:
            self.log.info("The hub's GPU kernels can be swapped out: idle kernels keep their state at their timeout")
        return True

    def start(self) -> None:
        asyncio.run(self.main())


main = GPUCuller.launch_instance
