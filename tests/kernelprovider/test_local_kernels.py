"""GPU kernels on a single machine, end to end: a real JupyterHub with the broker, the user's real
jupyter-server (jupyterhub-singleuser) started by the hub, the real provisioner, real ipykernels.

One hub for the module (one simulated H100, each user may hold 16 GiB, kernel size 10 GiB).
Tests stop the kernels they start; the test that kills a server runs last.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import Server, http, local_stack

SPEC = "elastic-gpu-gpu-10g"


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with local_stack(tmp_path_factory.mktemp("gpu-kernels-local")) as st:
        yield st["hub"], st["tokens"], st["installed"], st["prefix"]


@pytest.fixture()
def alice(stack) -> Iterator[Server]:
    hub, tokens, _, _ = stack
    server = Server(hub, "alice", tokens["alice"])
    yield server
    # a test that failed half-way must not leave its kernel behind to fill alice's quota for the
    # tests after it: her sessions are shut down, then whatever GPU kernel of hers is left
    status, sessions = server.api("GET", "/sessions")
    for session in sessions if status == 200 else []:
        server.api("DELETE", f"/sessions/{session['id']}")
    for record in broker_kernels(hub, "alice"):
        hub.api("DELETE", f"/gpu/kernels/{record['id']}")


def broker_kernels(hub: HubRunner, user: str | None = None) -> list[dict]:
    status, body = hub.api("GET", "/gpu/kernels" + (f"?user={user}" if user else ""))
    assert status == 200, body
    return body["kernels"]


def kernel_slices(hub: HubRunner) -> list[dict]:
    status, pool = hub.api("GET", "/gpu/pool")
    assert status == 200, pool
    return [s for n in pool["nodes"] for g in n["gpus"] for s in g["slices"] if s["kind"] == "kernel"]


def stop_session(server: Server, session: dict) -> None:
    status, body = server.api("DELETE", f"/sessions/{session['id']}")
    assert status == 204, body


def test_install_kernelspecs_makes_one_spec_per_hub_size(stack):
    _, _, installed, prefix = stack
    assert "Python 3 (GPU 10 GiB)" in installed and "Python 3 (GPU 4 GiB)" in installed
    spec = json.loads((prefix / "share/jupyter/kernels" / SPEC / "kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (GPU 10 GiB)"
    assert spec["interrupt_mode"] == "message"
    assert spec["metadata"]["kernel_provisioner"] == {
        "provisioner_name": "elastic-gpu-provisioner",
        "config": {"size": "gpu-10g"},
    }


def test_gpu_kernel_runs_code_with_its_slice_and_frees_it_on_shutdown(stack, alice):
    hub = stack[0]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    conn = alice.connect(session["kernel"]["id"])
    try:
        result = conn.execute("6 * 7")
        assert result["status"] == "ok" and result["text"] == "42"
        probe = conn.execute(
            "import os, stat\n"
            "cfg = os.environ['LIBVGPU_CONFIG']\n"
            "print(os.environ['CUDA_VISIBLE_DEVICES'], os.getpid())\n"
            "print(open(cfg).read())\n"
            "print('writable' if os.access(cfg, os.W_OK) and os.getuid() != 0 else oct(os.stat(cfg).st_mode & 0o777))"
        )
        assert probe["status"] == "ok", probe
        lines = probe["text"].splitlines()
        uuid, pid = lines[0].split()
        assert uuid.startswith("GPU-sim-")
        assert "memory_mib.0=10240" in probe["text"] and "cores_percent.0=25" in probe["text"]
        assert lines[-1] == "0o444", "the limits file must be read-only"
    finally:
        conn.close()
    [record] = broker_kernels(hub, "alice")
    assert record["state"] == "running" and record["holder"] == pid
    assert record["kernel_id"] == session["kernel"]["id"]
    assert record["memory_mib"] == 10240 and record["gpu"] == {"memory_mib": 10240, "cores_percent": 25}
    assert [s["allocation_id"] for s in kernel_slices(hub)] == [record["allocation_id"]]

    stop_session(alice, session)
    assert broker_kernels(hub, "alice") == []
    assert kernel_slices(hub) == [], "the slice must go back to the pool"
    hub.wait_for(lambda: not pid_alive(int(pid)), timeout=10, what="the kernel process to exit")


def test_interrupt_stops_a_long_cell_through_the_control_channel(alice):
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kid = session["kernel"]["id"]
    conn = alice.connect(kid)
    try:
        msg_id = conn.execute_async("import time\nprint('sleeping', flush=True)\ntime.sleep(120)")
        assert conn.wait_for_output(msg_id, "sleeping", timeout=30)
        started = time.monotonic()
        status, body = alice.api("POST", f"/kernels/{kid}/interrupt")
        assert status == 204, body
        result = conn.collect(msg_id, timeout=20)
        assert result["status"] == "error" and result["ename"] == "KeyboardInterrupt", result
        assert time.monotonic() - started < 10
        assert conn.execute("1 + 1")["text"] == "2", "the kernel must survive the interrupt"
    finally:
        conn.close()
        stop_session(alice, session)


def test_restart_keeps_the_slice_and_gives_a_fresh_kernel(stack, alice):
    hub = stack[0]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kid = session["kernel"]["id"]
    conn = alice.connect(kid)
    try:
        assert conn.execute("x = 'before'; x")["text"] == "'before'"
        [before] = broker_kernels(hub, "alice")
        status, body = alice.api("POST", f"/kernels/{kid}/restart")
        assert status == 200, body
    finally:
        conn.close()
    conn = alice.connect(kid)  # as JupyterLab does after a restart (the ports changed)
    try:
        result = conn.execute("'x' in dir()")
        assert result["status"] == "ok" and result["text"] == "False", "a restarted kernel starts empty"
    finally:
        conn.close()
    [after] = broker_kernels(hub, "alice")
    assert after["id"] == before["id"] and after["generation"] == before["generation"] + 1
    assert after["allocation_id"] == before["allocation_id"], "restart must keep the slice"
    assert after["holder"] != before["holder"] and after["shell_port"] != before["shell_port"]
    hub.wait_for(lambda: not pid_alive(int(before["holder"])), timeout=15, what="the old kernel process to exit")
    assert [s["allocation_id"] for s in kernel_slices(hub)] == [before["allocation_id"]]
    stop_session(alice, session)
    assert kernel_slices(hub) == []


def test_a_crashed_kernel_frees_its_slice_and_is_restarted_by_the_server(stack, alice):
    hub = stack[0]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kid = session["kernel"]["id"]
    conn = alice.connect(kid)
    try:
        [before] = broker_kernels(hub, "alice")
        conn.execute_async("import os; os._exit(3)")
        # jupyter-server's restarter sees the kernel dead (poll asks the broker) and restarts it:
        # the broker re-admits it (the crash released its slice) and starts a new process
        after = hub.wait_for(
            lambda: next((k for k in broker_kernels(hub, "alice") if k["generation"] > before["generation"]), None),
            timeout=30,
            what="the crashed kernel to be restarted",
        )
        assert after["id"] == before["id"] and after["allocation_id"] != before["allocation_id"]
        assert after["state"] == "running"
    finally:
        conn.close()
    conn = alice.connect(kid)
    try:
        assert conn.execute("40 + 2")["text"] == "42"
    finally:
        conn.close()
    assert [s["allocation_id"] for s in kernel_slices(hub)] == [after["allocation_id"]], "one slice, not two"
    stop_session(alice, session)
    assert kernel_slices(hub) == []


def test_a_second_kernel_over_quota_is_refused_with_the_reason(stack, alice):
    hub = stack[0]
    status, first = alice.start_session(SPEC)
    assert status == 201, first
    try:
        status, second = alice.start_session(SPEC)
        assert status >= 400
        message = second["message"]
        assert "16 GiB" in message and "does not fit" in message, message
        assert "Traceback" not in message
        assert len(broker_kernels(hub, "alice")) == 1, "a refused kernel leaves nothing behind"
        assert len(kernel_slices(hub)) == 1
        # a smaller size still fits beside the first kernel
        status, small = alice.start_session("elastic-gpu-gpu-4g")
        assert status == 201, small
        stop_session(alice, small)
    finally:
        stop_session(alice, first)


def test_user_cannot_touch_another_users_kernel_through_the_broker(stack, alice):
    hub, tokens, _, _ = stack
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    try:
        [record] = broker_kernels(hub, "alice")
        bob = tokens["bob"]
        base = f"{hub.hub_api}/gpu/kernels"
        for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/restart"), ("POST", "/interrupt")):
            status, body = http(method, f"{base}/{record['id']}{path}", bob, body={} if method == "POST" else None)
            assert status == 404, (method, path, status, body)
            assert set(body) == {"status", "message"}
        status, body = http("GET", f"{base}?user=alice", bob)
        assert status == 403 and "alice" in body["message"]
        status, body = http("GET", base, bob)
        assert status == 200 and body["kernels"] == []
        status, body = http("POST", base, bob, {"user": "alice", "size": "gpu-10g", "key": "k" * 32, "server_name": ""})
        assert status == 403 and "alice" in body["message"]
        # bob has no running server: he cannot get a kernel for himself either, and is told why
        status, body = http("POST", base, bob, {"size": "gpu-10g", "key": "k" * 32})
        assert status == 409 and "not running" in body["message"]
        # the kernel is untouched and alice still reaches it
        assert broker_kernels(hub, "alice")[0]["state"] == "running"
        status, mine = http("GET", f"{base}/{record['id']}", tokens["alice"])
        assert status == 200 and mine["id"] == record["id"]
    finally:
        stop_session(alice, session)


def test_bad_requests_are_refused_with_a_message_naming_what_is_allowed(stack):
    hub, tokens, _, _ = stack
    base = f"{hub.hub_api}/gpu/kernels"
    token = tokens["alice"]
    status, body = http("POST", base, token, {"size": "gpu-99g", "key": "k" * 32})
    assert status == 400 and "gpu-10g" in body["message"] and "gpu-4g" in body["message"]
    status, body = http("POST", base, token, {"size": "gpu-10g", "key": "short"})
    assert status == 400 and "'key'" in body["message"]
    status, body = http("POST", base, token, {"gpu": {"memory_mib": "lots"}, "key": "k" * 32})
    assert status == 400 and "memory_mib" in body["message"]
    status, body = http("GET", f"{base}/{'0' * 32}?wait=abc", token)
    assert status == 404
    status, body = http("GET", f"{hub.hub_api}/gpu/kernel-sizes", token)
    assert status == 200 and [s["name"] for s in body["sizes"]] == ["gpu-10g", "gpu-4g"]


def test_hub_restart_keeps_running_kernels(stack, alice):
    hub = stack[0]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kid = session["kernel"]["id"]
    conn = alice.connect(kid)
    assert conn.execute("y = 5")["status"] == "ok"
    conn.close()
    [before] = broker_kernels(hub, "alice")
    hub.restart()
    [after] = broker_kernels(hub, "alice")
    assert (after["id"], after["holder"], after["state"]) == (before["id"], before["holder"], "running")
    assert [s["allocation_id"] for s in kernel_slices(hub)] == [before["allocation_id"]]
    conn = alice.connect(kid)
    try:
        assert conn.execute("y * 2")["text"] == "10", "the kernel kept running through the hub restart"
    finally:
        conn.close()
    stop_session(alice, session)
    assert kernel_slices(hub) == []


def test_killing_the_server_collects_its_gpu_kernels(stack, alice):
    """Last: it kills alice's server."""
    hub = stack[0]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    [record] = broker_kernels(hub, "alice")
    kernel_pid = int(record["holder"])
    _, model = hub.api("GET", "/users/alice")
    server_pid = model["servers"][""]["state"]["pid"]
    os.kill(server_pid, signal.SIGKILL)
    hub.wait_for(lambda: broker_kernels(hub, "alice") == [], timeout=15, what="the broker to delete the kernel")
    hub.wait_for(lambda: not pid_alive(kernel_pid), timeout=10, what="the kernel process to be stopped")
    hub.wait_for(lambda: kernel_slices(hub) == [], timeout=10, what="the orphaned kernel's slice to be freed")
    assert "is gone" in hub.log_text()
