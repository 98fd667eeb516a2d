"""The agent's Prometheus metrics (names as docs/helm.md lists them for the Grafana dashboard).

Per GPU (labels node, gpu_uuid, gpu_index, model):
  elastic_gpu_memory_used_bytes, elastic_gpu_memory_total_bytes, elastic_gpu_utilization_ratio (0-1),
  elastic_gpu_temperature_celsius; elastic_gpu_xid_errors_total{node, gpu_uuid, gpu_index, xid}
  (counter; from NVML Xid events when the driver offers an event set — see
  elastic_gpu_xid_events_supported — else it stays at 0); elastic_gpu_out_of_service{node, gpu_uuid,
  gpu_index, xid} (1 while a fatal Xid keeps the card out of placement; libvgpu/health.py).
Per allocation and GPU (labels node, gpu_uuid, allocation_id, user, workspace, namespace, kind, pod):
  elastic_gpu_allocation_memory_used_bytes, elastic_gpu_allocation_memory_limit_bytes,
  elastic_gpu_allocation_last_activity_timestamp_seconds (only once it launched a kernel).
Backstop: elastic_gpu_enforcement_violations_total{node, gpu_uuid, reason},
  elastic_gpu_enforcement_kills_total{node, gpu_uuid, reason}.
Agent: elastic_gpu_agent_info{node, backend, driver_version}, elastic_gpu_agent_gpus.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..health import OutOfService
from .nvml import GPUInfo, GPUSample
from .usage import AllocationUsage

GPU_LABELS = ("node", "gpu_uuid", "gpu_index", "model")
ALLOCATION_LABELS = ("node", "gpu_uuid", "allocation_id", "user", "workspace", "namespace", "kind", "pod")


@dataclass
class Snapshot:
    """What the collector reports; the agent replaces it after each refresh."""

    gpus: Sequence[GPUInfo] = ()
    samples: dict[str, GPUSample] = field(default_factory=dict)
    allocations: Sequence[AllocationUsage] = ()
    xid_supported: dict[str, bool] = field(default_factory=dict)
    out_of_service: dict[str, OutOfService] = field(default_factory=dict)


class _SnapshotCollector(Collector):
    def __init__(self, metrics: AgentMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterable[Metric]:
        snap, node = self.m.snapshot, self.m.node
        used = GaugeMetricFamily("elastic_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=GPU_LABELS)
        total = GaugeMetricFamily("elastic_gpu_memory_total_bytes", "GPU memory size (NVML).", labels=GPU_LABELS)
        util = GaugeMetricFamily(
            "elastic_gpu_utilization_ratio", "Share of time a kernel ran on the GPU, 0-1 (NVML).", labels=GPU_LABELS
        )
        temp = GaugeMetricFamily("elastic_gpu_temperature_celsius", "GPU temperature (NVML).", labels=GPU_LABELS)
        xid_ok = GaugeMetricFamily(
            "elastic_gpu_xid_events_supported",
            "1 when Xid errors are counted from NVML events on this GPU, 0 when the driver offers no event set.",
            labels=("node", "gpu_uuid", "gpu_index"),
        )
        for gpu in snap.gpus:
            labels = [node, gpu.uuid, str(gpu.index), gpu.model]
            s = snap.samples.get(gpu.uuid)
            if s is not None:
                used.add_metric(labels, s.memory_used_bytes)
                total.add_metric(labels, s.memory_total_bytes)
                if s.utilisation_ratio is not None:
                    util.add_metric(labels, s.utilisation_ratio)
                if s.temperature_celsius is not None:
                    temp.add_metric(labels, s.temperature_celsius)
            xid_ok.add_metric([node, gpu.uuid, str(gpu.index)], 1.0 if snap.xid_supported.get(gpu.uuid) else 0.0)
        a_used = GaugeMetricFamily(
            "elastic_gpu_allocation_memory_used_bytes",
            "GPU memory an allocation uses on a GPU (the shim's count, else NVML's per-process figures).",
            labels=ALLOCATION_LABELS,
        )
        a_limit = GaugeMetricFamily(
            "elastic_gpu_allocation_memory_limit_bytes",
            "GPU memory slice of an allocation on a GPU (the card's size for whole cards).",
            labels=ALLOCATION_LABELS,
        )
        a_last = GaugeMetricFamily(
            "elastic_gpu_allocation_last_activity_timestamp_seconds",
            "Unix time of the allocation's last kernel launch on a GPU (from the shim).",
            labels=ALLOCATION_LABELS,
        )
        totals = {g.uuid: g.memory_mib << 20 for g in snap.gpus}
        for a in snap.allocations:
            labels = [node, a.gpu_uuid, a.allocation_id, a.user, a.workspace, a.namespace, a.kind, a.pod]
            a_used.add_metric(labels, a.used_bytes)
            limit = a.limit_bytes if a.limit_bytes is not None else totals.get(a.gpu_uuid)
            if limit is not None:
                a_limit.add_metric(labels, limit)
            if a.last_activity:
                a_last.add_metric(labels, a.last_activity)
        gpus = GaugeMetricFamily("elastic_gpu_agent_gpus", "GPUs the node agent found.", labels=("node",))
        gpus.add_metric([node], len(snap.gpus))
        out = GaugeMetricFamily(
            "elastic_gpu_out_of_service",
            "1 while a card takes no new slices after a fatal Xid (until an admin clears it).",
            labels=("node", "gpu_uuid", "gpu_index", "xid"),
        )
        for uuid, card in snap.out_of_service.items():
            out.add_metric([node, uuid, str(card.index), str(card.xid)], 1.0)
        yield from (used, total, util, temp, xid_ok, a_used, a_limit, a_last, gpus, out)


class AgentMetrics:
    """The registry the agent serves on --metrics-port."""

    def __init__(self, node: str, backend: str = "native", driver_version: str = "") -> None:
        self.node = node
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._snapshot = Snapshot()
        self.xid_errors = Counter(
            "elastic_gpu_xid_errors",
            "Xid critical errors reported by the driver (NVML events).",
            ("node", "gpu_uuid", "gpu_index", "xid"),
            registry=self.registry,
        )
        self.violations = Counter(
            "elastic_gpu_enforcement_violations",
            "Enforcement backstop findings, counted once per episode (reason: over-limit, unregistered, no-shim).",
            ("node", "gpu_uuid", "reason"),
            registry=self.registry,
        )
        self.kills = Counter(
            "elastic_gpu_enforcement_kills",
            "Processes the enforcement backstop killed.",
            ("node", "gpu_uuid", "reason"),
            registry=self.registry,
        )
        info = GaugeMetricFamily(
            "elastic_gpu_agent_info", "The node agent.", labels=("node", "backend", "driver_version")
        )
        info.add_metric([node, backend, driver_version], 1.0)
        self._info = info
        self.registry.register(_SnapshotCollector(self))
        self.registry.register(_Static(info))

    @property
    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def update(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def declare_gpus(self, gpus: Sequence[GPUInfo], reasons: Sequence[str]) -> None:
        """Create the backstop counters at 0 for every GPU, so rate() works from the start."""
        for gpu in gpus:
            for reason in reasons:
                self.violations.labels(self.node, gpu.uuid, reason)
                self.kills.labels(self.node, gpu.uuid, reason)

    def count_xid(self, gpu: GPUInfo | None, gpu_uuid: str, xid: int) -> None:
        index = str(gpu.index) if gpu else ""
        self.xid_errors.labels(self.node, gpu_uuid, index, str(xid)).inc()


class _Static(Collector):
    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        yield self.metric
