"""Run a real JupyterHub (with the real configurable-http-proxy) for end-to-end tests.

One hub per test module or session: starting one takes a few seconds on two cores, so
suites share it through fixtures. The hub runs in its own process group so that nothing it
started (proxy, single-user servers, kernels) outlives ``stop()``.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NODE_BIN = REPO / "node_modules" / ".bin"


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range, never the same one twice in this process.

    Not a bind to port 0: that hands out ephemeral ports, the ones JupyterHub's ``random_port``,
    `elastic-gpu init` (the hub's internal ports) and every kernel's ports also come from, so a port
    picked here and bound seconds later could be taken meanwhile, or be one of the hub's own ports
    (a CI run once started `elastic-gpu up --port P` with P its config's hub port)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    first, last = (10000, low) if low > 12000 else (high + 1, 65536)
    for _ in range(200):
        port = random.randrange(first, last)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port between {first} and {last}")


class HubRunner:
    """A JupyterHub process with a config written for the test."""

    def __init__(self, workdir: Path, config_text: str = "", env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_text = config_text
        self.env = dict(env or {})
        self.port = free_port()
        self.hub_port = free_port()
        self.proxy_api_port = free_port()
        self.admin_token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.hub_api = f"{self.url}/hub/api"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "jupyterhub.log"
        self.config_path = self.workdir / "jupyterhub_config.py"

    # ---- lifecycle ------------------------------------------------------------------------

    def write_config(self) -> None:
        base = f"""
c = get_config()  # noqa
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {self.port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {self.hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{self.proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{str(NODE_BIN / "configurable-http-proxy")!r}]
c.JupyterHub.db_url = "sqlite:///{self.workdir / "jupyterhub.sqlite"}"
c.JupyterHub.cookie_secret_file = "{self.workdir / "cookie_secret"}"
c.JupyterHub.pid_file = "{self.workdir / "jupyterhub.pid"}"
c.JupyterHub.authenticator_class = "dummy"
c.JupyterHub.services = [{{"name": "test-admin", "api_token": "{self.admin_token}"}}]
c.JupyterHub.load_roles = [{{"name": "admin", "services": ["test-admin"]}}]
c.JupyterHub.log_level = "DEBUG"
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
{self.servers_account_config()}"""
        self.config_path.write_text(base + "\n" + self.config_text + "\n")

    def servers_account_config(self) -> str:
        """A hub never runs a user's server as root: when the tests run as root, hub-user servers run as the
        unprivileged account `elastic-gpu up` uses (created if missing), let through the directories above
        the work dir (an ACL entry for that account alone, no listing)."""
        if os.geteuid() != 0:
            return ""
        from hubext.cli.accounts import TEAM_ACCOUNT, check_servers_can_reach, ensure_team_account

        ensure_team_account(self.workdir / "home")
        (self.workdir / "data").mkdir(exist_ok=True)
        check_servers_can_reach(self.workdir, TEAM_ACCOUNT, grant=True)
        return f"c.HubUserGPUSpawner.run_as_account = {TEAM_ACCOUNT!r}\n"

    def start(self, timeout: float = 90) -> HubRunner:
        self.write_config()
        env = dict(os.environ)
        env["PATH"] = f"{NODE_BIN}:{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env.update(self.env)
        log = open(self.log_path, "ab")
        log_start = log.tell()  # a restart appends: only this run's lines say it is running
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(self.config_path)],
            cwd=self.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyterhub exited with {self.proc.returncode}:\n{self.log_tail()}")
            # ready = JupyterHub's own word that its start-up is over (the proxy started and its
            # routes checked, managed services started), then our hub answering through our
            # proxy: a 200 alone comes as soon as the proxy forwards to the hub, while JupyterHub
            # is still starting the proxy and its services
            if self._said_running(log_start):
                try:
                    status, me = self.api("GET", "/user")
                    if status == 200 and me.get("name") == "test-admin":
                        return self
                except OSError:
                    pass
            time.sleep(0.3)
        raise RuntimeError(f"jupyterhub did not answer within {timeout} s:\n{self.log_tail()}")

    def _said_running(self, offset: int) -> bool:
        """Whether this run of the hub has logged "JupyterHub is now running" (after ``offset``)."""
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return b"JupyterHub is now running" in log.read()

    def stop(self, timeout: float = 30, keep_servers: bool = False) -> None:
        """Stop the hub (it stops its proxy and servers), then anything left in its process group.

        Servers a hub with ``cleanup_servers = False`` leaves running (in sessions of their own)
        are killed too, unless ``keep_servers`` (a restart: the next hub adopts them)."""
        if self.proc is None:
            if not keep_servers:
                self._kill_leftover_servers()
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self.proc = None
        if not keep_servers:
            self._kill_leftover_servers()

    def kill(self) -> None:
        """Kill the hub process only (SIGKILL), leaving its children as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, timeout: float = 90) -> HubRunner:
        self.stop(keep_servers=True)
        return self.start(timeout)

    def _kill_leftover_servers(self) -> None:
        """SIGKILL the processes of this hub's local servers (and their kernels): those whose
        environment points at this hub's API and whose home is under the hub's work dir."""
        api = f"JUPYTERHUB_API_URL=http://127.0.0.1:{self.hub_port}/hub/api".encode()
        home = f"HOME={self.workdir}/".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if api in env and any(v.startswith(home) for v in env):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> HubRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # ---- REST -----------------------------------------------------------------------------

    def api(
        self, method: str, path: str, token: str | None = None, body: Any = None, timeout: float = 30
    ) -> tuple[int, Any]:
        """Call the hub's REST API (path under /hub/api); returns (status, decoded JSON or text)."""
        return http(method, self.hub_api + path, token or self.admin_token, body, timeout)

    def user_token(self, name: str, admin: bool = False) -> str:
        """Create user ``name`` (if needed) and return a new API token of theirs."""
        status, body = self.api("POST", f"/users/{name}", body={"admin": admin})
        if status not in (201, 409):
            raise RuntimeError(f"cannot create user {name}: {status} {body}")
        status, body = self.api("POST", f"/users/{name}/tokens", body={"note": "test"})
        if status != 201:
            raise RuntimeError(f"cannot create a token for {name}: {status} {body}")
        return body["token"]

    def login(self, name: str, password: str = "any") -> urllib.request.OpenerDirector:
        """Log ``name`` in through the hub's login form (the dummy authenticator takes any password):
        an opener carrying the login cookie, as a browser would (pages take cookies, not tokens)."""
        jar = CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        opener.open(self.url + "/hub/login", timeout=30).read()
        xsrf = [c.value for c in jar if c.name == "_xsrf"][-1]
        form = urllib.parse.urlencode({"username": name, "password": password, "_xsrf": xsrf}).encode()
        opener.open(urllib.request.Request(self.url + "/hub/login?next=/hub/home", data=form), timeout=60).read()
        return opener

    def wait_for(self, predicate, timeout: float = 60, interval: float = 0.5, what: str = "condition") -> Any:
        """Poll ``predicate()`` until it returns something truthy; fail with the hub log otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.log_tail()}")


def http(method: str, url: str, token: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
    """One authenticated JSON call to a hub, a server or a service: (status, decoded JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"token {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")
