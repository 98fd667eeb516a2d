"""The culler on a real stack: a real JupyterHub and proxy, real jupyter-server single-user servers,
real ipykernels, the culler as a real service process.

The GPU broker is the test stand-in in ``fakebroker.py`` (same REST contract, a simulated GPU, the
shim's activity record as a JSON file per kernel) until hubext.broker lands.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time

import pytest

from tests.culler.stack import (
    CullerProcess,
    GPUKernelUnderTest,
    KernelTab,
    http,
    metric_value,
    pool,
    server_kernels,
    start_server,
    wait_until,
)
from tests.hubrunner import REPO, HubRunner, free_port

CULLER_TOKEN = secrets.token_hex(16)
MANAGED_PORT = free_port()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("culler-hub")
    config = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import culler
from tests.culler.fakebroker import HANDLERS
c.JupyterHub.extra_handlers = HANDLERS
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = {str(workdir / "home" / "{username}")!r}
c.Spawner.args = ["--allow-root"]
# the culler as the hub runs it in single-machine mode: managed, here in dry-run so that it only
# logs; the behaviour tests run their own culler process with their own policy
c.JupyterHub.services.append(culler.service_spec(
    name="gpu-culler", port={MANAGED_PORT}, proxy_url="http://127.0.0.1:{{port}}",
    dry_run=True, interval_seconds=0.5, idle_timeout_seconds=1, warning_seconds=0,
    state_file="",
))
c.JupyterHub.load_roles.append(culler.service_role("gpu-culler", ["admin:servers"]))
c.JupyterHub.services.append({{"name": "culler-under-test", "api_token": {CULLER_TOKEN!r}}})
c.JupyterHub.load_roles.append(culler.service_role("culler-under-test", ["admin:servers"]))
"""
    hub = HubRunner(workdir, "", env={"PYTHONPATH": str(REPO), "FAKE_BROKER_CAPACITY_MIB": "20480"})
    hub.config_text = config.replace("{port}", str(hub.port))
    hub.start()
    try:
        start_server(hub, "ada")
        start_server(hub, "bob")
        yield hub, workdir
    finally:
        hub.stop()


@pytest.fixture
def culler_factory(stack):
    hub, workdir = stack
    started: list[CullerProcess] = []

    def make(name: str, **traits) -> CullerProcess:
        proc = CullerProcess(hub, workdir, CULLER_TOKEN, name=name, **traits)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture
def kernels(stack):
    hub, workdir = stack
    made: list[GPUKernelUnderTest] = []

    def make(user: str, **kw) -> GPUKernelUnderTest:
        k = GPUKernelUnderTest(hub, user, workdir, **kw)
        made.append(k)
        return k

    yield make
    for k in made:
        k.stop()
    wait_until(lambda: pool(hub)["used_mib"] == 0, 30, "the pool to be empty after the test")


def test_idle_kernel_is_culled_after_its_timeout_and_its_slice_freed(stack, kernels, culler_factory):
    hub, _ = stack
    k = kernels("ada")
    assert pool(hub)["used_mib"] == 10240
    last_activity = server_kernels(hub, "ada")[k.kernel_id]["last_activity"]
    culler = culler_factory("idle", idle_timeout_seconds=3, warning_seconds=0).start()
    wait_until(lambda: not k.in_broker(), 20, "the idle kernel to be culled", log=culler.log_text())
    culled_at = time.time()
    assert not k.on_server(), "the kernel must be shut down through its server (JupyterLab sees it stopped)"
    assert pool(hub)["used_mib"] == 0
    from culler.model import parse_time

    assert culled_at - parse_time(last_activity, "last_activity") >= 3, "culled before its idle timeout"
    line = culler.wait_log(rf"Culled GPU kernel {k.kernel_id} of ada .*")
    assert "idle for" in line.group(0) and "freed 10.0 GiB of GPU memory (0 MiB in use) via server" in line.group(0)
    metrics = culler.metrics()
    labels = {"reason": "idle-timeout", "priority_class": "default", "method": "server"}
    assert metric_value(metrics, "elastic_gpu_culler_culls_total", **labels) == 1
    assert metric_value(metrics, "elastic_gpu_culler_freed_memory_mib_total", reason="idle-timeout") == 10240


GPU_WORK = """
import json, threading, time
stop = threading.Event()
def _launches(path={path!r}):
    # what the shim records while a training loop launches kernels
    while not stop.is_set():
        with open(path + ".tmp", "w") as f:
            json.dump({{"last_launch": time.time(), "memory_used_mib": 6144}}, f)
        import os; os.replace(path + ".tmp", path)
        time.sleep(0.2)
threading.Thread(target=_launches, daemon=True).start()
"""


def test_kernel_running_gpu_work_with_no_browser_is_not_culled(stack, kernels, culler_factory):
    hub, _ = stack
    k = kernels("ada")
    tab = KernelTab(hub, "ada", k.kernel_id)
    tab.execute(GPU_WORK.format(path=k.activity_file))
    tab.close()  # no browser: Jupyter sees an idle kernel with no connection
    culler = culler_factory("gpu-busy", idle_timeout_seconds=2, gpu_busy_window_seconds=1, warning_seconds=0)
    culler.start()
    time.sleep(7)
    model = server_kernels(hub, "ada")[k.kernel_id]
    assert model["execution_state"] == "idle" and model["connections"] == 0
    assert k.on_server() and k.in_broker(), "a kernel launching GPU work was culled"
    assert metric_value(culler.metrics(), "elastic_gpu_culler_kernels", reason="gpu-active") == 1
    # once its GPU work stops, the same kernel is idle on both signals and goes
    tab = KernelTab(hub, "ada", k.kernel_id)
    tab.execute("stop.set(); time.sleep(0.5)")
    tab.close()
    wait_until(
        lambda: not k.in_broker(), 20, "the kernel to be culled after its GPU work stopped", log=culler.log_text()
    )


def test_tab_open_without_gpu_work_is_culled_when_cull_connected_allows(stack, kernels, culler_factory):
    hub, _ = stack
    open_tab = kernels("ada", priority_class="default")
    protected = kernels("bob", priority_class="high")
    tab = KernelTab(hub, "ada", open_tab.kernel_id)
    protected_tab = KernelTab(hub, "bob", protected.kernel_id)
    try:
        culler = culler_factory(
            "connected",
            idle_timeout_seconds=3,
            warning_seconds=1.5,
            priority_class_policies={"high": {"cull_connected": False}},
        ).start()
        wait_until(
            lambda: not open_tab.in_broker(), 25, "the connected idle kernel to be culled", log=culler.log_text()
        )
        tab.drain(1.0)
        warnings = tab.streams("will be shut down at")
        assert len(warnings) == 1, f"expected one grace warning on the kernel's output, got {tab.streams('')}"
        assert "has been idle for" in warnings[0] and "10.0 GiB" in warnings[0]
        assert tab.streams("Shutting this kernel down to free its GPU slice"), "no notice before the shutdown"
        # the same situation in a class with cull_connected=False: kept, and told nothing
        model = server_kernels(hub, "bob")[protected.kernel_id]
        assert model["connections"] == 1 and protected.in_broker()
        assert metric_value(culler.metrics(), "elastic_gpu_culler_kernels", reason="connected") == 1
        protected_tab.drain(0.5)
        assert not protected_tab.streams("[elastic-gpu]")
    finally:
        tab.close()
        protected_tab.close()


def test_pressure_mode_frees_a_slice_for_a_waiting_request(stack, kernels, culler_factory):
    hub, _ = stack
    low = kernels("ada", priority_class="low")
    default = kernels("bob", priority_class="default")
    status, req = hub.api(
        "POST",
        "/gpu/requests",
        body={"request_id": "carol-1", "user": "carol", "memory_mib": 10240, "priority_class": "default"},
    )
    assert status == 200 and req["state"] == "waiting", req
    try:
        culler = culler_factory(
            "pressure",
            idle_timeout_seconds=600,
            warning_seconds=0,
            pressure_min_idle_seconds=1,
            gpu_busy_window_seconds=0.5,
        ).start()
        wait_until(
            lambda: hub.api("GET", "/gpu/requests/carol-1")[1]["state"] == "granted",
            20,
            "the waiting request to be granted",
            log=culler.log_text(),
        )
        assert not low.in_broker(), "the low-priority idle kernel should have yielded"
        wait_until(lambda: not low.on_server(), 10, "its server to list it as stopped")
        assert default.in_broker() and default.on_server(), "only as much as the request needs is reclaimed"
        culler.wait_log(rf"Culled GPU kernel {low.kernel_id} of ada .*reclaimed early for carol's waiting")
        time.sleep(1.5)  # later cycles: nothing waits any more, so nothing else goes
        assert default.in_broker()
        metrics = culler.metrics()
        assert metric_value(metrics, "elastic_gpu_culler_culls_total", reason="pressure", priority_class="low") == 1
        assert metric_value(metrics, "elastic_gpu_culler_culls_total", reason="pressure", priority_class="default") == 0
    finally:
        hub.api("DELETE", "/gpu/requests/carol-1")


def test_culler_restart_mid_cycle_is_safe(stack, kernels, culler_factory):
    hub, _ = stack
    k = kernels("ada")
    tab = KernelTab(hub, "ada", k.kernel_id)
    try:
        traits = dict(idle_timeout_seconds=4, warning_seconds=3)
        first = culler_factory("restart", **traits).start()
        first.wait_log(rf"Warned kernel {k.kernel_id}")
        first.kill()  # between the warning and the cull
        state = json.loads((first.dir / "state.json").read_text())
        assert k.kernel_id in state["warnings"]
        second = culler_factory("restart", **traits).start()
        second.wait_log(rf"Culling GPU kernel {k.kernel_id}", timeout=20)
        second.kill()  # in the middle of the reclaim
        third = culler_factory("restart", **traits).start()
        wait_until(lambda: not k.in_broker(), 20, "the kernel to be culled after the restarts", log=third.log_text())
        time.sleep(1.0)  # a few more cycles of the third culler
        tab.drain(1.0)
        assert len(tab.streams("will be shut down at")) == 1, "a restarted culler warned the kernel again"
        log = first.log_text()  # all three share the log file
        assert log.count(f"Warned kernel {k.kernel_id}") == 1
        assert "Could not free" not in log and "Traceback" not in log, log[-3000:]
        assert pool(hub)["used_mib"] == 0
        state = json.loads((first.dir / "state.json").read_text())
        assert k.kernel_id not in state["warnings"], "a culled kernel's warning must be forgotten"
    finally:
        tab.close()


def test_kernel_whose_server_does_not_know_it_is_reclaimed_through_the_broker(stack, culler_factory):
    hub, workdir = stack
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        status, record = hub.api(
            "POST",
            "/gpu/kernels",
            body={"kernel_id": "no-such-kernel", "user": "bob", "pid": holder.pid, "memory_mib": 4096},
        )
        assert status == 201
        culler = culler_factory("orphan", idle_timeout_seconds=2, warning_seconds=0).start()
        wait_until(
            lambda: hub.api("GET", f"/gpu/kernels/{record['id']}")[0] == 404,
            20,
            "the orphan to be reclaimed",
            log=culler.log_text(),
        )
        assert holder.wait(10) is not None
        culler.wait_log(
            r"Culled GPU kernel no-such-kernel of bob .*its server is gone or does not know it.* via broker"
        )
        labels = {"reason": "orphan", "method": "broker"}
        assert metric_value(culler.metrics(), "elastic_gpu_culler_culls_total", **labels) == 1
    finally:
        holder.kill()
        holder.wait()


def test_hub_managed_culler_serves_metrics_behind_the_hub_and_dry_run_culls_nothing(stack, kernels):
    hub, _ = stack
    k = kernels("bob")
    url = f"{hub.url}/services/gpu-culler/metrics"
    wait_until(
        lambda: f"[dry run] would cull kernel {k.kernel_id}" in hub.log_text(),
        20,
        "the managed culler to judge the kernel",
    )
    status, text = http("GET", url, hub.admin_token)
    assert status == 200, text
    status, _ = http("GET", url, "not-a-token")
    assert status == 403, "metrics through the hub must need a token"
    assert k.on_server() and k.in_broker(), "a dry-run culler culled a kernel"
