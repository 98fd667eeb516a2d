"""The chart as a platform team installs it: ``helm install``, ``helm upgrade`` and ``helm
uninstall`` of helm/elastic-gpu against the emulator, over TLS with the admin kubeconfig, as
kubectl and helm (client-go) talk to a real API server."""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.helm.tools import CHART, LAYER_ZIP, HelmMissing, helm_path
from tests.kubeemu import KubeEmulator, NodeSpec
from tests.kubeemu.helpers import release_objects
from tests.kubeemu.images import Image

RELEASE, NS = "eg", "jhub"
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> dict[str, Path]:
    try:
        helm = helm_path()
    except HelmMissing as e:
        pytest.fail(str(e))
    kubectl = tmp_path_factory.mktemp("bin") / "kubectl"
    with zipfile.ZipFile(LAYER_ZIP) as zf:
        kubectl.write_bytes(zf.read("kubectl/kubectl"))
    kubectl.chmod(0o755)
    return {"helm": helm, "kubectl": kubectl}


@pytest.fixture(scope="module")
def emu():
    # one node without GPUs: the node agent's DaemonSet selects none; the chart's image is the
    # test environment (the uninstall hook runs python -m libvgpu.agent.uninstall from it)
    with KubeEmulator(nodes=[NodeSpec("cpu-1")], namespaces=[NS], restart_backoff_seconds=1.0,
                      images={"jupyterhub-elastic-gpu:*": Image(uid=65534, gid=65534)}) as emu:
        yield emu


def _run(tools: dict, emu: KubeEmulator, tmp: Path, tool: str, *args: str,
         timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": emu.tls_kubeconfig_path,
           "HELM_CONFIG_HOME": str(tmp / "config"), "HELM_CACHE_HOME": str(tmp / "cache"),
           "HELM_DATA_HOME": str(tmp / "data")}
    proc = subprocess.run([str(tools[tool]), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, f"{tool} {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _ours(emu: KubeEmulator) -> list[str]:
    return release_objects(emu, RELEASE, NS)


def test_helm_install_upgrade_and_uninstall_leave_nothing_of_ours(tools, emu, tmp_path):
    _run(tools, emu, tmp_path, "helm", "install", RELEASE, str(CHART), "-n", NS)
    deployments = emu.list("deployments", NS, group="apps", label_selector=INSTANCE)
    assert deployments, "the chart's Deployment was not created"
    daemonsets = emu.list("daemonsets", group="apps", label_selector=INSTANCE)
    assert [d["metadata"]["name"] for d in daemonsets] == ["eg-elastic-gpu-node-agent"]
    (release,) = emu.list("secrets", NS, label_selector=f"owner=helm,name={RELEASE}")
    assert release["metadata"]["labels"]["status"] == "deployed"
    out = _run(tools, emu, tmp_path, "kubectl", "get", "deployments", "-n", NS).stdout
    assert deployments[0]["metadata"]["name"] in out

    name = deployments[0]["metadata"]["name"]
    emu.wait_for(lambda: emu.list("replicasets", NS, group="apps", label_selector=INSTANCE),
                 timeout=30, message="the Deployment's ReplicaSet")
    _run(tools, emu, tmp_path, "helm", "upgrade", RELEASE, str(CHART), "-n", NS,
         "--set-string", "culler.podAnnotations.rollout=2")
    emu.wait_for(lambda: len(emu.list("replicasets", NS, group="apps", label_selector=INSTANCE))
                 == 2, timeout=30, message="helm upgrade to roll the Deployment to a new template")
    releases = emu.list("secrets", NS, label_selector=f"owner=helm,name={RELEASE}")
    assert sorted(s["metadata"]["labels"]["version"] for s in releases) == ["1", "2"]

    _run(tools, emu, tmp_path, "helm", "uninstall", RELEASE, "-n", NS, "--timeout", "200s",
         timeout=260)
    emu.wait_for(lambda: not _ours(emu), timeout=60,
                 message=f"the release's objects to go (left: {_ours(emu)})")
    assert emu.get("deployments", name, NS, group="apps") is None



WEB = """apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: jhub}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: c
        image: python:3.11
        command: [python, -c, "print('hello', flush=True); import time; time.sleep(600)"]
"""


def test_kubectl_apply_get_logs_describe_and_rollout(tools, emu, tmp_path):
    manifest = tmp_path / "web.yaml"
    manifest.write_text(WEB)
    run = lambda *a: _run(tools, emu, tmp_path, "kubectl", "-n", NS, *a).stdout  # noqa: E731
    assert run("apply", "-f", str(manifest)) == "deployment.apps/web created\n"
    assert run("rollout", "status", "deploy/web", "--timeout=60s").endswith(
        'deployment "web" successfully rolled out\n')
    assert run("apply", "-f", str(manifest)) == "deployment.apps/web unchanged\n"
    assert run("get", "pods", "-l", "app=web", "-o", "name").startswith("pod/web-")
    emu.wait_for(lambda: "hello" in run("logs", "deploy/web"), timeout=30,
                 message="the pod's log through kubectl")
    described = run("describe", "deployment", "web")
    assert "NewReplicaSetAvailable" in described and "1 available" in described
    assert run("delete", "-f", str(manifest)).startswith('deployment.apps "web" deleted')
    emu.wait_for(lambda: not emu.list("pods", NS, label_selector="app=web"), timeout=30,
                 message="the Deployment's pods to go")
