"""The end-to-end test a platform team would recognise: our chart and a z2jh-shaped hub in the
Kubernetes emulator, every part from the images `./dev images` built.

`helm install` of our chart (the documented z2jh values, the agent image) into the emulator with
one GPU node (the CUDA/NVML doubles as its driver), beside z2jh's hub Deployment of the hub image
(its ServiceAccount and Role, its Service) and z2jh's proxy (configurable-http-proxy; its image is
not built here: the emulator runs it from this machine's node_modules). The node agent's
DaemonSet pod runs the agent image and installs the shim on the node; alice logs in through the
proxy's login form, spawns the example's fractional notebook profile (10 GiB of an H100): her server
runs the notebook image (z2jh's singleuser.image), whose entrypoint installs the GPU kernelspecs of
the hub's sizes; she starts a GPU kernel from it; the kernel's pod runs the kernel image, and the
shim in it holds the kernel's memory limit. `helm upgrade` rolls the hub (a new pod of the new template), `helm
uninstall` leaves nothing of ours behind.

Run by `./dev images` (skipped elsewhere, as test_images_run.py). It prints the emulator's own
share of each pod's start (tests/kubeemu/podstart.py says what counts): create call -> the
container's process (``create_to_process_s``; an init container's own run apart,
``init_program_s``), and Running -> Ready.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.helm import images_stack as stack
from tests.helm import tools

pytestmark = pytest.mark.skipif(not stack.IMAGES, reason=stack.SKIP_REASON)

NS = "jhub"
NODE = "gpu-1"
CHP_IMAGE = "quay.io/jupyterhub/configurable-http-proxy:4.6.3"
PROXY_LABELS = {"app": "jupyterhub", "component": "proxy"}

#: the kernel's cell: 4 GiB fits its 5 GiB slice, 2 GiB more does not; the card reads as the slice
KERNEL_CELL = """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
ctx, ptr, free, total = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_size_t()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
first = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4 << 30))
second = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(2 << 30))
cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
print("RESULT", first, second, total.value >> 20)
"""


def hub_config() -> str:
    """z2jh's config shape, with what z2jh's chart sets from its values (hub_connect_url, the
    profiles, the users' service account, singleuser.image and singleuser.cmd) and the kernel
    image of this run."""
    return stack.Z2JH_CONFIG + f"""
c.JupyterHub.hub_connect_url = "http://hub:8081"
c.KubeSpawner.profile_list = values["singleuser"]["profileList"]
c.KubeSpawner.service_account = values["singleuser"]["serviceAccountName"]
c.KubeSpawner.image = "{{name}}:{{tag}}".format(**values["singleuser"]["image"])
c.KubeSpawner.cmd = values["singleuser"].get("cmd", "jupyterhub-singleuser")
c.KubeSpawner.ip = "$(POD_IP)"
c.KubeSpawner.environment = {{"POD_IP": {{"valueFrom": {{"fieldRef": {{"fieldPath": "status.podIP"}}}}}}}}
c.KubeSpawner.start_timeout = 120
c.KubernetesKernelLauncher.image = {stack.IMAGES["kernel"]!r}
c.KubernetesKernelLauncher.image_pull_policy = "IfNotPresent"
"""


def z2jh_proxy(emu: Any) -> None:
    """z2jh's proxy: its Deployment (configurable-http-proxy, the hub as default target) and its
    `proxy-api` and `proxy-public` Services."""
    chp = tools.REPO / "node_modules" / ".bin" / "configurable-http-proxy"
    for name, port in (("proxy-api", 8001), ("proxy-public", 8000)):
        emu.create({"metadata": {"name": name}, "spec": {"selector": PROXY_LABELS, "ports": [
            {"port": port, "targetPort": port}]}}, "services", NS)
    container = {
        "name": "chp", "image": CHP_IMAGE,
        "command": [str(chp), "--ip=", "--api-ip=", "--api-port=8001", "--default-target=http://hub:8081",
                    "--error-target=http://hub:8081/hub/error", "--port=8000"],
        "env": [{"name": "CONFIGPROXY_AUTH_TOKEN", "value": "proxy-token"}],
        "ports": [{"name": "http", "containerPort": 8000}, {"name": "api", "containerPort": 8001}],
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 2},
    }
    emu.create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "proxy", "labels": PROXY_LABELS},
                "spec": {"replicas": 1, "selector": {"matchLabels": PROXY_LABELS}, "template": {
                    "metadata": {"labels": PROXY_LABELS}, "spec": {"containers": [container]}}}},
               "deployments", NS, group="apps")


def z2jh_chart(dest: Path, config: str, image: str) -> Path:
    """A chart of z2jh's hub objects (stack.z2jh_hub): its `hub` ConfigMap holds jupyterhub_config.py and
    the release's values, and the hub's pod template carries the ConfigMap's checksum, as z2jh's
    does, so that a `helm upgrade` with other values rolls the hub."""
    chart = dest / "jupyterhub"
    (chart / "templates").mkdir(parents=True)
    (chart / "files").mkdir()
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: jupyterhub\nversion: 4.3.3\nappVersion: 5.4.4\n")
    (chart / "files" / "jupyterhub_config.py").write_text(config)
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: hub\ndata:\n"
        '  jupyterhub_config.py: |\n{{ .Files.Get "files/jupyterhub_config.py" | indent 4 }}\n'
        "  values.yaml: |\n{{ toYaml .Values | indent 4 }}\n")
    objects = []
    for m in stack.z2jh_hub(NS, "", "", image):
        if m["kind"] == "ConfigMap":
            continue
        m["metadata"].pop("namespace")
        if m["kind"] == "Deployment":
            m["spec"]["template"]["metadata"]["annotations"] = {"checksum/config-map": "CHECKSUM"}
        objects.append(yaml.safe_dump(m, sort_keys=False))
    (chart / "templates" / "hub.yaml").write_text("---\n".join(objects).replace(
        "CHECKSUM", '{{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}'))
    return chart


class Browser:
    """A user's browser at the proxy's public address: cookies, the login form, JSON calls."""

    def __init__(self, url: str) -> None:
        self.url, self.jar = url, CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def xsrf(self) -> str:
        return [c.value for c in self.jar if c.name == "_xsrf"][-1]

    def login(self, name: str) -> str:
        self.opener.open(self.url + "/hub/login", timeout=30).read()
        form = urllib.parse.urlencode({"username": name, "password": "any", "_xsrf": self.xsrf()}).encode()
        with self.opener.open(urllib.request.Request(self.url + "/hub/login?next=/hub/home", data=form),
                              timeout=60) as r:  # fmt: skip
            return r.read().decode()

    def call(self, method: str, path: str, body: Any = None, timeout: float = 120) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, method=method,
                                     data=None if body is None else json.dumps(body).encode())  # fmt: skip
        if any(c.name == "_xsrf" for c in self.jar):
            req.add_header("X-XSRFToken", self.xsrf())
        req.add_header("Content-Type", "application/json")
        try:
            with self.opener.open(req, timeout=timeout) as r:
                text = r.read().decode()
                return r.status, json.loads(text) if text.strip().startswith(("{", "[")) else text
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")


#: the hub images `./dev images` built: on z2jh's JupyterHub (5) and on JupyterHub 6
HUBS = {name: major for name, major in (("hub", 5), ("hub-jupyterhub6", 6)) if name in stack.IMAGES}


@pytest.mark.parametrize("hub", sorted(HUBS))
def test_our_chart_and_a_z2jh_hub_from_the_built_images_serve_a_gpu_kernel_capped_by_the_shim(hub, tmp_path,
                                                                                              unpacked):
    from libvgpu import contract as L
    from tests.kernelprovider.helpers import KernelConnection, Server
    from tests.kubeemu import KubeEmulator, NodeSpec, podstart
    from tests.kubeemu.helpers import release_objects
    from tests.kubeemu.images import Image

    t0 = time.monotonic()
    root = stack.shared_dir(tmp_path / "gpu-node")
    driver_env = stack.gpu_node_driver(root, CONTEXT_MIB="0")
    emu = KubeEmulator(
        nodes=[NodeSpec(NODE, labels={"nvidia.com/gpu.present": "true", "kubernetes.io/hostname": NODE},
                        allocatable={"cpu": "64", "memory": "512Gi"})],
        namespaces=[NS], pod_env=driver_env, node_mounts=[str(root)], restart_backoff_seconds=1.0,
        images={CHP_IMAGE: Image(uid=65534, gid=65534)})  # fmt: skip
    emu.start()
    try:
        stack.add_nvidia_runtime_class(emu)
        for image in (hub, "agent", "kernel", "notebook"):
            emu.images[stack.IMAGES[image]] = unpacked(image)
        print(f"\nimages unpacked: {time.monotonic() - t0:.1f} s")
        host_lib_dir = stack.shared_dir(tmp_path / "host-elastic-gpu")
        # the example's values; a user may hold two slices here (her notebook's and her kernel's)
        stack.helm_chart(emu, "install", NS, "culler.enabled=false", f"nodeAgent.hostLibDir={host_lib_dir}",
                         "admission.workspaces.default.namespaces.default.user_limits.gpus=2",
                         *stack.image_sets(stack.IMAGES["agent"]))
        chart = z2jh_chart(tmp_path, hub_config(), stack.IMAGES[hub])
        # z2jh's singleuser.image: the notebook image of this run
        notebook_name, notebook_tag = stack.IMAGES["notebook"].rsplit(":", 1)
        z2jh = ["-f", str(tools.Z2JH_EXAMPLES / "values.yaml"), "--set", f"singleuser.image.name={notebook_name}",
                "--set-string", f"singleuser.image.tag={notebook_tag}"]
        proc = tools.helm("install", "jhub", str(chart), "-n", NS, "--kubeconfig", emu.tls_kubeconfig_path, *z2jh)
        assert proc.returncode == 0, proc.stderr
        z2jh_proxy(emu)
        # the agent on the GPU node: the node's inventory published, the shim installed
        emu.wait_for(lambda: L.NODE_GPUS_ANNOTATION in emu.get("nodes", NODE)["metadata"].get("annotations", {})
                     and (host_lib_dir / "ld.so.preload").is_file(), timeout=180, message="the node agent's inventory")
        # the DaemonSet's pod, on the GPU node with the chart's service account, RBAC and config,
        # published the double's one H100 as the agent's NVML saw it
        [card] = json.loads(emu.get("nodes", NODE)["metadata"]["annotations"][L.NODE_GPUS_ANNOTATION])
        assert (card["model"], card["memory_mib"]) == ("H100-80GB", 81559), card
        [agent_pod] = emu.list("pods", label_selector="app.kubernetes.io/component=node-agent")
        assert agent_pod["spec"]["nodeName"] == NODE
        log = emu.pod_log(agent_pod["metadata"]["name"], agent_pod["metadata"]["namespace"])
        assert "Traceback" not in log and "Forbidden" not in log, log[-3000:]
        hub_pod = stack.ready_pod(emu, NS, "component=hub")
        proxy_pod = stack.ready_pod(emu, NS, "component=proxy")
        print(f"hub and proxy ready: {time.monotonic() - t0:.1f} s")
        browser = Browser(f"http://{proxy_pod['status']['podIP']}:8000")
        # the proxy reaches the hub by its Service's name once the name has a ready endpoint
        emu.wait_for(lambda: browser.call("GET", "/hub/health", timeout=10)[0] == 200, timeout=60, interval=0.5,
                     message="the hub through the proxy")
        # the hub's pod talked to the API with its service account's token (z2jh's Role, our chart's)
        log = emu.pod_log(hub_pod["metadata"]["name"], NS)
        assert "Traceback" not in log and "Forbidden" not in log, log[-4000:]
        status, info = browser.call("GET", "/hub/api/")
        assert status == 200 and int(info["version"].split(".")[0]) == HUBS[hub], info

        # alice logs in through the proxy, spawns a fractional profile (10 GiB of her 20 GiB quota)
        home = browser.login("alice")
        assert "alice" in home, home[:500]
        status, body = browser.call("POST", "/hub/api/users/alice/server", {"profile": "h100"})  # 10 GiB
        assert status in (201, 202), (status, body)

        def server_ready() -> bool:
            _, model = browser.call("GET", "/hub/api/users/alice")
            return bool((model.get("servers") or {}).get("", {}).get("ready"))

        emu.wait_for(server_ready, timeout=180, interval=0.5, message="alice's server")
        [notebook] = emu.list("pods", NS, label_selector="component=singleuser-server")
        assert notebook["spec"]["runtimeClassName"] == "nvidia", notebook["spec"]
        assert notebook["spec"]["containers"][0]["image"] == stack.IMAGES["notebook"], notebook["spec"]
        print(f"alice's fractional notebook ready: {time.monotonic() - t0:.1f} s")

        # a GPU kernel from her server (its kernelspec: the notebook image's entrypoint installed those
        # of the hub's sizes): its pod runs the kernel image, the shim holds its slice
        status, tokens = browser.call("POST", "/hub/api/users/alice/tokens", {"note": "e2e"})
        assert status in (200, 201), tokens
        public = SimpleNamespace(url=browser.url)  # the hub's public address, as HubRunner.url
        server = Server(public, "alice", tokens["token"])
        status, session = server.start_session("elastic-gpu-gpu-5g")
        assert status == 201, (status, session)
        kernel_id = session["kernel"]["id"]
        [kernel_pod] = emu.list("pods", NS, label_selector=L.KERNEL_ID)
        assert kernel_pod["spec"]["containers"][0]["image"] == stack.IMAGES["kernel"]
        conn = KernelConnection(server, kernel_id)
        try:
            reply = conn.execute(KERNEL_CELL, timeout=120)
        finally:
            conn.close()
        assert reply["status"] == "ok", reply
        [line] = [x for x in reply["text"].splitlines() if x.startswith("RESULT")]
        first, second, total_mib = map(int, line.split()[1:])
        assert (first, second, total_mib) == (0, 2, 5120), line  # 2 = CUDA_ERROR_OUT_OF_MEMORY
        print(f"kernel capped: {time.monotonic() - t0:.1f} s")

        # alice's server stops: her notebook's and her kernel's pods go
        status, body = browser.call("DELETE", "/hub/api/users/alice/server")
        assert status in (202, 204), (status, body)
        emu.wait_for(lambda: not emu.list("pods", NS, label_selector=L.KIND), timeout=120,
                     interval=0.5, message="alice's GPU pods to go")
        # helm upgrade of z2jh's release with other values rolls the hub (the config's checksum)
        proc = tools.helm("upgrade", "jhub", str(chart), "-n", NS, "--kubeconfig", emu.tls_kubeconfig_path, *z2jh,
                          "--set", "cull.timeout=43200")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        stack.ready_pod(emu, NS, "component=hub", timeout=120, exclude=(hub_pod["metadata"]["name"],))
        emu.wait_for(lambda: browser.call("GET", "/hub/health", timeout=10)[0] == 200, timeout=60, interval=0.5,
                     message="the new hub through the proxy")
        print(f"hub rolled: {time.monotonic() - t0:.1f} s")

        # helm uninstall of our chart leaves nothing of ours, on the node neither

        proc = tools.helm("uninstall", "elastic-gpu", "-n", NS, "--kubeconfig", emu.tls_kubeconfig_path,
                          "--wait", timeout=240)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        print(f"our chart uninstalled: {time.monotonic() - t0:.1f} s")
        emu.wait_for(lambda: not release_objects(emu, "elastic-gpu", NS), timeout=60,
                     message=f"the release's objects to go (left: {release_objects(emu, 'elastic-gpu', NS)})")
        assert not list(host_lib_dir.iterdir()), "the uninstall hook left files on the node"
        print(f"its objects gone: {time.monotonic() - t0:.1f} s")
    finally:
        print("\n".join(podstart.report(list(emu.kubelet.timelines.values()))))
        print(f"end-to-end: {time.monotonic() - t0:.1f} s")
        emu.stop()
        print(f"emulator stopped: {time.monotonic() - t0:.1f} s")
