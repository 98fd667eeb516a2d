"""A cluster shaped like a platform team's (issue 14), through the Kubernetes API emulator: the
GPU node is tainted nvidia.com/gpu:NoSchedule (GKE, the GPU operator) and a CPU node is not.
A real hub (Kubernetes mode, the broker) starts a GPU notebook whose home is a PersistentVolumeClaim
(KubeSpawner's storage, as z2jh sets it up); a GPU kernel from that notebook lands on the tainted
node through kube-scheduler and reads a file of the user's home from the notebook's directory.
The users' namespace enforces Pod Security "baseline" (the emulator refuses what the standard
forbids): the GPU pods reach the node agent's directory through the chart's claim, not hostPath.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from kubernetes import client as kclient
from kubernetes import config as kconfig

from libvgpu import contract as L
from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import (
    ADMISSION,
    GPU_UUID,
    Server,
    _broker_config,
    install_kernelspecs,
    start_server,
)

NAMESPACE = "jhub"
GPU_NODE, CPU_NODE = "gpu-node-1", "cpu-node-1"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
SPEC = "elastic-gpu-gpu-10g"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.kubeemu import KubeEmulator
    from tests.kubeemu.helpers import create_host_claim
    from tests.kubeemu.podsecurity import ENFORCE_LABEL

    work = tmp_path_factory.mktemp("tainted-gpu-node")
    gpus = [{"uuid": GPU_UUID, "model": "H100-80GB", "memory_mib": 81920, "sm_count": 132, "index": 0}]
    emulator = KubeEmulator(
        nodes=[
            {
                "name": GPU_NODE,
                "labels": {L.NODE_GPU_LABEL: "true", "kubernetes.io/hostname": GPU_NODE},
                "annotations": {L.NODE_GPUS_ANNOTATION: json.dumps(gpus)},
                "taints": [GPU_TAINT],
            },
            {"name": CPU_NODE, "labels": {"kubernetes.io/hostname": CPU_NODE}},
        ],
        namespaces=[NAMESPACE],
        restart_backoff_seconds=1.0,
    )
    emulator.start()
    hub = None
    try:
        emulator.create(
            {
                "apiVersion": "node.k8s.io/v1",
                "kind": "RuntimeClass",
                "metadata": {"name": "nvidia"},
                "handler": "nvidia",
            }
        )
        emulator.create(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": "elastic-gpu-default"},
                "value": 100,
            }
        )
        # users' pods at Pod Security "baseline", enforced by the emulator's admission
        emulator.patch("namespaces", NAMESPACE, {"metadata": {"labels": {ENFORCE_LABEL: "baseline"}}}, None)
        host_dir = work / "host-elastic-gpu"
        (host_dir / "lib").mkdir(parents=True)
        (host_dir / "ld.so.preload").write_text("")
        create_host_claim(emulator, NAMESPACE, host_dir)  # the chart's claim of the agent's directory
        # the kernelspecs reach the server as a volume (a hostPath volume would break "baseline")
        prefix = work / "jupyter-prefix"
        (prefix / "share" / "jupyter").mkdir(parents=True, exist_ok=True)
        create_host_claim(emulator, NAMESPACE, prefix / "share" / "jupyter", name="kernelspecs")
        (work / "admission.yaml").write_text(yaml.safe_dump(ADMISSION))
        singleuser = Path(sys.executable).parent / "jupyterhub-singleuser"
        profile = {
            "display_name": "1/8 H100",
            "slug": "h100-eighth",
            "default": True,
            "gpu": {"memory_mib": 4096, "cores_percent": 10},
        }
        config = (
            textwrap.dedent(
                f"""
            from hubext.hubconfig import configure_hub
            configure_hub(c, mode="kubernetes", admission_config_file={str(work / "admission.yaml")!r}, culler=False)
            c.KubeSpawner.namespace = {NAMESPACE!r}
            c.KubernetesPool.namespace = {NAMESPACE!r}
            c.KubeSpawner.image = "quay.io/jupyter/base-notebook:emulated"
            c.KubeSpawner.cmd = [{str(singleuser)!r}]
            c.KubeSpawner.ip = "$(POD_IP)"
            c.KubeSpawner.environment = {{
                "POD_IP": {{"valueFrom": {{"fieldRef": {{"fieldPath": "status.podIP"}}}}}},
                "JUPYTER_PATH": "/opt/jupyter-kernelspecs",  # a volume: uid 1000 cannot read pytest's tmp dir
            }}
            c.KubeSpawner.start_timeout = 90
            c.KubeSpawner.http_timeout = 60
            # the home, as z2jh's singleuser.storage (dynamic) sets it up
            c.KubeSpawner.storage_pvc_ensure = True
            c.KubeSpawner.pvc_name_template = "claim-{{username}}"
            c.KubeSpawner.storage_capacity = "1Gi"
            c.KubeSpawner.storage_access_modes = ["ReadWriteOnce"]
            c.KubeSpawner.volumes = [
                {{"name": "home", "persistentVolumeClaim": {{"claimName": "claim-{{username}}"}}}},
                {{"name": "kernelspecs", "persistentVolumeClaim": {{"claimName": "kernelspecs"}}}},
            ]
            c.KubeSpawner.volume_mounts = [
                {{"name": "home", "mountPath": "/home/jovyan"}},
                {{"name": "kernelspecs", "mountPath": "/opt/jupyter-kernelspecs", "readOnly": True}},
            ]
            c.KubeSpawner.working_dir = "/home/jovyan"
            c.KubeSpawner.uid = 1000  # z2jh's singleuser.uid and fsGid
            c.KubeSpawner.fs_gid = 100
            c.KubeSpawner.profile_list = [{profile!r}]
            c.KubernetesKernelLauncher.network_policy = False
            c.KubernetesKernelLauncher.image = "quay.io/jupyter/pytorch-notebook:emulated"
            """
            )
            + _broker_config()
        )
        hub = HubRunner(work, config, env={"KUBECONFIG": str(emulator.kubeconfig_path)})
        hub.start()
        kconfig.load_kube_config(config_file=str(emulator.kubeconfig_path))
        token = hub.user_token("alice")
        install_kernelspecs(hub, token, prefix)
        start_server(hub, "alice", token)
        yield hub, emulator, kclient.CoreV1Api(), Server(hub, "alice", token)
    finally:
        if hub is not None:
            hub.stop()
        emulator.stop()


def _pods(api, selector: str) -> list:
    return [
        p
        for p in api.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        if not p.metadata.deletion_timestamp
    ]


def test_gpu_notebook_and_kernel_land_on_the_tainted_gpu_node_and_the_kernel_reads_the_users_home(cluster):
    hub, _emulator, api, alice = cluster
    [server] = _pods(api, "component=singleuser-server")
    assert server.spec.node_name == GPU_NODE, "the GPU notebook tolerates the GPU taint"
    assert server.spec.affinity.node_affinity is not None and server.metadata.labels[L.MANAGED] == "true"

    # a file in the user's home, written through the notebook server (as JupyterLab does)
    status, body = alice.api("PUT", "/contents/project", {"type": "directory"})
    assert status in (200, 201), body
    status, body = alice.api(
        "PUT", "/contents/project/data.csv", {"type": "file", "format": "text", "content": "a,b\n1,2\n"}
    )
    assert status in (200, 201), body

    status, session = alice.start_session(SPEC, path="project/analysis.ipynb")
    assert status == 201, session
    conn = alice.connect(session["kernel"]["id"])
    try:
        result = conn.execute("import os\nprint(os.getcwd())\nprint(open('data.csv').read().splitlines()[1])")
        assert result["status"] == "ok", result
        cwd, row = result["text"].splitlines()[:2]
        assert row == "1,2"
        assert cwd.endswith("/home/jovyan/project")
    finally:
        conn.close()
    [kernel] = _pods(api, f"{L.KIND}=kernel")
    assert kernel.spec.node_name == GPU_NODE
    assert any(t.key == "nvidia.com/gpu" for t in kernel.spec.tolerations)
    assert kernel.spec.security_context.run_as_non_root is True
    claims = [v.persistent_volume_claim.claim_name for v in kernel.spec.volumes if v.persistent_volume_claim]
    # the home (and the server's kernelspecs claim), and the agent's directory once: no hostPath
    assert sorted(claims) == ["claim-alice", "elastic-gpu-host", "kernelspecs"]
    for pod in (server, kernel):
        assert not [v.name for v in pod.spec.volumes if v.host_path], pod.metadata.name
    status, _ = alice.api("DELETE", f"/sessions/{session['id']}")
    assert status == 204
