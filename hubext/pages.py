"""What a user sees of their GPUs on /hub/home and the spawn page: their slices and what is left.

``configure_hub`` puts :func:`user_gpu` in ``c.JupyterHub.template_vars`` (JupyterHub calls it
with the page's user when it renders a page) and this package's templates first in
``c.JupyterHub.template_paths``: ``home.html`` and ``spawn.html`` extend JupyterHub's own
pages with ``elastic_gpu_user.html``. Nothing here changes state; a hub whose allocator has not
started yet shows nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from quotas import Allocation, Owner
from quotas.messages import compute_size, memory_size, mib, queue_place

from .allocator import GPUAllocator
from .events import recent_events

RESOURCES = ("memory_mib", "cores_percent", "gpus")


def size_formatter(user: Any) -> Callable[[int | float | None], str]:
    """The template variable ``gpu_size``: JupyterHub calls a callable template variable with the
    page's user, so this answers the one size formatter (``quotas.messages.mib``) itself; the
    pages then write sizes as the refusals, the CLI and the culler do ("10 GiB", "1.5 GiB")."""
    return mib


def server_names(users: Iterable[Any]) -> dict[str, tuple[str, str]]:
    """allocation id -> (user, server name) for the notebooks of running GPU servers."""
    out: dict[str, tuple[str, str]] = {}
    for user in users:
        for name, spawner in getattr(user, "spawners", {}).items():
            allocation_id = getattr(spawner, "_gpu_allocation_id", "")
            if allocation_id:
                out[allocation_id] = (user.name, name or "")
    return out


def kernel_records() -> dict[str, Any]:
    """allocation id -> the broker's kernel record, when the broker runs in this hub."""
    from .broker.core import GPUBroker

    if not GPUBroker.initialized():
        return {}
    return {r.allocation_id: r for r in GPUBroker.instance().kernels.values() if r.allocation_id}


def swap_capability() -> dict[str, Any] | None:
    """Whether this hub's GPU kernels can be swapped out instead of stopped ({able, why_not}),
    None while the broker does not run in this hub."""
    from .broker.core import GPUBroker

    if not GPUBroker.initialized() or GPUBroker.instance().launcher is None:
        return None
    return GPUBroker.instance().pool_swap_capability().as_dict()


def node_swap_capabilities(nodes: list[str]) -> dict[str, dict[str, Any]]:
    """Node name -> whether GPU kernels on it can be swapped out ({able, why_not}); {} while the
    broker does not run in this hub."""
    from .broker.core import GPUBroker

    if not GPUBroker.initialized() or GPUBroker.instance().launcher is None:
        return {}
    broker = GPUBroker.instance()
    return {node: broker.node_swap_capability(node).as_dict() for node in nodes}


def swapped_kernels(user: str | None = None) -> list[dict[str, Any]]:
    """The swapped-out GPU kernels (of ``user``): they hold host memory, no slice
    (``GPUBroker.swapped_kernels``); [] while the broker does not run in this hub."""
    from .broker.core import GPUBroker

    if not GPUBroker.initialized():
        return []
    rows = GPUBroker.instance().swapped_kernels(user)
    for row in rows:  # what pages print
        row["since_utc"] = utc_text(row["since"])
        row["cull_at_utc"] = utc_text(row["cull_at"])
    return rows


def utc_text(epoch: float | None) -> str:
    """An epoch time as pages print it ('' for None)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch)) if epoch else ""


def kernel_swap_capability(record: Any) -> dict[str, Any] | None:
    """Whether this GPU kernel can be swapped out instead of stopped ({able, why_not}), None while
    the broker does not run in this hub."""
    from .broker.core import GPUBroker

    if record is None or not GPUBroker.initialized() or GPUBroker.instance().launcher is None:
        return None
    return GPUBroker.instance().swap_capability(record).as_dict()


def slice_sizes(a: Mapping[str, Any]) -> dict[str, Any]:
    """A slice's request, limit and current use as pages, the CLI and the APIs show them, from an
    allocation's dict (``Allocation.to_dict``) and ``memory_in_use_mib`` (None: not measured):
    ``memory_text`` '20 GiB guaranteed, up to 40 GiB', ``cores_text`` '25% guaranteed, up to 100%'."""
    memory, cores = a["memory_mib"], a["cores_percent"]
    memory_limit = max(memory, a.get("memory_limit_mib") or 0)
    cores_limit = max(cores, a.get("cores_limit_percent") or 0)
    if a.get("whole"):
        memory_limit, cores_limit = memory, cores
    used = a.get("memory_in_use_mib")
    return {
        "memory_limit_mib": memory_limit,
        "cores_limit_percent": cores_limit,
        "elastic": memory_limit > memory or cores_limit > cores,
        "memory_text": memory_size(memory, memory_limit),
        "cores_text": compute_size(cores, cores_limit),
        "memory_in_use_mib": used,
        "in_use_text": "" if used is None else f"{mib(used)} in use",
    }


def slice_activity(allocator: GPUAllocator, ids: Iterable[str]) -> dict[str, Any]:
    """allocation id -> the shim's activity record of each slice (memory in use; ``{}`` where the
    pool has none: no process of it initialised CUDA, or the pool cannot say)."""
    backend = allocator.backend
    return backend.slice_activity(list(ids)) if backend is not None else {}


def slice_row(
    allocation: Allocation,
    servers: Mapping[str, tuple[str, str]],
    kernels: Mapping[str, Any],
    activity: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict:
    """One slice as pages show it: what it is for (server, kernel), its size (request, limit and
    memory in use, :func:`slice_sizes`), and for a kernel whether it can be swapped out (state
    kept) or only stopped (state lost) when reclaimed."""
    record = kernels.get(allocation.id)
    if record is not None:
        server_name, kernel_id = record.server_name, record.id
    else:
        server_name, kernel_id = servers.get(allocation.id, (allocation.owner.user, ""))[1], ""
    return {
        "swap_capability": kernel_swap_capability(record),
        "allocation_id": allocation.id,
        "user": allocation.owner.user,
        "kind": allocation.kind,
        "server_name": server_name,
        "kernel_id": kernel_id,
        "memory_mib": allocation.memory_mib,
        "cores_percent": allocation.cores_percent,
        "count": len(allocation.gpu_uuids),
        "whole": allocation.whole,
        "node": allocation.node,
        "priority_class": allocation.priority_class,
        **slice_sizes({**allocation.to_dict(),
                       "memory_in_use_mib": ((activity or {}).get(allocation.id) or {}).get("memory_used_mib")}),
    }


def quota_levels(usage: Mapping[str, Any], owner: Owner) -> list[dict[str, Any]]:
    """The owner's user, namespace and workspace levels from ``AdmissionState.usage()``, each with
    ``used``, ``limits`` and ``left`` (None = unlimited), narrowest first."""
    found: list[dict[str, Any]] = []
    for ws in usage["workspaces"]:
        if ws["name"] != owner.workspace:
            continue
        for ns in ws["namespaces"]:
            if ns["name"] != owner.namespace:
                continue
            user = next((u for u in ns["users"] if u["name"] == owner.user), None)
            if user is not None:
                found.append({"label": "you", **user})
            found.append({"label": f"namespace {ns['name']}", **ns})
        found.append({"label": f"workspace {ws['name']}", **ws})
    for level in found:
        level["left"] = {
            r: None if level["limits"][r] is None else max(0, level["limits"][r] - level["used"][r]) for r in RESOURCES
        }
    return found


def remaining(levels: list[dict[str, Any]]) -> dict[str, int | None]:
    """What one more request may take at most: the smallest room over the levels (None = unlimited)."""
    out: dict[str, int | None] = {}
    for r in RESOURCES:
        room = [level["left"][r] for level in levels if level["left"][r] is not None]
        out[r] = min(room) if room else None
    return out


def owner_of(user: Any) -> Owner:
    """The quota owner of ``user``'s GPU use, as their default spawner maps it."""
    spawner = getattr(user, "spawner", None)
    gpu_owner = getattr(spawner, "gpu_owner", None)
    if callable(gpu_owner):
        return gpu_owner()
    return Owner(user=user.name)


def user_gpu(user: Any) -> dict[str, Any] | None:
    """The page's user's slices, waiting requests and remaining quota (None: nothing to show)."""
    if user is None or not GPUAllocator.initialized():
        return None
    allocator = GPUAllocator.instance()
    state = allocator.state
    if state is None:
        return None
    owner = owner_of(user)
    mine = [a for a in state.allocations.values() if a.owner.user == user.name]
    servers = server_names([user])
    kernels = kernel_records()
    levels = quota_levels(state.usage(), owner)
    activity = slice_activity(allocator, (a.id for a in mine))
    return {
        "owner": {"workspace": owner.workspace, "namespace": owner.namespace},
        "slices": [slice_row(a, servers, kernels, activity) for a in sorted(mine, key=lambda a: a.created_at)],
        "waiting": [q for q in allocator.queue() if q["user"] == user.name],
        "swapped": swapped_kernels(user.name),
        "events": user_events(allocator, user.name),
        "levels": levels,
        "remaining": remaining(levels),
        "simulated": bool(allocator.backend.simulated) if allocator.backend is not None else False,
        "usage_page": usage_page_offered(),
        "queue_place": queue_place,  # a place in the GPU queue as the catalogue says it
    }


def user_events(allocator: GPUAllocator, user: str, limit: int = 5) -> list[dict[str, Any]]:
    """The user's latest notable slice events, newest first (a server or kernel stopped because a
    slice on its card needed its burst, preempted, culled, swapped out; the pool page's events),
    each with ``at_utc``: why a server the user left running is gone."""
    backend = allocator.backend
    kept = backend.events(limit=50) if backend is not None else []
    mine = [e for e in recent_events(kept, allocator.recent_events.latest(50), 50) if e.get("user") == user]
    return [{**e, "at_utc": utc_text(e.get("at"))} for e in mine[:limit]]


def usage_page_offered() -> bool:
    """Whether this hub records GPU usage (``configure_hub(metering=True)``): its page /hub/gpu/usage."""
    from .metering.meter import UsageMeter

    return UsageMeter.initialized()


def login_facts(user: Any) -> dict[str, Any] | None:
    """What the login page tells someone not logged in to a single-machine hub: whether its GPUs are
    simulated, and who its admins are (whom to ask for an account). None elsewhere (Kubernetes hubs
    have their own sign-in and admins) and once logged in."""
    if user is not None or not GPUAllocator.initialized():
        return None
    backend = GPUAllocator.instance().backend
    if backend is None or backend.mode != "local":
        return None
    from jupyterhub import orm
    from jupyterhub.app import JupyterHub

    admins: list[str] = []
    if JupyterHub.initialized():
        admins = sorted(u.name for u in JupyterHub.instance().db.query(orm.User).filter(orm.User.admin.is_(True)))
    return {"simulated": bool(backend.simulated), "admins": admins}
