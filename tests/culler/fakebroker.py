"""A stand-in for the GPU broker (hubext.broker), loaded into a real hub as extra handlers.

It keeps the broker's REST contract the culler relies on (``GET /hub/api/gpu/kernels``,
``GET|DELETE /hub/api/gpu/kernels/<id>``, ``GET /hub/api/gpu/pool`` with its queue), over a
single simulated GPU with a memory capacity, and holds no GPU itself:

- a test registers a real ipykernel (started through the user's real jupyter-server) as a GPU
  kernel with ``POST /hub/api/gpu/kernels``, giving its pid;
- like the local pool, a kernel whose process has exited is dropped from the ledger and its slice
  returns to the pool (this is how a shutdown through the user's server frees the slice);
- GPU activity comes from a per-kernel JSON record ``{"last_launch": epoch s, "memory_used_mib": n}``
  written where the test says (``activity_file``), standing in for the shim's record;
- ``POST /hub/api/gpu/requests`` queues a request when the pool is full, and grants waiting
  requests (priority order) whenever memory is freed.

Replace with the real broker once it lands (see docs/culler.md).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path

from jupyterhub.apihandlers.base import APIHandler
from jupyterhub.scopes import needs_scope
from tornado import web

CAPACITY_MIB = int(os.environ.get("FAKE_BROKER_CAPACITY_MIB", "20480"))
PRIORITIES = {"high": 1000, "default": 100, "low": 10}

KERNELS: dict[str, dict] = {}
REQUESTS: dict[str, dict] = {}
_seq = itertools.count(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _used() -> int:
    return sum(k["memory_mib"] for k in KERNELS.values()) + sum(
        r["memory_mib"] for r in REQUESTS.values() if r["state"] == "granted"
    )


def _reap() -> None:
    gone = [kid for kid, k in KERNELS.items() if not _alive(k["pid"])]
    for kid in gone:
        KERNELS.pop(kid)
    if gone:
        _pump()


def _pump() -> None:
    waiting = sorted(
        (r for r in REQUESTS.values() if r["state"] == "waiting"),
        key=lambda r: (-PRIORITIES.get(r["priority_class"], 0), r["seq"]),
    )
    for r in waiting:
        if _used() + r["memory_mib"] <= CAPACITY_MIB:
            r["state"], r["granted_at"] = "granted", time.time()


def _activity(k: dict) -> dict:
    path = k.get("activity_file")
    if path and os.path.exists(path):
        try:
            data = json.loads(Path(path).read_text())
            return {"last_launch": data.get("last_launch"), "memory_used_mib": data.get("memory_used_mib", 0)}
        except (OSError, ValueError):
            pass
    return {"last_launch": None, "memory_used_mib": 0}


def _record(k: dict) -> dict:
    public = {key: value for key, value in k.items() if key not in ("pid", "activity_file")}
    return {**public, **_activity(k)}


class KernelsHandler(APIHandler):
    @needs_scope("admin:servers")
    def get(self) -> None:
        _reap()
        self.finish(json.dumps([_record(k) for k in KERNELS.values()]))

    @needs_scope("admin:servers")
    def post(self) -> None:
        body = self.get_json_body()
        memory = int(body["memory_mib"])
        if _used() + memory > CAPACITY_MIB:
            raise web.HTTPError(409, "the simulated GPU is full")
        kid = f"gk-{next(_seq)}"
        KERNELS[kid] = {
            "id": kid,
            "kernel_id": body["kernel_id"],
            "user": body["user"],
            "server_name": body.get("server_name", ""),
            "allocation_id": f"alloc-{kid}",
            "memory_mib": memory,
            "cores_percent": int(body.get("cores_percent", 25)),
            "priority_class": body.get("priority_class", "default"),
            "profile": body.get("profile", ""),
            "workspace": body.get("workspace", "default"),
            "state": "running",
            "created_at": time.time(),
            "pid": int(body["pid"]),
            "activity_file": body.get("activity_file", ""),
        }
        self.set_status(201)
        self.finish(json.dumps(_record(KERNELS[kid])))


class KernelHandler(APIHandler):
    @needs_scope("admin:servers")
    def get(self, kid: str) -> None:
        _reap()
        if kid not in KERNELS:
            raise web.HTTPError(404, f"no GPU kernel {kid}")
        self.finish(json.dumps(_record(KERNELS[kid])))

    @needs_scope("admin:servers")
    def delete(self, kid: str) -> None:
        k = KERNELS.pop(kid, None)
        if k is None:
            raise web.HTTPError(404, f"no GPU kernel {kid}")
        try:
            os.kill(k["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.info("fake broker: deleted GPU kernel %s (%s)", kid, self.get_argument("reason", ""))
        _pump()
        self.set_status(204)
        self.finish()


class PoolHandler(APIHandler):
    @needs_scope("admin:servers")
    def get(self) -> None:
        _reap()
        queue = sorted(
            (r for r in REQUESTS.values() if r["state"] == "waiting"),
            key=lambda r: (-PRIORITIES.get(r["priority_class"], 0), r["seq"]),
        )
        self.finish(
            json.dumps(
                {
                    "capacity_mib": CAPACITY_MIB,
                    "used_mib": _used(),
                    "priority_classes": {name: {"value": v} for name, v in PRIORITIES.items()},
                    "queue": [{k: v for k, v in r.items() if k != "seq"} for r in queue],
                }
            )
        )


class RequestsHandler(APIHandler):
    @needs_scope("admin:servers")
    def post(self) -> None:
        body = self.get_json_body()
        rid = body["request_id"]
        REQUESTS[rid] = {
            "request_id": rid,
            "user": body["user"],
            "workspace": body.get("workspace", "default"),
            "priority_class": body.get("priority_class", "default"),
            "memory_mib": int(body["memory_mib"]),
            "count": 1,
            "state": "waiting",
            "seq": next(_seq),
        }
        _pump()
        self.finish(json.dumps({k: v for k, v in REQUESTS[rid].items() if k != "seq"}))


class RequestHandler(APIHandler):
    @needs_scope("admin:servers")
    def get(self, rid: str) -> None:
        _reap()
        if rid not in REQUESTS:
            raise web.HTTPError(404)
        self.finish(json.dumps({k: v for k, v in REQUESTS[rid].items() if k != "seq"}))

    @needs_scope("admin:servers")
    def delete(self, rid: str) -> None:
        REQUESTS.pop(rid, None)
        self.set_status(204)
        self.finish()


HANDLERS = [
    (r"/api/gpu/kernels", KernelsHandler),
    (r"/api/gpu/kernels/([^/]+)", KernelHandler),
    (r"/api/gpu/pool", PoolHandler),
    (r"/api/gpu/requests", RequestsHandler),
    (r"/api/gpu/requests/([^/]+)", RequestHandler),
]
