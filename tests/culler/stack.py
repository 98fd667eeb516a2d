"""Test helpers for the culler on a real stack: users' servers, kernels, browser-like tabs, a culler process."""

from __future__ import annotations

import html
import http.cookiejar as cookiejar
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import websocket

from tests.hubrunner import REPO, HubRunner, free_port
from tests.hubrunner import http as hub_http


def http(method: str, url: str, token: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
    return hub_http(method, url, token, body, timeout)


def start_server(hub: HubRunner, user: str, timeout: float = 90) -> None:
    hub.user_token(user)
    status, body = hub.api("POST", f"/users/{user}/server")
    assert status in (201, 202), (status, body)

    def ready():
        _, model = hub.api("GET", f"/users/{user}")
        server = (model.get("servers") or {}).get("")
        return server and server.get("ready")

    hub.wait_for(ready, timeout=timeout, what=f"{user}'s server to be ready")


def server_kernels(hub: HubRunner, user: str) -> dict[str, dict]:
    status, body = http("GET", f"{hub.url}/user/{user}/api/kernels", hub.admin_token)
    assert status == 200, (status, body)
    return {k["id"]: k for k in body}


class KernelTab:
    """What a browser tab does with a kernel: a websocket on the kernel's channels."""

    def __init__(self, hub: HubRunner, user: str, kernel_id: str) -> None:
        self.session = uuid.uuid4().hex
        url = (
            hub.url.replace("http", "ws", 1)
            + f"/user/{user}/api/kernels/{kernel_id}/channels?session_id={self.session}"
        )
        self.ws = websocket.create_connection(url, header=[f"Authorization: token {hub.admin_token}"], timeout=30)
        self.received: list[dict] = []

    def _recv(self, timeout: float) -> dict | None:
        self.ws.settimeout(timeout)
        try:
            raw = self.ws.recv()
        except websocket.WebSocketTimeoutException:
            return None
        except (websocket.WebSocketConnectionClosedException, OSError):
            return {"closed": True}
        if not raw or isinstance(raw, bytes):
            return {}
        msg = json.loads(raw)
        self.received.append(msg)
        return msg

    def send_execute(self, code: str) -> str:
        """Send an execute request as a notebook does; its msg_id."""
        msg_id = uuid.uuid4().hex
        self.ws.send(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "username": "test",
                        "session": self.session,
                        "msg_type": "execute_request",
                        "version": "5.3",
                        "date": datetime.now(timezone.utc).isoformat(),
                    },
                    "parent_header": {},
                    "metadata": {},
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": True,
                        "user_expressions": {},
                        "allow_stdin": False,
                        "stop_on_error": True,
                    },
                    "channel": "shell",
                    "buffers": [],
                }
            )
        )
        return msg_id

    def execute(self, code: str, timeout: float = 60) -> str:
        msg_id = self.send_execute(code)
        out, errors = [], []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._recv(max(0.1, deadline - time.monotonic()))
            if not msg or msg.get("parent_header", {}).get("msg_id") != msg_id:
                if msg and msg.get("closed"):
                    raise AssertionError("kernel websocket closed during execute")
                continue
            kind = msg.get("msg_type") or msg["header"]["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "error":
                errors.append("\n".join(msg["content"]["traceback"]))
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                assert not errors, errors
                return "".join(out)
        raise AssertionError(f"no reply to execute within {timeout} s")

    def wait_stream(self, msg_id: str, contains: str, timeout: float = 60) -> str:
        """The first stream text of the execution ``msg_id`` that contains ``contains``, as it arrives."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._recv(max(0.05, deadline - time.monotonic()))
            if msg and msg.get("closed"):
                raise AssertionError("kernel websocket closed")
            if not msg or msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if (msg.get("msg_type") or msg["header"]["msg_type"]) == "stream" and contains in msg["content"]["text"]:
                return msg["content"]["text"]
        raise AssertionError(f"no output containing {contains!r} within {timeout} s")

    def drain(self, seconds: float = 0.5) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = self._recv(max(0.05, deadline - time.monotonic()))
            if msg is None or msg.get("closed"):
                return

    def streams(self, contains: str) -> list[str]:
        """Stream texts received (from anyone's executions) that contain ``contains``."""
        return [
            m["content"]["text"]
            for m in self.received
            if (m.get("msg_type") or m.get("header", {}).get("msg_type")) == "stream"
            and contains in m["content"]["text"]
        ]

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass


class GPUKernelUnderTest:
    """A real ipykernel on a user's real server, registered with the broker as a GPU kernel."""

    def __init__(
        self,
        hub: HubRunner,
        user: str,
        workdir: Path,
        *,
        memory_mib: int = 10240,
        priority_class: str = "default",
        profile: str = "",
    ) -> None:
        self.hub, self.user = hub, user
        status, model = http("POST", f"{hub.url}/user/{user}/api/kernels", hub.admin_token, {"name": "python3"})
        assert status == 201, (status, model)
        self.kernel_id = model["id"]
        tab = KernelTab(hub, user, self.kernel_id)
        try:
            self.pid = int(tab.execute("import os; print(os.getpid())").strip())
        finally:
            tab.close()
        self.activity_file = str(workdir / f"activity-{self.kernel_id}.json")
        status, record = hub.api(
            "POST",
            "/gpu/kernels",
            body={
                "kernel_id": self.kernel_id,
                "user": user,
                "pid": self.pid,
                "memory_mib": memory_mib,
                "priority_class": priority_class,
                "profile": profile,
                "activity_file": self.activity_file,
            },
        )
        assert status == 201, (status, record)
        self.id = record["id"]

    def on_server(self) -> bool:
        return self.kernel_id in server_kernels(self.hub, self.user)

    def in_broker(self) -> bool:
        status, _ = self.hub.api("GET", f"/gpu/kernels/{self.id}")
        assert status in (200, 404), status
        return status == 200

    def stop(self) -> None:
        http("DELETE", f"{self.hub.url}/user/{self.user}/api/kernels/{self.kernel_id}", self.hub.admin_token)


def pool(hub: HubRunner) -> dict:
    status, body = hub.api("GET", "/gpu/pool")
    assert status == 200, (status, body)
    return body


class CullerProcess:
    """``python -m culler`` as an external hub service (the Kubernetes Deployment's way of running)."""

    def __init__(self, hub: HubRunner, workdir: Path, token: str, name: str = "culler", **traits: Any) -> None:
        self.hub = hub
        self.dir = Path(workdir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.config = {
            "GPUCuller": {
                "proxy_url": hub.url,
                "interval_seconds": 0.5,
                "metrics_port": self.port,
                "metrics_ip": "127.0.0.1",
                "authenticate_metrics": False,
                "state_file": str(self.dir / "state.json"),
                "confirm_timeout_seconds": 10,
                **traits,
            }
        }
        (self.dir / "culler_config.json").write_text(json.dumps(self.config))
        #: the file `python -m culler --config` reads (a .py config may replace it)
        self.config_file = self.dir / "culler_config.json"
        self.token = token
        self.log_path = self.dir / "culler.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> CullerProcess:
        env = dict(os.environ)
        env.update(
            JUPYTERHUB_API_URL=self.hub.hub_api,
            JUPYTERHUB_API_TOKEN=self.token,
            JUPYTERHUB_SERVICE_NAME="culler-under-test",
            PYTHONPATH=str(REPO),
        )
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "culler", "--config", str(self.config_file), "--log-level=DEBUG"],
            cwd=self.dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_log(self, pattern: str, timeout: float = 30) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log_text())
            if m:
                return m
            if self.proc and self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"culler log has no {pattern!r} within {timeout} s:\n{self.log_text()[-4000:]}")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def kill(self) -> None:
        """SIGKILL, as a node failure or OOM would."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2, log: Any = "") -> Any:
    """Poll ``predicate`` until truthy; on timeout fail with ``log`` (a string, or a callable giving one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    text = log() if callable(log) else log
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{text}")


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    return 0.0


def page_text(hub: HubRunner, user: str, path: str) -> str:
    """A hub page as ``user`` reads it after logging in through the login form (the dummy
    authenticator takes any password): its text, tags stripped, spaces collapsed."""
    jar = cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    opener.open(hub.url + "/hub/login", timeout=30).read()
    xsrf = [c.value for c in jar if c.name == "_xsrf"][-1]
    form = urllib.parse.urlencode({"username": user, "password": "any", "_xsrf": xsrf}).encode()
    opener.open(urllib.request.Request(hub.url + "/hub/login?next=/hub/home", data=form), timeout=60).read()
    with opener.open(hub.url + path, timeout=60) as resp:
        text = resp.read().decode()
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())
