"""pods/exec: a command inside a running container, over the WebSocket channel protocols.

The official clients (``kubernetes.stream.stream``, ``kubernetes_asyncio``'s WsApiClient) open
``GET /api/v1/namespaces/<ns>/pods/<name>/exec?command=...&stdout=1...`` as a WebSocket with
subprotocol ``v5.channel.k8s.io`` or ``v4.channel.k8s.io``: every binary frame starts with its
channel byte (0 stdin, 1 stdout, 2 stderr, 3 status, 4 resize; v5 adds 255 = close a channel).
The status channel gets a ``Status`` as the API server writes it (``NonZeroExitCode`` with the
exit code in ``details.causes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

import tornado.websocket

from . import container as ctr
from . import errors as E
from .errors import ApiError

if TYPE_CHECKING:
    from .emulator import KubeEmulator

PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")


def _status(code: int | None, argv: list[str], error: str | None) -> dict[str, Any]:
    if error:
        msg = (f"failed to exec in container: failed to start exec: OCI runtime exec failed: "
               f"exec failed: unable to start container process: {error}: unknown")
        return {"metadata": {}, "status": "Failure", "message": msg, "reason": "InternalError",
                "details": {"causes": [{"message": msg}]}, "code": 500}
    if code == 0:
        return {"metadata": {}, "status": "Success"}
    return {"metadata": {}, "status": "Failure",
            "message": f"command terminated with non-zero exit code: error executing command "
                       f"[{' '.join(argv)}], exit code {code}",
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}


class ExecHandler(tornado.websocket.WebSocketHandler):
    def initialize(self, emu: KubeEmulator) -> None:
        self.emu = emu
        self.proc: asyncio.subprocess.Process | None = None
        self.argv: list[str] = []
        self._pumps: list[asyncio.Task] = []

    def select_subprotocol(self, subprotocols: list[str]) -> str | None:
        for p in PROTOCOLS:
            if p in subprotocols:
                return p
        return None

    def _refuse(self, err: ApiError) -> None:
        self.set_status(err.code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(err.status()))

    async def get(self, version: str, ns: str, name: str) -> None:  # type: ignore[override]
        self.emu.requests.append(("GET", self.request.path, self.request.query))
        try:  # the WebSocket upgrade needs "create" on pods/exec (kube-apiserver 1.31+)
            self.emu.authorizer.check(self.request.headers.get("Authorization"), "create", "",
                                      "pods", "exec", ns, name)
        except ApiError as e:
            self._refuse(e)
            return
        pod = self.emu.get("pods", name, ns)
        if pod is None:
            self._refuse(E.not_found("pods", "", name))
            return
        self.argv = self.get_arguments("command")
        if not self.argv:
            self._refuse(E.bad_request("you must specify at least 1 command"))
            return
        names = [c["name"] for c in pod["spec"]["containers"]]
        cname = self.get_argument("container", None) or names[0]
        if cname not in names:
            self._refuse(E.bad_request(f"container {cname} is not valid for pod {name}"))
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            self._refuse(E.bad_request("cannot exec into a container in a completed pod; "
                                       f"current phase is {phase}"))
            return
        rt = self.emu.kubelet.runtime_for(ns, name)
        if rt is None or cname != names[0] or rt.pid1 is None:
            if rt is not None and cname != names[0] and rt.pid1 is not None:
                msg = (f"container {cname} of pod {name} runs no process in the emulator "
                       "(only the first container does)")
            else:
                msg = f'unable to upgrade connection: container not found ("{cname}")'
            self._refuse(E.bad_request(msg))
            return
        self.runtime = rt
        await super().get(version, ns, name)

    async def open(self, *args: str) -> None:  # type: ignore[override]
        stdin = self.get_argument("stdin", "") in ("1", "true", "True")
        proc = await self.runtime.exec(self.argv, stdin=stdin)
        if proc is None:
            self._send(3, json.dumps(_status(None, self.argv, "container is not running")))
            self.close()
            return
        self.proc = proc
        want_out = self.get_argument("stdout", "1") in ("1", "true", "True")
        want_err = self.get_argument("stderr", "") in ("1", "true", "True")
        self._pumps = [asyncio.ensure_future(self._pump(proc.stdout, 1 if want_out else None)),
                       asyncio.ensure_future(self._pump(proc.stderr, 2 if want_err else None))]
        asyncio.ensure_future(self._finish())

    async def _pump(self, stream: asyncio.StreamReader | None, channel: int | None) -> None:
        if stream is None:
            return
        while True:
            data = await stream.read(65536)
            if not data:
                return
            if channel is not None:
                self._send(channel, data)

    async def _finish(self) -> None:
        proc = self.proc
        assert proc is not None
        code = await proc.wait()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        error = ctr.exec_error(proc)
        self._send(3, json.dumps(_status(code, self.argv, error)))
        self.close()

    def _send(self, channel: int, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        with contextlib.suppress(tornado.websocket.WebSocketClosedError):
            self.write_message(bytes([channel]) + raw, binary=True)

    def on_message(self, message: str | bytes) -> None:
        raw = message.encode() if isinstance(message, str) else message
        if not raw or self.proc is None or self.proc.stdin is None:
            return
        channel, data = raw[0], raw[1:]
        if channel == 0 and data:
            with contextlib.suppress(Exception):
                self.proc.stdin.write(data)
        elif channel == 255 and data[:1] == b"\x00":  # v5: the client closed stdin
            with contextlib.suppress(Exception):
                self.proc.stdin.close()

    def on_close(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
