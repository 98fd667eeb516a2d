"""The README's first command, end to end: `elastic-gpu up` in a temp dir with simulated GPUs.

A real JupyterHub behind the real configurable-http-proxy, started by the CLI exactly as a new
user starts it. Users log in with first-use passwords, spawn GPU notebooks with profiles over
REST, hit a quota, get forged options refused, start a GPU kernel through the provisioner and
run code in it, see the pool in `elastic-gpu status` and on /hub/gpu in headless Chromium
(screenshot kept under artifacts/local/), and Ctrl-C (SIGTERM) leaves nothing running.

One hub for the module; the tests run in order and share it.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from tests.hubrunner import free_port
from tests.local.browser import Browser, chromium_path

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "local"
ELASTIC_GPU = Path(sys.executable).parent / "elastic-gpu"
ADMIN, ALICE, BOB = "boss", "alice", "bob"
PASSWORDS = {ADMIN: "boss-password-1", ALICE: "alice-password-1", BOB: "bob-password-1"}
QUARTER, HALF = "h100-80gb-quarter", "h100-80gb-half"


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [str(ELASTIC_GPU)] if ELASTIC_GPU.exists() else [sys.executable, "-m", "hubext.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)


class UpHub:
    """`elastic-gpu up` as a subprocess, plus the REST calls a user or admin makes."""

    def __init__(self, config_dir: Path) -> None:
        self.config_dir = config_dir
        self.port = free_port()
        self.url = ""
        self.out_path = config_dir.parent / "up.out"
        self.proc: subprocess.Popen | None = None
        self.tokens: dict[str, str] = {}
        self.sessions: dict[str, urllib.request.OpenerDirector] = {}
        self.seen: dict[int, psutil.Process] = {}

    def start(self, timeout: float = 120) -> None:
        cmd = [str(ELASTIC_GPU)] if ELASTIC_GPU.exists() else [sys.executable, "-m", "hubext.cli"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.url = ""
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd + ["up", "--config-dir", str(self.config_dir), "--port", str(self.port)],
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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, model = self.api("GET", f"/users/{user}", self.tokens[ADMIN])
            entry = (model or {}).get("servers", {}).get(server)
            if entry and entry.get("ready"):
                self.remember_processes()
                return entry
            if entry is None and time.monotonic() > deadline - timeout + 15:
                raise AssertionError(f"{user}'s server {server!r} is gone:\n{self.hub_log()}")
            time.sleep(0.5)
        raise AssertionError(f"{user}'s server {server!r} not ready in {timeout} s:\n{self.hub_log()}")

    def pool(self) -> dict:
        status, body = self.api("GET", "/gpu/pool", self.tokens[ADMIN])
        assert status == 200, body
        return body

    def slices(self) -> list[dict]:
        return [s for n in self.pool()["nodes"] for g in n["gpus"] for s in g["slices"]]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("single-machine")
    config_dir = root / "elastic-gpu"
    init = cli(
        "init", "--config-dir", str(config_dir), "--simulate-gpus", "2xH100-80GB",
        "--admin", ADMIN, "--user", ALICE, "--user", BOB,
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    # an admin's edit: bob may hold 30 GiB of GPU memory
    admission = config_dir / "elastic-gpu.yaml"
    text = admission.read_text()
    assert f"          {BOB}: {{}}" in text
    admission.write_text(text.replace(f"          {BOB}: {{}}", f"          {BOB}: {{memory_mib: 30720}}"))
    runner = UpHub(config_dir)
    try:
        runner.start()
        yield runner
    finally:
        runner.stop()
        runner.kill_leftovers()  # only after a failed test: the last test checks that none are left


# ---- start-up and login ------------------------------------------------------------------------------


def test_up_prints_the_url_and_says_the_gpus_are_simulated(hub):
    out = hub.output()
    assert hub.url == f"http://127.0.0.1:{hub.port}"
    assert "GPUs: 2 × H100-80GB (SIMULATED: no real GPU is used)" in out
    assert "GPU kernelspecs: installed into" in out
    assert "configurable-http-proxy" in out  # the real proxy
    assert f"Admin user(s): '{ADMIN}'" in out
    status, info = hub.api("GET", "/", "")
    assert status == 200 and "version" in info


def test_users_log_in_with_first_use_passwords(hub):
    for user in (ADMIN, ALICE, BOB):
        hub.tokens[user] = hub.login(user, PASSWORDS[user])
    status, me = hub.api("GET", "/user", hub.tokens[ALICE])
    assert status == 200 and me["name"] == ALICE and not me["admin"]
    with pytest.raises(PermissionError):
        hub.login(ALICE, "another-password")  # the first password stuck
    with pytest.raises(PermissionError):
        hub.login("mallory", "mallory-password-1")  # not an allowed user: cannot claim an account


# ---- GPU notebooks -----------------------------------------------------------------------------------


def test_gpu_notebooks_start_with_their_profile_and_a_read_only_limits_file(hub):
    for user in (ALICE, BOB):
        status, body = hub.spawn(user, {"profile": QUARTER})
        assert status in (201, 202), body
    for user in (ALICE, BOB):
        server = hub.wait_ready(user)
        pid = server["state"]["pid"]
        allocation_id = server["state"]["gpu_allocation_id"]
        env = dict(line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in line)
        limits = Path(env["LIBVGPU_CONFIG"])
        assert stat.S_IMODE(limits.stat().st_mode) == 0o444
        assert stat.S_IMODE(limits.parent.stat().st_mode) == 0o755
        assert limits.parent.stat().st_uid == os.getuid()
        text = limits.read_text().splitlines()
        assert "memory_mib.0=20480" in text and "cores_percent.0=25" in text and "priority=100" in text
        assert env["CUDA_VISIBLE_DEVICES"] == "GPU-sim-0000"  # binpack: both quarters on the first card
        assert env["ELASTIC_GPU_ALLOCATION_ID"] == allocation_id
    owners = sorted((s["user"], s["kind"], s["memory_mib"]) for s in hub.slices())
    assert owners == [(ALICE, "notebook", 20480), (BOB, "notebook", 20480)]


def test_a_spawn_over_quota_is_refused_with_the_reason(hub):
    status, body = hub.spawn(BOB, {"profile": HALF}, server="big")
    assert status == 403, body
    message = body["message"]
    assert "bob" in message and "30 GiB" in message and "40 GiB" in message, message
    assert "Traceback" not in message
    assert len(hub.slices()) == 2  # nothing was allocated
    status, model = hub.api("GET", f"/users/{BOB}", hub.tokens[ADMIN])
    assert "big" not in model["servers"]


def test_forged_and_unknown_options_are_refused(hub):
    status, body = hub.spawn(ALICE, {"profile": QUARTER, "gpu": {"memory_mib": 81920}}, server="forged")
    assert status == 400
    assert body["message"] == f"Unknown server option(s) 'gpu' for profile '{QUARTER}'. Allowed: 'profile'."
    status, body = hub.spawn(ALICE, {"profile": "h100-80gb-eight"}, server="forged")
    assert status == 400
    assert "No server profile 'h100-80gb-eight' is available to you. Choose one of: cpu, " in body["message"]
    assert len(hub.slices()) == 2


def test_the_spawn_page_lists_the_profiles_and_says_the_gpus_are_simulated(hub):
    status, html = hub.page(ALICE, f"/hub/spawn/{ALICE}/form")
    assert status == 200 and 'id="spawn_form"' in html
    assert "Simulated GPUs" in html and "2 × H100-80GB" in html
    for slug in ("cpu", QUARTER, HALF, "h100-80gb-whole"):
        assert f'value="{slug}"' in html


# ---- a GPU kernel through the provisioner -------------------------------------------------------


async def run_in_kernel(hub: UpHub, user: str, kernel_id: str, code: str, timeout: float = 60) -> str:
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


async def test_a_gpu_kernel_runs_code_with_its_own_slice_and_gives_it_back(hub):
    path = f"/user/{ALICE}/api/kernels"
    status, kernel = hub.api("POST", "", hub.tokens[ALICE], {"name": "elastic-gpu-gpu-10g"}, prefix=path)
    assert status == 201, f"{kernel}\n{hub.hub_log()}"
    hub.remember_processes()
    kernels = [s for s in hub.slices() if s["kind"] == "kernel"]
    assert [(s["user"], s["memory_mib"]) for s in kernels] == [(ALICE, 10240)]
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES']); print(open(os.environ['LIBVGPU_CONFIG']).read())"
    output = await run_in_kernel(hub, ALICE, kernel["id"], code)
    assert output.splitlines()[0].startswith("GPU-sim-")
    assert "memory_mib.0=10240" in output.splitlines()
    status, _ = hub.api("DELETE", f"/{kernel['id']}", hub.tokens[ALICE], prefix=path)
    assert status == 204
    deadline = time.monotonic() + 30
    while any(s["kind"] == "kernel" for s in hub.slices()):
        assert time.monotonic() < deadline, "the kernel's slice was not given back"
        await asyncio.sleep(0.3)


# ---- the pool, in the terminal and in the browser ------------------------------------------------


def test_status_shows_each_gpu_with_its_slices_live(hub):
    result = cli("status", "--config-dir", str(hub.config_dir))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"live, from the hub at {hub.url}" in out
    assert "SIMULATED GPUs" in out
    assert "localhost  GPU 0  H100-80GB  GPU-sim-0000" in out and "localhost  GPU 1  H100-80GB" in out
    assert re.search(r"memory  \[#{10}\.{10}\] 40\.0 GiB / 80\.0 GiB", out), out
    for user in (ALICE, BOB):
        assert re.search(rf"^  {user}\s+notebook\s+20\.0 GiB\s+25 %", out, re.M), out
    as_json = json.loads(cli("status", "--config-dir", str(hub.config_dir), "--json").stdout)
    assert as_json["totals"] == {"gpus": 2, "memory_mib": 163840, "used_memory_mib": 40960, "slices": 2}


def test_quota_shows_use_against_limits_per_user(hub):
    result = cli("quota", "--config-dir", str(hub.config_dir))
    assert result.returncode == 0, result.stderr
    assert re.search(r"^    bob\s+20\.0 GiB / 30\.0 GiB", result.stdout, re.M), result.stdout
    assert re.search(r"^    alice\s+20\.0 GiB / 80\.0 GiB", result.stdout, re.M), result.stdout


def test_gpu_pages_and_api_are_for_admins_only(hub):
    for path in ("/gpu/pool", "/gpu/quota"):
        status, _ = hub.api("GET", path, hub.tokens[ALICE])
        assert status == 403, f"/hub/api{path} answered {status} to a non-admin"
    status, _ = hub.page(ALICE, "/hub/gpu")
    assert status == 403, f"/hub/gpu answered {status} to a non-admin"
    status, html = hub.page(ADMIN, "/hub/gpu")
    assert status == 200 and "GPU pool" in html
    status, quota = hub.api("GET", "/gpu/quota", hub.tokens[ADMIN])
    assert status == 200 and quota["workspaces"][0]["name"] == "default"


async def test_admin_sees_the_pool_on_the_gpu_page_in_a_browser(hub):
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it: apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    browser = await Browser(width=1280, height=1300).start()
    try:
        await browser.goto(hub.url + "/hub/login")
        await browser.submit_and_wait(
            f"document.getElementById('username_input').value = {ADMIN!r};"
            f"document.getElementById('password_input').value = {PASSWORDS[ADMIN]!r};"
            "document.querySelector('form').submit();"
        )
        await browser.goto(hub.url + "/hub/gpu")
        assert (await browser.url()).endswith("/hub/gpu")
        text = await browser.evaluate("document.body.innerText")
        assert "GPU pool" in text and "Simulated GPUs." in text
        assert await browser.evaluate("document.querySelectorAll('.egpu-gpu').length") == 2
        slices = await browser.evaluate(
            "Array.from(document.querySelectorAll('.egpu-slices tbody tr')).map(r => r.cells[0].innerText)"
        )
        assert sorted(slices) == [ALICE, BOB]
        bars = await browser.evaluate("document.querySelectorAll('svg.egpu-bars rect[fill^=\"#\"] title').length")
        assert bars >= 4  # memory and compute segments of alice's and bob's slices
        quota_rows = await browser.evaluate(
            "Array.from(document.querySelectorAll('.egpu-quota-row td:first-child')).map(c => c.innerText.trim())"
        )
        assert "workspace default" in quota_rows and BOB in quota_rows
        shot = await browser.screenshot(ARTIFACTS / "hub-gpu.png")
        assert shot.stat().st_size > 10_000
    finally:
        await browser.close()


# ---- a crash and a restart ---------------------------------------------------------------------------


def test_after_a_hub_crash_the_next_up_adopts_running_servers_and_their_slices(hub):
    hub.remember_processes()
    before = sorted((s["allocation_id"], s["user"]) for s in hub.slices())
    hub_pid = json.loads((hub.config_dir / "data" / "hub.json").read_text())["hub_pid"]
    os.kill(hub_pid, signal.SIGKILL)  # the hub dies; its servers keep running
    assert hub.proc.wait(60) != 0
    assert "still run; the next `elastic-gpu up` adopts them" in hub.output(), hub.output()
    hub.proc = None

    hub.start()
    assert sorted((s["allocation_id"], s["user"]) for s in hub.slices()) == before
    hub.wait_ready(ALICE)  # the same process, polled alive by the new hub
    status, _ = hub.api("DELETE", f"/users/{ALICE}/server", hub.tokens[ADMIN])
    assert status in (202, 204)
    deadline = time.monotonic() + 60
    while any(s["user"] == ALICE for s in hub.slices()):
        assert time.monotonic() < deadline, "alice's slice was not released when her adopted server stopped"
        time.sleep(0.3)


# ---- stop -------------------------------------------------------------------------------------------------


def test_stopping_up_stops_everything_and_status_falls_back_to_the_ledger(hub):
    hub.remember_processes()
    started = dict(hub.seen)
    assert len(started) >= 4, f"expected proxies and servers, saw {started}"
    code = hub.stop()
    assert code == 0, hub.output()
    assert "==> stopped" in hub.output()
    leftovers = []
    for p in started.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                leftovers.append(f"{p.pid} {' '.join(p.cmdline())}")
        except psutil.NoSuchProcess:
            pass
    assert not leftovers, "left running:\n" + "\n".join(leftovers)
    result = cli("status", "--config-dir", str(hub.config_dir))
    assert result.returncode == 0, result.stderr
    assert "from the ledger" in result.stdout and "not reachable" in result.stdout
    assert "0 MiB of 160.0 GiB allocated in 0 slice(s)" in result.stdout, result.stdout
