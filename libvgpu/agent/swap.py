"""Swapping a GPU pod's CUDA processes out and back in, for the hub (Kubernetes mode).

The driver's checkpoint API (:mod:`libvgpu.checkpoint`) takes the target's *host* pid, so its
caller must be on the pod's node in the host pid namespace: the agent. The hub asks by
annotating the pod (``elastic-gpu.jupyter.org/swap``, JSON)::

    {"action": "suspend", "generation": 3, "lock_timeout_ms": 10000, "host_memory_percent": 50}
    {"action": "resume", "generation": 4, "remap": {"GPU-old": "GPU-new"}}

and the agent answers once per generation in ``elastic-gpu.jupyter.org/swap-status`` (JSON)::

    {"generation": 3, "action": "suspend", "ok": true, "message": "", "processes": [123],
     "host_mib": 1024, "stuck": false}

A resume's remap moves the pod's processes onto other cards of this node (driver 580+, same chip
type, and a node where the agent can give a running container another card: :func:`probe`
publishes ``remap`` so the hub asks only where it can). The pod's container has only the cards it
started with: the agent grants it the new card before the restore and takes the old one back after
it (:mod:`libvgpu.agent.cards`). A restore the driver refuses leaves them checkpointed (and the new
card taken back): the answer is not ``stuck``, the kernel stays swapped out.

A suspend is all or nothing (:meth:`CudaCheckpoint.suspend` undoes what it did when a step
fails; ``stuck``: the undo failed too, the pod cannot run on). It is refused, the pod left
running, when the GPU memory it would move brings what this node's swapped-out pods hold in host
memory over ``host_memory_percent`` of the node's RAM (the hub's ``swap_host_memory_percent``).
The agent needs no right beyond the pod patch it already has for the activity annotation.

While a kernel pod is swapped out, its *marker* ``<node region dir>/swapped/<kernel id>`` exists
(:func:`set_marker`; the pod sees the node region dir, so its kernel finds the marker before its
next cell and asks the hub for the resume: ``kernelprovider/resume.py``). The marker is made
before the checkpoint (a cell starting then asks the hub, which waits for the suspend to end)
and removed when the suspend failed or the resume is done.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libvgpu import contract as L
from libvgpu.checkpoint import CheckpointError, CheckpointUnavailable, CudaCheckpoint, ProcessState
from quotas.messages import swap_over_host_cap

from .cards import CardAccess, CardAccessError
from .pods import process_cgroup


@dataclass(frozen=True)
class SwapRequest:
    action: str  # "suspend" | "resume"
    generation: int
    lock_timeout_ms: int = 10000
    remap: tuple[tuple[str, str], ...] = ()
    #: suspend: share of the node's RAM (percent) swapped-out pods may hold; None: no cap
    host_memory_percent: float | None = None


def probe(cp: CudaCheckpoint | None, driver: str = "", cards: CardAccess | None = None) -> dict[str, Any]:
    """What the node publishes in ``elastic-gpu.jupyter.org/checkpoint``: whether its driver can
    checkpoint (``cp``: None when the agent's swap is off), and why not (blocking: the driver's
    first cuInit; run it in a thread). A resume may go onto another card where the driver
    restores there and ``cards`` can give a running container that card."""
    out: dict[str, Any] = {"able": False, "driver": driver}
    if cp is None:
        out["why_not"] = "the node agent's swap is off on this node (NodeAgent.swap_interval_seconds is 0)"
        return out
    try:
        cp.check()
        remap_why_not = cp.remap_unavailable() or (cards.why_not() if cards is not None else None)
    except CheckpointUnavailable as e:
        out["why_not"] = e.message
    else:
        out["able"] = True
        # a resume may go onto another card of this node (of the same model): the hub's admission asks
        out["remap"] = not remap_why_not
        if remap_why_not:
            out["remap_why_not"] = remap_why_not
    return out


def probe_line(text: str) -> str:
    """The probe's answer (JSON) as the agent's log says it."""
    data = json.loads(text)
    if not data["able"]:
        return f"not possible: {data['why_not']}"
    return "possible; " + (
        "a resume may go onto another card of the same model" if data.get("remap")
        else f"a resume only onto the kernel's own card ({data.get('remap_why_not')})"
    )


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
    percent = data.get("host_memory_percent")
    if percent is not None and (isinstance(percent, bool) or not isinstance(percent, int | float) or percent < 0):
        return f"the {L.A_SWAP} annotation's host_memory_percent must be a number of 0 or more"
    return SwapRequest(data["action"], generation, timeout, tuple(sorted(remap.items())), percent)


def swapped_mib(annotations: dict[str, str] | None) -> int:
    """GPU memory (MiB) a swapped-out pod holds in host memory (0 when it is not swapped out)."""
    if not L.swapped_out(annotations):
        return 0
    status = json.loads((annotations or {})[L.A_SWAP_STATUS])
    return int(status.get("host_mib") or 0) if isinstance(status.get("host_mib"), int) else 0


def node_memory_mib() -> int:
    """This node's RAM (MiB)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20


_KERNEL_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def marker_dir(region_dir: str | os.PathLike[str]) -> Path:
    """``<region dir>/swapped``, made (again) this process's own, mode 0711: the region dir is
    writable by every pod (sticky), so whatever a pod left at that name is removed first."""
    d = Path(region_dir) / L.SWAP_MARKER_DIR
    try:
        st = d.lstat()
    except FileNotFoundError:
        st = None
    if st is not None and not (os.path.isdir(d) and not d.is_symlink() and st.st_uid == os.geteuid()):
        if d.is_symlink() or not d.is_dir():
            d.unlink()
        else:
            for entry in d.iterdir():
                entry.unlink()
            d.rmdir()
        st = None
    if st is None:
        d.mkdir(mode=0o711)
    os.chmod(d, 0o711)
    return d


def sweep_markers(region_dir: str | os.PathLike[str], keep: set[str]) -> list[str]:
    """Remove the markers of kernels not in ``keep`` (their pod went, or was restarted while
    swapped out, which makes a fresh process of the same kernel); the kernel ids removed."""
    d = Path(region_dir) / L.SWAP_MARKER_DIR
    if not d.is_dir() or d.is_symlink():
        return []
    gone = sorted(entry.name for entry in d.iterdir() if entry.name not in keep)
    for name in gone:
        set_marker(region_dir, name, False)
    return gone


def keeps_marker(annotations: dict[str, str] | None) -> bool:
    """Whether a pod's kernel keeps its marker: swapped out (a refused resume included), or a suspend
    or resume is being carried out (a resume's success removes it)."""
    todo = pending(annotations)
    return L.swapped_out(annotations) or (todo is not None and isinstance(todo[0], SwapRequest))


def set_marker(region_dir: str | os.PathLike[str], kernel_id: str, present: bool) -> None:
    """Make or remove kernel ``kernel_id``'s marker (a kernel id that is no file name: nothing)."""
    if not _KERNEL_ID.match(kernel_id or ""):
        return
    path = marker_dir(region_dir) / kernel_id
    if present:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


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
    request: SwapRequest,
    pids: Iterable[int],
    cp: CudaCheckpoint,
    memory_mib: Callable[[list[int]], int],
    swapped_elsewhere_mib: int = 0,
    ram_mib: int = 0,
    cards: CardAccess | None = None,
    minors: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Carry out ``request`` on the pod's processes (blocking: run it in a thread); the status.

    ``swapped_elsewhere_mib``: what this node's other swapped-out pods hold in host memory;
    ``ram_mib``: the node's RAM (for the request's host-memory cap); ``cards``: gives the pod's
    container the cards of a remap (``minors``: this node's card uuid -> device minor)."""
    status: dict[str, Any] = {"generation": request.generation, "action": request.action, "ok": False,
                              "message": "", "processes": [], "host_mib": 0, "stuck": False}  # fmt: skip
    try:
        cp.check()
        if request.action == "suspend":
            cuda = cp.cuda_processes(pids)
            status["processes"], status["host_mib"] = cuda, memory_mib(cuda) if cuda else 0
            if request.host_memory_percent is not None:
                cap = int(ram_mib * request.host_memory_percent / 100)
                total = swapped_elsewhere_mib + status["host_mib"]
                if total > cap:
                    status["message"] = swap_over_host_cap(
                        status["host_mib"], total, cap, request.host_memory_percent, node_ram_mib=ram_mib)
                    return status
            cp.suspend(cuda, request.lock_timeout_ms)
        else:
            cuda = [p for p in sorted(set(pids)) if cp.state(p) is ProcessState.CHECKPOINTED]
            status["processes"] = cuda
            remap = dict(request.remap)
            if remap and cards is not None:
                cards.move(cuda, remap, minors or {}, lambda: cp.resume(cuda, remap))
            else:
                cp.resume(cuda, remap)
    except CardAccessError as e:  # the new card not granted: the processes are still checkpointed
        status["message"] = f"the kernel's container could not be given its new card: {e.strerror}"
    except CheckpointUnavailable as e:
        status["message"] = e.message
    except CheckpointError as e:  # a refused resume that left the processes checkpointed is not stuck
        status["message"], status["stuck"] = e.message, e.stuck
    except ValueError as e:  # a remap onto something not a GPU uuid
        status["message"] = str(e)
    else:
        status["ok"] = True
    return status
