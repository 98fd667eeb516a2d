"""The culler against the real GPU kernel stack of single-machine mode: a real JupyterHub with the real
broker and allocator (LocalPool, one simulated H100-80GB), users' real jupyter-servers, GPU kernels
started through the real provisioner (kernelspecs from `python -m kernelprovider install-kernelspecs`),
and the shim's activity record written in its binary layout where the broker says it lives.

Kernel sizes of 40 GiB (default, low and high priority): two fill the card. The behaviour tests run
their own culler process with their own policy (as the Kubernetes Deployment runs it); the hub also
runs one itself, managed and in dry-run, as single-machine mode does.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import yaml

from culler import service_role
from hubext.metering.store import UsageStore
from tests.culler.shimrecord import write_activity
from tests.culler.stack import CullerProcess, KernelTab, http, metric_value, page_text, wait_until
from tests.hubrunner import HubRunner, free_port
from tests.kernelprovider.helpers import Server, start_servers

TOKEN = secrets.token_hex(16)
MANAGED_PORT = free_port()
ADMISSION = {
    "priority_classes": {
        "high": {"value": 1000, "preempt": False, "borrow": False},
        "default": {"value": 100, "preempt": False, "borrow": False},
        "low": {"value": 10, "preempt": False, "borrow": False},
    },
    "default_priority_class": "default",
    "placement": {"node": "binpack", "gpu": "binpack"},
    "workspaces": {"default": {"namespaces": {"default": {}}}},
}
SIZES = [
    {"name": "gpu-40g", "display_name": "GPU 40 GiB", "memory_mib": 40960, "cores_percent": 50},
    *(
        {
            "name": f"gpu-40g-{pc}",
            "display_name": f"GPU 40 GiB ({pc})",
            "memory_mib": 40960,
            "cores_percent": 50,
            "priority_class": pc,
        }
        for pc in ("low", "high")
    ),
]
DEFAULT, LOW, HIGH = "elastic-gpu-gpu-40g", "elastic-gpu-gpu-40g-low", "elastic-gpu-gpu-40g-high"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("culler-gpu-kernels")
    (work / "admission.yaml").write_text(yaml.safe_dump(ADMISSION))
    prefix = work / "jupyter-prefix"
    role = service_role("culler-under-test", ["custom:elastic-gpu:admin"])
    config = textwrap.dedent(
        f"""
        from hubext.hubconfig import configure_hub
        from hubext.broker import grant_user_scopes, start_with_hub
        configure_hub(c, mode="local", admission_config_file={str(work / "admission.yaml")!r},
                      simulate_gpus="1xH100-80GB", data_dir={str(work / "data")!r},
                      culler=True, culler_port={MANAGED_PORT}, proxy_url="http://127.0.0.1:{{port}}")
        grant_user_scopes(c)
        start_with_hub()
        c.JupyterHub.spawner_class = "hubext.local.spawner.HubUserGPUSpawner"
        c.HubUserGPUSpawner.home_dir_template = {str(work / "home" / "{username}")!r}
        c.Spawner.environment = {{"JUPYTER_PATH": {str(prefix / "share" / "jupyter")!r}}}
        c.GPUBroker.kernel_sizes = {SIZES!r}
        c.GPUBroker.max_queue_seconds = 60  # a kernel that does not fit waits in the GPU queue
        c.GPUBroker.reconcile_interval_seconds = 1
        c.JupyterHub.services.append({{"name": "culler-under-test", "api_token": {TOKEN!r}}})
        c.JupyterHub.load_roles.append({role!r})
        # the culler as single-machine mode runs it: managed by the hub, set up the documented way
        # (docs/single-machine.md), here in dry-run: it only logs
        c.GPUCuller.dry_run = True
        c.GPUCuller.interval_seconds = 0.5
        c.GPUCuller.idle_timeout_seconds = 1
        c.GPUCuller.warning_seconds = 0
        c.GPUCuller.state_file = ""
        """
    )
    hub = HubRunner(work, "")
    hub.config_text = config.replace("{port}", str(hub.port))
    hub.start()
    try:
        yield hub, start_servers(hub, prefix), work
    finally:
        hub.stop()


def diagnose(hub: HubRunner, culler: CullerProcess) -> str:
    return f"--- culler log:\n{culler.log_text()[-4000:]}\n--- hub log:\n{hub.log_tail(40)}"


def broker_kernels(hub: HubRunner) -> dict[str, dict]:
    status, body = hub.api("GET", "/gpu/kernels")
    assert status == 200, body
    return {k["kernel_id"]: k for k in body["kernels"]}


def used_mib(hub: HubRunner) -> int:
    status, pool = hub.api("GET", "/gpu/pool")
    assert status == 200, pool
    return sum(s["memory_mib"] for n in pool["nodes"] for g in n["gpus"] for s in g["slices"])


@pytest.fixture
def sessions(stack):
    hub, servers, _ = stack
    started: list[tuple[Server, dict]] = []

    def start(user: str, spec: str) -> str:
        status, session = servers[user].start_session(spec)
        assert status == 201, session
        started.append((servers[user], session))
        return session["kernel"]["id"]

    yield start
    for server, session in started:
        server.api("DELETE", f"/sessions/{session['id']}")
    wait_until(lambda: used_mib(hub) == 0, 30, "the card to be free after the test")


@pytest.fixture
def culler_factory(stack):
    hub, _, work = stack
    made: list[CullerProcess] = []

    def make(name: str, **traits) -> CullerProcess:
        proc = CullerProcess(hub, work, TOKEN, name=name, **traits)
        made.append(proc)
        return proc.start()

    yield make
    for proc in made:
        proc.stop()


def usage_cause(hub: HubRunner, allocation_id: str) -> str | None:
    """The release cause of an allocation's usage record (the hub's database; docs/metering.md)."""
    store = UsageStore(f"sqlite:///{hub.workdir / 'jupyterhub.sqlite'}")
    try:
        (record,) = wait_until(
            lambda: [r for r in store.records() if r.id == allocation_id and r.released_at is not None],
            30,
            f"the usage record of {allocation_id} to close",
        )
    finally:
        store.close()
    return record.release_cause


def on_server(server: Server, kernel_id: str) -> bool:
    status, kernels = server.api("GET", "/kernels")
    assert status == 200, kernels
    return any(k["id"] == kernel_id for k in kernels)


def test_idle_gpu_kernel_is_culled_through_its_server_and_its_slice_returns_to_the_pool(
    stack, sessions, culler_factory
):
    hub, servers, _ = stack
    kid = sessions("alice", DEFAULT)
    record = broker_kernels(hub)[kid]
    assert record["activity_file"], "the broker must say where the shim's activity record is"
    assert used_mib(hub) == 40960
    culler = culler_factory("real-idle", idle_timeout_seconds=3, warning_seconds=0)
    wait_until(
        lambda: kid not in broker_kernels(hub),
        30,
        "the idle GPU kernel to be culled",
        log=lambda: diagnose(hub, culler),
    )
    assert used_mib(hub) == 0, "the slice must be back in the pool"
    # the broker forgets the kernel inside the server's shutdown (its provisioner's cleanup); the
    # server lists it until that shutdown returns, a moment later
    wait_until(lambda: not on_server(servers["alice"], kid), 10, "JupyterLab to see the kernel stopped")
    line = culler.wait_log(rf"Culled GPU kernel {kid} of alice .*").group(0)
    assert f"allocation {record['allocation_id']}" in line and "freed 40 GiB" in line and "via server" in line
    metrics = culler.metrics()
    labels = {"reason": "idle-timeout", "priority_class": "default", "method": "server"}
    assert metric_value(metrics, "elastic_gpu_culler_culls_total", **labels) == 1
    freed = {"reason": "idle-timeout", "action": "culled"}
    assert metric_value(metrics, "elastic_gpu_culler_freed_memory_bytes_total", **freed) == 40960 * 2**20
    assert usage_cause(hub, record["allocation_id"]) == "culled"  # the usage record says why it ended


def test_gpu_kernel_launching_work_with_no_browser_is_kept(stack, sessions, culler_factory):
    hub, servers, _ = stack
    kid = sessions("alice", DEFAULT)
    path = broker_kernels(hub)[kid]["activity_file"]
    stop = threading.Event()

    def shim() -> None:  # what libvgpu.so records while a training loop launches kernels
        while not stop.is_set():
            write_activity(path, last_launch=time.time(), used_mib=(6144,), launches=1000)
            time.sleep(0.2)

    writer = threading.Thread(target=shim, daemon=True)
    writer.start()
    try:
        # the shim records a launch every 0.2 s; the busy window leaves room for a loaded test machine
        culler = culler_factory("real-busy", idle_timeout_seconds=2, gpu_busy_window_seconds=3, warning_seconds=0)
        time.sleep(7)
        assert kid in broker_kernels(hub) and on_server(servers["alice"], kid), "a busy GPU kernel was culled"
        assert metric_value(culler.metrics(), "elastic_gpu_culler_kernels", reason="gpu-active") == 1
    finally:
        stop.set()
        writer.join()
    # the same kernel, once its GPU goes quiet, is idle on both signals and is reclaimed
    wait_until(
        lambda: kid not in broker_kernels(hub),
        20,
        "the kernel to be culled once its GPU is idle",
        log=lambda: diagnose(hub, culler),
    )
    assert "(6 GiB in use)" in culler.wait_log(rf"Culled GPU kernel {kid} .*").group(0)


def test_open_tab_without_gpu_work_is_warned_then_culled_when_cull_connected_allows(stack, sessions, culler_factory):
    hub, servers, _ = stack
    kid = sessions("bob", DEFAULT)
    protected = sessions("alice", HIGH)
    tab, protected_tab = KernelTab(hub, "bob", kid), KernelTab(hub, "alice", protected)
    try:
        assert servers["bob"].api("GET", f"/kernels/{kid}")[1]["connections"] == 1
        culler = culler_factory(
            "real-tab",
            idle_timeout_seconds=4,
            warning_seconds=2,
            priority_class_policies={"high": {"cull_connected": False}},
        )
        wait_until(
            lambda: kid not in broker_kernels(hub),
            30,
            "the connected idle kernel to be culled",
            log=lambda: diagnose(hub, culler),
        )
        tab.drain(1.0)
        warnings = tab.streams("will be shut down at")
        assert len(warnings) == 1, f"expected one warning on the kernel's output, got {tab.streams('')}"
        assert "has been idle for" in warnings[0] and "40 GiB" in warnings[0]
        # the real reason (the idle limit, nobody waits for the card) and the real time left (2 s)
        assert "idle GPU kernels are shut down after 4 s here" in warnings[0], warnings[0]
        assert "waiting" not in warnings[0], f"no request waits, yet the warning says one does: {warnings[0]}"
        assert re.search(r"will be shut down at \d\d:\d\d:\d\d UTC, in [12] s,", warnings[0]), warnings[0]
        assert not tab.streams("Shutting this kernel down"), "a warned kernel needs no second notice"
        assert used_mib(hub) == 40960
        # the same situation in a class with cull_connected=False: kept, and told nothing
        assert protected in broker_kernels(hub) and on_server(servers["alice"], protected)
        assert metric_value(culler.metrics(), "elastic_gpu_culler_kernels", reason="connected") == 1
        protected_tab.drain(0.5)
        assert not protected_tab.streams("[elastic-gpu]")
    finally:
        tab.close()
        protected_tab.close()


def test_pressure_mode_reclaims_the_low_priority_idle_kernel_for_a_waiting_kernel(stack, sessions, culler_factory):
    hub, servers, _ = stack
    low = sessions("alice", LOW)
    default = sessions("bob", DEFAULT)
    assert used_mib(hub) == 81920, "the card is full"
    tab = KernelTab(hub, "alice", low)  # alice has the notebook open, but does nothing
    culler = culler_factory(
        "real-pressure",
        idle_timeout_seconds=600,
        warning_seconds=0,
        pressure_min_idle_seconds=1,
        gpu_busy_window_seconds=0.5,
    )
    result: dict = {}

    def start_waiting() -> None:  # bob opens another notebook: its kernel waits in the GPU queue
        result["kid"] = sessions("bob", DEFAULT)

    waiting = threading.Thread(target=start_waiting)
    waiting.start()
    waiting.join(60)
    assert result.get("kid"), f"the waiting kernel did not start\n{diagnose(hub, culler)}"
    kernels = broker_kernels(hub)
    assert low not in kernels, "the low-priority idle kernel must have yielded"
    assert default in kernels and kernels[result["kid"]]["state"] == "running"
    line = culler.wait_log(rf"Culled GPU kernel {low} of alice .*").group(0)
    assert "while GPU requests are waiting" in line and "bob's waiting default-priority request" in line
    wait_until(lambda: not on_server(servers["alice"], low), 10, "JupyterLab to see the kernel stopped")
    tab.drain(0.5)
    tab.close()
    [notice] = tab.streams("Shutting this kernel down to free its GPU slice")
    assert "while GPU requests are waiting" in notice


def test_culler_restart_mid_cycle_is_safe(stack, sessions, culler_factory):
    hub, _, _ = stack
    kid = sessions("alice", DEFAULT)
    tab = KernelTab(hub, "alice", kid)
    try:
        traits = dict(idle_timeout_seconds=4, warning_seconds=3)
        first = culler_factory("restart", **traits)
        first.wait_log(rf"Warned kernel {kid}")
        first.kill()  # between the warning and the cull
        state = json.loads((first.dir / "state.json").read_text())
        assert kid in state["warnings"], "the warning must be on disk before it is logged"
        second = culler_factory("restart", **traits)
        second.wait_log(rf"Culling GPU kernel {kid}", timeout=20)
        second.kill()  # in the middle of the reclaim
        third = culler_factory("restart", **traits)
        wait_until(
            lambda: kid not in broker_kernels(hub),
            20,
            "the kernel to be culled after the restarts",
            log=lambda: diagnose(hub, third),
        )
        # the third culler's next cycle forgets the culled kernel's warning (waited on, not slept
        # on: a CI run at load 11 had not had that cycle within 1 s)
        wait_until(
            lambda: kid not in json.loads((first.dir / "state.json").read_text())["warnings"],
            20,
            "a culled kernel's warning to be forgotten",
            log=lambda: diagnose(hub, third),
        )
        tab.drain(1.0)
        assert len(tab.streams("will be shut down at")) == 1, "a restarted culler warned the kernel again"
        log = first.log_text()  # the three share one log file
        assert log.count(f"Warned kernel {kid}") == 1
        assert "Could not free" not in log and "Traceback" not in log, log[-3000:]
        assert used_mib(hub) == 0
    finally:
        tab.close()


def test_gpu_kernel_its_server_does_not_know_is_reclaimed_through_the_broker(stack, culler_factory):
    hub, _, _ = stack
    # a GPU kernel the broker runs but bob's server has no kernel for (e.g. the server lost track of it)
    status, record = hub.api(
        "POST",
        "/gpu/kernels",
        body={"user": "bob", "size": "gpu-40g", "key": secrets.token_hex(16), "kernel_id": "no-such-kernel"},
    )
    assert status == 201, record
    pid = int(record["holder"])
    culler = culler_factory("orphan", idle_timeout_seconds=2, warning_seconds=0)
    wait_until(
        lambda: "no-such-kernel" not in broker_kernels(hub),
        20,
        "the orphan to be reclaimed",
        log=lambda: diagnose(hub, culler),
    )
    line = culler.wait_log(r"Culled GPU kernel no-such-kernel of bob .*").group(0)
    assert "server is gone or does not know it" in line and "via broker" in line
    labels = {"reason": "orphan", "method": "broker"}
    assert metric_value(culler.metrics(), "elastic_gpu_culler_culls_total", **labels) == 1
    assert usage_cause(hub, record["allocation_id"]) == "culled"
    wait_until(
        lambda: subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0,
        10,
        "the kernel process to exit",
    )
    assert used_mib(hub) == 0


def test_hub_managed_culler_follows_the_hub_config_serves_metrics_and_dry_run_culls_nothing(stack, sessions):
    # c.GPUCuller.* in jupyterhub_config.py (the stack above) make it a dry-run culler with a 1 s timeout
    hub, servers, _ = stack
    kid = sessions("bob", DEFAULT)
    wait_until(
        lambda: f"[dry run] would cull kernel {kid}" in hub.log_text(), 20, "the hub-managed culler to judge the kernel"
    )
    url = f"{hub.url}/services/gpu-culler/metrics"
    status, text = http("GET", url, hub.admin_token)
    assert status == 200 and "elastic_gpu_culler_cycle_seconds_count" in text, text
    assert http("GET", url, "not-a-token")[0] == 403, "metrics through the hub must need a token"
    assert kid in broker_kernels(hub) and on_server(servers["bob"], kid), "a dry-run culler culled a kernel"


def test_bad_policy_is_refused_with_the_key_and_what_is_allowed():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "culler",
            "--GPUCuller.proxy_url=http://127.0.0.1:1",
            '--GPUCuller.priority_class_policies={"low": {"idle_timeout": 60}}',
        ],
        env={"JUPYTERHUB_API_TOKEN": "x", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "priority_class_policies.low has unknown key(s) idle_timeout; allowed: idle_timeout_seconds" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_slice_comes_back_at_the_timeout_not_at_the_next_cycle(stack, sessions, culler_factory):
    hub, _, _ = stack
    kid = sessions("alice", DEFAULT)
    last_activity = broker_kernels(hub)[kid]["created_at"]
    culler = culler_factory("due", interval_seconds=60, idle_timeout_seconds=4, warning_seconds=0)
    wait_until(lambda: kid not in broker_kernels(hub), 20, "the kernel to be culled", log=lambda: diagnose(hub, culler))
    assert time.time() - last_activity < 15, "reclaimed long after its timeout"
    assert culler.log_text().count("Cycle:") == 1, "the cull must come from the due check, before the next cycle"


def test_on_a_pool_that_cannot_swap_the_api_and_home_page_say_a_kernel_is_stopped_if_reclaimed(stack, sessions):
    # simulated GPUs: no driver can checkpoint them
    hub, _, _ = stack
    kid = sessions("bob", DEFAULT)
    model = broker_kernels(hub)[kid]
    assert model["swap_capability"]["able"] is False, model
    assert "simulated" in model["swap_capability"]["why_not"], model
    status, pool = hub.api("GET", "/gpu/pool")
    assert status == 200 and pool["swap_capability"]["able"] is False, pool
    home = page_text(hub, "bob", "/hub/home")
    assert "it is shut down and its variables are lost (it cannot be swapped out: the GPUs are simulated" in home, home


def test_on_a_pool_that_cannot_swap_the_culler_warns_that_the_kernel_will_be_stopped_and_promises_no_state(
    stack, sessions, culler_factory
):
    # swapping turned on as docs/culler.md describes, on simulated GPUs: no driver can checkpoint them
    hub, _, _ = stack
    kid = sessions("bob", DEFAULT)
    tab = KernelTab(hub, "bob", kid)
    try:
        culler = culler_factory("no-swap", swap_idle_kernels=True, idle_timeout_seconds=4, warning_seconds=2)
        wait_until(
            lambda: kid not in broker_kernels(hub),
            30,
            "the idle kernel to be stopped",
            log=lambda: diagnose(hub, culler),
        )
        tab.drain(1.0)
        notices = tab.streams("[elastic-gpu]")
        assert len(notices) == 1, notices
        (warning,) = notices
        for promise in ("variables stay", "host memory", "swapped out after", "next cell takes"):
            assert promise not in warning, f"the warning promises what cannot happen ({promise!r}): {warning}"
        assert "will be shut down at" in warning and "its variables will be lost" in warning, warning
        assert "It cannot be swapped out here (the GPUs are simulated" in warning, warning
        log = culler.log_text()
        start = re.search(r"GPU culler started: .*", log).group(0)
        assert "idle kernels are shut down (state lost): they cannot be swapped out here (the GPUs are simulated" in (
            start
        ), start
        said = re.findall(r"swap_idle_kernels is on, but the hub's GPU kernels cannot be swapped out: (.*)", log)
        assert len(said) == 1 and "simulated" in said[0], log[-3000:]
        line = culler.wait_log(rf"Culling GPU kernel {kid} of bob .*").group(0)
        assert "it cannot be swapped out (the GPUs are simulated" in line and "its state is lost" in line, line
        assert "Swapped out" not in log and "instead of culling" not in log
    finally:
        tab.close()
