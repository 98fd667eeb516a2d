"""The culler's I/O: the hub's GPU broker, and the users' servers reached through the proxy.

Every call has a timeout; failures come back as values (None, a status word), never as
exceptions the loop must guess about, so one broken server cannot stop a cycle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from textwrap import shorten
from typing import Any
from urllib.parse import quote, urlencode

from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse
from tornado.websocket import websocket_connect

from .model import ServerStatus

#: the ``username`` of the culler's notices in a kernel: a swapped-out kernel does not take its
#: GPU back for them (kernelprovider/resume.py says the same)
NOTICE_USERNAME = "elastic-gpu-culler"

#: statuses that mean "this server is not running" when asking /user/<name>/<server>/api/...
SERVER_GONE = {404, 410, 424, 503}


class HubUnavailable(Exception):
    """The hub's API did not answer as expected; the message says which call and how."""


@dataclass(frozen=True)
class ServerKernels:
    """A user's server's answer to ``GET /api/kernels``: status and kernel models by id."""

    status: ServerStatus
    kernels: Mapping[str, Mapping[str, Any]]
    detail: str = ""


class HubClient:
    """REST calls: to the hub with the culler's service token; to a user's server with a token of
    that user that opens that one server, asked of the broker (``POST /hub/api/gpu/server-token``).

    The culler's own token never goes to a user's server: the server is the user's process (it
    loads the user's config) and could keep anything sent to it.
    """

    #: a server token is renewed when less than this many seconds of it are left
    token_margin_seconds = 60.0

    def __init__(
        self,
        api_url: str,
        proxy_url: str,
        token: str,
        *,
        base_url: str = "/",
        request_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        concurrency: int = 32,
        log: logging.Logger | None = None,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self.proxy_url = proxy_url.rstrip("/")
        self.base_url = "/" + base_url.strip("/") + "/" if base_url.strip("/") else "/"
        self.token = token
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.log = log or logging.getLogger("culler")
        self.http = AsyncHTTPClient(force_instance=True, max_clients=max(1, concurrency))
        self.requests = 0
        #: (user, server name) -> (token, monotonic time it expires)
        self._server_tokens: dict[tuple[str, str], tuple[str, float]] = {}
        self._token_locks: dict[tuple[str, str], asyncio.Lock] = {}
        #: servers the broker said are not running (when last asked for their token)
        self._servers_gone: set[tuple[str, str]] = set()

    def close(self) -> None:
        self.http.close()

    # ---- plumbing ---------------------------------------------------------------------------

    async def _fetch(
        self, method: str, url: str, body: Any = None, timeout: float | None = None, token: str | None = None
    ) -> HTTPResponse | None:
        """One request (with ``token``, default the culler's own, for the hub's API only); None
        when it could not be made or timed out (logged at debug)."""
        self.requests += 1
        headers = {"Authorization": f"token {token or self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        req = HTTPRequest(
            url,
            method=method,
            headers=headers,
            body=data,
            allow_nonstandard_methods=True,
            connect_timeout=self.connect_timeout,
            request_timeout=timeout or self.request_timeout,
            follow_redirects=False,
        )
        try:
            return await self.http.fetch(req, raise_error=False)
        except (OSError, asyncio.TimeoutError, HTTPClientError) as e:
            self.log.debug("%s %s failed: %s", method, url, e)
            return None

    @staticmethod
    def _json(resp: HTTPResponse) -> Any:
        try:
            return json.loads(resp.body or b"null")
        except ValueError:
            return None

    def server_base(self, user: str, server_name: str, server_url: str = "") -> str:
        """The public URL of a user's server (through the proxy)."""
        if server_url:
            return self.proxy_url + "/" + server_url.strip("/") + "/"
        path = f"{self.base_url}user/{quote(user, safe='')}/"
        if server_name:
            path += f"{quote(server_name, safe='')}/"
        return self.proxy_url + path

    # ---- the broker -------------------------------------------------------------------------

    async def gpu_kernels(self) -> list[Mapping[str, Any]]:
        """All GPU kernels the broker knows; raise HubUnavailable when it does not answer."""
        url = f"{self.api_url}/gpu/kernels"
        resp = await self._fetch("GET", url)
        if resp is None:
            raise HubUnavailable(f"GET {url}: no answer within {self.request_timeout:g} s")
        if resp.code != 200:
            raise HubUnavailable(f"GET {url}: HTTP {resp.code} {_snippet(resp)}")
        body = self._json(resp)
        if isinstance(body, Mapping):
            body = body.get("kernels", body.get("items"))
        if not isinstance(body, list):
            raise HubUnavailable(f"GET {url}: expected a JSON list of kernels, got {_snippet(resp)}")
        return body

    async def gpu_kernel(self, broker_id: str) -> tuple[str, Mapping[str, Any] | None]:
        """("present", record) | ("gone", None) | ("unknown", None)."""
        resp = await self._fetch("GET", f"{self.api_url}/gpu/kernels/{quote(broker_id, safe='')}")
        if resp is None or resp.code >= 500:
            return "unknown", None
        if resp.code in (404, 410):
            return "gone", None
        if resp.code != 200:
            return "unknown", None
        body = self._json(resp)
        return ("present", body) if isinstance(body, Mapping) else ("unknown", None)

    async def announce_cull(self, broker_id: str, reason: str) -> bool:
        """Tell the broker this kernel is being culled (before its server shuts it down), so its
        slice's release is recorded as culled, not as a stop (docs/metering.md). True when noted."""
        url = f"{self.api_url}/gpu/kernels/{quote(broker_id, safe='')}/cull"
        resp = await self._fetch("POST", url, body={"reason": reason})
        return resp is not None and resp.code == 204

    async def tell_idle(self, broker_id: str, action: str | None, deadline: float = 0.0) -> bool:
        """Tell the broker when an idle kernel will be reclaimed and how (``action``: 'swap' or 'stop'),
        or (``None``) that it no longer will: JupyterLab counts down from it. True when noted."""
        body = {"action": action, "deadline": deadline} if action else {"action": None}
        url = f"{self.api_url}/gpu/kernels/{quote(broker_id, safe='')}/idle"
        resp = await self._fetch("POST", url, body=body)
        return resp is not None and resp.code == 204

    async def suspend_gpu_kernel(
        self, broker_id: str, reason: str, cull_after: float | None = None
    ) -> tuple[bool, str]:
        """Ask the broker to swap a kernel out (its slice goes back, the kernel lives on), and say
        when it will be culled (``cull_after`` seconds swapped out; on a kernel swapped out
        already, that alone): (True, "") when done, else (False, the broker's reason)."""
        query = urlencode(
            {
                "reason": shorten(reason, 200, placeholder="..."),
                **({"cull_after": f"{cull_after:g}"} if cull_after else {}),
            }
        )
        resp = await self._fetch("POST", f"{self.api_url}/gpu/kernels/{quote(broker_id, safe='')}/suspend?{query}")
        if resp is not None and resp.code == 200:
            return True, ""
        body = self._json(resp) if resp is not None else None
        message = body.get("message") if isinstance(body, Mapping) else None
        return False, str(message or (f"HTTP {resp.code}" if resp is not None else "the broker did not answer"))

    async def delete_gpu_kernel(self, broker_id: str, reason: str) -> bool:
        """Ask the broker to stop a kernel and free its slice as culled (the fallback path). True
        when done or already gone."""
        query = urlencode({"reason": shorten(reason, 200, placeholder="..."), "cause": "culled"})
        resp = await self._fetch("DELETE", f"{self.api_url}/gpu/kernels/{quote(broker_id, safe='')}?{query}")
        return resp is not None and resp.code in (200, 202, 204, 404, 410)

    async def gpu_pool(self) -> Mapping[str, Any] | None:
        """The pool and admission queue, or None when the broker does not answer."""
        resp = await self._fetch("GET", f"{self.api_url}/gpu/pool")
        if resp is None or resp.code != 200:
            return None
        body = self._json(resp)
        return body if isinstance(body, Mapping) else None

    # ---- users' servers ---------------------------------------------------------------------

    async def server_token(self, user: str, server_name: str) -> str | None:
        """A token of ``user`` that opens only their server ``server_name`` (cached until near its
        expiry), or None when the broker gives none (then the server is not asked at all)."""
        key = (user, server_name)
        lock = self._token_locks.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._server_tokens.get(key)
            if cached and cached[1] - time.monotonic() > self.token_margin_seconds:
                return cached[0]
            url = f"{self.api_url}/gpu/server-token"
            resp = await self._fetch("POST", url, {"user": user, "server_name": server_name})
            body = self._json(resp) if resp is not None and resp.code == 200 else None
            if not isinstance(body, Mapping) or not isinstance(body.get("token"), str):
                self._server_tokens.pop(key, None)
                if resp is not None and resp.code == 404:  # the server is not running
                    self._servers_gone.add(key)
                    return None
                why = "no answer" if resp is None else f"HTTP {resp.code} {_snippet(resp)}"
                self.log.warning("No token for the server of %s (%r) from the broker: %s", user, server_name, why)
                return None
            self._servers_gone.discard(key)
            expires_in = body.get("expires_in")
            lifetime = float(expires_in) if isinstance(expires_in, int | float) else 2 * self.token_margin_seconds
            self._server_tokens[key] = (body["token"], time.monotonic() + lifetime)
            return body["token"]

    async def _server_fetch(
        self, user: str, server_name: str, method: str, url: str, timeout: float | None = None
    ) -> HTTPResponse | None:
        """A request to a user's server with that server's own token; None without one."""
        token = await self.server_token(user, server_name)
        if token is None:
            return None
        resp = await self._fetch(method, url, timeout=timeout, token=token)
        if resp is not None and resp.code in (401, 403):
            self._server_tokens.pop((user, server_name), None)  # revoked or expired early: ask again next time
        return resp

    async def server_kernels(self, user: str, server_name: str, server_url: str = "") -> ServerKernels:
        url = self.server_base(user, server_name, server_url) + "api/kernels"
        resp = await self._server_fetch(user, server_name, "GET", url)
        if resp is None and (user, server_name) in self._servers_gone:
            return ServerKernels("gone", {}, "the server is not running")
        if resp is None:
            return ServerKernels("unknown", {}, "no answer")
        if resp.code == 200:
            body = self._json(resp)
            if isinstance(body, list):
                return ServerKernels(
                    "ok", {m["id"]: m for m in body if isinstance(m, Mapping) and isinstance(m.get("id"), str)}
                )
            return ServerKernels("unknown", {}, "answer is not a list of kernels")
        if resp.code in SERVER_GONE:
            return ServerKernels("gone", {}, f"HTTP {resp.code}")
        return ServerKernels("unknown", {}, f"HTTP {resp.code}")

    async def kernel_model(self, user: str, server_name: str, kernel_id: str, server_url: str = "") -> Mapping | None:
        url = self.server_base(user, server_name, server_url) + f"api/kernels/{quote(kernel_id, safe='')}"
        resp = await self._server_fetch(user, server_name, "GET", url)
        if resp is None or resp.code != 200:
            return None
        body = self._json(resp)
        return body if isinstance(body, Mapping) else None

    async def shutdown_kernel(self, user: str, server_name: str, kernel_id: str, server_url: str = "") -> str:
        """Shut a kernel down through its server, so JupyterLab shows it stopped.

        Returns "deleted", "gone" (the server does not know it / is not running) or "failed".
        """
        url = self.server_base(user, server_name, server_url) + f"api/kernels/{quote(kernel_id, safe='')}"
        resp = await self._server_fetch(user, server_name, "DELETE", url, timeout=max(self.request_timeout, 30.0))
        if resp is None:
            return "gone" if (user, server_name) in self._servers_gone else "failed"
        if resp.code in (200, 204):
            return "deleted"
        if resp.code in SERVER_GONE:
            return "gone"
        return "failed"

    async def kernel_language(self, user: str, server_name: str, kernelspec: str, server_url: str = "") -> str:
        """The language of a kernelspec on the user's server ("" when unknown)."""
        url = self.server_base(user, server_name, server_url) + "api/kernelspecs"
        resp = await self._server_fetch(user, server_name, "GET", url)
        if resp is None or resp.code != 200:
            return ""
        body = self._json(resp) or {}
        spec = (body.get("kernelspecs") or {}).get(kernelspec) or {}
        return str((spec.get("spec") or {}).get("language") or "")

    async def print_in_kernel(
        self, user: str, server_name: str, kernel_id: str, code: str, server_url: str = "", timeout: float = 15.0
    ) -> bool:
        """Run ``code`` (a print to stderr) in the kernel through the server's websocket.

        ``silent=False`` so its output goes out on iopub to every client of the kernel (JupyterLab
        logs such output in the notebook's Log Console); ``store_history=False`` so the execution
        count does not move. Returns True once the kernel reported idle after it.
        """
        token = await self.server_token(user, server_name)
        if token is None:
            return False
        base = self.server_base(user, server_name, server_url).replace("http", "ws", 1)
        session = uuid.uuid4().hex
        url = f"{base}api/kernels/{quote(kernel_id, safe='')}/channels?session_id={session}"
        req = HTTPRequest(
            url,
            headers={"Authorization": f"token {token}"},
            connect_timeout=self.connect_timeout,
            request_timeout=timeout,
        )
        msg = Session(session=session, username=NOTICE_USERNAME).msg(
            "execute_request",
            content={
                "code": code,
                "silent": False,
                "store_history": False,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": False,
            },
        )
        msg_id = msg["header"]["msg_id"]
        msg.update(channel="shell", buffers=[])
        deadline = time.monotonic() + timeout
        try:
            ws = await asyncio.wait_for(websocket_connect(req), timeout)
        except Exception as e:  # noqa: BLE001 - any failure to connect means "not warned"
            self.log.debug("websocket to kernel %s failed: %s", kernel_id, e)
            return False
        try:
            await ws.write_message(json.dumps(msg, default=json_default))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                raw = await asyncio.wait_for(ws.read_message(), left)
                if raw is None:
                    return False
                if isinstance(raw, bytes):
                    continue
                reply = json.loads(raw)
                if (
                    reply.get("channel") == "iopub"
                    and (reply.get("parent_header") or {}).get("msg_id") == msg_id
                    and reply.get("msg_type", (reply.get("header") or {}).get("msg_type")) == "status"
                    and (reply.get("content") or {}).get("execution_state") == "idle"
                ):
                    return True
        except (asyncio.TimeoutError, OSError, ValueError) as e:
            self.log.debug("warning kernel %s failed: %s", kernel_id, e)
            return False
        finally:
            ws.close()


def _snippet(resp: HTTPResponse, n: int = 200) -> str:
    try:
        return (resp.body or b"").decode(errors="replace")[:n]
    except Exception:  # noqa: BLE001
        return ""
