"""What the tests of the built images share (tests/helm/test_images_run.py, test_z2jh_e2e.py): the
engine and the images `./dev images` names, a GPU node of the CUDA/NVML doubles in the Kubernetes
emulator, `helm install` of our chart into it, and the z2jh-shaped hub (its ServiceAccount with
z2jh's Role, its config as a ConfigMap, its Service, its Deployment of the hub image).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from tests.helm import tools

IMAGES = dict(kv.split("=", 1) for kv in os.environ.get("ELASTIC_GPU_IMAGES", "").split() if "=" in kv)
DOCKER = os.environ.get("ELASTIC_GPU_DOCKER", "docker")
SKIP_REASON = "run by `./dev images` after it built the images (ELASTIC_GPU_IMAGES names them)"

#: the double's one H100, as the NVIDIA runtime would give it to a pod
H100 = {"CUDA_DOUBLE_DEVICES": "1", "CUDA_DOUBLE_MEMORY_MIB": "81559", "CUDA_DOUBLE_NAME": "NVIDIA H100 80GB HBM3"}


def docker(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:6])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_dir(path: Path) -> Path:
    """A directory every container user (the kernel's uid 1000 too) can use."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


def gpu_node_driver(root: Path, **double: str) -> dict[str, str]:
    """The CUDA/NVML doubles built under ``root`` (a directory every pod sees: mount it with the
    emulator's ``node_mounts``) and the driver's environment the NVIDIA runtime gives a pod."""
    from tests.libvgpu.agent.test_agent import build_doubles

    build = build_doubles(shared_dir(root) / "build")
    (root / "gpu.state").touch(0o666)
    (root / "gpu.state").chmod(0o666)
    return {"LD_LIBRARY_PATH": str(build.lib_dir), "CUDA_DOUBLE_STATE": str(root / "gpu.state"), **H100, **double}


def add_nvidia_runtime_class(emu: Any) -> None:
    """The NVIDIA GPU operator's RuntimeClass, which GPU pods name."""
    emu.create({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                "handler": "nvidia"}, "runtimeclasses", None, group="node.k8s.io")  # fmt: skip


def helm_chart(emu: Any, action: str, namespace: str, *sets: str, release: str = "elastic-gpu") -> None:
    """``helm install|upgrade`` of our chart with the documented z2jh values (+ ``--set``s)."""
    proc = tools.helm(action, release, str(tools.CHART), "-n", namespace, "--kubeconfig", emu.tls_kubeconfig_path,
                      "-f", str(tools.CHART / "examples" / "z2jh-integration.yaml"),
                      *[a for s in sets for a in ("--set", s)], timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def image_sets(image: str) -> list[str]:
    """The chart's ``--set``s naming ``image`` (repository:tag) as its image."""
    repository, tag = image.rsplit(":", 1)
    return [f"image.repository={repository}", f"image.tag={tag}"]


# ---- the z2jh-shaped hub ----------------------------------------------------------------------

Z2JH_CONFIG = '''
# the shape of z2jh's jupyterhub_config.py: what the chart sets, then hub.services, then
# hub.extraConfig's snippets in key order
import yaml
values = yaml.safe_load(open("/etc/z2jh/values.yaml"))
c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
c.JupyterHub.authenticator_class = "dummy"
c.JupyterHub.db_url = "sqlite:////tmp/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "/tmp/cookie_secret"
c.JupyterHub.hub_bind_url = "http://:8081"
c.ConfigurableHTTPProxy.should_start = False
c.ConfigurableHTTPProxy.api_url = "http://proxy-api:8001"
c.ConfigurableHTTPProxy.auth_token = "proxy-token"
c.JupyterHub.services = [
    {"name": name, "api_token": "token-" + name, **(svc or {})}
    for name, svc in sorted(values["hub"].get("services", {}).items())
]
for key in sorted(values["hub"]["extraConfig"]):
    exec(compile(values["hub"]["extraConfig"][key], "hub.extraConfig." + key, "exec"))
'''

# z2jh 4.x's hub Role (templates/hub/rbac.yaml)
Z2JH_HUB_RULES = [
    {"apiGroups": [""], "resources": ["pods", "persistentvolumeclaims", "secrets", "services"],
     "verbs": ["get", "watch", "list", "create", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "watch", "list"]},
]

HUB_LABELS = {"app": "jupyterhub", "component": "hub"}


def z2jh_hub(namespace: str, config: str, values: str, image: str = "") -> list[dict]:
    """z2jh's hub objects: the `hub` ServiceAccount, Role and RoleBinding, the `hub` ConfigMap
    (``config`` as jupyterhub_config.py by subPath, ``values`` as the chart's values), our
    admission ConfigMap mounted at /etc/elastic-gpu, the `hub` Service, and the `hub` Deployment
    of the hub image (``image``, default the one `./dev images` built on z2jh's JupyterHub; POD_NAMESPACE
    from the downward API, readiness on /hub/health)."""
    rbac = "rbac.authorization.k8s.io/v1"
    container = {
        "name": "hub", "image": image or IMAGES["hub"],
        "args": ["jupyterhub", "--config", "/usr/local/etc/jupyterhub/jupyterhub_config.py"],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "volumeMounts": [
            {"name": "config", "mountPath": "/usr/local/etc/jupyterhub/jupyterhub_config.py",
             "subPath": "jupyterhub_config.py"},
            {"name": "config", "mountPath": "/etc/z2jh/values.yaml", "subPath": "values.yaml"},
            {"name": "admission", "mountPath": "/etc/elastic-gpu"}],
        "ports": [{"name": "http", "containerPort": 8081}],
        "readinessProbe": {"httpGet": {"path": "/hub/health", "port": "http"}, "periodSeconds": 2},
    }
    meta = {"namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "hub", **meta}},
        {"apiVersion": rbac, "kind": "Role", "metadata": {"name": "hub", **meta}, "rules": Z2JH_HUB_RULES},
        {"apiVersion": rbac, "kind": "RoleBinding", "metadata": {"name": "hub", **meta},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "hub"},
         "subjects": [{"kind": "ServiceAccount", "name": "hub", "namespace": namespace}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "hub", **meta},
         "data": {"jupyterhub_config.py": config, "values.yaml": values}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "hub", **meta},
         "spec": {"selector": HUB_LABELS, "ports": [{"name": "hub", "port": 8081, "targetPort": 8081}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "hub", "labels": HUB_LABELS, **meta},
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"},  # z2jh's: one hub at a time
                  "selector": {"matchLabels": HUB_LABELS}, "template": {
             "metadata": {"labels": HUB_LABELS},
             "spec": {"serviceAccountName": "hub", "containers": [container], "volumes": [
                 {"name": "config", "configMap": {"name": "hub"}},
                 {"name": "admission", "configMap": {"name": "elastic-gpu-admission"}}]}}}},
    ]


def ready_pod(emu: Any, namespace: str, selector: str, timeout: float = 240, exclude: tuple[str, ...] = ()) -> dict:
    """The first Ready pod of ``selector`` (not one named in ``exclude``); on a timeout, or a pod
    that ended, the logs of the namespace's pods."""

    def ready() -> dict | None:
        for pod in emu.list("pods", namespace, label_selector=selector):
            if pod["metadata"]["name"] in exclude or pod["metadata"].get("deletionTimestamp"):
                continue
            conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
            if conditions.get("Ready") == "True":
                return pod
            if pod.get("status", {}).get("phase") in ("Failed", "Succeeded"):
                raise AssertionError(emu.pod_log(pod["metadata"]["name"], namespace)[-4000:])
        return None

    try:
        return emu.wait_for(ready, timeout=timeout, interval=0.2, message=f"a Ready pod of {selector}")
    except TimeoutError:
        logs = [f"{p['metadata']['name']}: {json.dumps(p.get('status', {}).get('containerStatuses'))}\n"
                f"{emu.pod_log(p['metadata']['name'], namespace)[-4000:]}" for p in emu.list("pods", namespace)]
        raise AssertionError("\n".join(logs)) from None
