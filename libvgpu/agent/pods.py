"""Which pod a host process belongs to, and what allocation that pod holds.

A process's cgroup path (``/proc/<pid>/cgroup``, readable by anyone, from the host pid namespace
the agent runs in with ``hostPID``) names its pod's uid and its container under every kubelet
cgroup driver and runtime::

    0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope
    0::/kubepods/besteffort/pod<uid>/<id>                      (cgroupfs driver)
    11:memory:/kubepods/pod<uid>/<id>                          (cgroup v1, Guaranteed QoS)

The pod's uid leads to the Pod object (listed from the API for this node), whose labels and
annotations (:mod:`hubext.labels`) record the allocation it holds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libvgpu import contract as L
from quotas import Allocation

_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})", re.IGNORECASE)
_CONTAINER = re.compile(r"(?:^|[-/])([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class ProcessCgroup:
    """The pod and container a process runs in (from its cgroup path)."""

    pod_uid: str
    container_id: str  # "" when the path does not show it


def parse_cgroup(text: str) -> ProcessCgroup | None:
    """The pod uid and container id in the contents of ``/proc/<pid>/cgroup`` (None: not a pod's)."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path = parts[2].strip()
        match = _POD_UID.search(path)
        if not match:
            continue
        uid = match.group(1).replace("_", "-").lower()
        last = path.rstrip("/").rsplit("/", 1)[-1]
        container = _CONTAINER.search(last)
        return ProcessCgroup(pod_uid=uid, container_id=container.group(1) if container else "")
    return None


def process_cgroup(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> ProcessCgroup | None:
    """The pod of host process ``pid`` (None: gone, not in a pod, or unreadable)."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    return parse_cgroup(text)


def process_name(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> str:
    """The process's command name (``comm``), "" when it cannot be read."""
    try:
        return (Path(proc_root) / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class PodInfo:
    """A pod on this node and the allocation it holds (None: not one of ours)."""

    name: str
    namespace: str
    uid: str
    phase: str
    allocation: Allocation | None
    priority: int | None = None  # the priority in the shim's limits file (annotation)
    #: the pod has a deletionTimestamp: its gpu-activity is published at once (metering's last word)
    deleting: bool = False
    #: the hub's swap request, the agent's answer (libvgpu.agent.swap), the kernel id and the
    #: agent's gpu-reclaim (libvgpu.agent.reclaims); no other annotation
    annotations: dict[str, str] | None = field(default=None, hash=False, compare=False)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


KEPT_ANNOTATIONS = (L.A_SWAP, L.A_SWAP_STATUS, L.A_KERNEL_ID, L.A_GPU_RECLAIM)


def pod_info(pod: Any) -> PodInfo:
    """A PodInfo from a kubernetes_asyncio V1Pod or a plain dict (as the API returns it)."""
    if isinstance(pod, dict):
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        name, namespace, uid = meta.get("name", ""), meta.get("namespace", ""), meta.get("uid", "")
        labels, annotations, phase = meta.get("labels"), meta.get("annotations"), status.get("phase", "")
        deleting = bool(meta.get("deletionTimestamp"))
    else:
        meta = pod.metadata
        name, namespace, uid = meta.name or "", meta.namespace or "", meta.uid or ""
        labels, annotations = meta.labels, meta.annotations
        phase = (pod.status.phase if pod.status else "") or ""
        deleting = meta.deletion_timestamp is not None
    return PodInfo(
        name=name,
        namespace=namespace,
        uid=(uid or "").lower(),
        phase=phase,
        allocation=L.allocation_from_metadata(labels, annotations),
        priority=limits_priority((annotations or {}).get(L.A_LIMITS, "")),
        deleting=deleting,
        annotations={k: v for k, v in (annotations or {}).items() if k in KEPT_ANNOTATIONS},
    )


def limits_priority(text: str) -> int | None:
    """The ``priority=`` of a limits file's text (None when it has none)."""
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "priority" and value.strip().lstrip("-").isdigit():
            return int(value.strip())
    return None
