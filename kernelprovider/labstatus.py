"""What JupyterLab shows of a GPU kernel: the server extension behind the ``@elastic-gpu/jupyterlab``
status item and notifications.

``GET {base_url}elastic-gpu/kernels`` answers, for each GPU kernel of this server (keyed by its
Jupyter kernel id), the broker's view of it: its slice (memory guaranteed and limit, compute
share, memory in use), its state (running, swapped out, queued for a GPU at a position, stopped
and why). The hub is asked with the server's own token (``$JUPYTERHUB_API_TOKEN``, which holds
the kernel scope for this user only) about ``$JUPYTERHUB_USER``: who is asked about comes from the
server, never from the browser, and no new credential reaches a kernel or the page.

A kernel whose first start waits in the GPU queue is listed by the hub with its place (``queue``)
before JupyterLab has it; the provisioner knows its notebook (:data:`kernelprovider.provisioner.STARTING`),
answered as ``path`` (relative to the server's root) so the page shows it on that notebook. The
culler's warning reaches the page as the broker's ``idle_action`` and ``idle_deadline``, counted down
here.

A kernel the hub stopped (an admin) is no longer listed by the hub; its provisioner in this
server kept the hub's reason (:data:`kernelprovider.provisioner.STOPPED_BY_HUB`), which is
answered as ``state: "stopped"`` with that reason.

Enabled by ``jupyter-config/jupyter_server_config.d/elastic_gpu.json`` (installed with the package).
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import datetime
from typing import Any
from urllib.parse import quote

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from quotas.messages import HUB_STOPPED_IT, mib, plural, queue_place

from .provisioner import STARTING, STOPPED_BY_HUB

#: jupyter_server's authorization resource for this endpoint: reading kernels
AUTH_RESOURCE = "kernels"
#: JupyterLab shows at most this many characters of a notification's message
NOTICE_CHARS = 140
#: the fields of the broker's kernel model the page reads (nothing else is relayed)
RELAYED = (
    "state",
    "reason",
    "size",
    "memory_mib",
    "cores_percent",
    "gpu_count",
    "gpu_swapped",
    "swap",
    "activity",
    "queue",
    "idle_action",
    "idle_deadline",
    "last_stop",
)
#: a culler's deadline this far past is stale (the kernel was swapped out and back, or the culler is gone)
IDLE_STALE_SECONDS = 30

#: how the provisioner begins the reason of a kernel the hub stopped (``stopped_reason``)
HUB_STOPPED = f"{HUB_STOPPED_IT}: "
SWAP_FIELDS = ("state", "position", "since", "cull_at", "reason", "host_mib", "waiting_reason")


def _minutes(seconds: float) -> str:
    minutes = max(1, math.ceil(seconds / 60))
    return f"{minutes} min"


def slice_text(view: dict[str, Any]) -> str:
    """The slice in a few words: "GPU 1.5 GiB / 4 GiB, 25% compute" (memory in use / guaranteed),
    "1 whole GPU, 80 GiB"."""
    used = (view.get("activity") or {}).get("memory_used_mib")
    size = mib(view.get("memory_mib"))
    memory = f"{mib(used)} / {size}" if isinstance(used, int | float) else size
    limit = view.get("memory_limit_mib")
    if isinstance(limit, int | float) and limit > (view.get("memory_mib") or 0):
        memory += f" (up to {mib(limit)})"
    count = view.get("gpu_count") or 1
    if view.get("whole"):  # all of each card: its memory, no compute share to tell
        return f"{plural(count, 'whole GPU')}, {memory}{' each' if count > 1 else ''}"
    cards = f"{count} × " if count > 1 else ""
    return f"GPU {cards}{memory}, {view.get('cores_percent', 100)}% compute"


def where_queued(position: Any) -> str:
    """'position 3 in the GPU queue (2 requests ahead)' (``position``: requests ahead), or 'in the GPU queue'."""
    if isinstance(position, int) and not isinstance(position, bool):
        return queue_place(position)
    return "in the GPU queue"


def in_queue(
    place: dict[str, Any], kind: str, status: str, to: str, then: str, told: str | None = None
) -> dict[str, str]:
    """A kernel waiting in the GPU queue (``place``: ``position``, requests ahead, and ``waiting_reason``):
    a first start (``kind`` 'waiting') or a swapped-out kernel's resume ('queued'). The notice says
    what it waits ``to`` do unless ``told`` replaces that."""
    where = where_queued(place.get("position"))
    why = f" {place['waiting_reason']}" if place.get("waiting_reason") else ""
    notice = f"Your GPU kernel waits for a GPU{to if told is None else told}: {where}."
    return {
        "status": f"{status}: {where}",
        "detail": f"Your GPU kernel waits for a GPU{to}: {where}.{why} {then}",
        "event": f"{kind}:{place.get('position')}",
        "notice": notice + ("" if told is None else f" {then}"),
        "level": "info",
    }


def idle_in(view: dict[str, Any], now: float) -> str:
    """' · idle: stopped in 2 min' from the broker's ``idle_action``/``idle_deadline`` ('' when not warned)."""
    try:
        deadline = datetime.fromisoformat(str(view.get("idle_deadline"))).timestamp()
    except ValueError:
        return ""
    action = {"swap": "swapped out", "stop": "stopped"}.get(str(view.get("idle_action")))
    if action is None or deadline < now - IDLE_STALE_SECONDS:
        return ""
    return f" · idle: {action} in {_minutes(deadline - now)}"


def short(sentence: str, detail: str, rest: str = "") -> str:
    """``sentence`` with ``detail`` put in where it says ``{}``, cut (…) so the whole fits in
    NOTICE_CHARS: JupyterLab cuts a notification's message there, and the end says what to do."""
    room = NOTICE_CHARS - len(sentence.format("")) - len(rest)
    if len(detail) > room:
        detail = detail[: max(0, room - 1)].rstrip() + "…"
    return sentence.format(detail) + rest


def describe(view: dict[str, Any], now: float) -> dict[str, str]:
    """What JupyterLab shows of one kernel: ``status`` (the status bar, its tooltip ``detail``),
    ``event`` (a key that changes when the user should be told something), ``notice`` (that
    sentence, at most NOTICE_CHARS) and ``level`` (info, success, warning, error: JupyterLab's
    notification kinds)."""
    state = view.get("state")
    swap = view.get("swap") if isinstance(view.get("swap"), dict) else {}
    if state == "stopped" or state == "failed":
        reason = str(view.get("reason") or "it stopped")
        by_hub = reason.startswith(HUB_STOPPED)
        why = reason[len(HUB_STOPPED) :] if by_hub else reason
        said = "The hub stopped your GPU kernel ({})." if by_hub else "Your GPU kernel stopped ({})."
        return {
            "status": f"GPU kernel {'stopped by the hub' if by_hub else 'stopped'}: {why}",
            "detail": f"{said.format(why)} Its variables are lost; start a new kernel (Kernel → Change Kernel) "
            "to run cells again.",
            "event": "stopped",
            "notice": short(said, why, " Start a new kernel; its variables are lost."),
            "level": "error",
        }
    queue = view.get("queue") if isinstance(view.get("queue"), dict) else {}
    if state == "pending" and queue:
        return in_queue(
            queue, "waiting", "GPU kernel queued to start", " to start", "It starts as soon as a GPU is free."
        )
    if state == "pending":
        return {"status": "GPU kernel starting", "detail": "", "event": "pending", "notice": "", "level": "info"}
    stop_in = ""
    if isinstance(swap.get("cull_at"), int | float):
        stop_in = f"; stopped in {_minutes(swap['cull_at'] - now)} unless a cell runs"
    if swap.get("state") == "queued":
        return in_queue(swap, "queued", "GPU queued", " to run its next cell", "Its variables are kept.", told="")
    if swap:
        return {
            "status": f"GPU swapped out ({mib(swap.get('host_mib'))} in host memory){stop_in}",
            "detail": f"Your GPU kernel was swapped out ({swap.get('reason') or 'idle'}): its GPU memory was moved "
            "to host memory and its slice given back. Its variables are kept; the next cell takes a GPU again "
            f"first (it may wait for one){stop_in}.",
            "event": "swapped",
            "notice": short(
                "Your GPU kernel was swapped out ({}).",
                str(swap.get("reason") or "idle"),
                " Its variables are kept; the next cell takes a GPU again first.",
            ),
            "level": "warning",
        }
    idle = idle_in(view, now)
    stop = view.get("last_stop") if isinstance(view.get("last_stop"), dict) else {}
    if stop.get("reason"):  # stopped by the hub and started afresh by jupyter-server's restarter
        why = str(stop["reason"]).removeprefix("stopped: ")
        return {
            "status": slice_text(view) + idle,
            "detail": f"Your GPU kernel was stopped and started afresh ({why}). Its variables were lost; run "
            "your cells again.",
            "event": f"restarted:{stop.get('at')}",
            "notice": short(
                "Your GPU kernel was stopped and started afresh ({}).",
                why,
                " Its variables were lost; run your cells again.",
            ),
            "level": "warning",
        }
    return {
        "status": slice_text(view) + idle,
        "detail": f"Your GPU kernel's slice: {slice_text(view)}."
        + (f" Idle:{idle.split(':', 1)[1]} unless a cell runs." if idle else ""),
        "event": "running",
        "notice": f"Your GPU kernel is on a GPU again ({slice_text(view)}); its variables were kept.",
        "started": f"Your GPU kernel has its GPU and started ({slice_text(view)}).",
        "level": "success",
    }


def slice_view(model: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """The part of the broker's kernel model the page shows, with the slice's limit spelled out and
    the words to show (:func:`describe`)."""
    view = {k: model[k] for k in RELAYED if k in model}
    swap = view.get("swap")
    if isinstance(swap, dict):
        view["swap"] = {k: swap.get(k) for k in SWAP_FIELDS}
    gpu = model.get("gpu") if isinstance(model.get("gpu"), dict) else {}
    limit = gpu.get("memory_limit_mib") or model.get("memory_limit_mib") or model.get("memory_mib")
    if limit:
        view["memory_limit_mib"] = limit
    if gpu.get("whole") is True:
        view["whole"] = True
    view.update(describe(view, time.time() if now is None else now))
    return view


class GPUKernelsHandler(APIHandler):
    """GET {base_url}elastic-gpu/kernels: this server's GPU kernels as the hub's broker sees them."""

    auth_resource = AUTH_RESOURCE

    async def _from_hub(self) -> tuple[dict[str, dict[str, Any]], str]:
        """The hub's models of this server's kernels by Jupyter kernel id, and why not ('' when answered)."""
        api_url = os.environ.get("JUPYTERHUB_API_URL", "")
        token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
        user = os.environ.get("JUPYTERHUB_USER", "")
        if not (api_url and token and user):
            return {}, "This server was not started by JupyterHub, so it has no GPU kernels."
        request = HTTPRequest(
            f"{api_url.rstrip('/')}/gpu/kernels?user={quote(user)}",
            headers={"Authorization": f"token {token}"},
            request_timeout=10,
            connect_timeout=5,
        )
        try:
            response = await AsyncHTTPClient().fetch(request, raise_error=False)
        except OSError as e:
            return {}, f"The hub cannot be reached ({e}); GPU state will show again when it answers."
        if response.code != 200:
            return {}, f"The hub's GPU broker answered HTTP {response.code}; GPU state is not shown."
        try:
            kernels = json.loads(response.body).get("kernels", [])
        except (ValueError, AttributeError):
            return {}, "The hub's GPU broker answered something that is not a kernel list."
        server = os.environ.get("JUPYTERHUB_SERVER_NAME", "")
        found = {
            m["kernel_id"]: slice_view(m)
            for m in kernels
            if isinstance(m, dict) and m.get("kernel_id") and m.get("server_name", "") == server
        }
        return found, ""

    def _paths(self, kernels: dict[str, dict[str, Any]]) -> None:
        """The notebook of each kernel whose start is under way (relative to the server's root, as
        JupyterLab names it), so the page shows a start that waits before JupyterLab has the kernel."""
        root = os.path.realpath(self.settings.get("server_root_dir") or os.getcwd())
        for kernel_id, path in list(STARTING.items()):
            if kernel_id in kernels:
                relative = os.path.relpath(os.path.realpath(path), root)
                if not relative.startswith(".."):
                    kernels[kernel_id]["path"] = relative.replace(os.sep, "/")

    @staticmethod
    def _stopped_here() -> dict[str, dict[str, Any]]:
        """Kernels of this server the hub stopped, with its reason (the provisioner kept them)."""
        return {kernel_id: slice_view(model) for kernel_id, model in list(STOPPED_BY_HUB.items())}

    @web.authenticated
    @authorized
    async def get(self) -> None:
        kernels, unavailable = await self._from_hub()
        self._paths(kernels)
        for kernel_id, view in self._stopped_here().items():
            kernels.setdefault(kernel_id, view)
        self.finish(json.dumps({"kernels": kernels, "unavailable": unavailable}))


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "kernelprovider.labstatus"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    """Add the endpoint to a jupyter_server (called by jupyter_server for enabled extensions)."""
    web_app = serverapp.web_app
    route = url_path_join(web_app.settings["base_url"], "elastic-gpu", "kernels")
    web_app.add_handlers(".*$", [(route, GPUKernelsHandler)])
