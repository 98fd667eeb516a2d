"""What a kernel pod and a server pod say about a GPU kernel: pure functions over Kubernetes objects."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import Any

from jupyter_client.connect import port_names

from libvgpu import contract as C

from ..backends import LaunchError
from ..kernels import KernelRecord

#: container waiting reasons that will not resolve by waiting
FATAL_WAITING = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
}


def record_from_pod(kid: str, pod: Any) -> KernelRecord | None:
    """The broker's record of kernel ``kid`` rebuilt from its pod (None: not ours, or damaged).

    The caller applies the pod's status (:func:`apply_pod_status`)."""
    meta = pod.metadata
    ann = meta.annotations or {}
    allocation = C.allocation_from_metadata(meta.labels, ann)
    if allocation is None:
        return None
    try:
        ports = json.loads(ann.get(C.A_PORTS, "{}"))
        section = json.loads(ann.get(C.A_SECTION, "{}"))
    except ValueError:
        ports, section = {}, {}
    record = KernelRecord(
        id=kid,
        user=allocation.owner.user,
        server_name=ann.get(C.A_SERVER_NAME, ""),
        size=ann.get(C.A_SIZE, ""),
        allocation_id=allocation.id,
        section=section,
        ports={k: int(v) for k, v in ports.items() if k in port_names},
        signature_scheme=ann.get(C.A_SIGNATURE_SCHEME, "hmac-sha256"),
        server_identity=ann.get(C.A_SERVER_IDENTITY, ""),
        holder=meta.name,
        namespace=meta.namespace,
        generation=int(ann.get(C.A_GENERATION, "0")),
        created_at=float(ann.get(C.A_KERNEL_CREATED_AT, "0") or 0),
        jupyter_kernel_id=ann.get(C.A_JUPYTER_KERNEL_ID, ""),
        cwd=(pod.spec.containers[0].working_dir or "") if pod.spec and pod.spec.containers else "",
        key_sha256=ann.get(C.A_KEY_SHA256, ""),
        resume_url=ann.get(C.A_RESUME_URL, ""),
    )
    record.set_allocation(allocation)
    return record


def swap_from_pod(pod: Any) -> dict[str, Any]:
    """The broker's ``KernelRecord.swap`` of a swapped-out kernel pod ({} when it is on its GPU):
    the hub's suspend request and the node agent's answer, kept on the pod, outlive the hub. The
    pod's labels still name the slice it was swapped out of (its cards)."""
    meta = pod.metadata
    ann = meta.annotations or {}
    if not C.swapped_out(ann):
        return {}
    request, status = json.loads(ann[C.A_SWAP]), json.loads(ann[C.A_SWAP_STATUS])
    allocation = C.allocation_from_metadata(meta.labels, ann)
    return {
        "state": "swapped",
        "since": float(request.get("since") or request["generation"] / 1e6),
        "host_mib": int(status.get("host_mib") or 0),
        "processes": list(status.get("processes") or []),
        "gpu_uuids": list(allocation.gpu_uuids) if allocation else [],
        "model": str(request.get("model") or ""),
        "position": None,
        "reason": str(request.get("reason") or ""),
    }


def apply_pod_status(
    record: KernelRecord, pod: Any, unschedulable_since: dict[str, float], unschedulable_grace_seconds: float
) -> None:
    """Set ``record``'s state, reason, ip, exit code and GPU activity from its pod.

    ``unschedulable_since`` remembers since when each kernel's pod is Unschedulable. A record
    the broker ended while its pod was read (a burst reclaim or a preemption stopped it: failed,
    with the sentence its notebook shows) keeps its state and reason."""
    if record.state not in ("pending", "running"):
        return
    record.activity = C.gpu_activity((pod.metadata.annotations or {}).get(C.A_GPU_ACTIVITY))
    if not record.swap:  # swapped out before this hub started, or after it stopped waiting for the agent
        record.swap = swap_from_pod(pod)
    status = pod.status
    phase = status.phase if status else "Pending"
    record.ip = (status.pod_ip if status else "") or ""
    if pod.metadata.deletion_timestamp is not None:
        record.state, record.reason = "stopped", "the kernel pod is being deleted"
        return
    if phase == "Running":
        record.state, record.reason = "running", ""
        unschedulable_since.pop(record.id, None)
        return
    term = None
    for cs in (status.container_statuses or []) if status else []:
        state = cs.state
        if state and state.waiting and state.waiting.reason in FATAL_WAITING:
            record.state = "failed"
            record.reason = (
                f"the kernel container cannot start: {state.waiting.reason}: {state.waiting.message or ''}".strip(": ")
            )
            return
        if state and state.terminated:
            term = state.terminated
    if phase in ("Succeeded", "Failed"):
        code = term.exit_code if term else (0 if phase == "Succeeded" else 1)
        record.exit_code = code
        if phase == "Succeeded":
            record.state, record.reason = "stopped", "the kernel process exited"
        else:
            detail = (term.message or term.reason) if term else (status.message or status.reason or "")
            record.state = "failed"
            record.reason = f"the kernel pod failed (exit code {code}){': ' + detail if detail else ''}"
        return
    why = unschedulable_message(pod)
    if why is not None:
        since = unschedulable_since.setdefault(record.id, time.monotonic())
        if time.monotonic() - since >= unschedulable_grace_seconds:
            record.state = "failed"
            record.reason = f"the kernel pod cannot be scheduled: {why}"
            return
    record.state = "pending"
    record.reason = (status.reason or status.message or "waiting for the kernel pod to start") if status else ""


def unschedulable_message(pod: Any) -> str | None:
    """kube-scheduler's message when ``pod`` (a client model, or the dict KubeSpawner's reflector
    holds) is Unschedulable (condition PodScheduled False), else None."""
    status = pod.get("status") if isinstance(pod, dict) else pod.status
    conditions = (status.get("conditions") if isinstance(status, dict) else getattr(status, "conditions", None)) or []
    for cond in conditions:
        c = cond if isinstance(cond, dict) else {k: getattr(cond, k) for k in ("type", "status", "reason", "message")}
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c.get("message") or "Unschedulable"
    return None


def notebook_status(pod: Any) -> Any | None:
    """The container status of a server pod's notebook container (KubeSpawner names it 'notebook')."""
    statuses = (pod.status.container_statuses if pod.status else None) or []
    return next((c for c in statuses if c.name == "notebook"), statuses[0] if statuses else None)


def server_identity(pod: Any) -> str:
    """A server pod's uid and its notebook container's restart count: a kernel belongs to one run
    of the server process (a restarted container has lost its kernels)."""
    notebook = notebook_status(pod)
    restarts = notebook.restart_count if notebook is not None else 0
    return f"{pod.metadata.uid}/{restarts or 0}"


def api_message(e: Exception) -> str:
    body = getattr(e, "body", None)
    if body:
        try:
            return json.loads(body).get("message") or str(body)
        except (ValueError, AttributeError, TypeError):
            return str(body)[:300]
    return str(getattr(e, "reason", "") or e)


class APITimeout(LaunchError, asyncio.TimeoutError):
    """The Kubernetes API did not answer in time: a sentence for the user (503), and still a
    ``TimeoutError`` for the callers that clean up or retry on one."""


async def api_call(coro: Awaitable[Any], timeout: float) -> Any:
    """``coro`` (a Kubernetes API call) within ``timeout`` seconds, or :class:`APITimeout`."""
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        raise APITimeout(
            f"The Kubernetes API did not answer within {timeout:g} s, so the hub could not do this; "
            "try again in a moment (if it keeps happening, tell your hub's admin).",
            503,
        ) from None
