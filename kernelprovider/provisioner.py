"""ElasticGPUProvisioner: a jupyter_client kernel provisioner whose kernels run through the hub's GPU broker.

The notebook server holds no GPU and no rights to create pods. For a GPU kernelspec this
provisioner asks the hub's broker (``$JUPYTERHUB_API_URL/gpu/kernels``, with the server's
own ``$JUPYTERHUB_API_TOKEN``) for a kernel with a slice; the broker runs admission and
starts the kernel (a pod, or a local process on a single machine) with the connection key
the kernel manager chose. The server then talks to the kernel over ZMQ as to any kernel.

- interrupt: by the control channel (the kernelspecs say ``interrupt_mode: message``), so
  no port but the kernel's own is open;
- restart: the broker starts a new kernel process in the same slice (new address/ports,
  which jupyter_server and JupyterLab reconnect to), then stops the old one;
- shutdown: the broker deletes the kernel and the slice goes back to the pool;
- poll: the broker's view of the kernel, cached for ``poll_cache_seconds``.

A refusal (quota, pool full, unschedulable) reaches the user as the kernel start's error,
with the broker's sentence and HTTP status.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from typing import Any
from urllib.parse import quote

from jupyter_client.connect import port_names
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Dict, Float, Unicode, default

from quotas.messages import stopped_by_hub


class Sentence(str):
    """A message that must reach the user as it is, wherever it becomes an ``HTTPError``.

    jupyter_server answers a failed POST /api/sessions (what JupyterLab calls) with
    ``HTTPError(500, str(e))``, and tornado escapes every ``%`` of a log message given without
    arguments (``message.replace("%", "%%")``), so "25% of compute" would read "25%% of compute".
    A Sentence is left as it is by that escaping; it is still an ordinary ``str`` for JSON.
    """

    def replace(self, old: str, new: str, count: int = -1) -> str:  # type: ignore[override]
        if old == "%" and new == "%%":
            return self
        return str.replace(self, old, new, count)


class GPUKernelError(web.HTTPError):
    """A GPU kernel could not be had; jupyter_server answers the kernel start with ``status`` and ``message``.

    What jupyter_server sends (``str(e)`` for POST /api/sessions, ``log_message`` for POST
    /api/kernels) is the sentence as one line, as a :class:`Sentence`, so that every ``%`` shows
    once; API clients get no hard line breaks. JupyterLab's "Error Starting Kernel" dialog shows it
    in a <pre>, which the package's JupyterLab extension wraps (labextension/style/index.css).
    """

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(status, "%s", message)
        self.message = message
        self.status = status

    @property
    def log_message(self) -> str:  # type: ignore[override]
        return Sentence(self.message)

    @log_message.setter
    def log_message(self, value: str | None) -> None:  # tornado before 6.5 assigns it in __init__
        self._log_message = value

    def __str__(self) -> str:
        return self.log_message


#: kernels of this server the hub stopped, newest last: Jupyter kernel id -> the broker's last model
#: of it, with ``state: "stopped"`` and the hub's reason (read by :mod:`kernelprovider.labstatus`;
#: jupyter_server forgets a dead kernel at once, the user is told about it later)
STOPPED_BY_HUB: dict[str, dict[str, Any]] = {}
STOPPED_KEPT = 100

#: kernels of this server whose first start is under way: Jupyter kernel id -> the path of the
#: notebook it starts for (``JPY_SESSION_NAME``, absolute), so the page can show a start that waits
#: in the GPU queue before JupyterLab has the kernel (read by :mod:`kernelprovider.labstatus`)
STARTING: dict[str, str] = {}


def stopped_reason(data: Any) -> str:
    """Why the hub stopped a kernel, from the broker's 404 answer: "the hub stopped it", with the
    hub's reason (who stopped it and the reason they gave) when the broker kept it."""
    return stopped_by_hub(str(data.get("message", "")) if isinstance(data, dict) else "")


class ElasticGPUProvisioner(KernelProvisionerBase):
    """Kernels with a GPU slice, started by the hub's GPU broker."""

    size = Unicode(
        "",
        config=True,
        help="The GPU kernel size to ask for (a name from the hub's /hub/api/gpu/kernel-sizes).",
    )
    gpu = Dict(
        config=True,
        help="An explicit gpu section ({memory_mib, cores_percent, count, ...}) instead of a size.",
    )
    hub_api_url = Unicode(
        config=True,
        help="The hub's API URL. Default: $JUPYTERHUB_API_URL (set by the hub for every server).",
    )
    api_token = Unicode(
        config=True,
        help="Token for the broker. Default: $JUPYTERHUB_API_TOKEN (the server's own token).",
    )
    server_name = Unicode(
        config=True,
        help="The server the kernel belongs to. Default: $JUPYTERHUB_SERVER_NAME ('' = the default server).",
    )
    launch_timeout = Float(
        120.0,
        config=True,
        help="""Seconds to wait for a GPU kernel to be running before the start fails, including its
        wait in the hub's GPU queue (keep it above GPUBroker.max_queue_seconds). Default: 120.""",
    )
    request_timeout = Float(30.0, config=True, help="Seconds to wait for one broker request. Default: 30.")
    poll_cache_seconds = Float(
        1.0,
        config=True,
        help="Seconds a poll() answer is reused before the broker is asked again. Default: 1.",
    )

    @default("hub_api_url")
    def _default_hub_api_url(self) -> str:
        return os.environ.get("JUPYTERHUB_API_URL", "")

    @default("api_token")
    def _default_api_token(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    @default("server_name")
    def _default_server_name(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVER_NAME", "")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.remote_id: str | None = None
        self.model: dict[str, Any] = {}
        self._polled_at = 0.0
        self._replaced = False  # a restart was requested: the old kernel process counts as gone
        self._shutting_down = False
        self._deleted = False  # the broker's record is gone (deleted by us, or by the hub)
        self._gone_reason = ""  # set when the hub stopped it: then a restart must not take a new slice

    def _stopped_by_hub(self, data: Any) -> None:
        """The broker no longer knows the kernel (404): remember why, and let it die without a restart."""
        self._deleted = True
        self._gone_reason = self._gone_reason or stopped_reason(data)
        self.model = {**self.model, "state": "stopped", "exit_code": 1, "reason": self._gone_reason}
        if self.kernel_id:
            STOPPED_BY_HUB.pop(self.kernel_id, None)
            STOPPED_BY_HUB[self.kernel_id] = dict(self.model)
            while len(STOPPED_BY_HUB) > STOPPED_KEPT:
                STOPPED_BY_HUB.pop(next(iter(STOPPED_BY_HUB)))
        self.log.warning("GPU kernel %s (kernel %s): %s", self.remote_id, self.kernel_id, self._gone_reason)
        self._no_autorestart()

    def _no_autorestart(self) -> None:
        """The hub stopped the kernel on purpose: jupyter_client's restarter must not try to start it
        again (JupyterLab would show "The kernel appears to have died. It will restart automatically.",
        and the restart is refused anyway); JupyterLab's extension tells the user the hub's reason."""
        restarter = getattr(self.parent, "_restarter", None)  # jupyter_client's KernelRestarter, if started
        if restarter is not None:
            restarter.restart_limit = 0  # this poll's "not alive" then reports the kernel dead, not restarting

    # ---- talking to the broker ---------------------------------------------------------------

    async def _api(
        self, method: str, path: str, body: dict | None = None, timeout: float | None = None
    ) -> tuple[int, Any]:
        if not self.hub_api_url or not self.api_token:
            raise GPUKernelError(
                "GPU kernels need a JupyterHub server: JUPYTERHUB_API_URL and JUPYTERHUB_API_TOKEN are not set.",
                500,
            )
        request = HTTPRequest(
            self.hub_api_url.rstrip("/") + path,
            method=method,
            headers={"Authorization": f"token {self.api_token}", "Content-Type": "application/json"},
            body=json.dumps(body) if body is not None else (b"" if method == "POST" else None),
            request_timeout=timeout or self.request_timeout,
            connect_timeout=min(10.0, timeout or self.request_timeout),
        )
        try:
            response = await AsyncHTTPClient().fetch(request, raise_error=False)
        except (OSError, HTTPClientError, asyncio.TimeoutError) as e:
            raise GPUKernelError(f"The hub's GPU broker cannot be reached ({e}); try again in a moment.", 503) from None
        if response.code == 599:
            raise GPUKernelError(
                f"The hub's GPU broker cannot be reached ({response.error}); try again in a moment.", 503
            )
        data: Any = None
        if response.body:
            try:
                data = json.loads(response.body)
            except ValueError:
                data = {"message": response.body.decode(errors="replace")[:300]}
        return response.code, data

    @staticmethod
    def _message(code: int, data: Any) -> str:
        if isinstance(data, dict) and data.get("message"):
            return str(data["message"])
        return f"The hub's GPU broker answered HTTP {code}."

    def _kernel_path(self, suffix: str = "") -> str:
        return f"/gpu/kernels/{quote(self.remote_id or '')}{suffix}"

    async def _wait_running(self) -> dict[str, Any]:
        """Wait for the kernel to run; raise GPUKernelError with the broker's reason if it cannot."""
        deadline = time.monotonic() + self.launch_timeout
        while True:
            left = deadline - time.monotonic()
            if self.model.get("state") == "running" and self.model.get("ip"):
                return self.model
            if self.model.get("state") in ("failed", "stopped"):
                reason = self.model.get("reason") or self.model["state"]
                await self._delete_quietly()
                raise GPUKernelError(f"The GPU kernel could not start: {reason}.", 503)
            if left <= 0:
                await self._delete_quietly()
                raise GPUKernelError(
                    f"The GPU kernel did not start within {self.launch_timeout:g} s "
                    f"({self.model.get('reason') or 'still pending'}); its slice was released.",
                    504,
                )
            wait = max(0.1, min(left, 10.0))
            code, data = await self._api("GET", self._kernel_path(f"?wait={wait:.1f}"), timeout=wait + 15)
            if code == 404:
                raise GPUKernelError("The GPU kernel was deleted by the hub while it started.", 410)
            if code != 200:
                raise GPUKernelError(self._message(code, data), code if 400 <= code < 600 else 500)
            self.model = data
            self._polled_at = time.monotonic()

    async def _delete_quietly(self) -> None:
        if self.remote_id is None or self._deleted:
            return
        try:
            code, data = await self._api("DELETE", self._kernel_path())
            if code not in (204, 404):
                self.log.warning("GPU kernel %s: delete answered %s: %s", self.remote_id, code, data)
        except GPUKernelError as e:
            self.log.warning("GPU kernel %s: could not delete: %s", self.remote_id, e.message)
            return
        self._deleted = True
        self.model = {**self.model, "state": "stopped"}

    def _connection_info(self, key: bytes) -> dict[str, Any]:
        m = self.model
        info: dict[str, Any] = {
            "ip": m["ip"],
            "transport": m.get("transport", "tcp"),
            "signature_scheme": m.get("signature_scheme", "hmac-sha256"),
            "key": key,
            "kernel_name": self.kernel_spec.name if self.kernel_spec is not None else "",
        }
        for name in port_names:  # jupyter_client's own list of a kernel's channels
            info[name] = int(m[name])
        return info

    # ---- KernelProvisionerBase ------------------------------------------------------------------

    @property
    def has_process(self) -> bool:
        return self.remote_id is not None

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        kwargs = await super().pre_launch(**kwargs)
        km = self.parent
        if not km.session.key:
            km.session.key = uuid.uuid4().hex.encode()
        kwargs["cmd"] = list(self.kernel_spec.argv) if self.kernel_spec is not None else []
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> dict[str, Any]:
        km = self.parent
        key: bytes = km.session.key
        if self.remote_id is not None and self._gone_reason:
            # the hub stopped this kernel (culled, deleted by an admin, its server gone): an
            # automatic restart must not quietly take a new slice; the user starts a new kernel
            raise GPUKernelError(f"The GPU kernel cannot be restarted: {self._gone_reason}. Start a new kernel.", 410)
        if self.remote_id is not None and self._deleted:
            self.remote_id = None  # we deleted it (a forced restart of a live kernel): start a new one
        if self.remote_id is not None:
            if not self._replaced:  # a restart that did not come through shutdown_requested/kill
                await self._restart_remote()
            self._replaced = False
            await self._wait_running()
            self.log.info("GPU kernel %s restarted at %s", self.remote_id, self.model.get("ip"))
            return self._connection_info(key)

        body: dict[str, Any] = {
            "server_name": self.server_name,
            "key": key.decode(),
            "signature_scheme": km.session.signature_scheme,
            "kernel_name": self.kernel_spec.name if self.kernel_spec is not None else "",
            "cwd": kwargs.get("cwd") or "",
            "kernel_id": self.kernel_id or "",
        }
        if self.gpu:
            body["gpu"] = dict(self.gpu)
        else:
            body["size"] = self.size
        path = (kwargs.get("env") or {}).get("JPY_SESSION_NAME", "")
        if self.kernel_id and path:
            STARTING[self.kernel_id] = path
        try:
            # the start may wait in the hub's GPU queue: up to launch_timeout, not one request's timeout
            code, data = await self._api(
                "POST", "/gpu/kernels", body, timeout=max(self.launch_timeout, self.request_timeout)
            )
        finally:
            STARTING.pop(self.kernel_id or "", None)
        if code != 201:
            raise GPUKernelError(self._message(code, data), code if 400 <= code < 600 else 500)
        self.remote_id = data["id"]
        self.model = data
        self._deleted = self._replaced = self._shutting_down = False
        self._gone_reason = ""
        self._polled_at = time.monotonic()
        try:
            await self._take_up()
            await self._wait_running()
        except BaseException:
            self.remote_id = None
            raise
        self.log.info(
            "GPU kernel %s (%s) running at %s for kernel %s",
            self.remote_id,
            self.size,
            self.model["ip"],
            self.kernel_id,
        )
        return self._connection_info(key)

    async def _take_up(self) -> None:
        """Tell the broker this server has the kernel (one GET): a kernel its server never asks
        about is taken for an orphan whose start answer was lost, and deleted."""
        code, data = await self._api("GET", self._kernel_path())
        if code == 200 and isinstance(data, dict):
            self.model = data

    async def _restart_remote(self) -> None:
        code, data = await self._api("POST", self._kernel_path("/restart"), timeout=self.request_timeout + 30)
        if code == 404:
            self._stopped_by_hub(data)
            raise GPUKernelError(f"The GPU kernel cannot be restarted: {self._gone_reason}. Start a new kernel.", 410)
        if code != 200:
            raise GPUKernelError(self._message(code, data), code if 400 <= code < 600 else 500)
        self.model = data
        self._replaced = True
        self._polled_at = time.monotonic()

    async def poll(self) -> int | None:
        if self.remote_id is None or self._deleted or self._replaced:
            return 0
        fresh = time.monotonic() - self._polled_at < self.poll_cache_seconds
        if not fresh or self._shutting_down:
            try:
                code, data = await self._api("GET", self._kernel_path(), timeout=10)
            except GPUKernelError as e:
                self.log.warning("GPU kernel %s: poll failed, assuming it runs: %s", self.remote_id, e.message)
                return None
            if code == 404:
                self._stopped_by_hub(data)
                return 1
            if code == 200:
                self.model = data
                self._polled_at = time.monotonic()
        state = self.model.get("state")
        if state in ("pending", "running"):
            return None
        code = self.model.get("exit_code")
        return int(code) if code is not None else (0 if state == "stopped" else 1)

    async def wait(self) -> int | None:
        while True:
            status = await self.poll()
            if status is not None:
                return status
            await asyncio.sleep(0.2)

    async def send_signal(self, signum: int) -> None:
        if signum == 0 or self.remote_id is None:
            return
        if signum in (signal.SIGTERM, signal.SIGKILL):
            await self.kill()
            return
        if signum == signal.SIGINT:
            code, data = await self._api("POST", self._kernel_path("/interrupt"))
            if code == 204:
                return
            if code == 409:  # a pod: the hub cannot signal it; the control channel can
                km = self.parent
                km.session.send(km._control_socket or km.connect_control(), "interrupt_request", {})
                return
            raise GPUKernelError(self._message(code, data), code)
        self.log.warning("GPU kernel %s: signal %d is not supported; ignored", self.remote_id, signum)

    async def kill(self, restart: bool = False) -> None:
        if self.remote_id is None:
            return
        if restart:
            if not self._replaced and not self._deleted:
                await self._restart_remote()
            return
        if self.model.get("state") in ("stopped", "failed"):
            # already dead: nothing to kill. jupyter_client kills with restart=False even when it
            # restarts a dead kernel (restart_kernel(now=True)); cleanup() deletes it if final.
            return
        await self._delete_quietly()

    async def terminate(self, restart: bool = False) -> None:
        await self.kill(restart=restart)

    async def shutdown_requested(self, restart: bool = False) -> None:
        if restart and self.remote_id is not None and not self._deleted:
            # start the replacement now, in the same slice, while the old kernel exits
            await self._restart_remote()
        elif not restart:
            self._shutting_down = True
            if self.remote_id is not None and not self._deleted:
                # the kernel may exit before cleanup() deletes it: the hub then records a stop
                try:
                    await self._api("POST", self._kernel_path("/stopping"), timeout=10)
                except Exception as e:  # noqa: BLE001 - only the usage record's cause is at stake
                    self.log.debug("GPU kernel %s: could not announce its shutdown: %s", self.remote_id, e)

    async def cleanup(self, restart: bool = False) -> None:
        if restart:
            return
        await self._delete_quietly()
        self.remote_id = None
        self._replaced = self._shutting_down = False

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info.update({"remote_id": self.remote_id, "size": self.size, "server_name": self.server_name})
        return info

    async def load_provisioner_info(self, provisioner_info: dict) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.remote_id = provisioner_info.get("remote_id")
        self.size = provisioner_info.get("size", self.size)
        self.server_name = provisioner_info.get("server_name", self.server_name)

    def get_shutdown_wait_time(self, recommended: float = 5.0) -> float:
        return min(recommended, 4.0)
