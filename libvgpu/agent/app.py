"""The node agent application: ``python -m libvgpu.agent --node-name N --metrics-port 9400
--config /etc/elastic-gpu/config.yaml --host-lib-dir /var/lib/elastic-gpu``.

One asyncio loop of periodic jobs, each woken early by a watch where one helps; each concern is a
mixin in its own module: the inventory, checkpoint capability and card health on the Node
(:mod:`.publication`), the pods and processes (:mod:`.podview`), the metrics snapshot, burst
looks and activity annotations (:mod:`.refresh`), the hub's swap requests (:mod:`.swaps`), the
backstop check (:mod:`.enforcement`) and the watches (:mod:`.watches`). Xid events are waited
for in one thread (the NVML wait blocks). This module keeps the settings, the start and the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tornado.web
import yaml
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from traitlets import Bool, Dict, Enum, Float, Integer, List, TraitError, Unicode, default
from traitlets.config import Application, Config

from libvgpu import ShimNotBuilt, health
from libvgpu.backstop import REASONS, Backstop
from libvgpu.checkpoint import CudaCheckpoint
from libvgpu.regions import NodeGPU
from quotas import ConfigError

from . import inventory, swap
from .activity import ActivityPublisher
from .cards import CardAccess
from .enforcement import BackstopCheck
from .install import install_shim
from .kube import Kube, KubeError
from .metrics import AgentMetrics
from .nvml import NVML, GPUInfo, NVMLUnavailable, XidWatcher
from .pods import PodInfo
from .podview import PodView
from .publication import NodePublication
from .reclaims import ReclaimPublisher
from .refresh import Refresh
from .relay import Relay
from .swaps import SwapRequests
from .watches import Watches

BACKENDS = ("native", "hami", "mig", "whole")
CONFIG_SECTIONS = ("NodeAgent", "Backstop")


class AgentError(Exception):
    """A start-up problem the agent cannot run with; the message is one line saying what to fix."""


class NodeAgent(NodePublication, PodView, Refresh, SwapRequests, BackstopCheck, Watches, Application):
    """The node agent on a GPU node: its settings, its start and its jobs (each concern's in its
    own module, mixed in here)."""

    name = "elastic-gpu-node-agent"
    description = """The elastic-gpu node agent (a DaemonSet on every GPU node).

    Finds the node's GPUs with NVML and publishes them on its Node (label
    elastic-gpu.jupyter.org/gpu-node=true, annotation elastic-gpu.jupyter.org/gpus), installs
    libvgpu.so into --host-lib-dir, serves Prometheus metrics on --metrics-port (per GPU and per
    allocation), and runs the enforcement backstop.

    --config names a YAML file of traitlets settings by class, e.g.

        NodeAgent: {pod_namespace: jhub, refresh_interval_seconds: 5}
        Backstop: {action: kill, tolerance_mib: 256, interval_seconds: 5}

    (all options: --help-all). Flags given on the command line win over the file.
    """

    aliases = {
        "node-name": "NodeAgent.node_name",
        "metrics-port": "NodeAgent.metrics_port",
        "config": "NodeAgent.config_file",
        "host-lib-dir": "NodeAgent.host_lib_dir",
        "log-level": "Application.log_level",
    }
    flags: dict = {}

    node_name = Unicode(
        config=True,
        help="Name of the Node this agent runs on (the DaemonSet passes spec.nodeName). Default: $NODE_NAME.",
    )

    @default("node_name")
    def _default_node_name(self) -> str:
        return os.environ.get("NODE_NAME", "")

    metrics_port = Integer(
        9400, min=1, max=65535, config=True, help="Port of the Prometheus /metrics endpoint. Default: 9400."
    )
    metrics_ip = Unicode("0.0.0.0", config=True, help="Address the metrics endpoint listens on. Default: all.")
    config_file = Unicode("", config=True, help="YAML file of settings (NodeAgent:/Backstop: sections). Default: none.")
    host_lib_dir = Unicode(
        "/var/lib/elastic-gpu",
        config=True,
        help="""Host directory (a hostPath) where the agent installs lib/libvgpu.so (+ proxies),
        ld.so.preload and regions/ (the shim's node regions). GPU pods mount it through the
        chart's claim of it (the spawner's gpu_host_claim). Default: /var/lib/elastic-gpu.""",
    )
    container_lib_dir = Unicode(
        "/usr/local/lib/elastic-gpu",
        config=True,
        help="""Where GPU pods mount <host-lib-dir>/lib: ld.so.preload names libvgpu.so under this
        path. Default: /usr/local/lib/elastic-gpu (what the spawner mounts).""",
    )
    backend = Enum(
        list(BACKENDS),
        config=True,
        help="""How slices reach the cards: 'native' (libvgpu: installs the shim, reads its regions),
        'hami', 'mig' or 'whole'. Default: $ELASTIC_GPU_BACKEND, else 'native'.""",
    )

    @default("backend")
    def _default_backend(self) -> str:
        return os.environ.get("ELASTIC_GPU_BACKEND", "native") or "native"

    install_shim = Bool(
        True, config=True, help="Install libvgpu into --host-lib-dir (native backend only). Default: True."
    )
    publish_inventory = Bool(True, config=True, help="Publish the GPUs on the Node. Default: True.")
    nvml_library = Unicode(
        "", config=True, help="Path of the NVML library to load. Default: libnvidia-ml.so.1 from the loader's path."
    )
    proc_root = Unicode(
        "/proc",
        config=True,
        help="""The host's /proc (the agent runs with hostPID): where a process's cgroup names its
        pod. Default: /proc.""",
    )
    cgroup_root = Unicode(
        "/sys/fs/cgroup",
        config=True,
        help="""The host's cgroup filesystem: where a swapped-out kernel resuming on another card of
        this node is allowed that card in its container's device cgroup (cgroup v1; on cgroup v2
        the agent cannot widen a running container's device filter, and resumes go back to their
        own card). Default: /sys/fs/cgroup.""",
    )
    pod_namespace = Unicode(
        "",
        config=True,
        help="""Namespace of the GPU pods (the hub's user namespace). Empty: pods of every
        namespace (needs a cluster-wide list right). Default: empty.""",
    )
    extra_pod_namespaces = List(
        Unicode(),
        config=True,
        help="""More namespaces of GPU pods, besides pod_namespace: the user namespaces of the other
        hubs that slice this node's cards (releases sharing a claims namespace), so their pods'
        processes are matched to their slices, not taken for processes without one. Ignored when
        pod_namespace is empty (every namespace). Default: none.""",
    )
    node_event_namespace = Unicode(
        "default",
        config=True,
        help="Namespace of Events about the Node (the API server accepts 'default' for them). Default: default.",
    )
    default_mode = Enum(
        ["shared", "whole"],
        config=True,
        help="""Mode published for cards not in MIG mode: 'shared' (slices) or 'whole'.
        Default: 'whole' with the whole backend, else 'shared'.""",
    )

    @default("default_mode")
    def _default_mode(self) -> str:
        return "whole" if self.backend == "whole" else "shared"

    memory_oversub = Float(1.0, min=0.01, config=True, help="memory_oversub published for every GPU. Default: 1.0.")
    cores_oversub = Float(1.0, min=0.01, config=True, help="cores_oversub published for every GPU. Default: 1.0.")
    gpu_overrides = Dict(
        config=True,
        help="""Per-GPU settings published instead of the defaults, keyed by GPU uuid or index:
        {"0": {mode: whole}, "GPU-8f3c...": {memory_oversub: 1.5, model: H100-80GB}}.
        Keys: mode, memory_oversub, cores_oversub, model.""",
    )
    refresh_interval_seconds = Float(
        5.0, min=0.1, config=True, help="Seconds between two metrics snapshots (NVML, regions, pods). Default: 5."
    )
    inventory_interval_seconds = Float(
        60.0, min=1.0, config=True, help="Seconds between two GPU discoveries (republished when changed). Default: 60."
    )
    recovery_hold_down_seconds = Float(
        600.0,
        min=0.0,
        config=True,
        help="""Seconds a card out of service after a fatal Xid must answer NVML again, with no new
        fatal Xid, before the agent puts it back in service itself; only a card the agent saw lost
        (NVML answering nothing for it, as after Xid 79 until a reset) comes back so, probed every
        inventory_interval_seconds. 0: only an admin clears cards. Default: 600.""",
    )
    relay_interval_seconds = Float(
        0.05,
        min=0.0,
        config=True,
        help="""Seconds between two copies of the GPU pods' entries into the node regions (native
        backend): pods mount the node regions read-only, and each container's priority, memory
        in use, last launch and burst waits reach the other pods on its cards this much later at
        most (libvgpu.agent.relay). 0: not relayed (pods that can write the node regions write
        their own entries). Default: 0.05.""",
    )
    pod_refresh_seconds = Float(
        30.0,
        min=0.1,
        config=True,
        help="""Seconds between two lists of this node's pods; a process of a pod not seen yet
        triggers a list at once. Default: 30.""",
    )
    publish_activity = Bool(
        True,
        config=True,
        help="""Publish each GPU pod's GPU activity (last kernel launch, memory in use, from the
        shim's node regions; native backend only) on the pod as the annotation
        elastic-gpu.jupyter.org/gpu-activity, for the culler. Needs patch on pods. Default: True.""",
    )
    activity_interval_seconds = Float(
        30.0,
        min=0.0,
        config=True,
        help="""At most one patch of a pod's gpu-activity annotation per this many seconds for small
        changes (a later launch, a little more memory); a first launch, a launch this much after the
        published one, or memory moving by activity_memory_step_mib is patched at once, an unchanged
        value never. Default: 30.""",
    )
    burst_sample_seconds = Float(
        0.5,
        min=0.0,
        config=True,
        help="""Seconds between two looks at NVML's per-process samples (SM time, memory held) on the
        shared cards, which measure what each elastic slice uses above its request; the running
        total is published in the pod's gpu-activity annotation (burst_gpu_seconds) and metering
        bills it (never the pod's own activity file). A driver keeps its samples about a second:
        keep it under that. Looks are made only while an elastic pod runs on the node (native
        backend, publish_activity on). 0: burst is not metered. Default: 0.5.""",
    )
    activity_memory_step_mib = Integer(
        256,
        min=1,
        config=True,
        help="Change in a pod's GPU memory (MiB) that is patched at once. Default: 256.",
    )
    swap_interval_seconds = Float(
        2.0,
        min=0.0,
        config=True,
        help="""Seconds between two looks (a list of this node's pods) for the hub's requests to swap
        a kernel pod's GPU state out or in (annotation elastic-gpu.jupyter.org/swap), which the agent
        carries out with the driver's checkpoint API on the pod's host pids. A watch of the node's
        pods wakes it as soon as a request comes; the looks are the fallback when the watch
        breaks. 0: never swap. Default: 2.""",
    )
    cuda_library = Unicode(
        "libcuda.so.1",
        config=True,
        help="The CUDA driver library checkpoints go through (driver 570+). Default: libcuda.so.1.",
    )
    k8s_api_request_timeout = Float(10.0, min=0.1, config=True, help="Seconds to wait for one Kubernetes API call.")

    classes = [Backstop]
    #: the node's checkpoint capability (JSON) as probed at start (None until then)
    _checkpoint_text: str | None = None

    @default("log_level")
    def _default_log_level(self) -> int:
        return logging.INFO

    @default("log_format")
    def _default_log_format(self) -> str:
        return "[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s] %(message)s"

    # ---- start-up ------------------------------------------------------------------------

    def initialize(self, argv: Sequence[str] | None = None) -> None:
        self.parse_command_line(argv)
        cli = self.cli_config
        where = f"--config {self.config_file}" if self.config_file else "command line"
        try:
            if self.config_file:
                self.update_config(load_yaml_config(self.config_file))
                self.update_config(cli)  # the command line wins
            self.backstop = Backstop(parent=self)
        except TraitError as e:
            raise AgentError(f"{where}: invalid setting: {_trait_message(e)}") from e
        if not self.node_name:
            raise AgentError("--node-name is required (or $NODE_NAME): the Node to publish the GPUs on")
        try:
            inventory.check_overrides(self.gpu_overrides)
        except ConfigError as e:
            raise AgentError(f"{where}: {e}") from e

    def start(self) -> None:
        asyncio.run(self.run())

    # ---- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        self.nvml = NVML(self.nvml_library)
        self.nvml.init()  # NVMLUnavailable: main() prints its one line
        self.gpus: list[GPUInfo] = self.nvml.discover()
        driver = self.nvml.driver_version()
        self.log.info(
            "Node %s: %d GPU(s)%s: %s",
            self.node_name,
            len(self.gpus),
            f" (driver {driver})" if driver else "",
            ", ".join(f"{g.index}={g.model} {g.uuid}{' MIG' if g.mig_enabled else ''}" for g in self.gpus) or "none",
        )
        self.metrics = AgentMetrics(self.node_name, self.backend, driver)
        self.metrics.declare_gpus(self.gpus, REASONS)
        if self.backend == "native" and self.install_shim:
            try:
                done = install_shim(self.host_lib_dir, self.container_lib_dir, gpus=[g.uuid for g in self.gpus])
            except ShimNotBuilt as e:
                raise AgentError(str(e)) from e
            except OSError as e:
                raise AgentError(
                    f"cannot install libvgpu into {self.host_lib_dir} ({e.strerror or e}): mount it "
                    "writable (the chart's host-lib hostPath)"
                ) from e
            self.log.info(
                "libvgpu in %s (%s); ld.so.preload -> %s/libvgpu.so",
                done.lib_dir,
                "updated " + ", ".join(done.changed) if done.changed else "already current",
                self.container_lib_dir,
            )
            for problem in done.region_problems:
                self.log.warning(
                    "Node region not made (GPU pods on that card hold no priority, see no bursts of others): %s",
                    problem,
                )
        self.kube = Kube(self.node_name, self.k8s_api_request_timeout)
        try:
            await self.kube.connect()
        except Exception as e:  # ConfigException, bad kubeconfig
            raise AgentError(f"no Kubernetes API configuration ({e}): run in a pod, or set KUBECONFIG") from e
        self._loop = asyncio.get_running_loop()
        self._fatal: dict[str, health.OutOfService] = {}  # fatal Xids the node does not show yet
        self._out_of_service: dict[str, health.OutOfService] = {}  # what the node shows
        self._health_wake = asyncio.Event()
        self._recovery = health.Recovery(self.recovery_hold_down_seconds)
        self.xid = XidWatcher(self.nvml, [g.uuid for g in self.gpus], self._on_xid)
        self.xid.start()
        if not self.xid.supported:
            self.log.info("Xid errors are not counted (no NVML event set: %s)", self.xid.reason or "unsupported")
        server = self._serve_metrics()
        self._published: str | None = None
        self._pods: dict[str, PodInfo] = {}
        self._pods_at = 0.0
        self._pods_lock = asyncio.Lock()
        self._warned_pod_names = False
        self._regions: dict[str, NodeGPU] = {}
        self._relay: Relay | None = None  # the node regions' writer (native backend, relay on)
        self.activity = ActivityPublisher(
            self._annotate_activity,
            self.log,
            interval_seconds=self.activity_interval_seconds,
            memory_step_mib=self.activity_memory_step_mib,
        )
        self.reclaims = ReclaimPublisher(self._annotate_reclaim, self.log)
        self._start_burst()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        self.checkpoint = CudaCheckpoint(self.cuda_library) if self.swap_interval_seconds > 0 else None
        self.cards = CardAccess(self.proc_root, self.cgroup_root)
        self._checkpoint_text = json.dumps(await asyncio.to_thread(swap.probe, self.checkpoint, driver, self.cards))
        self.log.info("Checkpoints (swapping kernel pods out): %s", swap.probe_line(self._checkpoint_text))
        await self._publish()
        await self._refresh()
        self._inventory_wake = asyncio.Event()
        tasks = [
            asyncio.ensure_future(
                self._every(self.inventory_interval_seconds, self._rediscover, "inventory", self._inventory_wake)
            ),
            asyncio.ensure_future(self._watch_uninstall()),
            asyncio.ensure_future(self._every(self.refresh_interval_seconds, self._refresh, "metrics refresh")),
            asyncio.ensure_future(self._every(self.backstop.interval_seconds, self._check, "backstop")),
            asyncio.ensure_future(
                self._every(self.inventory_interval_seconds, self._publish_health, "card health", self._health_wake)
            ),
        ]
        if self.backend == "native" and self.publish_activity and self.burst_sample_seconds > 0:
            tasks.append(asyncio.ensure_future(self._every(self.burst_sample_seconds, self._sample_burst, "burst")))
        namespaces = dict.fromkeys([self.pod_namespace, *self.extra_pod_namespaces]) if self.pod_namespace else [""]
        if self.backend == "native" and self.publish_activity:
            self._deletion_wake = asyncio.Event()
            tasks.append(asyncio.ensure_future(self._publish_deletions()))
        if self.backend == "native" and self.relay_interval_seconds > 0:
            relay = self._relay = Relay(Path(self.host_lib_dir) / "regions", self.proc_root)
            cards = [g.uuid for g in self.gpus if not g.mig_enabled]
            tasks.append(asyncio.ensure_future(relay.run(lambda: cards, self.relay_interval_seconds, self.log)))
        if self.checkpoint is not None:
            self._swap_wake = asyncio.Event()
            tasks.append(asyncio.ensure_future(self._swap_loop()))
        if self._swap_wake is not None or self._deletion_wake is not None:
            tasks += [asyncio.ensure_future(self._watch_pods(ns)) for ns in namespaces]
        try:
            await stop.wait()
        finally:
            self.log.info("Stopping")
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            server.stop()
            self.xid.stop()
            await self.kube.close()
            self.nvml.shutdown()

    async def _every(self, seconds: float, job: Any, what: str, wake: asyncio.Event | None = None) -> None:
        """Run ``job`` every ``seconds``, and at once when ``wake`` is set."""
        while True:
            if wake is None:
                await asyncio.sleep(seconds)
            else:
                try:
                    await asyncio.wait_for(wake.wait(), seconds)
                except asyncio.TimeoutError:
                    pass
                wake.clear()
            try:
                await job()
            except KubeError as e:
                self.log.warning("%s: %s (retrying)", what, e)
            except Exception:
                self.log.exception("%s failed (retrying)", what)

    def _serve_metrics(self) -> Any:
        registry = self.metrics.registry

        class MetricsHandler(tornado.web.RequestHandler):
            def get(self) -> None:
                self.set_header("Content-Type", CONTENT_TYPE_LATEST)
                self.write(generate_latest(registry))

        class HealthHandler(tornado.web.RequestHandler):
            def get(self) -> None:
                self.write("ok\n")

        app = tornado.web.Application([(r"/metrics", MetricsHandler), (r"/health", HealthHandler)])
        try:
            server = app.listen(self.metrics_port, self.metrics_ip, xheaders=False)
        except OSError as e:
            where = f"{self.metrics_ip}:{self.metrics_port}"
            raise AgentError(f"cannot serve metrics on {where} ({e.strerror or e})") from e
        self.log.info("Metrics on http://%s:%d/metrics", self.metrics_ip, self.metrics_port)
        return server


# ---- config file --------------------------------------------------------------------------


def load_yaml_config(path: str) -> Config:
    """The --config file as traitlets Config; AgentError naming the file and key when it is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise AgentError(f"--config {path}: cannot read it ({e.strerror or e})") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise AgentError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from e
    if data is None:
        return Config()
    if not isinstance(data, Mapping):
        raise AgentError(f"--config {path}: must be a mapping of {' / '.join(CONFIG_SECTIONS)} sections, got {data!r}")
    known = {"NodeAgent": NodeAgent, "Backstop": Backstop}
    for section, body in data.items():
        if section not in known:
            raise AgentError(f"--config {path}: unknown section {section!r} (allowed: {', '.join(CONFIG_SECTIONS)})")
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise AgentError(f"--config {path}: {section} must be a mapping of settings, got {body!r}")
        traits = known[section].class_traits(config=True)
        for key in body:
            if key not in traits:
                raise AgentError(
                    f"--config {path}: {section}.{key} is not a setting (allowed: {', '.join(sorted(traits))})"
                )
    return Config({k: dict(v or {}) for k, v in data.items()})


def _trait_message(e: TraitError) -> str:
    return " ".join(str(e).split())


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: one line on stderr and a non-zero exit for anything it cannot run with."""
    app = NodeAgent()
    try:
        app.initialize(argv)
        app.start()
    except NVMLUnavailable as e:
        print(f"elastic-gpu node agent: {e}", file=sys.stderr)
        sys.exit(3)
    except AgentError as e:
        print(f"elastic-gpu node agent: {e}", file=sys.stderr)
        sys.exit(2)
    except TraitError as e:
        print(f"elastic-gpu node agent: invalid setting: {_trait_message(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass
