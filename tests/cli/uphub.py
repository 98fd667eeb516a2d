"""`elastic-gpu up` as a subprocess, exactly as a new user starts it, plus the REST calls users make.

Shared by the CLI's end-to-end tests (tests/cli) and the single-machine security tests
(tests/security). Each module starts one hub and shares it between its tests.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from tests.hubrunner import free_port

ELASTIC_GPU = Path(sys.executable).parent / "elastic-gpu"


def cli_command() -> list[str]:
    return [str(ELASTIC_GPU)] if ELASTIC_GPU.exists() else [sys.executable, "-m", "hubext.cli"]


def cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_command() + list(args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def reachable_dir(prefix: str) -> Path:
    """A fresh directory other accounts may traverse (pytest's tmp_path is 0700 when run as root).

    The hub's servers run under another account than the hub when it runs as root, and must
    reach their home and limits file under the config dir."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o711)
    return path


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class UpHub:
    """`elastic-gpu up` as a subprocess, plus the REST calls a user or admin makes."""

    def __init__(self, config_dir: Path, admin: str, extra_args: list[str] | None = None) -> None:
        self.config_dir = config_dir
        self.admin = admin
        self.port = free_port()
        self.url = ""
        self.out_path = config_dir.parent / f"up-{config_dir.name}.out"
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self.tokens: dict[str, str] = {}
        self.sessions: dict[str, urllib.request.OpenerDirector] = {}
        self.seen: dict[int, psutil.Process] = {}

    def start(self, timeout: float = 120) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.url = ""
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                cli_command()
                + ["up", "--config-dir", str(self.config_dir), "--port", str(self.port)]
                + self.extra_args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(r"Elastic GPU hub is up at (\S+)/", self.output())
            if match:
                self.url = match.group(1)
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"elastic-gpu up exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.3)
        raise AssertionError(f"elastic-gpu up did not print its URL in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""

    def hub_log(self, lines: int = 60) -> str:
        log = self.config_dir / "data" / "jupyterhub.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""

    def remember_processes(self) -> None:
        """Note every process the hub has started so far (servers, kernels, proxy)."""
        if self.proc is None:
            return
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def stop(self, timeout: float = 120) -> int | None:
        if self.proc is None:
            return None
        self.remember_processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        code = self.proc.returncode
        self.proc = None
        return code

    def kill_leftovers(self) -> None:
        for p in self.seen.values():
            try:
                if p.is_running():
                    p.kill()
            except psutil.NoSuchProcess:
                pass

    # ---- REST -------------------------------------------------------------------------------

    def api(self, method: str, path: str, token: str, body: Any = None, prefix: str = "/hub/api") -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + prefix + path, data=data, method=method)
        req.add_header("Authorization", f"token {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                raw, status = resp.read(), resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def login(self, user: str, password: str) -> str:
        """Log in through the hub's login form (first use sets the password); return a new API token."""
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        opener.open(self.url + "/hub/login", timeout=30).read()
        xsrf = [c.value for c in jar if c.name == "_xsrf"][-1]
        form = urllib.parse.urlencode({"username": user, "password": password, "_xsrf": xsrf}).encode()
        try:
            opener.open(urllib.request.Request(self.url + "/hub/login?next=/hub/home", data=form), timeout=60).read()
        except urllib.error.HTTPError as e:  # 403 with the login form again
            raise PermissionError(f"{user} could not log in ({e.code})") from None
        xsrf = [c.value for c in jar if c.name == "_xsrf"][-1]
        req = urllib.request.Request(
            f"{self.url}/hub/api/users/{user}/tokens", data=json.dumps({"note": "test"}).encode(), method="POST"
        )
        req.add_header("X-XSRFToken", xsrf)
        req.add_header("Content-Type", "application/json")
        try:
            with opener.open(req, timeout=30) as resp:
                token = json.loads(resp.read())["token"]
        except urllib.error.HTTPError as e:
            raise PermissionError(f"{user} could not log in ({e.code})") from None
        self.sessions[user] = opener
        return token

    def page(self, user: str, path: str) -> tuple[int, str]:
        """GET a hub page in ``user``'s browser session (pages take the login cookie, not tokens)."""
        try:
            with self.sessions[user].open(self.url + path, timeout=60) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def spawn(self, user: str, options: dict, server: str = "") -> tuple[int, Any]:
        path = f"/users/{user}/servers/{server}" if server else f"/users/{user}/server"
        return self.api("POST", path, self.tokens[user], options)

    def wait_ready(self, user: str, server: str = "", timeout: float = 120) -> dict:
        token = self.tokens[self.admin]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, model = self.api("GET", f"/users/{user}", token)
            entry = (model or {}).get("servers", {}).get(server)
            if entry and entry.get("ready"):
                self.remember_processes()
                return entry
            if entry is None and time.monotonic() > deadline - timeout + 15:
                raise AssertionError(f"{user}'s server {server!r} is gone:\n{self.hub_log()}")
            time.sleep(0.5)
        raise AssertionError(f"{user}'s server {server!r} not ready in {timeout} s:\n{self.hub_log()}")

    def pool(self) -> dict:
        status, body = self.api("GET", "/gpu/pool", self.tokens[self.admin])
        assert status == 200, body
        return body

    def slices(self) -> list[dict]:
        return [s for n in self.pool()["nodes"] for g in n["gpus"] for s in g["slices"]]

    def start_kernel(self, user: str, kernel_name: str = "") -> dict:
        body = {"name": kernel_name} if kernel_name else {}
        status, kernel = self.api("POST", "", self.tokens[user], body, prefix=f"/user/{user}/api/kernels")
        assert status == 201, f"{kernel}\n{self.hub_log()}"
        self.remember_processes()
        return kernel

    def run_code(self, user: str, kernel_id: str, code: str, timeout: float = 60) -> str:
        return asyncio.run(run_in_kernel(self, user, kernel_id, code, timeout))


async def run_in_kernel(hub: UpHub, user: str, kernel_id: str, code: str, timeout: float = 60) -> str:
    """Execute ``code`` in a kernel of ``user``'s server over its websocket; return what it printed."""
    ws_url = hub.url.replace("http", "ws", 1) + f"/user/{user}/api/kernels/{kernel_id}/channels"
    conn = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {hub.tokens[user]}"}))
    msg_id = uuid.uuid4().hex
    header = {"msg_id": msg_id, "username": user, "session": uuid.uuid4().hex, "msg_type": "execute_request",
              "version": "5.3", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ")}  # fmt: skip
    content = {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False,
               "stop_on_error": True}  # fmt: skip
    conn.write_message(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "content": content,
                                   "channel": "shell", "buffers": []}))  # fmt: skip
    out: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            raw = await asyncio.wait_for(conn.read_message(), max(0.1, deadline - time.monotonic()))
            assert raw is not None, "the kernel's websocket closed"
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "error":
                raise AssertionError(f"kernel error: {msg['content']['evalue']}")
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out)
    finally:
        conn.close()
