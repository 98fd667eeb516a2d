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
import json
import os
import re
import signal
import stat
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from tests.cli.browser import Browser, chromium_path
from tests.cli.test_render import assert_columns_line_up
from tests.cli.uphub import UpHub, cli, cli_command, reachable_dir, remove_dir, run_in_kernel
from tests.hubrunner import free_port

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "local"
ADMIN, ALICE, BOB = "boss", "alice", "bob"
PASSWORDS = {ADMIN: "boss-password-1", ALICE: "alice-password-1", BOB: "bob-password-1"}
QUARTER, HALF = "h100-80gb-quarter", "h100-80gb-half"


@pytest.fixture(scope="module")
def hub():
    root = reachable_dir("egpu-up-")
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
    runner = UpHub(config_dir, ADMIN)
    try:
        runner.start()
        yield runner
    finally:
        runner.stop()
        runner.kill_leftovers()  # only after a failed test: the last test checks that none are left
        remove_dir(root)


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
    assert re.search(r"memory  \[#{10}\.{10}\] 40 GiB / 80 GiB", out), out
    for user in (ALICE, BOB):
        assert re.search(rf"^  {user}\s+notebook\s+20 GiB\s+25 %", out, re.M), out
    as_json = json.loads(cli("status", "--config-dir", str(hub.config_dir), "--json").stdout)
    assert as_json["totals"] == {"gpus": 2, "memory_mib": 163840, "used_memory_mib": 40960, "slices": 2}


def test_quota_shows_use_against_limits_per_user(hub):
    result = cli("quota", "--config-dir", str(hub.config_dir))
    assert result.returncode == 0, result.stderr
    assert re.search(r"^    bob\s+20 GiB / 30 GiB", result.stdout, re.M), result.stdout
    assert re.search(r"^    alice\s+20 GiB / 80 GiB", result.stdout, re.M), result.stdout
    assert_columns_line_up(result.stdout)


def test_a_second_up_on_a_running_hub_says_so_and_leaves_it_alone(hub):
    data = hub.config_dir / "data"
    hub_state = (data / "hub.json").read_text()
    proxy_pid = int((data / "jupyterhub-proxy.pid").read_text())
    log = data / "jupyterhub.log"
    starts = log.read_text(errors="replace").count("Running JupyterHub version")
    for port in (hub.port, free_port()):
        second = subprocess.Popen(
            cli_command() + ["up", "--config-dir", str(hub.config_dir), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            out, _ = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            second.terminate()
            out, _ = second.communicate(timeout=60)
            raise AssertionError(f"a second `elastic-gpu up` did not give up:\n{out}") from None
        assert second.returncode != 0, out
        assert f"a hub already runs with the config dir {hub.config_dir}" in out and hub.url in out, out
        assert "Traceback" not in out and "hub is up" not in out, out
    assert (data / "hub.json").read_text() == hub_state
    assert int((data / "jupyterhub-proxy.pid").read_text()) == proxy_pid and psutil.pid_exists(proxy_pid)
    assert log.read_text(errors="replace").count("Running JupyterHub version") == starts, "a second hub started"
    status, _ = hub.api("GET", "/", "")
    assert status == 200
    status, _ = hub.api("GET", "/status", hub.tokens[BOB], prefix=f"/user/{BOB}/api")
    assert status == 200, "bob's server is no longer reachable through the proxy"


def test_the_cli_token_reads_the_pool_and_the_sizes_but_has_no_rights_on_kernels(hub):
    token = (hub.config_dir / "data" / "cli-token").read_text().strip()
    for path in ("/gpu/pool", "/gpu/quota", "/gpu/kernel-sizes"):
        status, body = hub.api("GET", path, token)
        assert status == 200, (path, body)
    status, body = hub.api("GET", f"/gpu/kernels?user={ALICE}", token)
    assert status == 403, f"the CLI token lists alice's GPU kernels: {body}"
    status, body = hub.api("POST", "/gpu/kernels", token, {"user": ALICE, "name": "gpu-10g"})
    assert status == 403, f"the CLI token starts GPU kernels for alice: {body}"


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
        # each slice's stop button lies inside its GPU's card (they overflowed the card's right edge)
        outside = await browser.evaluate(
            "Array.from(document.querySelectorAll('.egpu-stop-kernel, .egpu-stop-server')).filter(b => {"
            " const c = b.closest('.egpu-gpu').getBoundingClientRect(), r = b.getBoundingClientRect();"
            " return r.right > c.right + 0.5 || r.left < c.left - 0.5; }).map(b => b.outerHTML)"
        )
        assert await browser.evaluate("document.querySelectorAll('.egpu-stop-server').length") == 2
        assert outside == [], outside
        headers = await browser.evaluate(
            "Array.from(document.querySelectorAll('.egpu-quota thead th')).map(h => h.innerText.trim())"
        )
        assert "GPUs" not in headers and "vGPUs (slices)" in headers, headers  # it counted slices, not GPUs
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
    assert "from the ledger" in result.stdout
    assert f"the hub at {hub.url} is not running" in result.stdout, result.stdout
    assert "0 MiB of 160 GiB allocated in 0 slice(s)" in result.stdout, result.stdout


class TokenTrap:
    """An HTTP service that is not the hub, recording the Authorization headers sent to it."""

    def __init__(self, port: int = 0) -> None:
        seen: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                seen.append(self.headers.get("Authorization") or "")
                self.send_response(503)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.seen = seen
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("command", ["status", "quota"])
def test_with_the_hub_down_status_and_quota_use_its_port_and_send_the_token_nowhere(hub, command, monkeypatch, capsys):
    from hubext import cli as elastic_gpu
    from hubext.cli import base

    token = (hub.config_dir / "data" / "cli-token").read_text().strip()
    on_hub_port = TokenTrap(hub.port)  # another service took the stopped hub's port
    on_default_port = TokenTrap()  # and another one listens where a hub listens by default
    monkeypatch.setattr(base, "DEFAULT_PORT", on_default_port.port)
    try:
        assert elastic_gpu.main([command, "--config-dir", str(hub.config_dir)]) == 0
    finally:
        on_hub_port.close()
        on_default_port.close()
    out = capsys.readouterr().out
    leaked = [h for h in on_hub_port.seen + on_default_port.seen if token in h]
    assert not leaked, f"the CLI token was sent to a service that is not the hub:\n{out}"
    assert f"the hub at {hub.url} is not running" in out, out
    assert "from the ledger" in out
