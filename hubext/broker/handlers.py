"""The broker's REST handlers (under ``/hub/api``), its scopes, and how a hub config registers them.

Authorization uses JupyterHub scopes. ``custom:elastic-gpu:kernels`` with a user filter
(``!user``) lets a token act on that user's kernels only; the user role holds it for its own
user and servers' tokens request it (``c.Spawner.server_token_scopes``).
``custom:elastic-gpu:admin`` (or ``admin:users``) acts on everyone's. Every refusal is JSON
``{"status": ..., "message": ...}`` with a 4xx status.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from jupyterhub.apihandlers.base import APIHandler
from tornado import web

from quotas.messages import kernel_stopped

from ..kernels import KernelRecord
from .core import GPUBroker, start_with_hub
from .sizes import BrokerError, bad_text_in

KERNELS_SCOPE = "custom:elastic-gpu:kernels"
ADMIN_SCOPE = "custom:elastic-gpu:admin"
SIZES_SCOPE = "custom:elastic-gpu:sizes"

#: for ``c.JupyterHub.custom_scopes``
CUSTOM_SCOPES: dict[str, dict[str, Any]] = {
    KERNELS_SCOPE: {
        "description": "Create, read, interrupt, restart and delete GPU kernels.",
    },
    ADMIN_SCOPE: {
        "description": "List, read and delete every user's GPU kernels.",
        "subscopes": [KERNELS_SCOPE, SIZES_SCOPE],
    },
    SIZES_SCOPE: {
        "description": "Read every GPU kernel size (to install the kernelspecs); no rights on kernels.",
    },
}
#: added to the ``user`` role (:func:`grant_user_scopes`): every user holds the kernel scope for themself
USER_SCOPES: list[str] = [f"{KERNELS_SCOPE}!user"]
#: added to ``c.Spawner.server_token_scopes``: a server's token acts for its own user only
SERVER_TOKEN_SCOPES: list[str] = [f"{KERNELS_SCOPE}!user"]


def _implements(handler: type, method: str) -> bool:
    return getattr(handler, method) is not getattr(web.RequestHandler, method)


class BrokerAPIHandler(APIHandler):
    """Shared auth and error rendering of the broker's endpoints."""

    @property
    def broker(self) -> GPUBroker:
        return GPUBroker.instance(config=self.settings.get("config"), log=self.log)

    async def prepare(self) -> None:
        await super().prepare()
        if self.current_user is None:
            raise web.HTTPError(403, "Missing or invalid credentials.")
        try:
            await self.broker.ensure_started(self.users)
        except BrokerError:
            raise
        except Exception as e:
            self.log.exception("GPU broker failed to start")
            raise BrokerError(f"The GPU broker could not start: {e}", 503) from None

    # ---- who may do what ---------------------------------------------------------------------

    @property
    def is_gpu_admin(self) -> bool:
        return self.has_scope(ADMIN_SCOPE) or self.has_scope("admin:users")

    def may_act_for(self, user_name: str) -> bool:
        return self.is_gpu_admin or self.has_scope(f"{KERNELS_SCOPE}!user={user_name}")

    def caller_name(self) -> str:
        user = self.current_user
        return user.name if getattr(user, "kind", "user") == "user" else ""

    def caller_groups(self) -> set[str] | None:
        """Groups of the calling user for size visibility (None: every size, for admins and services
        holding the kernel scope for everyone)."""
        if self.is_gpu_admin or self.has_scope(KERNELS_SCOPE):
            return None
        user = self.current_user
        return {g.name for g in getattr(user, "groups", [])}

    def require_any_kernel_scope(self) -> None:
        if not (self.is_gpu_admin or KERNELS_SCOPE in self.parsed_scopes):
            raise BrokerError(
                f"This token may not use GPU kernels: it lacks the scope {KERNELS_SCOPE}. "
                "Use the server's own token (JUPYTERHUB_API_TOKEN) or ask an admin to grant the scope.",
                403,
            )

    def find_kernel(self, kernel_id: str) -> KernelRecord:
        record = self.broker.kernels.get(kernel_id)
        if record is None or not self.may_act_for(record.user):
            user, why = self.broker.stopped.get(kernel_id, ("", ""))
            if record is None and user and self.may_act_for(user):  # its owner learns who stopped it, and why
                raise BrokerError(kernel_stopped(why), 404)
            # the same answer for "not yours" and "does not exist": ids are not disclosed
            raise BrokerError(f"No GPU kernel {kernel_id!r}.", 404)
        return record

    def json_body(self) -> dict[str, Any]:
        body = self.get_json_body()
        if body is None:
            return {}
        if not isinstance(body, dict):
            raise BrokerError("The request body must be a JSON object.")
        where = bad_text_in(body)
        if where:
            raise BrokerError(f"{where} holds text that is not valid Unicode (a lone surrogate); send UTF-8 text.")
        return body

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """JupyterHub's JSON error, with a sentence where tornado gives none (405: the methods offered)."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if status_code == 405 and isinstance(exc, web.HTTPError) and not exc.log_message:
            offered = [m for m in self.SUPPORTED_METHODS if _implements(type(self), m.lower())]
            sentence = BrokerError(f"{self.request.method} is not offered here; use {' or '.join(offered)}.", 405)
            kwargs["exc_info"] = (BrokerError, sentence, None)
        super().write_error(status_code, **kwargs)

    def wait_arg(self) -> float:
        """``?wait=``: a finite number of seconds, at least 0; longer than the broker's
        ``max_wait_seconds`` is cut to it."""
        raw = self.get_argument("wait", "0")
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            limit = self.broker.max_wait_seconds
            raise BrokerError(
                f"'wait' must be a number of seconds from 0 to {limit:g} (longer waits are cut to {limit:g}), "
                f"got {raw!r}."
            )
        return value


class KernelSizesHandler(BrokerAPIHandler):
    """GET /hub/api/gpu/kernel-sizes"""

    async def get(self) -> None:
        if self.has_scope(SIZES_SCOPE):  # the kernelspec installer (`elastic-gpu up`): every size, no kernels
            sizes = self.broker.sizes_for(None)
        else:
            self.require_any_kernel_scope()
            sizes = self.broker.sizes_for(self.caller_groups())
        self.finish(
            json.dumps(
                {
                    "sizes": [{"name": s["name"], "display_name": s["display_name"], **s["gpu"]} for s in sizes],
                    "custom_allowed": self.broker.allow_custom_gpu,
                    "simulated": bool(getattr(self.broker.allocator.backend, "simulated", False)),
                }
            )
        )


class KernelsHandler(BrokerAPIHandler):
    """GET (list) and POST (create) /hub/api/gpu/kernels"""

    async def get(self) -> None:
        self.require_any_kernel_scope()
        wanted = self.get_argument("user", "")
        if wanted:
            if not self.may_act_for(wanted):
                raise BrokerError(f"You may not list the GPU kernels of {wanted!r}.", 403)
            users = {wanted}
        elif self.is_gpu_admin:
            users = None
        else:
            name = self.caller_name()
            if not name or not self.may_act_for(name):
                raise BrokerError("Name the user whose kernels to list: ?user=<name>.", 400)
            users = {name}
        # and kernels waiting in the GPU queue to start, with their place (their server tells the user)
        known = [*self.broker.kernels.values(), *self.broker.starting.values()]
        records = [r for r in known if users is None or r.user in users]
        # the GPU memory each running slice's programs hold, as its pool sees it (both modes)
        running = [r.allocation_id for r in records if r.state == "running" and not r.swap]
        activity = self.broker.allocator.backend.slice_activity(running) if running else {}
        kernels = [
            {**self.broker.model(r), **({"activity": activity[r.allocation_id]} if r.allocation_id in activity else {})}
            for r in records
        ]
        kernels.sort(key=lambda m: m["created_at"])
        self.finish(json.dumps({"kernels": kernels}))

    async def post(self) -> None:
        self.require_any_kernel_scope()
        body = self.json_body()
        user_name = body.get("user") or self.caller_name()
        if not isinstance(user_name, str) or not user_name:
            raise BrokerError("Name the user the kernel is for: 'user'.")
        if not self.may_act_for(user_name):
            raise BrokerError(f"You may not start GPU kernels for {user_name!r}.", 403)
        server_name = body.get("server_name", "")
        if not isinstance(server_name, str):
            raise BrokerError("'server_name' must be a string ('' is the default server).")
        if not self.is_gpu_admin and not self.has_scope(f"access:servers!server={user_name}/{server_name}"):
            raise BrokerError(f"This token does not belong to the server {user_name}/{server_name}.", 403)
        groups = self.caller_groups()
        if groups is not None and user_name != self.caller_name():
            groups = set()
        record = await self.broker.create(user_name, server_name, body, groups, expect_claim=not self.is_gpu_admin)
        self.set_status(201)
        self.finish(json.dumps(self.broker.model(record)))


#: how far from now an idle deadline may be (a clock gone wrong, or a number that is no time)
IDLE_DEADLINE_RANGE_SECONDS = 366 * 86400


def idle_warning(body: dict[str, Any]) -> dict[str, Any]:
    """The culler's word on an idle kernel: ``{"action": "swap" | "stop", "deadline": seconds since the
    epoch}``, or ``{"action": null}`` (it is no longer idle); a BrokerError (400) for anything else."""
    action, deadline = body.get("action"), body.get("deadline")
    if action is None:
        return {}
    if action not in ("swap", "stop"):
        raise BrokerError(f"'action' must be 'swap', 'stop' or null (no longer idle); got {str(action)[:40]!r}.")
    number = isinstance(deadline, int | float) and not isinstance(deadline, bool) and math.isfinite(deadline)
    if not number or abs(deadline - time.time()) > IDLE_DEADLINE_RANGE_SECONDS:
        raise BrokerError(
            "'deadline' must be when the kernel is reclaimed, in seconds since the epoch (within a year of now); "
            f"got {str(deadline)[:40]!r}."
        )
    return {"action": action, "deadline": float(deadline)}


def _check_cull(handler: BrokerAPIHandler, cause: str) -> None:
    """Only the culler (a GPU admin) says a kernel is culled; any other cause is refused."""
    if cause != "culled":
        raise BrokerError(f"cause must be 'culled' (or left out for a plain stop); got {cause[:40]!r}.")
    if not handler.is_gpu_admin:
        raise BrokerError(f"Only a GPU admin (the scope {ADMIN_SCOPE}, the culler's) may cull a kernel.", 403)


class KernelHandler(BrokerAPIHandler):
    """GET and DELETE /hub/api/gpu/kernels/<id>"""

    async def get(self, kernel_id: str) -> None:
        record = self.find_kernel(kernel_id)
        wait = self.wait_arg()
        if not self.is_gpu_admin:
            self.broker.claim(record)
        record = await self.broker.status(record, wait)
        self.finish(json.dumps(self.broker.model(record)))

    async def delete(self, kernel_id: str) -> None:
        record = self.find_kernel(kernel_id)
        who = self.caller_name() or getattr(self.current_user, "name", "a service")
        reason = self.get_argument("reason", "")[:200]
        cause = self.get_argument("cause", "")
        if cause:
            _check_cull(self, cause)
            self.broker.mark_culled(record, reason)
        await self.broker.delete(record, f"kernel shut down by {who}" + (f": {reason}" if reason else ""))
        self.set_status(204)
        self.finish()


class KernelActionHandler(BrokerAPIHandler):
    """POST /hub/api/gpu/kernels/<id>/(restart|interrupt|cull|idle|stopping)

    ``stopping`` (its server, from the provisioner's ``shutdown_requested``): a shutdown is under
    way; if the kernel exits before the server deletes it, its slice is released as stopped.

    ``cull`` (GPU admins: the culler, before it shuts the kernel down through its server;
    body ``{"reason": ...}``): the kernel's next release is recorded as culled.

    ``idle`` (GPU admins: the culler, when it warns; body :func:`idle_warning`'s): when and how the
    idle kernel will be reclaimed, listed as ``idle_action`` and ``idle_deadline`` (JupyterLab's
    countdown), until the culler says it is no longer idle (``{"action": null}``)."""

    async def post(self, kernel_id: str, action: str) -> None:
        record = self.find_kernel(kernel_id)
        if action == "cull":
            _check_cull(self, "culled")
            reason = self.json_body().get("reason", "")
            self.broker.mark_culled(record, str(reason)[:200])
            self.set_status(204)
            self.finish()
            return
        if action == "idle":
            if not self.is_gpu_admin:
                raise BrokerError(
                    f"Only a GPU admin (the scope {ADMIN_SCOPE}, the culler's) may say when an idle kernel "
                    "is reclaimed.",
                    403,
                )
            record.idle = idle_warning(self.json_body())
            self.set_status(204)
            self.finish()
            return
        if not self.is_gpu_admin:
            self.broker.claim(record)
        if action == "stopping":
            self.broker.mark_stopping(record)
            self.set_status(204)
            self.finish()
            return
        if action == "restart":
            record = await self.broker.restart(record)
            self.finish(json.dumps(self.broker.model(record)))
        else:
            await self.broker.interrupt(record)
            self.set_status(204)
            self.finish()


class KernelSwapHandler(BrokerAPIHandler):
    """POST /hub/api/gpu/kernels/<id>/(suspend|resume)[?wait=seconds]

    Suspend takes ``?cull_after=seconds`` from a GPU admin (the culler): how long the kernel may
    stay swapped out before it is culled (``swap.cull_at`` on the pages); on a kernel swapped out
    already it only sets that.

    Suspend: the kernel's owner or a GPU admin (the culler). Resume: them, or the kernel itself
    with ``Authorization: kernel-key <its connection key>`` (what it does before a cell runs when
    it is swapped out); ``?wait=`` waits that long for the resume to end. Both answer the model:
    ``gpu_swapped`` and, while swapped out, ``swap`` (state swapped | queued, position in the GPU
    queue, host_mib, since, reason)."""

    def _kernel_key(self) -> str:
        header = self.request.headers.get("Authorization", "")
        return header[len("kernel-key ") :].strip() if header.startswith("kernel-key ") else ""

    def check_xsrf_cookie(self) -> None:
        if not self._kernel_key():  # a kernel's key is no cookie: nothing to forge
            super().check_xsrf_cookie()

    async def prepare(self) -> None:
        if not self._kernel_key():
            await super().prepare()
            return
        try:
            await self.broker.ensure_started(self.users)
        except Exception as e:
            raise BrokerError(f"The GPU broker could not start: {e}", 503) from None

    def _cull_after(self) -> float | None:
        """``?cull_after=`` (GPU admins only): seconds; None when not given."""
        raw = self.get_argument("cull_after", "")
        if not raw:
            return None
        if not self.is_gpu_admin:
            raise BrokerError(
                f"Only a GPU admin (the scope {ADMIN_SCOPE}, the culler's) may say when a kernel is culled.", 403
            )
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise BrokerError(f"cull_after must be a number of seconds > 0; got {raw[:40]!r}.")
        return value

    async def post(self, kernel_id: str, action: str) -> None:
        key = self._kernel_key()
        if key:
            record = self.broker.kernels.get(kernel_id)
            if action != "resume" or record is None or not self.broker.kernel_key_matches(record, key):
                raise BrokerError(f"No GPU kernel {kernel_id!r}.", 404)
        else:
            record = self.find_kernel(kernel_id)
        if action == "suspend":
            who = self.caller_name() or getattr(self.current_user, "name", "a service")
            reason = self.get_argument("reason", "")[:200]
            cull_after = self._cull_after()
            record = await self.broker.suspend(record, f"by {who}" + (f": {reason}" if reason else ""), cull_after)
        else:
            record = await self.broker.resume(record, self.wait_arg())
        self.finish(json.dumps(self.broker.model(record)))


class ServerTokenHandler(BrokerAPIHandler):
    """POST /hub/api/gpu/server-token {user, server_name}: a token for the culler to reach one server.

    The token belongs to that user and opens only that server (``access:servers!server=<user>/<name>``),
    for ``GPUBroker.server_token_seconds``: a user who keeps it from their own server's requests holds
    nothing they did not have. GPU admins only (the culler's service).
    """

    async def post(self) -> None:
        if not self.is_gpu_admin:
            raise BrokerError(f"Only a GPU admin (the scope {ADMIN_SCOPE}) may ask for a server token.", 403)
        body = self.json_body()
        user_name, server_name = body.get("user"), body.get("server_name", "")
        if not isinstance(user_name, str) or not user_name or not isinstance(server_name, str):
            raise BrokerError("Give the server as {'user': <name>, 'server_name': <name, '' for the default>}.")
        user = self.find_user(user_name)
        if user is None or server_name not in user.orm_spawners or not user.spawners[server_name].active:
            label = f"{user_name}/{server_name}" if server_name else user_name
            raise BrokerError(f"No running server {label!r}.", 404)
        seconds = int(self.broker.server_token_seconds)
        token = user.new_api_token(
            scopes=[f"access:servers!server={user.name}/{server_name}"],
            note="elastic-gpu culler: this server only",
            expires_in=seconds,
        )
        self.finish(json.dumps({"token": token, "expires_in": seconds, "user": user.name, "server_name": server_name}))


#: for ``c.JupyterHub.extra_handlers`` (patterns are under the hub prefix, /hub)
BROKER_HANDLERS: list[tuple[str, type]] = [
    (r"/api/gpu/server-token", ServerTokenHandler),
    (r"/api/gpu/kernel-sizes", KernelSizesHandler),
    (r"/api/gpu/kernels", KernelsHandler),
    (r"/api/gpu/kernels/([0-9a-f]{32})", KernelHandler),
    (r"/api/gpu/kernels/([0-9a-f]{32})/(restart|interrupt|cull|idle|stopping)", KernelActionHandler),
    (r"/api/gpu/kernels/([0-9a-f]{32})/(suspend|resume)", KernelSwapHandler),
]


def grant_user_scopes(c: Any) -> None:
    """Give every user :data:`USER_SCOPES` through the ``user`` role in ``c.JupyterHub.load_roles``.

    JupyterHub 5 has no ``extra_user_scopes``; redefining the default ``user`` role (keeping
    ``self``) works on 5 and 6. A ``user`` role the config already defines keeps its scopes.
    """
    roles = [dict(r) for r in c.JupyterHub.get("load_roles", [])]
    for role in roles:
        if role.get("name") == "user":
            scopes = list(role.get("scopes", ["self"]))
            role["scopes"] = scopes + [s for s in USER_SCOPES if s not in scopes]
            break
    else:
        roles.append({"name": "user", "scopes": ["self", *USER_SCOPES]})
    c.JupyterHub.load_roles = roles


def configure(c: Any) -> None:
    """Register the broker's handlers, scopes and start-up in a JupyterHub config ``c``."""
    c.JupyterHub.extra_handlers = list(c.JupyterHub.get("extra_handlers", [])) + BROKER_HANDLERS
    c.JupyterHub.custom_scopes = {**dict(c.JupyterHub.get("custom_scopes", {})), **CUSTOM_SCOPES}
    grant_user_scopes(c)
    existing = c.Spawner.get("server_token_scopes", None)
    base = (
        list(existing) if isinstance(existing, list | tuple | set) else ["access:servers!server", "users:activity!user"]
    )
    c.Spawner.server_token_scopes = sorted({*base, *SERVER_TOKEN_SCOPES})
    start_with_hub()
