"""Test helpers: a user's jupyter-server through the hub's proxy, and a browser-like kernel connection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import websocket
import yaml

from libvgpu import contract as L
from tests.hubrunner import HubRunner
from tests.hubrunner import http as hub_http

#: what a notebook's first cell does on a GPU: the driver, a context, 1 GiB of device memory
CUDA_CELL = """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
print("alloc", cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 30)))
"""

ADMISSION = {
    "priority_classes": {
        "high": {"value": 1000, "preempt": True, "borrow": False},
        "default": {"value": 100, "preempt": False, "borrow": False},
    },
    "default_priority_class": "default",
    "placement": {"node": "binpack", "gpu": "binpack"},
    "workspaces": {
        "default": {
            "namespaces": {
                # each user may hold 16 GiB: one 10 GiB kernel fits, a second does not
                "default": {"user_limits": {"memory_mib": 16384}},
            }
        }
    },
}

SIZES = [
    {"name": "gpu-10g", "display_name": "GPU 10 GiB", "memory_mib": 10240, "cores_percent": 25},
    {"name": "gpu-4g", "display_name": "GPU 4 GiB", "memory_mib": 4096, "cores_percent": 10},
]


def http(method: str, url: str, token: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
    return hub_http(method, url, token, body, timeout)


def start_server(hub: HubRunner, user: str, token: str, timeout: float = 90) -> None:
    status, body = hub.api("POST", f"/users/{user}/server")
    assert status in (201, 202, 400), (status, body)  # 400: already running

    def ready() -> bool:
        _, model = hub.api("GET", f"/users/{user}")
        server = (model.get("servers") or {}).get("")
        return bool(server and server.get("ready"))

    hub.wait_for(ready, timeout=timeout, what=f"{user}'s server to be ready")


def install_kernelspecs(hub: HubRunner, token: str, prefix: Path) -> str:
    """Run the real `python -m kernelprovider install-kernelspecs` against the hub; return its output."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kernelprovider",
            "install-kernelspecs",
            "--hub-url",
            hub.url,
            "--token",
            token,
            "--prefix",
            str(prefix),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def start_servers(hub: HubRunner, prefix: Path, users: tuple[str, ...] = ("alice", "bob")) -> dict[str, Server]:
    """The GPU kernelspecs installed under ``prefix`` and ``users``' servers running; their Servers."""
    tokens = {name: hub.user_token(name) for name in users}
    install_kernelspecs(hub, tokens[users[0]], prefix)
    # the servers start together, as users' do (the hub answers a start request only when the
    # server is up or after its slow_spawn_timeout, 10 s: the requests go out side by side)
    with ThreadPoolExecutor(len(users)) as pool:
        list(pool.map(lambda name: start_server(hub, name, tokens[name]), users))
    return {name: Server(hub, name, token) for name, token in tokens.items()}


class Server:
    """A user's single-user server, reached through the proxy with the user's token."""

    def __init__(self, hub: HubRunner, user: str, token: str) -> None:
        self.hub, self.user, self.token = hub, user, token
        self.base = f"{hub.url}/user/{user}"

    def api(self, method: str, path: str, body: Any = None, timeout: float = 90) -> tuple[int, Any]:
        return http(method, self.base + "/api" + path, self.token, body, timeout)

    def start_session(self, kernel_name: str, path: str | None = None) -> tuple[int, Any]:
        return self.api(
            "POST",
            "/sessions",
            {"path": path or f"{uuid.uuid4().hex[:8]}.ipynb", "type": "notebook", "kernel": {"name": kernel_name}},
        )

    def connect(self, kernel_id: str) -> KernelConnection:
        return KernelConnection(self, kernel_id)


class KernelConnection:
    """What JupyterLab does with a kernel: a websocket on its channels (Jupyter's JSON protocol)."""

    def __init__(self, server: Server, kernel_id: str) -> None:
        self.kernel_id = kernel_id
        self.session = uuid.uuid4().hex
        url = server.base.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels?session_id={self.session}"
        self.ws = websocket.create_connection(url, header=[f"Authorization: token {server.token}"], timeout=30)

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass

    def _send(self, channel: str, msg_type: str, content: dict) -> str:
        msg_id = uuid.uuid4().hex
        self.ws.send(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "msg_type": msg_type,
                        "session": self.session,
                        "username": "test",
                        "version": "5.3",
                        "date": "",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "content": content,
                    "channel": channel,
                    "buffers": [],
                }
            )
        )
        return msg_id

    def execute_async(self, code: str) -> str:
        return self._send(
            "shell",
            "execute_request",
            {"code": code, "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False},
        )

    def collect(self, msg_id: str, timeout: float = 60, until: str = "") -> dict[str, Any]:
        """Outputs of a request until its execute_reply and idle status: {status, text, ename};
        with ``until``, only until its output holds that text (the rest is left to a later call)."""
        deadline = time.monotonic() + timeout
        out: dict[str, Any] = {"status": None, "text": "", "ename": None}
        idle = False
        while time.monotonic() < deadline and not (out["status"] and idle) and not (until and until in out["text"]):
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                msg = json.loads(self.ws.recv())
            except websocket.WebSocketTimeoutException:
                break
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out["text"] += content["text"]
            elif kind in ("execute_result", "display_data"):
                out["text"] += content["data"].get("text/plain", "")
            elif kind == "error":
                out["ename"] = content["ename"]
            elif kind == "execute_reply":
                out["status"] = content["status"]
                out["ename"] = out["ename"] or content.get("ename")
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        return out

    def execute(self, code: str, timeout: float = 60) -> dict[str, Any]:
        return self.collect(self.execute_async(code), timeout)

    def wait_for_output(self, msg_id: str, needle: str, timeout: float = 30) -> bool:
        """Read messages until a stream output of ``msg_id`` contains ``needle``."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                msg = json.loads(self.ws.recv())
            except websocket.WebSocketTimeoutException:
                return False
            if msg.get("parent_header", {}).get("msg_id") == msg_id and msg["msg_type"] == "stream":
                text += msg["content"]["text"]
                if needle in text:
                    return True
        return False


# ---- the two stacks (shared by the tests and bench/kernel_start.py) ------------------------------

GPU_UUID = "GPU-aaaaaaaa-2222-3333-4444-555555555555"
NODE = "gpu-node-1"
NAMESPACE = "jhub"


def _broker_config(sizes: list[dict[str, Any]] | None = None) -> str:
    return f"""
from hubext.broker import grant_user_scopes, start_with_hub
grant_user_scopes(c)
start_with_hub()
c.JupyterHub.cleanup_servers = False
c.Spawner.default_url = "/tree"
c.GPUBroker.kernel_sizes = {sizes or SIZES!r}
c.GPUBroker.reconcile_interval_seconds = 1
"""


@contextmanager
def local_stack(
    work: Path,
    users: tuple[str, ...] = ("alice", "bob"),
    *,
    admission: dict[str, Any] | None = None,
    sizes: list[dict[str, Any]] | None = None,
    extra_config: str = "",
) -> Iterator[dict[str, Any]]:
    """Single-machine mode: a hub with the broker (one simulated H100), alice's server running.

    ``admission``, ``sizes`` and ``extra_config`` (lines appended to jupyterhub_config.py)
    replace the defaults (ADMISSION, SIZES) for tests that need another situation.
    """
    (work / "admission.yaml").write_text(yaml.safe_dump(admission or ADMISSION))
    prefix = work / "jupyter-prefix"
    config = (
        textwrap.dedent(
            f"""
        from hubext.hubconfig import configure_hub
        configure_hub(c, mode="local", admission_config_file={str(work / "admission.yaml")!r},
                      simulate_gpus="1xH100-80GB", data_dir={str(work / "data")!r}, culler=False)
        c.JupyterHub.spawner_class = "hubext.local.spawner.HubUserGPUSpawner"
        c.HubUserGPUSpawner.home_dir_template = {str(work / "home" / "{username}")!r}
        c.Spawner.environment = {{"JUPYTER_PATH": {str(prefix / "share" / "jupyter")!r}}}
        """
        )
        + _broker_config(sizes)
        + extra_config
    )
    hub = HubRunner(work, config)
    try:
        hub.start()
        tokens = {name: hub.user_token(name) for name in users}
        installed = install_kernelspecs(hub, tokens["alice"], prefix)
        start_server(hub, "alice", tokens["alice"])
        yield {
            "hub": hub,
            "tokens": tokens,
            "installed": installed,
            "prefix": prefix,
            "alice": Server(hub, "alice", tokens["alice"]),
        }
    finally:
        hub.stop()


def machine_mib() -> int:
    """This machine's memory (the share of it swapped-out kernels may hold is set from it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)


@contextmanager
def doubles_stack(
    work: Path,
    *,
    devices: int,
    memory_mib: int,
    admission: dict[str, Any],
    sizes: list[dict[str, Any]],
    extra_config: str = "",
    gpu_servers: bool = False,
) -> Iterator[tuple[HubRunner, dict]]:
    """Single-machine mode on the CUDA/NVML doubles as the machine's driver (the pool is read
    through NVML; GPU kernels run with the compiled shim preloaded): a hub with the broker and
    the servers of alice and bob. ``extra_config``: lines appended to jupyterhub_config.py;
    ``gpu_servers``: servers (of a GPU profile) find the doubles as kernels do."""
    from tests.libvgpu.harness import build_doubles

    lib_dir = build_doubles(work / "build" / "lib")  # the kernels preload the installed shim
    double = {
        "CUDA_DOUBLE_STATE": str(work / "gpu.state"),
        "CUDA_DOUBLE_DEVICES": str(devices),
        "CUDA_DOUBLE_NAME": "NVIDIA H100 80GB HBM3",  # one model: a resume may move between cards
        "CUDA_DOUBLE_MEMORY_MIB": str(memory_mib),
        "CUDA_DOUBLE_CONTEXT_MIB": "0",
    }
    state = work / "gpu.state"  # the cards, shared by the hub and the kernels (another account)
    state.touch()
    state.chmod(0o666)
    (work / "admission.yaml").write_text(yaml.safe_dump(admission))
    prefix = work / "jupyter-prefix"
    server_env = {"LD_LIBRARY_PATH": str(lib_dir), **double} if gpu_servers else {}
    config = f"""
from hubext.hubconfig import configure_hub
configure_hub(c, mode="local", admission_config_file={str(work / "admission.yaml")!r},
              data_dir={str(work / "data")!r}, culler=False)
c.JupyterHub.spawner_class = "hubext.local.spawner.HubUserGPUSpawner"
c.HubUserGPUSpawner.home_dir_template = {str(work / "home" / "{username}")!r}
c.Spawner.environment = {{"JUPYTER_PATH": {str(prefix / "share" / "jupyter")!r}, **{server_env!r}}}
c.LocalKernelLauncher.environment = {double!r}
""" + extra_config + _broker_config(sizes)
    hub = HubRunner(work, config, env={"LD_LIBRARY_PATH": str(lib_dir), **double})
    try:
        hub.start()
        yield hub, start_servers(hub, prefix)
    finally:
        hub.stop()


@contextmanager
def kube_stack(
    work: Path,
    *,
    admission: dict[str, Any] | None = None,
    sizes: list[dict[str, Any]] | None = None,
    extra_config: str = "",
    emulator_options: dict[str, Any] | None = None,
    gpus: list[dict[str, Any]] | None = None,
) -> Iterator[dict[str, Any]]:
    """Kubernetes mode through the API emulator: one simulated H100 on gpu-node-1, alice's server pod running.

    ``admission`` and ``sizes`` replace the defaults (ADMISSION, SIZES); ``extra_config``: lines
    appended to jupyterhub_config.py; ``emulator_options``: more KubeEmulator arguments (pod_env,
    node_mounts); ``gpus``: the node's cards as its agent publishes them (default: one H100)."""
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    from tests.kubeemu import KubeEmulator
    from tests.kubeemu.helpers import create_host_claim

    gpus = gpus or [{"uuid": GPU_UUID, "model": "H100-80GB", "memory_mib": 81920, "sm_count": 132, "index": 0}]
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
        **(emulator_options or {}),
    )
    emulator.start()
    hub = None
    try:
        # what the Helm chart and the node agent install
        emulator.create(
            {
                "apiVersion": "node.k8s.io/v1",
                "kind": "RuntimeClass",
                "metadata": {"name": "nvidia"},
                "handler": "nvidia",
            }
        )
        for name, value in (("high", 1000), ("default", 100)):
            emulator.create(
                {
                    "apiVersion": "scheduling.k8s.io/v1",
                    "kind": "PriorityClass",
                    "metadata": {"name": f"elastic-gpu-{name}"},
                    "value": value,
                }
            )
        host_dir = work / "host-elastic-gpu"
        (host_dir / "lib").mkdir(parents=True, exist_ok=True)
        (host_dir / "ld.so.preload").write_text("")
        create_host_claim(emulator, NAMESPACE, host_dir)  # the chart's claim of the agent's directory
        (work / "admission.yaml").write_text(yaml.safe_dump(admission or ADMISSION))
        prefix = work / "jupyter-prefix"
        (prefix / "share" / "jupyter").mkdir(parents=True, exist_ok=True)
        singleuser = Path(sys.executable).parent / "jupyterhub-singleuser"
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
            # the server pod runs as the image's user (jovyan): the kernelspecs reach it as a
            # volume, as they would from a node or a PVC (the host path itself is not its to read)
            c.KubeSpawner.volumes = [
                {{"name": "kernelspecs", "hostPath": {{"path": {str(prefix / "share" / "jupyter")!r}}}}}
            ]
            c.KubeSpawner.volume_mounts = [
                {{"name": "kernelspecs", "mountPath": "/opt/jupyter-kernelspecs", "readOnly": True}}
            ]
            c.KubeSpawner.environment = {{
                "POD_IP": {{"valueFrom": {{"fieldRef": {{"fieldPath": "status.podIP"}}}}}},
                "JUPYTER_PATH": "/opt/jupyter-kernelspecs",
            }}
            c.KubeSpawner.start_timeout = 90
            c.KubeSpawner.http_timeout = 60
            # the emulator serves no NetworkPolicy API (the policy object is checked in test_launcher_objects)
            c.KubernetesKernelLauncher.network_policy = False
            c.KubernetesKernelLauncher.image = "quay.io/jupyter/pytorch-notebook:emulated"
            """
            )
            + _broker_config(sizes)
            + extra_config
        )
        hub = HubRunner(work, config, env={"KUBECONFIG": str(emulator.kubeconfig_path)})
        hub.start()
        kconfig.load_kube_config(config_file=str(emulator.kubeconfig_path))
        token = hub.user_token("alice")
        install_kernelspecs(hub, token, prefix)
        start_server(hub, "alice", token)
        yield {"hub": hub, "emulator": emulator, "api": kclient.CoreV1Api(), "alice": Server(hub, "alice", token)}
    finally:
        if hub is not None:
            hub.stop()
        emulator.stop()
