"""Swapping a GPU pod's CUDA processes out and back in, for the hub (Kubernetes mode).

The driver's checkpoint API (:mod:`libvgpu.checkpoint`) takes the target's *host* pid, so its
caller must be on the pod's node in the host pid namespace: the agent. The hub asks by
annotating the pod (``elastic-gpu.jupyter.org/swap``, JSON)::

    {"action": "suspend", "generation": 3, "lock_timeout_ms": 10000}
    {"action": "resume", "generation": 4, "remap": {"GPU-old": "GPU-new"}}

and the agent answers once per generation in ``elastic-gpu.jupyter.org/swap-status`` (JSON)::

    {"generation": 3, "action": "suspend", "ok": true, "message": "", "processes": [123],
     "host_mib": 1024, "stuck": false}

A suspend is all or nothing (:meth:`CudaCheckpoint.suspend` undoes what it did when a step
fails; ``stuck``: the undo failed too, the pod cannot run on). The agent needs no right beyond
the pod patch it already has for the activity annotation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hubext import contract as L
from libvgpu.checkpoint import CheckpointError, CheckpointUnavailable, CudaCheckpoint, ProcessState

from .pods import process_cgroup


@dataclass(frozen=True)
class SwapRequest:
    action: str  # "suspend" | "resume"
    generation: int
    lock_timeout_ms: int = 10000
    remap: tuple[tuple[str, str], ...] = ()


def parse_request(text: str) -> SwapRequest | str:
    """The hub's request, or a sentence saying what is wrong with it."""
    try:
        data = json.loads(text)
    except ValueError:
        return f"the {L.A_SWAP} annotation is not JSON"
    if not isinstance(data, dict) or data.get("action") not in ("suspend", "resume"):
        return f"the {L.A_SWAP} annotation's action must be 'suspend' or 'resume'"
    generation, timeout = data.get("generation"), data.get("lock_timeout_ms", 10000)
    if not isinstance(generation, int) or not isinstance(timeout, int) or timeout < 0:
        return f"the {L.A_SWAP} annotation needs an integer generation (and lock_timeout_ms >= 0)"
    remap = data.get("remap") or {}
    if not isinstance(remap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in remap.items()):
        return f"the {L.A_SWAP} annotation's remap must map GPU uuids to GPU uuids"
    return SwapRequest(data["action"], generation, timeout, tuple(sorted(remap.items())))


def answered_generation(status_text: str) -> int | None:
    try:
        data = json.loads(status_text) if status_text else None
    except ValueError:
        return None
    return data.get("generation") if isinstance(data, dict) and isinstance(data.get("generation"), int) else None


def pending(annotations: dict[str, str] | None) -> tuple[SwapRequest | str, int] | None:
    """(request or error, its generation) when the pod asks something not answered yet."""
    annotations = annotations or {}
    text = annotations.get(L.A_SWAP)
    if not text:
        return None
    request = parse_request(text)
    generation = request.generation if isinstance(request, SwapRequest) else -1
    if answered_generation(annotations.get(L.A_SWAP_STATUS, "")) == generation:
        return None
    return request, generation


def pod_processes(pod_uid: str, proc_root: str | os.PathLike[str]) -> list[int]:
    """Host pids whose cgroup names the pod."""
    out = []
    for entry in Path(proc_root).iterdir():
        if entry.name.isdigit():
            cgroup = process_cgroup(int(entry.name), proc_root)
            if cgroup is not None and cgroup.pod_uid == pod_uid:
                out.append(int(entry.name))
    return sorted(out)


def perform(
    request: SwapRequest, pids: Iterable[int], cp: CudaCheckpoint, memory_mib: Callable[[list[int]], int]
) -> dict[str, Any]:
    """Carry out ``request`` on the pod's processes (blocking: run it in a thread); the status."""
    status: dict[str, Any] = {"generation": request.generation, "action": request.action, "ok": False,
                              "message": "", "processes": [], "host_mib": 0, "stuck": False}  # fmt: skip
    try:
        cp.check()
        if request.action == "suspend":
            cuda = cp.cuda_processes(pids)
            status["processes"], status["host_mib"] = cuda, memory_mib(cuda) if cuda else 0
            cp.suspend(cuda, request.lock_timeout_ms)
        else:
            cuda = [p for p in sorted(set(pids)) if cp.state(p) is ProcessState.CHECKPOINTED]
            status["processes"] = cuda
            cp.resume(cuda, dict(request.remap))
    except CheckpointUnavailable as e:
        status["message"] = e.message
    except CheckpointError as e:
        status["message"], status["stuck"] = e.message, e.stuck or request.action == "resume"
    except ValueError as e:  # a remap onto something not a GPU uuid
        status["message"] = str(e)
    else:
        status["ok"] = True
    return status
