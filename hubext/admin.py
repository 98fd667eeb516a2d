"""The GPU admin page (/hub/gpu) and its JSON API (/hub/api/gpu/pool, /hub/api/gpu/quota).

The views are built by plain functions (:func:`pool_view`, :func:`quota_view`) from plain
data, so ``elastic-gpu status`` renders the very same view from the SQLite ledger when the
hub is down. Access uses JupyterHub's own scopes: the page needs ``admin-ui`` (as JupyterHub's
admin page), the JSON API ``read:servers`` without a filter (admins have it through
``admin:servers``; a monitoring service can be given just that).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jinja2 import ChoiceLoader, FileSystemLoader
from jupyterhub.apihandlers.base import APIHandler
from jupyterhub.handlers.base import BaseHandler
from jupyterhub.scopes import needs_scope
from tornado import web

from quotas import AdmissionState
from quotas.messages import mib

from .allocator import GPUAllocator
from .events import recent_events
from .pages import (
    kernel_records,
    node_swap_capabilities,
    server_names,
    slice_activity,
    slice_row,
    slice_sizes,
    swap_capability,
    swapped_kernels,
)

TEMPLATES = Path(__file__).parent / "templates"
RESOURCES = ("memory_mib", "cores_percent", "gpus")


# ---- views (plain data in, JSON-ready dict out) --------------------------------------------------


def pool_view(
    nodes: list[dict[str, Any]],
    allocations: Iterable[Mapping[str, Any]],
    *,
    simulated: bool,
    activity: Mapping[str, Mapping[str, int]] | None = None,
    queue: list[dict[str, Any]] | None = None,
    events: list[dict[str, Any]] | None = None,
    source: str = "hub",
    now: float | None = None,
    holders: Mapping[str, Mapping[str, str]] | None = None,
    elsewhere: Iterable[Mapping[str, Any]] = (),
    slice_use: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The pool: every GPU with its slices (owner, size, age), use against capacity and activity.

    Each slice shows its request, its limit and its memory in use (``slice_use``: allocation id ->
    the shim's activity record, ``PoolBackend.slice_activity``; absent: not measured); the card's
    used memory and compute count requests, as admission does.

    ``elsewhere``: slices other hubs hold on these cards (``PoolBackend.held_elsewhere()``);
    each card lists them under ``held_elsewhere`` and counts them as used.

    ``holders``: allocation id -> {server_name, kernel_id} where the hub knows what holds a
    slice (the admin page's stop buttons need them).

    ``nodes`` is load_pool's format (``[{name, gpus: [{uuid, model, memory_mib, ...}]}]``),
    ``allocations`` dicts as :meth:`quotas.Allocation.to_dict` writes them.
    """
    now = time.time() if now is None else now
    activity = activity or {}
    holders = holders or {}
    allocations = list(allocations)
    foreign: dict[str, list[Mapping[str, Any]]] = {}
    for held in elsewhere:
        for uuid in held["gpu_uuids"]:
            foreign.setdefault(uuid, []).append(held)
    by_gpu: dict[str, list[Mapping[str, Any]]] = {}
    for a in allocations:
        for uuid in a["gpu_uuids"]:
            by_gpu.setdefault(uuid, []).append(a)
    out_nodes = []
    totals = {"gpus": 0, "memory_mib": 0, "used_memory_mib": 0, "slices": len(allocations)}
    for node in nodes:
        gpus = []
        for gpu in node["gpus"]:
            capacity_memory = int(gpu["memory_mib"] * gpu.get("memory_oversub", 1.0))
            capacity_cores = int(100 * gpu.get("cores_oversub", 1.0))
            slices = []
            used_memory = used_cores = 0
            for a in sorted(by_gpu.get(gpu["uuid"], []), key=lambda a: a.get("created_at", 0.0)):
                memory = capacity_memory if a.get("whole") else a["memory_mib"]
                cores = capacity_cores if a.get("whole") else a["cores_percent"]
                used_memory += memory
                used_cores += cores
                created = a.get("created_at") or 0.0
                slices.append(
                    {
                        "allocation_id": a["id"],
                        "user": a["user"],
                        "workspace": a["workspace"],
                        "namespace": a["namespace"],
                        "kind": a.get("kind", "notebook"),
                        "priority_class": a.get("priority_class", ""),
                        "memory_mib": memory,
                        "cores_percent": cores,
                        "whole": bool(a.get("whole")),
                        "borrowed": bool(a.get("borrowed")),
                        "age_seconds": round(max(0.0, now - created)) if created else None,
                        "server_name": holders.get(a["id"], {}).get("server_name", ""),
                        "kernel_id": holders.get(a["id"], {}).get("kernel_id", ""),
                        "swap_capability": holders.get(a["id"], {}).get("swap_capability"),
                        **slice_sizes({**a, "memory_mib": memory, "cores_percent": cores,
                                       "memory_in_use_mib": ((slice_use or {}).get(a["id"]) or {}).get(
                                           "memory_used_mib")}),
                    }
                )
            held_elsewhere = []
            for h in foreign.get(gpu["uuid"], []):
                memory = capacity_memory if h.get("whole") else h["memory_mib"]
                cores = capacity_cores if h.get("whole") else h["cores_percent"]
                used_memory += memory
                used_cores += cores
                held_elsewhere.append(
                    {"hub": h["hub"], "allocation_id": h["allocation_id"], "memory_mib": memory,
                     "cores_percent": cores, "whole": bool(h.get("whole"))}
                )
            act = dict(activity.get(gpu["uuid"], {}))
            gpus.append(
                {
                    **gpu,
                    "capacity_memory_mib": capacity_memory,
                    "capacity_cores_percent": capacity_cores,
                    "used_memory_mib": used_memory,
                    "used_cores_percent": used_cores,
                    "free_memory_mib": max(0, capacity_memory - used_memory),
                    "utilization_percent": act.get("utilization_percent"),
                    "memory_in_use_mib": act.get("memory_used_mib"),
                    "slices": slices,
                    "held_elsewhere": held_elsewhere,
                }
            )
            totals["gpus"] += 1
            totals["memory_mib"] += capacity_memory
            totals["used_memory_mib"] += used_memory
        # the node as the pool codec writes it (CPU and host memory included), its cards in full
        out_nodes.append({**node, "gpus": gpus})
    return {
        "source": source,
        "simulated": simulated,
        "generated_at": now,
        "totals": totals,
        "nodes": out_nodes,
        "queue": list(queue or []),
        "events": list(events or []),
    }


def quota_view(state: AdmissionState, *, source: str = "hub") -> dict[str, Any]:
    """Use against limits per workspace, namespace and user, from the admission core's own
    accounting (so whole cards and oversubscription count exactly as admission counts them).

    Every configured workspace and namespace is listed, used or not; users when they hold
    something or have their own limits. A limit of None is unlimited.
    """
    return {"source": source, "workspaces": state.usage()["workspaces"]}


async def hub_pool_view(allocator: GPUAllocator, users: Iterable[Any] = ()) -> dict[str, Any]:
    """The pool view of a running hub's allocator (any pool backend); ``users`` (the hub's
    users) let it name the server of each notebook slice."""
    await allocator.ensure_started()
    backend = allocator.backend
    pool = await backend.inventory()
    activity = backend.activity()
    events = recent_events(backend.events(), allocator.recent_events.latest())
    allocations = list(allocator.state.allocations.values())
    servers, kernels = server_names(users), kernel_records()
    holders = {}
    for a in allocations:
        row = slice_row(a, servers, kernels)
        holders[a.id] = {k: row[k] for k in ("server_name", "kernel_id", "swap_capability")}
    view = pool_view(
        pool.to_dict()["nodes"],
        [a.to_dict() for a in allocations],
        simulated=bool(backend.simulated),
        activity=activity,
        queue=allocator.queue(),
        events=events,
        holders=holders,
        elsewhere=backend.held_elsewhere(),
        slice_use=slice_activity(allocator, (a.id for a in allocations)),
    )
    out_of_service = backend.out_of_service()  # a card after a fatal Xid: which, and why
    for gpu in (g for n in view["nodes"] for g in n["gpus"]):
        gpu["out_of_service"] = out_of_service.get(gpu["uuid"])
    view["swapped"] = swapped_kernels()  # kernels holding host memory, no slice
    swap = swap_capability()
    if swap is not None:  # can idle kernels be swapped out here (state kept) or only stopped?
        view["swap_capability"] = swap
        for node, capability in node_swap_capabilities([n["name"] for n in view["nodes"]]).items():
            next(n for n in view["nodes"] if n["name"] == node)["swap_capability"] = capability
    return view


async def hub_quota_view(allocator: GPUAllocator) -> dict[str, Any]:
    await allocator.ensure_started()
    return quota_view(allocator.state)


# ---- handlers --------------------------------------------------------------------------------------


def _allocator(handler: BaseHandler) -> GPUAllocator:
    return GPUAllocator.instance(config=handler.settings.get("config"), log=handler.log)


class GPUPoolAPIHandler(APIHandler):
    """GET /hub/api/gpu/pool: every GPU, its slices and owners, the queue and recent preemptions."""

    @needs_scope("read:servers")
    async def get(self) -> None:
        self.write(json.dumps(await hub_pool_view(_allocator(self), self.users.values())))


class GPUQuotaAPIHandler(APIHandler):
    """GET /hub/api/gpu/quota: use against limits per workspace, namespace and user."""

    @needs_scope("read:servers")
    async def get(self) -> None:
        self.write(json.dumps(await hub_quota_view(_allocator(self))))


class GPUQueueAPIHandler(APIHandler):
    """DELETE /hub/api/gpu/queue/<request_id>: cancel a waiting request (its user is told why).

    Needs ``admin:servers`` without a filter: it refuses another user's spawn or kernel start.
    """

    @needs_scope("admin:servers")
    async def delete(self, request_id: str) -> None:
        allocator = _allocator(self)
        await allocator.ensure_started()
        who = self.current_user.name if self.current_user is not None else "an admin"
        if not await allocator.cancel(request_id, by=f"an admin ({who})"):
            raise web.HTTPError(404, "%s", f"GPU request {request_id!r} is no longer waiting in the queue.")
        self.set_status(204)
        self.finish()


class GPUAdminPageHandler(BaseHandler):
    """GET /hub/gpu: the pool, the queue and quota usage, for admins (scope admin-ui)."""

    def _add_template_path(self) -> None:
        env = self.settings["jinja2_env"]
        if not getattr(env, "_elastic_gpu_templates", False):
            env.loader = ChoiceLoader([env.loader, FileSystemLoader(str(TEMPLATES))])
            env._elastic_gpu_templates = True

    @web.authenticated
    @needs_scope("admin-ui")
    async def get(self) -> None:
        self._add_template_path()
        allocator = _allocator(self)
        pool = await hub_pool_view(allocator, self.users.values())
        quota = await hub_quota_view(allocator)
        try:  # ?refresh=SECONDS: how often the page reloads its content (default 5, at least 1)
            refresh = max(1.0, float(self.get_argument("refresh", "5")))
        except ValueError:
            refresh = 5.0
        html = await self.render_template(
            "elastic_gpu_admin.html", pool=pool, quota=quota, bars=gpu_bars(pool), refresh_seconds=refresh
        )
        self.finish(html)


# ---- the utilisation picture ------------------------------------------------------------------------

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")


#: the bar colour of slices other hubs hold
ELSEWHERE_COLOUR = "#adb5bd"


def gpu_bars(pool: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per GPU: bar segments (x, width in %, colour, label) for memory and compute, one colour per user."""
    users = sorted({s["user"] for n in pool["nodes"] for g in n["gpus"] for s in g["slices"]})
    colour = {u: PALETTE[i % len(PALETTE)] for i, u in enumerate(users)}
    out = []
    for node in pool["nodes"]:
        for gpu in node["gpus"]:
            rows = {}
            for resource, capacity in (
                ("memory_mib", gpu["capacity_memory_mib"]),
                ("cores_percent", gpu["capacity_cores_percent"]),
            ):
                x = 0.0
                segs = []
                for s in gpu["slices"]:
                    width = 100.0 * s[resource] / capacity if capacity else 0.0
                    segs.append(
                        {
                            "x": round(x, 2),
                            "width": round(min(width, 100.0 - x), 2),
                            "colour": colour[s["user"]],
                            "label": f"{s['user']} ({s['kind']}): {_fmt(resource, s[resource])}",
                        }
                    )
                    x = min(100.0, x + width)
                for h in gpu.get("held_elsewhere", ()):
                    width = 100.0 * h[resource] / capacity if capacity else 0.0
                    segs.append(
                        {
                            "x": round(x, 2),
                            "width": round(min(width, 100.0 - x), 2),
                            "colour": ELSEWHERE_COLOUR,
                            "label": f"held by hub {h['hub']}: {_fmt(resource, h[resource])}",
                        }
                    )
                    x = min(100.0, x + width)
                rows[resource] = segs
            util = gpu.get("utilization_percent")
            out.append(
                {
                    "node": node["name"],
                    "gpu": gpu,
                    "memory": rows["memory_mib"],
                    "cores": rows["cores_percent"],
                    "utilization": util,
                    "legend": [
                        {"user": u, "colour": colour[u]} for u in users if any(s["user"] == u for s in gpu["slices"])
                    ]
                    + [
                        {"user": f"held by hub {hub}", "colour": ELSEWHERE_COLOUR}
                        for hub in sorted({h["hub"] for h in gpu.get("held_elsewhere", ())})
                    ],
                }
            )
    return out


def _fmt(resource: str, value: int) -> str:
    if resource == "memory_mib":
        return mib(value)
    return f"{value} %"


ADMIN_HANDLERS = [
    (r"/gpu", GPUAdminPageHandler),
    (r"/api/gpu/pool", GPUPoolAPIHandler),
    (r"/api/gpu/quota", GPUQuotaAPIHandler),
    (r"/api/gpu/queue/([^/]+)", GPUQueueAPIHandler),
]
