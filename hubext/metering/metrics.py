"""Prometheus counters of GPU use, served on the hub's /hub/metrics (JupyterHub's registry).

Labels are bounded sets (namespace, workspace), never user names. GPU-seconds are
card-equivalents, as in the reports: a quarter card held for 4 s adds 1.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter

PREFIX = "elastic_gpu_usage_"


class UsageMetrics:
    """The meter's series (``registry``: JupyterHub's default one in the hub; a fresh one in tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = REGISTRY if registry is None else registry
        self.held = Counter(
            PREFIX + "held_gpu_seconds",
            "GPU-seconds held by granted slices (card-equivalents), by namespace and workspace",
            ["namespace", "workspace"],
            registry=r,
        )
        self.busy = Counter(
            PREFIX + "busy_gpu_seconds",
            "GPU-seconds held while busy (a kernel launched in the sample interval), by namespace and workspace",
            ["namespace", "workspace"],
            registry=r,
        )
        self.dropped = Counter(
            PREFIX + "dropped_events",
            "Usage events refused because the write queue was full (reconciliation repairs their records)",
            registry=r,
        )
