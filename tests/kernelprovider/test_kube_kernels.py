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
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client as kclient
from kubernetes import config as kconfig

from hubext import labels as L
from hubext.kernel_launcher import KERNEL_ID
from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import ADMISSION, SIZES, Server, install_kernelspecs, start_server
from tests.kubeemu import KubeEmulator

GPU_UUID = "GPU-aaaaaaaa-2222-3333-4444-555555555555"
NODE = "gpu-node-1"
NAMESPACE = "jhub"
SPEC = "elastic-gpu-gpu-10g"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu-kernels-kube")
    gpus = [{"uuid": GPU_UUID, "model": "H100-80GB", "memory_mib": 81920, "sm_count": 132, "index": 0}]
    emulator = KubeEmulator(
        nodes=[
            {
                "name": NODE,
                "labels": {L.NODE_GPU_LABEL: "true", "kubernetes.io/hostname": NODE},
                "annotations": {L.NODE_GPUS_ANNOTATION: json.dumps(gpus)},
            }
        ],
        namespaces=[NAMESPACE],
        restart_backoff_seconds=1.0,
    )
    emulator.start()
    emulator.create(
        {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"}, "handler": "nvidia"}
    )
    for name, value in (("high", 1000), ("default", 100)):  # the chart makes one per admission class
        emulator.create(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": f"elastic-gpu-{name}"},
                "value": value,
            }
        )
    host_dir = work / "host-elastic-gpu"  # what the node agent installs on GPU nodes
    (host_dir / "lib").mkdir(parents=True)
    (host_dir / "ld.so.preload").write_text("")
    (work / "admission.yaml").write_text(yaml.safe_dump(ADMISSION))
    prefix = work / "jupyter-prefix"
    singleuser = Path(sys.executable).parent / "jupyterhub-singleuser"
    config = textwrap.dedent(
        f"""
        from hubext.hubconfig import configure_hub
        from hubext.broker import USER_SCOPES, start_with_hub
        configure_hub(c, mode="kubernetes", admission_config_file={str(work / "admission.yaml")!r}, culler=False)
        c.JupyterHub.extra_user_scopes = set(USER_SCOPES)
        start_with_hub()
        c.JupyterHub.cleanup_servers = False
        c.KubeSpawner.namespace = {NAMESPACE!r}
        c.KubernetesPool.namespace = {NAMESPACE!r}
        c.KubeSpawner.image = "quay.io/jupyter/base-notebook:emulated"
        c.KubeSpawner.cmd = [{str(singleuser)!r}]
        c.KubeSpawner.args = ["--ServerApp.allow_root=True"]  # the emulator runs pods as this test's user
        c.KubeSpawner.ip = "$(POD_IP)"
        c.KubeSpawner.environment = {{
            "POD_IP": {{"valueFrom": {{"fieldRef": {{"fieldPath": "status.podIP"}}}}}},
            "JUPYTER_PATH": {str(prefix / "share" / "jupyter")!r},
        }}
        c.KubeSpawner.start_timeout = 90
        c.KubeSpawner.http_timeout = 60
        c.Spawner.default_url = "/tree"
        c.ElasticGPUSpawner.gpu_host_dir = {str(host_dir)!r}
        c.GPUBroker.kernel_sizes = {SIZES!r}
        c.GPUBroker.reconcile_interval_seconds = 1
        # the emulator serves no NetworkPolicy API; the policy object is checked in test_launcher_objects
        c.KubernetesKernelLauncher.network_policy = False
        c.KubernetesKernelLauncher.image = "quay.io/jupyter/pytorch-notebook:emulated"
        """
    )
    hub = HubRunner(work, config, env={"KUBECONFIG": str(emulator.kubeconfig_path)})
    try:
        hub.start()
        kconfig.load_kube_config(config_file=str(emulator.kubeconfig_path))
        api = kclient.CoreV1Api()
        token = hub.user_token("alice")
        install_kernelspecs(hub, token, prefix)
        start_server(hub, "alice", token)
        yield hub, emulator, api, Server(hub, "alice", token)
    finally:
        hub.stop()
        emulator.stop()


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
    assert pod.metadata.labels[KERNEL_ID] == record["id"]
    assert pod.metadata.annotations[L.ALLOCATION_ID] == record["allocation_id"]
    assert pod.spec.node_selector["kubernetes.io/hostname"] == NODE
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
    assert api.list_namespaced_secret(NAMESPACE, label_selector=KERNEL_ID).items == []


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


def test_killing_the_server_process_collects_its_kernel_pods(cluster):
    """Last: it kills alice's server process (KubeSpawner's pod restarts it, without its kernels)."""
    hub, emulator, api, alice = cluster
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    [pod] = kernel_pods(api)
    owner = server_pod(api)
    os.kill(emulator.pod_pid(owner.metadata.name, NAMESPACE), signal.SIGKILL)
    hub.wait_for(lambda: kernel_pods(api) == [], timeout=30, what="the kernel pod to be collected")
    assert broker_kernels(hub) == [] and kernel_slices(hub) == []
    assert api.list_namespaced_secret(NAMESPACE, label_selector=KERNEL_ID).items == []
    assert pod.metadata.name in hub.log_text()
