"""The shim's and the node agent's contract with the hub: every format that crosses from the hub
to the processes and pods that hold slices, and to the node agent.

- the shim's limits file and environment names (what ``libvgpu.so`` reads);
- the GPU activity record (what the node agent publishes, the broker and the culler read);
- pod labels and annotations (the Kubernetes ledger: pods carry their allocation in labels,
  selectable, and annotations, exact), the node inventory annotation and the swap handshake
  (what the node agent reads and answers);
- the GPU model name derived from NVML's product name (the local pool and the node agent).

Its owner is the shim's package: ``hubext``, the culler and the node agent import it from here,
and nothing in ``libvgpu`` imports ``hubext``. The allocation and pool codecs (JSON dicts) are
``quotas``' own (``Allocation.to_dict``, ``Pool.to_dict``, ``quotas.load_pool``); sizes are
written for people by ``quotas.messages.mib``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from quotas import Allocation, Owner
from quotas.config import KNOWN_MODELS

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
A_MEMORY_LIMIT_MIB = PREFIX + "memory-limit-mib"
A_CORES_LIMIT_PERCENT = PREFIX + "cores-limit-percent"
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
# the chart's uninstall hook asks each node's agent to withdraw (value: the release); the agent
# answers "done: ..." once its host files and its inventory are gone
NODE_UNINSTALL_ANNOTATION = PREFIX + "uninstall"
# whether the node's driver can checkpoint kernel pods (swap them out keeping their state),
# published by the node agent: JSON {"able": bool, "why_not": str, "driver": NVML's driver version,
# "remap": bool, "remap_why_not": str}; every card of the node shares its driver. The hub promises
# a swap (state kept) only for kernels on a node that says able (see node_checkpoint); a resume
# goes onto another card of the node (same model) only where it says remap (see node_remap)
NODE_CHECKPOINT_ANNOTATION = PREFIX + "checkpoint"
# cards out of service after a fatal Xid, published by the node agent, cleared by an admin:
# JSON {gpu_uuid: {"xid": int, "since": epoch s, "index": int}} (libvgpu/health.py)
NODE_GPU_HEALTH_ANNOTATION = PREFIX + "gpu-health"
# a GPU pod's GPU activity, published by the node agent, read by the broker (for the culler):
# compact JSON {"last_launch": unix s | null, "memory_used_mib": int, "updated_at": unix s}
A_GPU_ACTIVITY = PREFIX + "gpu-activity"
# a GPU pod whose allocation waits for memory within its request that other slices' bursts hold,
# published by the node agent while it waits (absent otherwise), read by the hub's reclaim pass:
# compact JSON [{"gpu_uuid", "wanted_mib", "since": unix s, "burster": allocation id, "burst_mib"}]
# (libvgpu/elastic.py: pod_reclaims)
A_GPU_RECLAIM = PREFIX + "gpu-reclaim"
# a kernel pod's swap: the hub asks (JSON {"action": "suspend"|"resume", "generation": n, ...}),
# the node agent answers once per generation (JSON {"generation": n, "ok": bool, "message": ...});
# see libvgpu/agent/swap.py
A_SWAP = PREFIX + "swap"
A_SWAP_STATUS = PREFIX + "swap-status"
# a kernel pod that resumes itself (its kernel asks the hub before a cell runs): where it asks,
# and the digest of its connection key (the hub recognises the kernel by it, also after a restart)
A_RESUME_URL = PREFIX + "resume-url"
A_KEY_SHA256 = PREFIX + "key-sha256"
#: the node agent's markers of swapped-out kernels, ``<node region dir>/swapped/<kernel id>``
#: (root's, mode 0711: a kernel finds its own marker, lists none): present while the kernel's
#: GPU state is in host memory, so its next cell asks for the resume first
SWAP_MARKER_DIR = "swapped"


def swapped_out(annotations: dict[str, str] | None) -> bool:
    """Whether a kernel pod's GPU state is in host memory: the hub's last swap request is a suspend
    and the node agent answered it done, or a resume the agent answered refused and not stuck (the
    hub then puts the suspend back). Such a pod holds no slice (the ledger skips it)."""
    annotations = annotations or {}
    try:
        request = json.loads(annotations.get(A_SWAP) or "null")
        status = json.loads(annotations.get(A_SWAP_STATUS) or "null")
    except ValueError:
        return False
    if not (isinstance(request, dict) and isinstance(status, dict)) or status.get("generation") != request.get(
        "generation"
    ):
        return False
    if request.get("action") == "suspend":
        return status.get("ok") is True
    # a resume the driver refused, its GPU state left in host memory: still swapped out
    return request.get("action") == "resume" and status.get("ok") is False and status.get("stuck") is False


def _node_checkpoint_data(annotations: Mapping[str, str] | None) -> dict[str, Any] | None:
    try:
        data = json.loads((annotations or {}).get(NODE_CHECKPOINT_ANNOTATION) or "null")
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("able"), bool) else None


def node_checkpoint(annotations: Mapping[str, str] | None) -> tuple[bool, str] | None:
    """A node's published checkpoint capability: (able, why not); None when its agent said nothing
    readable (no annotation, or not the JSON above)."""
    data = _node_checkpoint_data(annotations)
    if data is None:
        return None
    return data["able"], "" if data["able"] else str(data.get("why_not") or "the node agent gave no reason")


def node_remap(annotations: Mapping[str, str] | None) -> tuple[bool, str]:
    """Whether a node's driver restores a swapped-out kernel onto another of its cards (of the same
    model), and why not: only where its agent said so (an agent of before says nothing: no)."""
    data = _node_checkpoint_data(annotations)
    if data is not None and data["able"] and data.get("remap") is True:
        return True, ""
    why = data.get("remap_why_not") if data is not None and data["able"] else ""
    return False, str(why or "its node agent has not said that its driver can restore onto another card")


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
        A_MEMORY_LIMIT_MIB: str(allocation.memory_limit_mib),
        A_CORES_LIMIT_PERCENT: str(allocation.cores_limit_percent),
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
            memory_limit_mib=int(annotations.get(A_MEMORY_LIMIT_MIB, "0")),
            cores_limit_percent=int(annotations.get(A_CORES_LIMIT_PERCENT, "0")),
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
    shim's regions to the allocation for the node agent and the culler. An elastic allocation
    (``memory_limit_mib`` / ``cores_limit_percent`` above its request) also gets
    ``memory_limit_mib.N`` / ``cores_limit_percent.N``: what it may burst to (docs/libvgpu.md).
    """
    lines = [f"# elastic-gpu allocation {allocation.id}", f"name={allocation.id}"]
    # elastic slices: the burst limits, written only above the request (absent = the request)
    memory_limit, cores_limit = allocation.memory_limit_mib, allocation.cores_limit_percent
    for index, _uuid in enumerate(allocation.gpu_uuids):
        if not allocation.whole:
            lines.append(f"memory_mib.{index}={allocation.memory_mib}")
            lines.append(f"cores_percent.{index}={allocation.cores_percent}")
            if memory_limit > allocation.memory_mib:
                lines.append(f"memory_limit_mib.{index}={memory_limit}")
            if cores_limit > allocation.cores_percent:
                lines.append(f"cores_limit_percent.{index}={min(cores_limit, 100)}")
    lines.append(f"priority={priority_value}")
    for key, value in (
        ("container_region", container_region),
        ("node_region_dir", node_region_dir),
        ("activity_file", activity_file),
    ):
        if value:
            lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"


# ---- the shim's environment (libvgpu reads these; the limits file wins where both say) -------

ENV_CONFIG = "LIBVGPU_CONFIG"
ENV_CONTAINER_REGION = "LIBVGPU_CONTAINER_REGION"
ENV_NODE_REGION_DIR = "LIBVGPU_NODE_REGION_DIR"
ENV_ALLOCATION_ID = "ELASTIC_GPU_ALLOCATION_ID"
ENV_KERNEL_ID = "ELASTIC_GPU_KERNEL_ID"

# ---- GPU model names -----------------------------------------------------------------------------

_VENDOR = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO"}
_FORM = re.compile(r"^(SXM\d*|PCIE|HBM\d*E?|NVL|NVLINK|GPU|MIG)$", re.IGNORECASE)
_GB = re.compile(r"^(\d+)GB$", re.IGNORECASE)


def model_name(nvml_name: str, memory_mib: int) -> str:
    """NVML's product name as the pool's model string: ``"NVIDIA H100 80GB HBM3"`` -> ``"H100-80GB"``,
    ``"NVIDIA A100-SXM4-40GB"`` -> ``"A100-40GB"``, ``"Tesla T4"`` -> ``"T4-16GB"``.

    The one definition, used by the local pool and the node agent, so a profile's ``model``
    means the same card in both modes (and matches the simulated pool's names).
    The size comes from the name when it has one, else from the model table of ``quotas``
    (nominal size, when NVML's figure is within 10 % below it), else from the memory NVML
    reports, rounded to GiB (``"NVIDIA H100 NVL"`` with 95830 MiB -> ``"H100-94GB"``).
    """
    tokens = [t for t in re.split(r"[\s\-_]+", nvml_name.strip()) if t]
    words: list[str] = []
    size: str | None = None
    for token in tokens:
        if token.upper() in _VENDOR or _FORM.match(token):
            continue
        match = _GB.match(token)
        if match:
            size = size or match.group(1)
            continue
        words.append(token)
    base = "-".join(words) or "GPU"
    if size is None:
        known = KNOWN_MODELS.get(base.upper())
        # the nominal size when NVML's figure is that card's (a little less: reserved memory)
        if known and 0.9 * known[0] * 1024 <= memory_mib <= known[0] * 1024:
            size = str(int(known[0]))
        else:
            size = str(max(1, round(memory_mib / 1024)))
    return f"{base}-{size}GB"


# ---- the GPU activity record ------------------------------------------------------------------


def gpu_activity(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """``{last_launch, memory_used_mib[, burst_gpu_seconds]}`` from a GPU activity record (the node agent's
    ``gpu-activity`` annotation, JSON text, or an already parsed mapping).

    ``{}`` (unknown to the culler) when there is none or it is not what the agent writes.
    """
    if not value:
        return {}
    data: Any = value
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except ValueError:
            return {}
    if not isinstance(data, Mapping):
        return {}
    last, used = data.get("last_launch"), data.get("memory_used_mib")
    number = (int, float)
    if last is not None and (
        isinstance(last, bool) or not isinstance(last, number) or not math.isfinite(last) or last < 0
    ):
        return {}
    if isinstance(used, bool) or not isinstance(used, int) or used < 0:
        return {}
    burst = data.get("burst_gpu_seconds")  # card-seconds above the request so far, as the agent measured them
    if isinstance(burst, bool) or not isinstance(burst, number) or not math.isfinite(burst) or burst < 0:
        return {"last_launch": last, "memory_used_mib": used}
    return {"last_launch": last, "memory_used_mib": used, "burst_gpu_seconds": burst}
