"""Prometheus metrics of the culler (one registry per culler, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "elastic_gpu_culler_"


MIB = 1 << 20


class CullerMetrics:
    """The culler's series, sizes in bytes (Prometheus's base unit). Labels are bounded sets (reason,
    priority class, method, action), never user names."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.culls = Counter(
            PREFIX + "culls",
            "GPU kernels shut down to reclaim their slice, by reason (idle-timeout, max-age, pressure, orphan), "
            "priority class and how (server: through the user's server; broker: the broker's fallback; failed). "
            "A kernel swapped out instead is counted in swap_outs_total",
            ["reason", "priority_class", "method"],
            registry=r,
        )
        self.swap_outs = Counter(
            PREFIX + "swap_outs",
            "GPU kernels swapped out instead of culled (they live on; their GPU state waits in host memory), "
            "by reason and priority class",
            ["reason", "priority_class"],
            registry=r,
        )
        self.freed_memory = Counter(
            PREFIX + "freed_memory_bytes",
            "GPU memory returned to the pool (bytes of slice), by reason, priority class and action "
            "(culled, swapped)",
            ["reason", "priority_class", "action"],
            registry=r,
        )
        self.idle_at_cull = Histogram(
            PREFIX + "cull_idle_seconds",
            "How long a kernel had been idle (both signals) when it was culled",
            ["reason"],
            buckets=(30, 60, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400, float("inf")),
            registry=r,
        )
        self.reclaim = Histogram(
            PREFIX + "reclaim_seconds",
            "From the start of a cull to the broker confirming the slice is free",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, float("inf")),
            registry=r,
        )
        self.warnings = Counter(PREFIX + "warnings", "Grace warnings sent to kernels", ["result"], registry=r)
        self.cycle = Histogram(
            PREFIX + "cycle_seconds",
            "Duration of one culling cycle (gather, decide, warn, reclaim)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, float("inf")),
            registry=r,
        )
        self.kernels = Gauge(
            PREFIX + "kernels", "GPU kernels seen in the last cycle, by verdict reason", ["reason"], registry=r
        )
        self.waiting = Gauge(
            PREFIX + "waiting_requests",
            "Requests waiting for a GPU at the last cycle (pressure mode when > 0)",
            registry=r,
        )
        self.errors = Counter(PREFIX + "errors", "Failed calls, by stage", ["stage"], registry=r)
        self.last_cycle = Gauge(
            PREFIX + "last_cycle_timestamp_seconds", "When the last cycle finished (epoch seconds)", registry=r
        )
