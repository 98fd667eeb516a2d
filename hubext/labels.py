"""The one label/annotation prefix, and the mapping between an Allocation and Kubernetes metadata.

Pods (notebooks and kernels) carry their allocation in labels (selectable) and annotations
(exact values). The Kubernetes pool rebuilds its ledger from these, so this module is the
single place where the format is defined.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from quotas import Allocation, Owner

PREFIX = "elastic-gpu.jupyter.org/"

MANAGED = PREFIX + "managed"
ALLOCATION_ID = PREFIX + "allocation-id"
USER = PREFIX + "user"
WORKSPACE = PREFIX + "workspace"
NAMESPACE = PREFIX + "namespace"
PRIORITY_CLASS = PREFIX + "priority-class"
KIND = PREFIX + "kind"
SERVER = PREFIX + "server"

# annotations (exact values; labels are escaped to be valid label values)
A_USER = PREFIX + "user-name"
A_WORKSPACE = PREFIX + "workspace-name"
A_NAMESPACE = PREFIX + "namespace-name"
A_GPU_UUIDS = PREFIX + "gpu-uuids"
A_NODE = PREFIX + "node"
A_MEMORY_MIB = PREFIX + "memory-mib"
A_CORES_PERCENT = PREFIX + "cores-percent"
A_BORROWED = PREFIX + "borrowed"
A_WHOLE = PREFIX + "whole"
A_CREATED_AT = PREFIX + "created-at"
A_LIMITS = PREFIX + "limits"

A_BACKEND = PREFIX + "backend"
A_SECTION = PREFIX + "section"

# kernel pods (the broker's): label = the broker's kernel id, shared by all generations of one kernel
KERNEL_ID = PREFIX + "kernel-id"
A_KERNEL_ID = PREFIX + "kernel-id"
A_SERVER_NAME = PREFIX + "server-name"
A_SERVER_IDENTITY = PREFIX + "server-identity"
A_GENERATION = PREFIX + "generation"
A_PORTS = PREFIX + "ports"
A_SIZE = PREFIX + "size"
A_SIGNATURE_SCHEME = PREFIX + "signature-scheme"
A_KERNEL_CREATED_AT = PREFIX + "kernel-created-at"
A_JUPYTER_KERNEL_ID = PREFIX + "jupyter-kernel-id"

# node inventory published by the node agent
NODE_GPU_LABEL = PREFIX + "gpu-node"
NODE_GPUS_ANNOTATION = PREFIX + "gpus"
# a GPU pod's GPU activity, published by the node agent, read by the broker (for the culler):
# compact JSON {"last_launch": unix s | null, "memory_used_mib": int, "updated_at": unix s}
A_GPU_ACTIVITY = PREFIX + "gpu-activity"

_LABEL_OK = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


def label_value(value: str) -> str:
    """A valid Kubernetes label value for any string (exact when already valid, else a stable slug)."""
    if _LABEL_OK.match(value):
        return value
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", value).strip("-_.")[:40] or "x"
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    return f"{slug}-{digest}"


def allocation_labels(allocation: Allocation, server: str = "") -> dict[str, str]:
    """Labels that make a pod selectable as holder of ``allocation``."""
    labels = {
        MANAGED: "true",
        ALLOCATION_ID: label_value(allocation.id),
        USER: label_value(allocation.owner.user),
        WORKSPACE: label_value(allocation.owner.workspace),
        NAMESPACE: label_value(allocation.owner.namespace),
        PRIORITY_CLASS: label_value(allocation.priority_class),
        KIND: allocation.kind,
    }
    if server:
        labels[SERVER] = label_value(server)
    return labels


def allocation_annotations(allocation: Allocation) -> dict[str, str]:
    """Annotations that record ``allocation`` exactly, so a restarted hub can rebuild its ledger."""
    return {
        ALLOCATION_ID: allocation.id,
        A_USER: allocation.owner.user,
        A_WORKSPACE: allocation.owner.workspace,
        A_NAMESPACE: allocation.owner.namespace,
        A_GPU_UUIDS: ",".join(allocation.gpu_uuids),
        A_NODE: allocation.node,
        A_MEMORY_MIB: str(allocation.memory_mib),
        A_CORES_PERCENT: str(allocation.cores_percent),
        A_BORROWED: "true" if allocation.borrowed else "false",
        A_WHOLE: "true" if allocation.whole else "false",
        A_CREATED_AT: repr(allocation.created_at),
        PRIORITY_CLASS: allocation.priority_class,
        KIND: allocation.kind,
    }


def allocation_from_metadata(
    labels: Mapping[str, str] | None, annotations: Mapping[str, str] | None
) -> Allocation | None:
    """The allocation a pod holds, or None when the pod is not ours or its record is damaged."""
    labels = labels or {}
    annotations = annotations or {}
    if labels.get(MANAGED) != "true" or ALLOCATION_ID not in annotations:
        return None
    try:
        return Allocation(
            id=annotations[ALLOCATION_ID],
            owner=Owner(
                user=annotations[A_USER],
                namespace=annotations[A_NAMESPACE],
                workspace=annotations[A_WORKSPACE],
            ),
            node=annotations[A_NODE],
            gpu_uuids=tuple(u for u in annotations[A_GPU_UUIDS].split(",") if u),
            memory_mib=int(annotations[A_MEMORY_MIB]),
            cores_percent=int(annotations[A_CORES_PERCENT]),
            priority_class=annotations[PRIORITY_CLASS],
            whole=annotations.get(A_WHOLE) == "true",
            borrowed=annotations.get(A_BORROWED) == "true",
            kind=annotations.get(KIND, "notebook"),
            created_at=float(annotations.get(A_CREATED_AT, "0")),
        )
    except (KeyError, ValueError):
        return None


def limits_file_text(
    allocation: Allocation,
    priority_value: int,
    *,
    container_region: str = "",
    node_region_dir: str = "",
    activity_file: str = "",
) -> str:
    """The shim's read-only limits file (libvgpu's key=value format) for ``allocation``.

    GPU indices are container-relative: the container sees only its granted GPUs, in order.
    Region paths live here too, not only in env vars a user could change; ``name`` ties the
    shim's regions to the allocation for the node agent and the culler.
    """
    lines = [f"# elastic-gpu allocation {allocation.id}", f"name={allocation.id}"]
    for index, _uuid in enumerate(allocation.gpu_uuids):
        if not allocation.whole:
            lines.append(f"memory_mib.{index}={allocation.memory_mib}")
            lines.append(f"cores_percent.{index}={allocation.cores_percent}")
    lines.append(f"priority={priority_value}")
    for key, value in (
        ("container_region", container_region),
        ("node_region_dir", node_region_dir),
        ("activity_file", activity_file),
    ):
        if value:
            lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"
