"""The images `./dev images` built, run: the hub image initialises JupyterHub under z2jh's config
shape and serves behind configurable-http-proxy, the agent image installs its shim that caps a
container of the kernel image, the kernel image runs the launcher's kernel command. Each image
carries only what it needs. In the Kubernetes emulator, pods of the built images run from the
images' own filesystems (tests/kubeemu/images.py from_engine, each image unpacked once for the
run: the ``unpacked`` fixture): a pod of the agent image here; the z2jh-shaped hub Deployment of
the hub image beside our chart installed by `helm install`, and the chart's node-agent DaemonSet
of the agent image on a GPU node with the CUDA/NVML doubles, in tests/helm/test_z2jh_e2e.py.

`./dev images` builds the images, then runs this file with ``ELASTIC_GPU_IMAGES`` naming them
(``hub=... agent=... kernel=...``) and ``DOCKER_HOST`` its engine. Without that variable (the main
suite) the file is skipped: the images are built by that step, in CI beside the suite.

Containers use the host's network (the engine runs without a bridge), so the agent reaches the
Kubernetes emulator and the test reaches the kernel's ports on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helm import tools
from tests.helm.images_stack import (
    IMAGES,
    SKIP_REASON,
    Z2JH_CONFIG,
    docker,
    free_port,
    shared_dir,
)

pytestmark = pytest.mark.skipif(not IMAGES, reason=SKIP_REASON)


def in_image(image: str, code: str, *run_args: str, timeout: float = 300) -> str:
    """``python -c code`` in a fresh container of ``image``; its stdout."""
    return docker("run", "--rm", "--network", "none", *run_args, image, "python", "-c", code,
                  timeout=timeout).stdout  # fmt: skip


MISSING = "import importlib.util, json; print(json.dumps({n: importlib.util.find_spec(n) is not None for n in %r}))"


# ---- what each image carries ------------------------------------------------------------------


def test_the_agent_image_runs_the_agent_without_jupyterhub_jupyterlab_or_the_spawner():
    """The agent image carried JupyterHub, JupyterLab, jupyter-server and KubeSpawner (+357 MB over
    its base) into a root, host-PID DaemonSet. The culler, which imports jupyterhub, runs from the
    hub image."""
    hub_lab_and_spawner = ["jupyterhub", "jupyterlab", "jupyter_server", "notebook", "ipykernel", "kubespawner"]
    found = json.loads(in_image(IMAGES["agent"], MISSING % (hub_lab_and_spawner,)))
    assert not any(found.values()), f"the agent image carries {[n for n, f in found.items() if f]}"
    out = in_image(IMAGES["agent"], "import libvgpu.agent.app, libvgpu; print(libvgpu.library_files()[0])")
    assert out.strip().endswith("libvgpu.so")


def test_the_hub_image_carries_jupyterhub_5_and_the_culler_but_no_jupyterlab_or_jupyter_server():
    found = json.loads(in_image(IMAGES["hub"], MISSING % (["jupyterlab", "jupyter_server", "notebook"],)))
    assert not any(found.values()), f"the hub image carries {[n for n, f in found.items() if f]}"
    assert in_image(IMAGES["hub"], "import jupyterhub; print(jupyterhub.__version__)").startswith("5.")
    # the chart's culler Deployment runs this image (culler.image)
    assert in_image(IMAGES["hub"], "import culler.app; print('ok')").strip() == "ok"


def test_the_notebook_image_serves_jupyterlab_with_our_extension_and_its_server_extension_loaded():
    """Issue 26: the JupyterLab extension must be "present in the notebook image" (z2jh's
    singleuser.image). What a user's server runs there: jupyterhub-singleuser, JupyterLab with
    @elastic-gpu/jupyterlab enabled, the server extension that relays the broker's state, and the
    GPU kernels' provisioner; nothing of the hub's or the agent's."""

    def jupyter(*args: str) -> str:
        proc = docker("run", "--rm", "--network", "none", IMAGES["notebook"], "jupyter", *args, timeout=300)
        return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # they list on stderr, in colour

    labextensions = jupyter("labextension", "list")
    line = next((x for x in labextensions.splitlines() if "@elastic-gpu/jupyterlab" in x), "")
    assert "enabled" in line and "OK" in line, labextensions
    server = jupyter("server", "extension", "list")
    assert re.search(r"kernelprovider\.labstatus\s+enabled", server), server
    assert re.search(r"kernelprovider\.labstatus\s+OK", server), server  # it imports and loads
    code = (
        "import importlib.metadata as m, shutil; "
        "print(sorted(e.name for e in m.entry_points(group='jupyter_client.kernel_provisioners')), "
        "bool(shutil.which('jupyterhub-singleuser')))"
    )
    out = in_image(IMAGES["notebook"], code)
    assert "'elastic-gpu-provisioner'" in out and out.strip().endswith("True"), out
    found = json.loads(in_image(IMAGES["notebook"], MISSING % (["kubespawner", "firstuseauthenticator", "pynvml"],)))
    assert not any(found.values()), f"the notebook image carries {[n for n, f in found.items() if f]}"
    uid = docker("run", "--rm", "--network", "none", IMAGES["notebook"], "id", "-u").stdout.strip()
    assert uid == "1000", uid  # z2jh's singleuser uid


def test_a_server_of_the_notebook_image_gets_the_gpu_kernelspecs_of_the_hubs_sizes(tmp_path):
    """Started by a hub (its API URL and the server's token in the environment, as KubeSpawner sets
    them), the image's entrypoint installs one kernelspec per size the hub's broker offers the user,
    then runs the command it was given (z2jh's singleuser.cmd)."""
    from tests.hubrunner import HubRunner
    from tests.kernelprovider.helpers import ADMISSION, SIZES, _broker_config

    (tmp_path / "admission.yaml").write_text(yaml.safe_dump(ADMISSION))
    config = f"""
from hubext.hubconfig import configure_hub
configure_hub(c, mode="local", admission_config_file={str(tmp_path / "admission.yaml")!r},
              simulate_gpus="1xH100-80GB", data_dir={str(tmp_path / "data")!r}, culler=False)
""" + _broker_config(SIZES)
    hub = HubRunner(tmp_path / "hub", config)
    hub.start()
    try:
        token = hub.user_token("alice")
        proc = docker("run", "--rm", "--network", "host", "-e", f"JUPYTERHUB_API_URL={hub.hub_api}",
                      "-e", f"JUPYTERHUB_API_TOKEN={token}", IMAGES["notebook"],
                      "jupyter", "kernelspec", "list", "--json")  # fmt: skip
    finally:
        hub.stop()
    out = proc.stdout
    specs = json.loads(out[out.index("{"):])["kernelspecs"]
    for size in SIZES:
        spec = specs.get(f"elastic-gpu-{size['name']}")
        assert spec, (size["name"], out, proc.stderr[-2000:])
        assert spec["spec"]["metadata"]["kernel_provisioner"]["provisioner_name"] == "elastic-gpu-provisioner", spec
        assert spec["resource_dir"].startswith("/home/jovyan/"), spec  # the user's own (--user)


def test_a_pod_of_the_agent_image_runs_the_images_contents_in_the_kubernetes_emulator(unpacked):
    """The emulator's kubelet runs a pod of an image this engine holds from that image's own
    filesystem (tests/kubeemu/images.py from_engine): the pod's python is the image's, which has
    our package and neither JupyterLab nor KubeSpawner (this test's own environment has both), and
    the in-cluster configuration the kubelet mounts works from inside the image."""
    from tests.kubeemu import KubeEmulator

    emu = KubeEmulator(namespaces=["jhub"])
    emu.start()
    try:
        emu.images[IMAGES["agent"]] = unpacked("agent")
        code = (MISSING % (["jupyterlab", "kubespawner", "libvgpu"],)) + INCLUSTER
        emu.create({"metadata": {"name": "probe"}, "spec": {"restartPolicy": "Never", "containers": [
            {"name": "main", "image": IMAGES["agent"], "command": ["python", "-c", code]}]}}, "pods", "jhub")
        pod = emu.wait_for_pod_phase("probe", ("Succeeded", "Failed"), "jhub", timeout=120)
        log = emu.pod_log("probe", "jhub")
        assert pod["status"]["phase"] == "Succeeded", log
        found_line, status = log.strip().splitlines()[-2:]
        assert json.loads(found_line) == {"jupyterlab": False, "kubespawner": False, "libvgpu": True}
        # the default service account may not list pods: the API server knew who asked
        assert status == "403", log
        import importlib.util

        assert importlib.util.find_spec("jupyterlab") is not None  # here, not in the pod
    finally:
        emu.stop()


INCLUSTER = """
import asyncio
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.rest import ApiException

async def main():
    config.load_incluster_config()  # the token, CA and KUBERNETES_SERVICE_HOST the kubelet gave
    async with client.ApiClient() as api:
        try:
            await client.CoreV1Api(api).list_namespaced_pod("jhub")
            print(200)
        except ApiException as e:
            print(e.status)

asyncio.run(main())
"""


# ---- the hub image: JupyterHub 5 initialised under z2jh's config shape ------------------------

HUB_PROBE = '''
import asyncio, json
import jupyterhub
from jupyterhub.app import JupyterHub
from jupyterhub import orm

async def main():
    app = JupyterHub.instance()
    await app.initialize(["--config", "/etc/z2jh/jupyterhub_config.py"])
    roles = {r.name: sorted(r.scopes) for r in app.db.query(orm.Role)}
    print(json.dumps({
        "version": jupyterhub.__version__,
        "spawner": f"{app.spawner_class.__module__}.{app.spawner_class.__name__}",
        "custom_scopes": sorted(app.custom_scopes),
        "roles": roles,
        "services": sorted(s.name for s in app.db.query(orm.Service)),
    }))

asyncio.run(main())
'''


def test_the_hub_image_initialises_jupyterhub_with_z2jh_config_and_our_extension(tmp_path):
    """helm/examples-z2jh/values.yaml's hub.extraConfig and hub.services, run as z2jh's
    jupyterhub_config.py runs them, with the elastic-gpu chart's admission ConfigMap mounted
    where the values say; JupyterHub initialises (database, roles, scopes, spawner)."""
    conf = shared_dir(tmp_path / "z2jh")
    shutil.copy(tools.Z2JH_EXAMPLES / "values.yaml", conf / "values.yaml")
    (conf / "jupyterhub_config.py").write_text(Z2JH_CONFIG)
    admission = shared_dir(tmp_path / "admission")
    z2jh_integration = tools.CHART / "examples" / "z2jh-integration.yaml"
    docs = tools.render([z2jh_integration], release="elastic-gpu")
    configmap = tools.one(docs, "ConfigMap", "elastic-gpu-admission")
    for name, text in configmap["data"].items():
        (admission / name).write_text(text)
    for f in [*conf.iterdir(), *admission.iterdir()]:
        f.chmod(0o644)
    out = in_image(IMAGES["hub"], HUB_PROBE, "-v", f"{conf}:/etc/z2jh:ro", "-v", f"{admission}:/etc/elastic-gpu:ro")
    hub = json.loads(out.strip().splitlines()[-1])
    assert hub["version"].startswith("5.")
    assert hub["spawner"] == "hubext.kubernetes.spawner.ElasticGPUSpawner"
    assert len(hub["custom_scopes"]) == 3 and all(s.startswith("custom:") for s in hub["custom_scopes"])
    assert "elastic-gpu-culler" in hub["services"]
    culler_roles = [name for name, scopes in hub["roles"].items() if any(s.startswith("custom:") for s in scopes)]
    assert culler_roles, f"no role grants the broker's scopes: {hub['roles']}"


def _z2jh_config_dirs(tmp_path: Path, extra: str = "") -> tuple[Path, Path]:
    """z2jh's config shape (+ ``extra`` lines) and our chart's admission ConfigMap, as files."""
    conf = shared_dir(tmp_path / "z2jh")
    shutil.copy(tools.Z2JH_EXAMPLES / "values.yaml", conf / "values.yaml")
    (conf / "jupyterhub_config.py").write_text(Z2JH_CONFIG + extra)
    admission = shared_dir(tmp_path / "admission")
    docs = tools.render([tools.CHART / "examples" / "z2jh-integration.yaml"], release="elastic-gpu")
    for name, text in tools.one(docs, "ConfigMap", "elastic-gpu-admission")["data"].items():
        (admission / name).write_text(text)
    for f in [*conf.iterdir(), *admission.iterdir()]:
        f.chmod(0o644)
    return conf, admission


def test_the_hub_image_starts_jupyterhub_and_serves_behind_the_proxy(tmp_path):
    """The hub image runs ``jupyterhub`` as z2jh's hub pod does (z2jh's config shape, the
    example's extension settings, the chart's admission config, a Kubernetes API to talk to), with
    configurable-http-proxy in front as z2jh's proxy pod: the hub starts, registers its routes, and
    /hub/health and the login page answer through the proxy. (Initialising only, as the test above
    does, never starts the spawner's pool, the broker's handlers or the proxy sync.)"""
    import urllib.error
    import urllib.request

    from tests.kubeemu import KubeEmulator

    hub_port, proxy_port, api_port = free_port(), free_port(), free_port()
    conf, admission = _z2jh_config_dirs(tmp_path, f"""
# what z2jh's Services give the hub pod, on this machine's network
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
""")
    chp = tools.REPO / "node_modules" / ".bin" / "configurable-http-proxy"
    emu = KubeEmulator(namespaces=["jhub"])
    emu.start()
    proxy = subprocess.Popen(
        [str(chp), "--ip", "127.0.0.1", "--port", str(proxy_port), "--api-ip", "127.0.0.1",
         "--api-port", str(api_port), "--default-target", f"http://127.0.0.1:{hub_port}",
         "--error-target", f"http://127.0.0.1:{hub_port}/hub/error"],
        env={**os.environ, "CONFIGPROXY_AUTH_TOKEN": "proxy-token"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    kube = shared_dir(tmp_path / "kube")
    shutil.copy(emu.env()["KUBECONFIG"], kube / "config")
    (kube / "config").chmod(0o644)
    name = f"hub-{uuid.uuid4().hex[:8]}"
    try:
        docker("run", "-d", "--name", name, "--network", "host", "-v", f"{conf}:/etc/z2jh:ro",
               "-v", f"{admission}:/etc/elastic-gpu:ro", "-v", f"{kube}:/etc/kube:ro",
               "-e", "KUBECONFIG=/etc/kube/config", "-e", "POD_NAMESPACE=jhub",
               IMAGES["hub"], "jupyterhub", "--config", "/etc/z2jh/jupyterhub_config.py")  # fmt: skip

        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{proxy_port}{path}", timeout=10) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode(errors="replace")
            except OSError as e:
                return 0, str(e)

        deadline = time.monotonic() + 180
        while True:
            running = docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() == "true"
            assert running, f"the hub exited:\n{docker('logs', name).stderr[-4000:]}"
            code, body = get("/hub/health")
            if code == 200:
                break
            assert time.monotonic() < deadline, (
                f"/hub/health answers {code} {body[:200]}:\n{docker('logs', name).stderr[-4000:]}")
            time.sleep(0.5)
        code, body = get("/hub/login")
        assert code == 200 and "<form" in body, body[:500]
        log = docker("logs", name).stderr
        assert "Traceback" not in log, log[-4000:]
    finally:
        docker("rm", "-f", name, check=False)
        proxy.terminate()
        proxy.wait(10)
        emu.stop()


# ---- the kernel image: the launcher's kernel command ------------------------------------------


def _kernel_pod(backend: str, ports: dict[str, int]) -> dict:
    """The kernel pod KubernetesKernelLauncher writes (its default kernel_cmd)."""
    import asyncio

    from kubernetes_asyncio.client import ApiClient

    from hubext.kernels import KernelRecord
    from hubext.kubernetes.launcher import KubernetesKernelLauncher
    from hubext.kubernetes.objects import make_kernel_pod

    kernel_cmd = KubernetesKernelLauncher._default_kernel_cmd(None)  # the trait's default
    record = KernelRecord(id=uuid.uuid4().hex, user="alice", server_name="", size="small", allocation_id="a-1",
                          namespace="jhub", ports=ports, resume_url="http://hub:8081/hub/api/gpu/kernels/x/resume")
    pod = make_kernel_pod(record, image=IMAGES["kernel"], image_pull_policy="IfNotPresent", kernel_cmd=kernel_cmd,
                          resume_hook=backend == "native")

    async def serialise() -> dict:
        async with ApiClient() as api:
            return api.sanitize_for_serialization(pod)

    return asyncio.run(serialise())


class KernelContainer:
    """The kernel's container, as ``wait_for_kernel`` polls a process."""

    def __init__(self, name: str) -> None:
        self.name, self.returncode = name, None

    def poll(self) -> int | None:
        if docker("inspect", "-f", "{{.State.Running}}", self.name).stdout.strip() != "true":
            self.returncode = docker("logs", self.name).stderr[-3000:]
            return 1
        return None


@pytest.mark.parametrize("backend", ["native", "whole"])
def test_the_kernel_image_runs_the_launchers_kernel_command(backend, tmp_path):
    """The kernel container of the pod the launcher writes, run from the kernel image with its
    connection Secret mounted: the kernel answers an execute request on its ports, and its log
    has no traceback (the resume hook is loaded only where the bootstrap installed it)."""
    from jupyter_client import BlockingKernelClient

    from tests.kernelprovider.test_units import wait_for_kernel

    ports = {name: free_port() for name in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")}
    key = uuid.uuid4().hex
    pod = _kernel_pod(backend, ports)
    [container] = pod["spec"]["containers"]
    secret = shared_dir(tmp_path / "secret")
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "connection"]
    from hubext.kubernetes.objects import SECRET_FILE

    (secret / SECRET_FILE).write_text(json.dumps({"key": key, "signature_scheme": "hmac-sha256",
                                                  "transport": "tcp", "kernel_name": "python3"}))
    (secret / SECRET_FILE).chmod(0o644)
    env = [f"{e['name']}={e.get('value', '')}" for e in container["env"] if "value" in e]
    name = f"kernel-{uuid.uuid4().hex[:8]}"
    sc = container.get("securityContext") or {}
    user = str(sc.get("runAsUser") or pod["spec"].get("securityContext", {}).get("runAsUser") or 1000)
    docker("run", "-d", "--name", name, "--network", "host", "--user", user,
           "-e", "POD_IP=127.0.0.1", *[a for e in env for a in ("-e", e)],
           "-v", f"{secret}:{mount['mountPath']}:ro", "--entrypoint", container["command"][0],
           IMAGES["kernel"], *container["command"][1:])  # fmt: skip
    try:
        client = BlockingKernelClient()
        client.load_connection_info({**ports, "ip": "127.0.0.1", "key": key, "transport": "tcp",
                                     "signature_scheme": "hmac-sha256"})
        client.start_channels()
        try:
            wait_for_kernel(client, KernelContainer(name))
            reply = client.execute_interactive("print(6 * 7)", timeout=60, output_hook=lambda m: None)
            assert reply["content"]["status"] == "ok"
        finally:
            client.stop_channels()
        logs = docker("logs", name).stderr + docker("logs", name).stdout
        assert "Traceback" not in logs and "ModuleNotFoundError" not in logs, logs
    finally:
        docker("rm", "-f", name, check=False)


# ---- the agent image enforces a slice in a container of the kernel image ----------------------


@pytest.fixture
def gpu_node(tmp_path_factory) -> Iterator[dict]:
    """The NVML/CUDA doubles (built by the tests' harness), a Kubernetes emulator with one GPU
    node, and the agent image's agent running against both with the chart's flags."""
    from libvgpu import contract as L
    from tests.kubeemu import KubeEmulator, NodeSpec
    from tests.libvgpu.agent.test_agent import NODE, add_default_priority_class, build_doubles

    root = shared_dir(tmp_path_factory.mktemp("gpu-node"))
    build = build_doubles(root / "build")
    doubles = shared_dir(root / "doubles")  # what the NVIDIA runtime would mount: driver libraries
    for f in [*build.lib_dir.iterdir(), build.probe]:
        shutil.copy2(f, doubles / f.name)
    state = shared_dir(root / "gpu")  # the "device": one state every process shares
    (state / "gpu.state").touch(0o666)  # as /dev/nvidia* is to every container user
    (state / "gpu.state").chmod(0o666)
    host = root / "host"  # the agent's hostPath
    driver_env = {
        "LD_LIBRARY_PATH": "/opt/driver",
        "CUDA_DOUBLE_STATE": "/run/gpu/gpu.state",
        "CUDA_DOUBLE_DEVICES": "1",
        "CUDA_DOUBLE_MEMORY_MIB": "81559",
        "CUDA_DOUBLE_NAME": "NVIDIA H100 80GB HBM3",
        "CUDA_DOUBLE_CONTEXT_MIB": "0",  # no context overhead: the slice is all the program's
    }
    emu = KubeEmulator(nodes=[NodeSpec(NODE, labels={"nvidia.com/gpu.present": "true"})], namespaces=["jhub"])
    emu.start()
    add_default_priority_class(emu)
    kubeconfig = shared_dir(root / "kube") / "config"
    shutil.copy(emu.env()["KUBECONFIG"], kubeconfig)
    kubeconfig.chmod(0o644)
    name = f"agent-{uuid.uuid4().hex[:8]}"
    mounts = ["-v", f"{doubles}:/opt/driver:ro", "-v", f"{state}:/run/gpu", "-v", f"{host}:/var/lib/elastic-gpu",
              "-v", f"{kubeconfig}:/etc/kube/config:ro"]  # fmt: skip
    try:
        # as the DaemonSet runs it: root, the node's name, the host directory (default path)
        docker("run", "-d", "--name", name, "--network", "host", "--user", "0", *mounts,
               *[a for k, v in {**driver_env, "KUBECONFIG": "/etc/kube/config", "NODE_NAME": NODE}.items()
                 for a in ("-e", f"{k}={v}")],
               IMAGES["agent"], "python", "-m", "libvgpu.agent", "--node-name", NODE,
               "--metrics-port", str(free_port()), "--host-lib-dir", "/var/lib/elastic-gpu")  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            annotations = emu.get("nodes", NODE)["metadata"].get("annotations", {})
            if L.NODE_GPUS_ANNOTATION in annotations and (host / "ld.so.preload").is_file():
                break
            state_ = docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip()
            assert state_ == "true", docker("logs", name).stderr[-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError(f"the agent published no inventory:\n{docker('logs', name).stderr[-3000:]}")
        yield {"root": root, "host": host, "doubles": doubles, "state": state, "env": driver_env,
               "annotations": annotations}
    finally:
        docker("rm", "-f", name, check=False)
        emu.stop()


def _run_gpu_pod(node: dict, tmp_path: Path, memory_mib: int, steps: list[str]) -> subprocess.CompletedProcess:
    """The GPU pod the spawner writes (apply_gpu_to_pod, native backend), run as containers of
    the kernel image: its init container (as its uid) fills the pod's emptyDir, then the pod's
    container runs with its downward-API limits file and its mounts of the agent's directory."""
    from tests.libvgpu.agent.test_agent import allocation, gpu_pod

    pod = gpu_pod(None, "kernel", allocation("a-1", "alice", memory_mib), ["/opt/driver/probe", *steps], {})
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}

    def mounts(container: dict) -> list[str]:
        args: list[str] = []
        for m in container["volumeMounts"]:
            vol = volumes[m["name"]]
            ro = ":ro" if m.get("readOnly") else ""
            if "downwardAPI" in vol:
                d = shared_dir(tmp_path / m["name"])
                for item in vol["downwardAPI"]["items"]:
                    key = item["fieldRef"]["fieldPath"].split("'")[1]
                    (d / item["path"]).write_text(pod["metadata"]["annotations"][key])
                    (d / item["path"]).chmod(0o444)
                args += ["-v", f"{d}:{m['mountPath']}{ro}"]
            elif "persistentVolumeClaim" in vol:  # the chart's claim of the agent's host directory
                args += ["-v", f"{node['host'] / m.get('subPath', '')}:{m['mountPath']}{ro}"]
            elif "emptyDir" in vol:  # the pod's own volume (world-writable, as the kubelet makes it)
                args += ["-v", f"{shared_dir(tmp_path / m['name']) / m.get('subPath', '')}:{m['mountPath']}{ro}"]
        return args

    for init in pod["spec"].get("initContainers") or []:
        uid = init["securityContext"]["runAsUser"]
        done = docker("run", "--rm", "--network", "none", "--user", f"{uid}:{init['securityContext']['runAsGroup']}",
                      *mounts(init), IMAGES["kernel"], *init["command"], check=False)  # fmt: skip
        assert done.returncode == 0, f"init container {init['name']}: {done.stdout}{done.stderr}"
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    return docker("run", "--rm", "--network", "none", "--user", "1000",
                  "-v", f"{node['doubles']}:/opt/driver:ro", "-v", f"{node['state']}:/run/gpu", *mounts(container),
                  *[a for k, v in {**node["env"], **env}.items() for a in ("-e", f"{k}={v}")],
                  IMAGES["kernel"], *container["command"], check=False)  # fmt: skip


def test_the_agent_images_shim_caps_a_kernel_image_container_at_its_slice(gpu_node, tmp_path):
    """The agent installed the shim of its image (built for glibc 2.17) on the host; a container
    of the kernel image with the pod's mounts gets 1 GiB: the first allocation fits, the second
    is refused with out-of-memory, and the device reports the slice as its total memory."""
    from tests.libvgpu.harness import Result

    assert gpu_node["host"].joinpath("lib", "libvgpu.so").is_file()
    proc = _run_gpu_pod(gpu_node, tmp_path, 1024, ["init", "ctx", "alloc:1G", "alloc:1", "info"])
    r = Result.parse(proc.returncode, proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r.rcs("alloc") == [0, 2], proc.stdout  # the second allocation is over the slice: out of memory
    assert int(r.one("info")["total"]) == 1024 << 20


def test_z2jh_values_and_the_images_agree_on_the_hub_and_notebook_images():
    """The hub and notebook images ./dev images built are the ones helm/examples-z2jh/values.yaml
    names (hub.image, singleuser.image; up to the registry)."""
    values = yaml.safe_load((tools.Z2JH_EXAMPLES / "values.yaml").read_text())
    for image, built in ((values["hub"]["image"], IMAGES["hub"]), (values["singleuser"]["image"], IMAGES["notebook"])):
        repository, tag = built.rsplit(":", 1)
        assert image["name"].rsplit("/", 1)[-1] == repository.rsplit("/", 1)[-1] and image["tag"] == tag, image
