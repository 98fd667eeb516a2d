"""GPU kernels in their own pods, end to end: a real JupyterHub (Kubernetes mode) with the broker,
KubeSpawner and the GPU broker talking to the Kubernetes API emulator, whose kubelet runs the
user's jupyterhub-singleuser and each kernel pod's ipykernel as local processes, each on its own
loopback address. The notebook server holds no GPU and no Kubernetes rights.

One emulator and hub for the module: one simulated H100 (80 GiB) on node gpu-node-1, each user
may hold 16 GiB, kernel size 10 GiB.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time

import pytest
from kubernetes import client as kclient

from libvgpu import contract as L
from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import GPU_UUID, NAMESPACE, NODE, Server, kube_stack

SPEC = "elastic-gpu-gpu-10g"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with kube_stack(tmp_path_factory.mktemp("gpu-kernels-kube")) as st:
        yield st["hub"], st["emulator"], st["api"], st["alice"]


def kernel_pods(api) -> list[kclient.V1Pod]:
    pods = api.list_namespaced_pod(NAMESPACE, label_selector=f"{L.KIND}=kernel").items
    return [p for p in pods if not p.metadata.deletion_timestamp]


def kernel_slices(hub: HubRunner) -> list[dict]:
    status, pool = hub.api("GET", "/gpu/pool")
    assert status == 200, pool
    return [s for n in pool["nodes"] for g in n["gpus"] for s in g["slices"] if s["kind"] == "kernel"]


def broker_kernels(hub: HubRunner) -> list[dict]:
    status, body = hub.api("GET", "/gpu/kernels?user=alice")
    assert status == 200, body
    return body["kernels"]


def server_pod(api) -> kclient.V1Pod:
    [pod] = [
        p
        for p in api.list_namespaced_pod(NAMESPACE, label_selector="component=singleuser-server").items
        if not p.metadata.deletion_timestamp
    ]
    return pod


def stop_session(server: Server, session: dict) -> None:
    status, body = server.api("DELETE", f"/sessions/{session['id']}")
    assert status == 204, body


def test_gpu_kernel_runs_in_its_own_pod_holding_the_slice(cluster):
    hub, _emulator, api, alice = cluster
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    conn = alice.connect(session["kernel"]["id"])
    try:
        probe = conn.execute(
            "import os\nprint(os.environ['NVIDIA_VISIBLE_DEVICES'])\nprint(open(os.environ['LIBVGPU_CONFIG']).read())"
        )
        assert probe["status"] == "ok", probe
        assert probe["text"].splitlines()[0] == GPU_UUID
        assert "memory_mib.0=10240" in probe["text"] and "cores_percent.0=25" in probe["text"]
    finally:
        conn.close()
    [pod] = kernel_pods(api)
    [record] = broker_kernels(hub)
    assert pod.metadata.name == record["holder"] and pod.status.pod_ip == record["ip"]
    assert pod.metadata.labels[L.KERNEL_ID] == record["id"]
    assert pod.metadata.annotations[L.ALLOCATION_ID] == record["allocation_id"]
    [term] = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert term.match_fields[0].values == [NODE] and pod.spec.node_name == NODE
    assert pod.spec.automount_service_account_token is False, "kernel pods get no API token"
    owner = server_pod(api)
    assert [(r.kind, r.name, r.uid) for r in pod.metadata.owner_references] == [
        ("Pod", owner.metadata.name, owner.metadata.uid)
    ], "the kernel pod is garbage-collected with the user's server"
    # the key is in the Secret only: never in the pod's spec, env or annotations
    secret = api.read_namespaced_secret(pod.spec.volumes[0].secret.secret_name, NAMESPACE)
    key = json.loads(base64.b64decode(secret.data["connection.json"]))["key"]
    assert len(key) >= 16 and key not in json.dumps(api.api_client.sanitize_for_serialization(pod))
    assert secret.metadata.owner_references[0].uid == owner.metadata.uid
    assert [s["allocation_id"] for s in kernel_slices(hub)] == [record["allocation_id"]]

    stop_session(alice, session)
    assert broker_kernels(hub) == []
    assert kernel_slices(hub) == [], "shutdown gives the slice back"
    hub.wait_for(lambda: kernel_pods(api) == [], timeout=20, what="the kernel pod to be deleted")
    assert api.list_namespaced_secret(NAMESPACE, label_selector=L.KERNEL_ID).items == []


def test_interrupt_and_restart_of_a_kernel_pod(cluster):
    hub, _emulator, api, alice = cluster
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kid = session["kernel"]["id"]
    conn = alice.connect(kid)
    try:
        msg_id = conn.execute_async("import time\nprint('sleeping', flush=True)\ntime.sleep(120)")
        assert conn.wait_for_output(msg_id, "sleeping", timeout=30)
        status, _ = alice.api("POST", f"/kernels/{kid}/interrupt")
        assert status == 204
        result = conn.collect(msg_id, timeout=20)
        assert result["ename"] == "KeyboardInterrupt", result
        assert conn.execute("z = 3; z")["text"] == "3"
        [before] = broker_kernels(hub)
        status, body = alice.api("POST", f"/kernels/{kid}/restart")
        assert status == 200, body
    finally:
        conn.close()
    conn = alice.connect(kid)
    try:
        assert conn.execute("'z' in dir()")["text"] == "False", "a restarted kernel starts empty"
    finally:
        conn.close()
    [after] = broker_kernels(hub)
    assert after["allocation_id"] == before["allocation_id"], "restart keeps the slice"
    assert after["holder"] != before["holder"] and after["generation"] == before["generation"] + 1
    assert after["shell_port"] != before["shell_port"], "the ports change, so jupyter-server reconnects"
    hub.wait_for(
        lambda: [p.metadata.name for p in kernel_pods(api)] == [after["holder"]],
        timeout=20,
        what="only the new kernel pod to remain",
    )
    assert len(kernel_slices(hub)) == 1
    stop_session(alice, session)
    assert kernel_slices(hub) == []


def test_an_unschedulable_kernel_fails_fast_with_the_schedulers_reason(cluster):
    hub, emulator, api, alice = cluster
    emulator.patch("nodes", NODE, {"spec": {"unschedulable": True}}, namespace=None)
    try:
        started = time.monotonic()
        status, body = alice.start_session(SPEC)
        took = time.monotonic() - started
    finally:
        emulator.patch("nodes", NODE, {"spec": {"unschedulable": False}}, namespace=None)
    assert status >= 400, body
    assert "cannot be scheduled" in body["message"] and "unschedulable" in body["message"], body
    assert took < 15, f"an unschedulable kernel must fail fast, took {took:.1f} s"
    assert broker_kernels(hub) == [] and kernel_slices(hub) == []
    hub.wait_for(lambda: kernel_pods(api) == [], timeout=20, what="the pending pod to be deleted")


def test_a_second_kernel_over_quota_is_refused_and_creates_no_pod(cluster):
    hub, _emulator, api, alice = cluster
    status, first = alice.start_session(SPEC)
    assert status == 201, first
    try:
        status, second = alice.start_session(SPEC)
        assert status >= 400 and "does not fit" in second["message"], second
        assert len(kernel_pods(api)) == 1 and len(kernel_slices(hub)) == 1
    finally:
        stop_session(alice, first)


def test_a_kubernetes_api_that_answers_too_late_refuses_the_kernel_with_a_sentence_and_keeps_nothing(cluster):
    """The API server answers the hub's read of alice's server pod after the hub's 10 s
    (overloaded, or cut off): her kernel start is refused with a sentence, not a traceback, and
    leaves no slice, record or pod behind; once the API answers again her kernel starts."""
    hub, emulator, api, alice = cluster
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{server_pod(api).metadata.name}"
    emulator.stall("GET", path, 12)
    status, body = alice.start_session(SPEC)
    assert status >= 400, body
    message = body["message"]
    assert "The Kubernetes API did not answer within 10 s" in message and "try again" in message, message
    assert "Traceback" not in message and "TimeoutError" not in message, message
    assert broker_kernels(hub) == [] and kernel_slices(hub) == [] and kernel_pods(api) == []
    hub.wait_for(lambda: emulator.stall_left("GET", path) == 0, timeout=30, what="the API to answer again")
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    stop_session(alice, session)
    assert kernel_slices(hub) == []


def test_a_restarted_hub_finds_its_kernel_pods_again(cluster):
    hub, _emulator, api, alice = cluster
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kid = session["kernel"]["id"]
    conn = alice.connect(kid)
    assert conn.execute("w = 21")["status"] == "ok"
    conn.close()
    [before] = broker_kernels(hub)
    hub.restart()
    [after] = broker_kernels(hub)
    assert (after["id"], after["holder"], after["allocation_id"]) == (
        before["id"],
        before["holder"],
        before["allocation_id"],
    )
    assert after["state"] == "running" and after["kernel_id"] == kid
    assert [s["allocation_id"] for s in kernel_slices(hub)] == [before["allocation_id"]]
    conn = alice.connect(kid)
    try:
        assert conn.execute("w * 2")["text"] == "42"
    finally:
        conn.close()
    stop_session(alice, session)
    assert kernel_slices(hub) == []


def test_killing_the_server_process_collects_its_kernel_pods(cluster):
    """Last: it kills alice's server process (KubeSpawner's pod restarts it, without its kernels)."""
    hub, emulator, api, alice = cluster
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    [pod] = kernel_pods(api)
    owner = server_pod(api)
    os.kill(emulator.pod_pid(owner.metadata.name, NAMESPACE), signal.SIGKILL)
    hub.wait_for(lambda: kernel_pods(api) == [], timeout=30, what="the kernel pod to be collected")
    hub.wait_for(lambda: kernel_slices(hub) == [], timeout=10, what="the orphaned kernel's slice to be freed")
    assert broker_kernels(hub) == []
    assert api.list_namespaced_secret(NAMESPACE, label_selector=L.KERNEL_ID).items == []
    assert "is gone" in hub.log_text()
