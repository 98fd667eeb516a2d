"""The node agent application: ``python -m libvgpu.agent --node-name N --metrics-port 9400
--config /etc/elastic-gpu/config.yaml --host-lib-dir /var/lib/elastic-gpu``.

One asyncio loop with three periodic jobs: the inventory (NVML -> the Node's label and
annotation, republished when it changes), the metrics snapshot (NVML samples, node regions,
pods -> Prometheus), and the enforcement backstop (:mod:`libvgpu.backstop`). Xid events are
waited for in one thread (the NVML wait blocks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tornado.web
import yaml
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from traitlets import Bool, Dict, Enum, Float, Integer, List, TraitError, Unicode, default
from traitlets.config import Application, Config

from libvgpu import ShimNotBuilt, health
from libvgpu import contract as L
from libvgpu.backstop import EVENT_REASONS, REASONS, Backstop, Finding, Proc, Slice, evaluate
from libvgpu.burst import BurstCounter, Owners, Sample, elastic_slices, pids_seen, requests_on
from libvgpu.checkpoint import CudaCheckpoint
from libvgpu.elastic import reclaims_in
from libvgpu.regions import NodeGPU, read_node_regions, write_priority_table
from quotas import ConfigError

from . import inventory, swap
from .activity import ActivityPublisher, pod_activity
from .cards import CardAccess
from .install import install_shim
from .kube import Kube, KubeError, ObjectRef, dump_gpus
from .metrics import AgentMetrics, Snapshot
from .nvml import NVML, BurstLooks, GPUInfo, GPUProcess, NVMLUnavailable, XidWatcher
from .pods import PodInfo, pod_info, process_cgroup, process_name
from .reclaims import ReclaimPublisher
from .relay import Relay
from .uninstall import withdraw
from .usage import RegionMatch, allocation_usage, live_allocations, match_regions

BACKENDS = ("native", "hami", "mig", "whole")
CONFIG_SECTIONS = ("NodeAgent", "Backstop")


class AgentError(Exception):
    """A start-up problem the agent cannot run with; the message is one line saying what to fix."""


class NodeAgent(Application):
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
            tasks += [asyncio.ensure_future(self._watch_deletions(ns)) for ns in namespaces]
        if self.backend == "native" and self.relay_interval_seconds > 0:
            relay = self._relay = Relay(Path(self.host_lib_dir) / "regions", self.proc_root)
            cards = [g.uuid for g in self.gpus if not g.mig_enabled]
            tasks.append(asyncio.ensure_future(relay.run(lambda: cards, self.relay_interval_seconds, self.log)))
        if self.checkpoint is not None:
            self._swap_wake = asyncio.Event()
            tasks.append(asyncio.ensure_future(self._swap_loop()))
            tasks += [asyncio.ensure_future(self._watch_swaps(ns)) for ns in namespaces]
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

    def _on_xid(self, uuid: str, xid: int) -> None:  # from the Xid thread
        gpu = next((g for g in self.gpus if g.uuid == uuid), None)
        self.metrics.count_xid(gpu, uuid, xid)
        self.log.warning("Xid %d on GPU %s (%s)", xid, gpu.index if gpu else "?", uuid)
        if xid in health.FATAL_XIDS:  # in the loop's thread, where the probes run
            self._loop.call_soon_threadsafe(self._fatal_while_out, uuid, xid)
        if xid in health.FATAL_XIDS and gpu is not None and uuid not in {**self._fatal, **self._out_of_service}:
            self._fatal[uuid] = health.OutOfService(xid, time.time(), gpu.index)
            self.log.error(
                "GPU %d (%s) out of service: Xid %d (%s): no new slices on it until it recovers or an admin clears it "
                "(annotation %s of node %s)",
                gpu.index,
                uuid,
                xid,
                health.FATAL_XIDS[xid],
                L.NODE_GPU_HEALTH_ANNOTATION,
                self.node_name,
            )
            self._loop.call_soon_threadsafe(self._health_wake.set)

    def _fatal_while_out(self, uuid: str, xid: int) -> None:
        if uuid in self._out_of_service and self._recovery.fatal(uuid):
            self.log.warning(
                "GPU %d (%s) stays out of service: Xid %d (%s) restarts its %g s hold-down",
                self._out_of_service[uuid].index,
                uuid,
                xid,
                health.FATAL_XIDS[xid],
                self.recovery_hold_down_seconds,
            )

    async def _publish_health(self) -> None:
        """Add the cards with a new fatal Xid to the node's health annotation and take off those
        that recovered (health.Recovery); an admin clears a card by removing its entry, which the
        agent then forgets (libvgpu/health.py)."""
        text = await self.kube.node_annotation(L.NODE_GPU_HEALTH_ANNOTATION)
        try:
            shown = health.parse(text)
        except ValueError as e:
            self.log.warning(
                "Node %s: annotation %s is not the agent's (%s): rewriting it",
                self.node_name,
                L.NODE_GPU_HEALTH_ANNOTATION,
                e,
            )
            shown = {}
        pending = dict(self._fatal)
        recovered = await self._probe_out_of_service({u: c for u, c in shown.items() if u not in pending})
        wanted = {**pending, **{u: c for u, c in shown.items() if u not in recovered}}  # first Xid and time kept
        if wanted != shown or (text and not shown):
            await self.kube.annotate_node(L.NODE_GPU_HEALTH_ANNOTATION, health.dump(wanted))
        for uuid in pending:
            self._fatal.pop(uuid, None)
        for uuid in {*self._out_of_service, *recovered} - wanted.keys():  # recovered, or cleared by an admin
            self._recovery.forget(uuid)
        self._out_of_service = wanted

    async def _probe_out_of_service(self, cards: dict[str, health.OutOfService]) -> set[str]:
        """Probe each card out of service (health.Recovery); the cards that recovered."""
        recovered = set()
        for uuid, card in cards.items():
            step = self._recovery.probed(uuid, await asyncio.to_thread(self.nvml.answers, uuid), time.time())
            hold = self.recovery_hold_down_seconds
            if step == "lost":
                self.log.warning(
                    "GPU %d (%s) answers NVML nothing (lost after %s): it comes back in service "
                    "once it answers again, reset, for %g s",
                    card.index,
                    uuid,
                    card.meaning(),
                    hold,
                )
            elif step == "answering":
                self.log.info(
                    "GPU %d (%s) answers NVML again (reset after %s): back in service after %g s without a fatal Xid",
                    card.index,
                    uuid,
                    card.meaning(),
                    hold,
                )
            elif step == "recovered":
                recovered.add(uuid)
                self.log.warning(
                    "GPU %d (%s) back in service: it was reset after %s and answered NVML for %g s "
                    "without a fatal Xid (annotation %s of node %s)",
                    card.index,
                    uuid,
                    card.meaning(),
                    hold,
                    L.NODE_GPU_HEALTH_ANNOTATION,
                    self.node_name,
                )
        return recovered

    # ---- inventory -----------------------------------------------------------------------

    def gpu_objects(self) -> list[dict]:
        objs = inventory.gpu_objects(
            self.gpus,
            default_mode=self.default_mode,
            memory_oversub=self.memory_oversub,
            cores_oversub=self.cores_oversub,
            overrides=self.gpu_overrides,
        )
        inventory.validate(self.node_name, objs)
        return objs

    async def _publish(self) -> None:
        await self._publish_checkpoint()
        if not self.publish_inventory:
            return
        try:
            objs = self.gpu_objects()
        except ConfigError as e:
            self.log.error("Not publishing the GPU inventory, the pool would refuse it: %s", e)
            return
        text = dump_gpus(objs)
        try:
            label, current = await self.kube.node_inventory()
            if self.kube.uninstall_requested and not self.kube.uninstall_requested.startswith("done"):
                await withdraw(self)  # the chart is being uninstalled
                return
            want_label = "true" if objs else None
            if current == text and label == want_label:
                self._published = text
                return
            await self.kube.publish_inventory(text, bool(objs))
        except KubeError as e:
            self.log.warning("GPU inventory not published yet: %s (retrying)", e)
            return
        changed = "republished" if self._published is not None else "published"
        self._published = text
        self.log.info("GPU inventory %s on node %s: %d GPU(s)", changed, self.node_name, len(objs))

    async def _publish_checkpoint(self) -> None:
        """The node's checkpoint capability (probed at start) on the Node, so the hub promises a
        swap only where it can be done; repaired when someone else changed it."""
        if self._checkpoint_text is None:
            return  # not probed yet
        try:
            if await self.kube.publish_checkpoint(self._checkpoint_text):
                self.log.info("Checkpoint capability published on node %s", self.node_name)
        except KubeError as e:
            self.log.warning("Checkpoint capability not published yet: %s (retrying)", e)

    async def _rediscover(self) -> None:
        gpus = self.nvml.discover()
        if gpus != self.gpus:
            self.log.info("The node's GPUs changed: %d GPU(s) now", len(gpus))
            self.gpus = gpus
            self.metrics.declare_gpus(gpus, REASONS)
        await self._publish()  # also repairs an annotation someone else changed

    async def _watch_uninstall(self) -> None:
        """Wake the inventory publication (which withdraws) as soon as the uninstall hook
        annotates this node: `helm uninstall` waits for the answer. A broken watch only slows it
        down to the inventory read every inventory_interval_seconds."""

        def asked(node: Any) -> bool:
            value = (node.metadata.annotations or {}).get(L.NODE_UNINSTALL_ANNOTATION, "")
            return bool(value) and not value.startswith("done") and self.publish_inventory

        await self._wake_on(
            self.kube.watch_node, asked, self._inventory_wake,
            f"Watch of node {self.node_name} broke (%s); the uninstall annotation is read every "
            f"{self.inventory_interval_seconds:g} s meanwhile",
            min(30.0, self.inventory_interval_seconds),
        )  # fmt: skip

    async def _wake_on(
        self,
        watch: Callable[[], AsyncIterator[Any]],
        wanted: Callable[[Any], bool],
        wake: asyncio.Event,
        broke: str,
        retry_seconds: float,
    ) -> None:
        """Set ``wake`` whenever ``watch()`` yields an object ``wanted`` accepts; a broken watch is
        logged (``broke``, with the error for its %s) and started again after ``retry_seconds``."""
        while True:
            try:
                async for obj in watch():
                    if wanted(obj):
                        wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.warning(broke, e)
                await asyncio.sleep(retry_seconds)

    # ---- pods and processes --------------------------------------------------------------

    async def _node_pods(self, *, force: bool = False) -> dict[str, PodInfo]:
        async with self._pods_lock:
            if force or time.monotonic() - self._pods_at >= self.pod_refresh_seconds:
                if self.pod_namespace:
                    items = []
                    for namespace in dict.fromkeys([self.pod_namespace, *self.extra_pod_namespaces]):
                        items += await self.kube.node_pods(namespace)
                else:
                    items = await self.kube.node_pods("")
                self._pods = {p.uid: p for p in (pod_info(i) for i in items)}
                self._pods_at = time.monotonic()
            return self._pods

    async def _pods_of(self, pids: Sequence[int]) -> dict[int, PodInfo | None]:
        """Host pid -> its pod (None: not one of this node's pods we know)."""
        uids = {pid: process_cgroup(pid, self.proc_root) for pid in pids}
        pods = await self._node_pods()
        if any(c is not None and c.pod_uid not in pods for c in uids.values()):
            since = time.monotonic() - self._pods_at
            if since >= min(self.pod_refresh_seconds, self.backstop.interval_seconds):
                pods = await self._node_pods(force=True)
        return {pid: (pods.get(c.pod_uid) if c else None) for pid, c in uids.items()}

    async def _other_pods(self, pod_of_pid: dict[int, PodInfo | None]) -> dict[int, str]:
        """Host pid -> "namespace/name" of the pod of another workload it runs in (its cgroup
        names a pod that is not one of ours), or "uid <uid>" when the agent may not list it."""
        foreign = {}
        for pid, pod in pod_of_pid.items():
            cgroup = process_cgroup(pid, self.proc_root) if pod is None else None
            if cgroup is not None:
                foreign[pid] = cgroup.pod_uid
        if not foreign:
            return {}
        try:
            names = await self.kube.pods_on_node()
        except KubeError as e:
            if not self._warned_pod_names:
                self._warned_pod_names = True
                self.log.warning("Cannot name the pods of other workloads on this node: %s", e)
            names = {}
        return {pid: names.get(uid, f"uid {uid}") for pid, uid in foreign.items()}

    def _shared_cards(self) -> list[GPUInfo]:
        modes = {
            o["uuid"]: o["mode"]
            for o in inventory.gpu_objects(self.gpus, default_mode=self.default_mode, overrides=self.gpu_overrides)
        }
        return [g for g in self.gpus if modes.get(g.uuid) == "shared"]

    def _processes(self, gpus: Sequence[GPUInfo]) -> dict[str, list[GPUProcess]]:
        out: dict[str, list[GPUProcess]] = {}
        for g in gpus:
            if g.mig_enabled:
                continue
            try:
                out[g.uuid] = self.nvml.processes(g.uuid)
            except self.nvml.nv.NVMLError as e:
                self.log.debug("No process list for GPU %s: %s", g.uuid, e)
        return out

    def _write_priorities(self, pods: Sequence[PodInfo]) -> None:
        """The node regions' priority table: the shim believes an entry's priority only if
        this table (which containers cannot write) gives its allocation the same."""
        if self.backend != "native":
            return
        running = [
            p
            for p in pods
            if p.allocation is not None and p.priority is not None and p.phase not in ("Succeeded", "Failed")
        ]
        table = {p.allocation.id: p.priority for p in running}
        gpus = {p.allocation.id: p.allocation.gpu_uuids for p in running}
        try:
            if write_priority_table(Path(self.host_lib_dir) / "regions", table, gpus):
                self.log.info("Priority table of the node regions: %d allocation(s)", len(table))
        except OSError as e:
            self.log.warning("Priority table not written: %s (priorities are not applied)", e)

    def _read_regions(self) -> dict[str, NodeGPU]:
        if self.backend != "native":
            return {}
        return read_node_regions(Path(self.host_lib_dir) / "regions")

    # ---- metrics -------------------------------------------------------------------------

    async def _refresh(self) -> None:
        samples = {}
        for g in self.gpus:
            try:
                samples[g.uuid] = self.nvml.sample(g.uuid)
            except self.nvml.nv.NVMLError as e:
                self.log.warning("GPU %s: no sample (%s)", g.uuid, e)
        processes = self._processes(self.gpus)
        try:
            pod_of_pid = await self._pods_of([p.pid for ps in processes.values() for p in ps])
        except KubeError as e:
            self.log.warning("Pods of node %s not listed: %s (usage per allocation may be stale)", self.node_name, e)
            pod_of_pid = {}
        pods = list(self._pods.values())
        self._write_priorities(pods)
        self._regions = self._read_regions()
        usage = allocation_usage(pods, self._regions, processes, pod_of_pid)
        self.metrics.update(
            Snapshot(
                gpus=list(self.gpus),
                samples=samples,
                allocations=usage,
                xid_supported={g.uuid: self.xid.supported for g in self.gpus},
                out_of_service=dict(self._out_of_service),
            )
        )
        if self.publish_activity and self.backend == "native":
            await self.activity.publish(pod_activity(pods, usage, self._regions, self.burst.totals))
        if self.backend == "native":
            await self.reclaims.publish(pods, reclaims_in(self._regions))

    def _start_burst(self) -> None:
        """Counting burst from zero: the running totals, the pids' last slices, the cards' looks."""
        self.burst, self._burst_owners, self._burst_nvml = BurstCounter(), Owners(), BurstLooks(self.nvml, self.log)

    async def _sample_burst(self) -> None:
        """One look at the shared cards that hold elastic slices: NVML's samples and memory per
        process, each process's pod from its cgroup (the kernel's word), into ``self.burst``."""
        elastic = elastic_slices(p.allocation for p in live_allocations(list(self._pods.values())))  # type: ignore[misc]
        self.burst.forget(a.id for a in elastic)
        cards = [g for g in self.gpus if not g.mig_enabled and any(g.uuid in a.gpu_uuids for a in elastic)]
        if not cards:
            return
        looks = await asyncio.to_thread(self._burst_looks, cards)
        pids = sorted(pids_seen((samples, memory) for samples, memory, _ in looks.values()))
        pod_of_pid = await self._pods_of(pids) if pids else {}
        linked = {pid: pod.allocation.id for pid, pod in pod_of_pid.items() if pod is not None and pod.allocation}
        alive = lambda pid: (Path(self.proc_root) / str(pid)).exists()  # noqa: E731
        owner = self._burst_owners.resolve(linked, pids, alive, time.time())
        for g in cards:
            if g.uuid in looks:
                samples, memory, now = looks[g.uuid]
                self.burst.observe(g.uuid, samples, memory, owner, requests_on(g.uuid, elastic, g.memory_mib), now)

    def _burst_looks(self, cards: Sequence[GPUInfo]) -> dict[str, tuple[list[Sample], dict[int, int], float]]:
        """Per card: NVML's per-process samples since the last look, memory per process, when."""
        out = {}
        for g in cards:
            now = time.time()
            seen = self._burst_nvml.look(g.uuid, self.burst.since_us(g.uuid, now))
            if seen is not None:
                out[g.uuid] = (*seen, now)
        return out

    async def _watch_deletions(self, namespace: str) -> None:
        """Wake ``_publish_deletions`` when an elastic pod of this node gets a deletionTimestamp."""

        def deleting_elastic(pod: Any) -> bool:
            info = pod_info(pod)
            return info.deleting and info.allocation is not None and info.allocation.elastic

        await self._wake_on(
            lambda: self.kube.watch_node_pods(namespace),
            deleting_elastic,
            self._deletion_wake,
            f"Watch of this node's pods{f' in {namespace}' if namespace else ''} broke (%s); a deleted elastic "
            f"pod's last burst is published at the next pod list ({self.pod_refresh_seconds:g} s)",
            30.0,
        )

    async def _publish_deletions(self) -> None:
        """An elastic pod being deleted: list the pods, look at the cards, publish its activity now
        (its annotation is the burst metering bills, and cannot change once the pod is gone)."""
        while True:
            await self._deletion_wake.wait()
            self._deletion_wake.clear()
            try:
                await self._node_pods(force=True)
                if self.burst_sample_seconds > 0:
                    await self._sample_burst()
                await self._refresh()
            except KubeError as e:
                self.log.warning("last activity of deleted pods: %s", e)
            except Exception:
                self.log.exception("last activity of deleted pods failed")

    async def _annotate_activity(self, namespace: str, name: str, value: str) -> None:
        await self.kube.annotate_pod(namespace, name, L.A_GPU_ACTIVITY, value)

    async def _annotate_reclaim(self, namespace: str, name: str, value: str | None) -> None:
        await self.kube.annotate_pod(namespace, name, L.A_GPU_RECLAIM, value)

    # ---- swap (the hub's requests on kernel pods) -------------------------------------------

    async def _swap_loop(self) -> None:
        """Carry out the hub's swap requests as soon as the watch sees one, else every
        swap_interval_seconds (a broken watch only slows it down)."""
        while True:
            try:
                await asyncio.wait_for(self._swap_wake.wait(), self.swap_interval_seconds)
            except asyncio.TimeoutError:
                pass
            self._swap_wake.clear()
            try:
                await self._swap()
            except KubeError as e:
                self.log.warning("swap: %s (retrying)", e)
            except Exception:
                self.log.exception("swap failed (retrying)")

    async def _watch_swaps(self, namespace: str) -> None:
        """Wake the swap loop when a pod of this node carries a request not answered yet."""
        await self._wake_on(
            lambda: self.kube.watch_node_pods(namespace),
            lambda pod: swap.pending(pod_info(pod).annotations) is not None,
            self._swap_wake,
            f"Watch of this node's pods{f' in {namespace}' if namespace else ''} broke (%s); swap requests are "
            f"looked for every {self.swap_interval_seconds:g} s meanwhile",
            min(30.0, 5 * self.swap_interval_seconds),
        )  # fmt: skip

    async def _swap(self) -> None:
        pods = list((await self._node_pods(force=True)).values())
        regions = Path(self.host_lib_dir) / "regions"
        keep = {(p.annotations or {}).get(L.A_KERNEL_ID, "") for p in pods if swap.keeps_marker(p.annotations)}
        try:
            swept = await asyncio.to_thread(swap.sweep_markers, regions, keep)
        except OSError as e:
            self.log.warning("Swap markers in %s not swept: %s", regions, e)
        else:
            if swept:
                self.log.info("Swap markers of kernels no longer swapped out here removed: %s", ", ".join(swept))
        for pod in pods:
            todo = swap.pending(pod.annotations)
            if todo is None:
                continue
            request, generation = todo
            if isinstance(request, str):
                status = {"generation": generation, "ok": False, "message": request}
            else:
                pids = swap.pod_processes(pod.uid, self.proc_root)
                elsewhere = sum(swap.swapped_mib(p.annotations) for p in pods if p.uid != pod.uid)
                kernel = (pod.annotations or {}).get(L.A_KERNEL_ID, "")
                try:
                    if request.action == "suspend":  # before the lock: a cell starting now asks the hub first
                        await asyncio.to_thread(swap.set_marker, regions, kernel, True)
                    minors = {g.uuid: g.index if g.minor is None else g.minor for g in self.gpus}
                    status = await asyncio.to_thread(
                        swap.perform,
                        request,
                        pids,
                        self.checkpoint,
                        self._used_mib,
                        elsewhere,
                        swap.node_memory_mib(),
                        self.cards,
                        minors,
                    )
                    if status["ok"] == (request.action == "resume"):
                        await asyncio.to_thread(swap.set_marker, regions, kernel, False)
                except OSError as e:  # the marker: a suspend is not tried without it
                    status = {"generation": generation, "action": request.action, "ok": False, "processes": [],
                              "message": f"the kernel's swap marker in {regions} could not be written ({e})",
                              "host_mib": 0, "stuck": False}  # fmt: skip
                self.log.info(
                    "%s of pod %s (processes %s): %s", request.action, pod.key,
                    ",".join(map(str, status["processes"])) or "none with CUDA state",
                    "done" if status["ok"] else status["message"],
                )  # fmt: skip
            await self.kube.annotate_pod(pod.namespace, pod.name, L.A_SWAP_STATUS, json.dumps(status))

    def _used_mib(self, pids: list[int]) -> int:
        wanted = set(pids)
        used = sum(p.used_bytes for ps in self._processes(self.gpus).values() for p in ps if p.pid in wanted)
        return used >> 20

    # ---- the backstop --------------------------------------------------------------------

    async def _check(self) -> None:
        cards = self._shared_cards()
        processes = self._processes(cards)
        pids = [p.pid for ps in processes.values() for p in ps]
        pod_of_pid = await self._pods_of(pids) if pids else {}
        other_pods = await self._other_pods(pod_of_pid)
        pods = list(self._pods.values())
        match: RegionMatch | None = None
        check_shim = self.backstop.check_shim and self.backend == "native"
        if check_shim:
            match = match_regions(pods, self._read_regions())
        findings: list[Finding] = []
        for g in cards:
            procs = processes.get(g.uuid, [])
            if not procs:
                continue
            slices = {}
            for pod in pods:
                a = pod.allocation
                if a is None or g.uuid not in a.gpu_uuids or pod.phase in ("Succeeded", "Failed"):
                    continue
                slices[a.id] = Slice(
                    allocation_id=a.id,
                    gpu_uuid=g.uuid,
                    limit_bytes=None if a.whole else a.memory_ceiling_mib << 20,  # an elastic slice's limit
                    pod=pod.key,
                    pod_uid=pod.uid,
                    user=a.owner.user,
                    registered=(a.id, g.uuid) in match.registered if match is not None else True,
                )
            views = []
            for p in procs:
                pod = pod_of_pid.get(p.pid)
                if self.backstop.recently_killed(p.pid) or (pod and pod.phase in ("Succeeded", "Failed")):
                    continue  # on its way out: the driver lists a process until it is reaped
                views.append(
                    Proc(
                        pid=p.pid,
                        used_bytes=p.used_bytes,
                        name=process_name(p.pid, self.proc_root),
                        pod=pod.key if pod else "",
                        pod_uid=pod.uid if pod else "",
                        allocation_id=pod.allocation.id if pod and pod.allocation else "",
                        other_pod=other_pods.get(p.pid, ""),
                    )
                )
            findings += evaluate(
                g.uuid,
                g.index,
                views,
                slices,
                tolerance_bytes=self.backstop.tolerance_bytes,
                check_unregistered=self.backstop.check_unregistered,
                check_shim=check_shim,
            )
        await self.backstop.act(findings, _AgentActions(self))


class _AgentActions:
    """The backstop's effects: metrics, Kubernetes Events."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    def count(self, finding: Finding) -> None:
        self.agent.metrics.violations.labels(self.agent.node_name, finding.gpu_uuid, finding.reason).inc()

    def killed(self, finding: Finding, proc: Proc) -> None:
        self.agent.metrics.kills.labels(self.agent.node_name, finding.gpu_uuid, finding.reason).inc()

    async def record(self, finding: Finding, message: str) -> None:
        agent = self.agent
        if finding.pod:
            namespace, name = finding.pod.split("/", 1)
            about = ObjectRef("Pod", name, namespace, finding.pod_uid)
        else:
            namespace = agent.node_event_namespace
            about = ObjectRef("Node", agent.node_name, "", agent.kube.node_uid)
        try:
            await agent.kube.event(about, EVENT_REASONS[finding.reason], message, namespace=namespace)
        except KubeError as e:
            agent.log.warning("Event not recorded: %s", e)


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
