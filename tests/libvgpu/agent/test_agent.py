"""The node agent (``python -m libvgpu.agent``) as the DaemonSet runs it, against the NVML/CUDA test
doubles and the Kubernetes emulator.

One simulated GPU node for the module: two GPUs (0 shared, 1 in MIG mode with two 3g.40gb
instances), an agent subprocess with the four DaemonSet flags, and on GPU 0:

* pod ``pod-a`` (allocation ``a-ok``, 1 GiB slice) built by the spawner's own ``apply_gpu_to_pod``,
  running a CUDA program under the shim the agent installed, within its slice;
* pod ``pod-b`` (allocation ``b-over``, 256 MiB slice) whose program bypasses the shim and takes
  1 GiB: over its slice;
* a process of no pod taking 512 MiB: never registered.

Processes reach their pods through their cgroup, read from ``NodeAgent.proc_root`` — here a
directory where the test writes each pod process's ``cgroup`` file in the kubelet's (systemd
driver, containerd) format, since these machines cannot create cgroups.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import libvgpu
from libvgpu import contract as L
from libvgpu.health import FATAL_XIDS as FATAL
from libvgpu.regions import read_node_region, read_node_regions
from quotas import Allocation, Owner, load_pool
from tests.kubeemu import KubeEmulator, NodeSpec
from tests.kubeemu.helpers import create_host_claim
from tests.kubeemu.images import Image
from tests.libvgpu.harness import CFLAGS, Build, cc

REPO = Path(__file__).resolve().parents[3]
DOUBLE = REPO / "tests" / "libvgpu" / "double"
NODE = "gpu-node-1"
NS = "jhub"
NS_OTHER_HUB = "research"  # the user namespace of a second hub slicing the same node
HOST_PROC = "/run/host-proc"  # where GPU pods see the host's /proc (node_mounts)
MIB = 1 << 20
GPU0 = "GPU-d00b1e00-7369-6d2d-6770-750000000000"
GPU1 = "GPU-d00b1e00-7369-6d2d-6770-750000000001"


# ---- builds and processes -------------------------------------------------------------------


def build_doubles(root: Path) -> Build:
    """The CUDA/NVML doubles and the probe program (the shim itself comes from the package: the
    agent installs ``libvgpu.library_files()``)."""
    b = Build(root, root / "shim", root / "lib", root / "bin")
    for d in (b.lib_dir, b.bin_dir):
        d.mkdir(parents=True, exist_ok=True)
    for src, soname in (("cuda_double.c", "libcuda.so.1"), ("nvml_double.c", "libnvidia-ml.so.1")):
        cc(*CFLAGS, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-Bsymbolic-functions",
           f"-Wl,-soname,{soname}", "-o", b.lib_dir / soname, DOUBLE / src)
    cc(*CFLAGS, "-O2", "-o", b.probe, REPO / "tests" / "libvgpu" / "progs" / "probe.c", "-Wl,--no-as-needed",
       b.lib_dir / "libcuda.so.1", b.lib_dir / "libnvidia-ml.so.1", "-ldl")
    return b


def gpu_node_root(
    tmp_path_factory: pytest.TempPathFactory, name: str, **double: str
) -> tuple[Path, Build, dict[str, str]]:
    """A GPU node's work dir with the doubles built in it, and its driver's environment: one
    state every process shares, 81559 MiB H100s, an empty XID file; ``double`` adds or overrides
    ``CUDA_DOUBLE_<KEY>`` settings (e.g. ``DEVICES="2"``)."""
    try:
        libvgpu.library_files()
    except libvgpu.ShimNotBuilt as e:
        pytest.fail(str(e))
    root = tmp_path_factory.mktemp(name)
    build = build_doubles(root / "build")
    (root / "xid").write_text("")
    (root / "lost").write_text("")
    env = {
        "LD_LIBRARY_PATH": str(build.lib_dir),
        "CUDA_DOUBLE_STATE": str(root / "gpu.state"),
        "CUDA_DOUBLE_DEVICES": "1",
        "CUDA_DOUBLE_MEMORY_MIB": "81559",
        "CUDA_DOUBLE_NAME": "NVIDIA H100 80GB HBM3",
        "CUDA_DOUBLE_XID_FILE": str(root / "xid"),
        "CUDA_DOUBLE_LOST_FILE": str(root / "lost"),
    }
    env.update({f"CUDA_DOUBLE_{key}": value for key, value in double.items()})
    return root, build, env


def add_default_priority_class(emu: KubeEmulator) -> None:
    """The chart's PriorityClass that GPU pods name (the API server refuses pods naming none)."""
    emu.create({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": "elastic-gpu-default"}, "value": 100},
               "priorityclasses", None, group="scheduling.k8s.io")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIBVGPU_", "CUDA_", "KUBERNETES_"))}
    env.pop("LD_PRELOAD", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] of every sample served on /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def sample(metrics: dict, name: str, **labels: str) -> float | None:
    for got, value in metrics.get(name, []):
        if all(got.get(k) == v for k, v in labels.items()):
            return value
    return None


def wait_for(predicate, timeout: float = 20.0, what: str = "condition", interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")


# ---- the simulated node -----------------------------------------------------------------------


@dataclass
class Node:
    root: Path
    build: Build
    emu: KubeEmulator
    host_dir: Path
    proc_root: Path
    xid_file: Path
    gpu_env: dict[str, str]
    agent: subprocess.Popen | None = None
    agent_log: Path | None = None
    port: int = 0
    started_at: float = 0.0
    pids: dict[str, int] = field(default_factory=dict)
    others: list[subprocess.Popen] = field(default_factory=list)

    def metrics(self) -> dict:
        return scrape(self.port)

    def log(self) -> str:
        return self.agent_log.read_text() if self.agent_log and self.agent_log.exists() else ""

    def events(self, namespace: str) -> list[dict]:
        return [e for e in self.emu.list("events", namespace)
                if (e.get("source") or {}).get("component") == "elastic-gpu-node-agent"]

    def write_cgroup(self, pid: int, pod_uid: str, comm: str) -> None:
        """/proc/<pid>/cgroup as a containerd pod under the systemd cgroup driver shows it."""
        d = self.proc_root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        slice_uid = pod_uid.replace("-", "_")
        (d / "cgroup").write_text(
            "0::/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{slice_uid}.slice/cri-containerd-{'ab' * 32}.scope\n"
        )
        (d / "comm").write_text(comm + "\n")
        if not (d / "root").is_symlink():  # the pod's filesystem, where the agent's relay reads its region
            (d / "root").symlink_to(f"/proc/{pid}/root")


def start_agent(node: Node, config: str, *extra: str) -> None:
    cfg = node.root / "config.yaml"
    cfg.write_text(config)
    node.port = free_port()
    node.agent_log = node.root / "agent.log"
    env = {**clean_env(), **node.gpu_env, **node.emu.env(), "ELASTIC_GPU_BACKEND": "native", "NODE_NAME": NODE}
    node.agent = subprocess.Popen(
        [sys.executable, "-m", "libvgpu.agent", "--node-name", NODE, "--metrics-port", str(node.port),
         "--config", str(cfg), "--host-lib-dir", str(node.host_dir), *extra],
        env=env, cwd=REPO, stdout=node.agent_log.open("w"), stderr=subprocess.STDOUT,
    )

    def up():
        if node.agent.poll() is not None:
            raise AssertionError(f"the agent exited ({node.agent.returncode}):\n{node.log()}")
        try:
            return node.metrics()
        except OSError:
            return None

    # an agent starting beside other hubs and agents on a loaded 2-core machine took over 30 s
    wait_for(up, 90, "the agent's metrics endpoint")


def gpu_pod(node: Node, name: str, allocation: Allocation | None, command: list[str], env: dict[str, str],
            bypass_shim: bool = False, namespace: str = NS) -> dict:
    """A pod written by the spawner's own apply_gpu_to_pod (native backend); with no allocation,
    a pod of another workload that reaches the card by itself."""
    from kubernetes_asyncio.client import ApiClient
    from kubernetes_asyncio.client import models as k8s

    from hubext.kubernetes.spawner import apply_gpu_to_pod

    pod = k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(name=name, namespace=namespace),
        spec=k8s.V1PodSpec(
            restart_policy="Never",
            containers=[k8s.V1Container(
                name="kernel", image="jupyter/gpu", command=command,
                env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()],
            )],
        ),
    )
    if allocation is not None:
        apply_gpu_to_pod(pod, allocation, backend="native", section={}, priority_value=100,
                         priority_class_name="elastic-gpu-default", runtime_class="")
    if bypass_shim:
        # The kubelet really mounts the node's /etc/ld.so.preload: a program that bypasses the
        # shim (a static binary, its own loader) is a container without that mount.
        [c] = pod.spec.containers
        c.volume_mounts = [m for m in c.volume_mounts if m.mount_path != "/etc/ld.so.preload"]

    async def serialise() -> dict:
        async with ApiClient() as api:
            return api.sanitize_for_serialization(pod)

    return asyncio.run(serialise())


def allocation(alloc_id: str, user: str, memory_mib: int) -> Allocation:
    return Allocation(id=alloc_id, owner=Owner(user=user, namespace="default", workspace="vision"), node=NODE,
                      gpu_uuids=(GPU0,), memory_mib=memory_mib, cores_percent=50, priority_class="default",
                      kind="kernel", created_at=time.time())


def run_pod(node: Node, name: str, alloc: Allocation | None, steps: list[str], env: dict[str, str],
            bypass_shim: bool = False, namespace: str = NS) -> int:
    """Start a pod whose program waits until the test wrote its cgroup file (no race with the
    agent's checks), then runs the probe with ``steps``."""
    go = node.root / f"{name}.go"
    command = ["/bin/sh", "-c", f'while [ ! -e "{go}" ]; do sleep 0.02; done; exec "$0" "$@"',
               str(node.build.probe), *steps]
    node.emu.create(gpu_pod(node, name, alloc, command, env, bypass_shim, namespace), "pods", namespace)
    node.emu.wait_for_pod_phase(name, "Running", namespace, timeout=20)
    pid = wait_for(lambda: node.emu.pod_pid(name, namespace), 10, f"the process of {name}")
    uid = node.emu.get("pods", name, namespace)["metadata"]["uid"]
    node.write_cgroup(pid, uid, "probe")
    node.pids[name] = pid
    go.touch()
    return pid


def stop_agent(n: Node) -> None:
    """SIGTERM the node's agent (SIGKILL after 10 s)."""
    if n.agent and n.agent.poll() is None:
        n.agent.send_signal(signal.SIGTERM)
        try:
            n.agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            n.agent.kill()
            n.agent.wait()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root, build, gpu_env = gpu_node_root(
        tmp_path_factory, "agent-node", DEVICES="2", CONTEXT_MIB="0", MIG="1:3g.40gb,3g.40gb", TEMPERATURE_C="52"
    )
    emu = KubeEmulator(
        nodes=[NodeSpec(NODE, labels={"nvidia.com/gpu.present": "true"})],
        namespaces=[NS, NS_OTHER_HUB, "ml"],
        pod_env={**gpu_env, "CUDA_DOUBLE_HOST_PROC": HOST_PROC},
        restart_backoff_seconds=1.0,
        # the GPU double's state (one "device" every process shares) and, as a driver has it,
        # the host's process view: the double reports host pids, as NVML does
        node_mounts=[str(root), f"/proc:{HOST_PROC}"],
        # the probe and the doubles live in pytest's private (0700) tmp dir: the image runs as root
        images={"jupyter/gpu*": Image()},
    )
    emu.start()
    add_default_priority_class(emu)
    for ns in (NS, NS_OTHER_HUB):
        create_host_claim(emu, ns, root / "host")  # the chart's claim of the agent's host directory
    n = Node(root, build, emu, root / "host", root / "proc", root / "xid", gpu_env)
    n.proc_root.mkdir()
    try:
        n.started_at = time.time()
        start_agent(
            n,
            f"""
NodeAgent:
  proc_root: {n.proc_root}
  pod_namespace: {NS}
  extra_pod_namespaces: [{NS_OTHER_HUB}]
  metrics_ip: 127.0.0.1
  refresh_interval_seconds: 0.3
  inventory_interval_seconds: 1
  recovery_hold_down_seconds: 4
  pod_refresh_seconds: 0.3
Backstop:
  action: kill
  tolerance_mib: 64
  interval_seconds: 0.3
  confirm_checks: 2
""",
        )
        wait_for(lambda: emu.get("nodes", NODE)["metadata"].get("annotations", {}).get(L.NODE_GPUS_ANNOTATION),
                 15, "the inventory annotation")
        shim = "/usr/local/lib/elastic-gpu/libvgpu.so"  # the pod's hostPath mount of the node's lib dir
        run_pod(n, "pod-a", allocation("a-ok", "alice", 1024),
                ["init", "ctx", "alloc:300M", "launch:3:100", "wait"], {"LD_PRELOAD": shim})
        run_pod(n, "pod-b", allocation("b-over", "bob", 256), ["init", "ctx", "alloc:1G", "wait"], {},
                bypass_shim=True)
        # the other hub's notebook on the same card, within its slice
        run_pod(n, "pod-c", allocation("c-other-hub", "carol", 512), ["init", "ctx", "alloc:200M", "wait"],
                {"LD_PRELOAD": shim}, namespace=NS_OTHER_HUB)
        stray = subprocess.Popen([str(build.probe), "init", "ctx", "alloc:512M", "wait"],
                                 env={**clean_env(), **gpu_env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        n.others.append(stray)
        assert stray.stdout.readline().strip() != ""
        n.pids["stray"] = stray.pid
        yield n
    finally:
        stop_agent(n)
        for p in n.others:
            if p.poll() is None:
                p.kill()
            p.wait()
        emu.stop()


# ---- inventory --------------------------------------------------------------------------------


def test_inventory_is_published_on_the_node_and_accepted_by_the_pool(node):
    meta = node.emu.get("nodes", NODE)["metadata"]
    assert meta["labels"][L.NODE_GPU_LABEL] == "true"
    raw = meta["annotations"][L.NODE_GPUS_ANNOTATION]
    gpus = json.loads(raw)
    # what hubext.kubernetes.pool.KubernetesPool.inventory() does with it
    pool = load_pool([{"name": NODE, "gpus": gpus}])
    shared, mig = pool.node(NODE).gpus
    assert (shared.uuid, shared.model, shared.memory_mib, shared.sm_count, shared.mode.value, shared.index) == (
        GPU0, "H100-80GB", 81559, 132, "shared", 0)
    assert (mig.uuid, mig.mode.value, mig.mig_profiles, mig.index) == (GPU1, "mig", ("3g.40gb", "3g.40gb"), 1)
    documented = {"uuid", "model", "memory_mib", "sm_count", "mode", "mig_profiles", "index", "memory_oversub",
                  "cores_oversub"}
    assert all(set(g) <= documented for g in gpus)


def test_inventory_is_republished_when_the_annotation_changes(node):
    node.emu.patch("nodes", NODE, {"metadata": {"annotations": {L.NODE_GPUS_ANNOTATION: "[]"},
                                                "labels": {L.NODE_GPU_LABEL: "false"}}}, None)

    def repaired():
        meta = node.emu.get("nodes", NODE)["metadata"]
        return meta["labels"].get(L.NODE_GPU_LABEL) == "true" and len(json.loads(
            meta["annotations"][L.NODE_GPUS_ANNOTATION])) == 2

    wait_for(repaired, 10, "the agent to republish its inventory")
    # the agent logs the event after its patch has landed: the line follows the patch, not with it
    wait_for(lambda: "GPU inventory republished" in node.log(), 5, "the agent to log the republication")


# ---- the shim on the host ------------------------------------------------------------------------


def test_shim_is_installed_in_the_host_dir_with_the_preload_file_and_regions(node):
    lib = node.host_dir / "lib"
    for src in map(Path, libvgpu.library_files()):
        assert (lib / src.name).read_bytes() == src.read_bytes(), src.name
    assert (node.host_dir / "ld.so.preload").read_text() == "/usr/local/lib/elastic-gpu/libvgpu.so\n"
    regions = node.host_dir / "regions"
    assert regions.is_dir() and regions.stat().st_mode & 0o7777 == 0o755
    # the agent made each card's node region (GPU pods map it, but cannot remove or replace it)
    assert (regions / f"{GPU0}.region").stat().st_mode & 0o777 == 0o666
    assert read_node_region(regions / f"{GPU0}.region").uuid == GPU0



def test_the_priority_table_of_the_regions_lists_each_running_allocation(node):
    from libvgpu.priorities import read_priority_table

    regions = node.host_dir / "regions"
    wait_for(lambda: read_priority_table(regions).get("a-ok") == 100, 15, "a-ok's priority in the table")
    table = regions / "priorities"
    assert table.stat().st_mode & 0o777 == 0o644 and table.stat().st_uid == regions.stat().st_uid
    assert f"a-ok 100 {GPU0}\n" in table.read_text()  # believed on the cards the allocation holds only

# ---- metrics ---------------------------------------------------------------------------------------


def test_gpu_metrics_are_served_with_the_dashboards_names(node):
    m = node.metrics()
    g0 = {"node": NODE, "gpu_uuid": GPU0, "gpu_index": "0", "model": "H100-80GB"}
    assert sample(m, "elastic_gpu_memory_total_bytes", **g0) == 81559 * MIB
    assert sample(m, "elastic_gpu_temperature_celsius", **g0) == 52
    assert sample(m, "elastic_gpu_temperature_celsius", gpu_uuid=GPU1) == 53
    # as the driver sees it: pod-a's 300 MiB at least (pod-b and the stray process may be killed by now)
    used = sample(m, "elastic_gpu_memory_used_bytes", **g0)
    assert used is not None and 300 * MIB <= used <= 81559 * MIB
    util = sample(m, "elastic_gpu_utilization_ratio", **g0)
    assert util is not None and 0.0 <= util <= 1.0
    assert sample(m, "elastic_gpu_xid_events_supported", gpu_uuid=GPU0) == 1


def test_utilisation_follows_the_kernels_that_run(node):
    busy = subprocess.Popen([str(node.build.probe), "init", "ctx", "util:0:3:2000:kernel"],
                            env={**clean_env(), **node.gpu_env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node.others.append(busy)
    wait_for(lambda: (sample(node.metrics(), "elastic_gpu_utilization_ratio", gpu_uuid=GPU0) or 0) > 0.5, 10,
             "GPU 0's utilisation to rise while kernels run")
    busy.kill()
    busy.wait()


def test_xid_errors_are_counted_from_nvml_events(node):
    with node.xid_file.open("a") as f:
        f.write("0 79\n0 79\n1 48\n")
    wait_for(lambda: sample(node.metrics(), "elastic_gpu_xid_errors_total", gpu_uuid=GPU0, xid="79") == 2, 10,
             "two Xid 79 on GPU 0")
    assert sample(node.metrics(), "elastic_gpu_xid_errors_total", gpu_uuid=GPU1, gpu_index="1", xid="48") == 1


def _health(node) -> dict:
    text = (node.emu.get("nodes", NODE)["metadata"].get("annotations") or {}).get(L.NODE_GPU_HEALTH_ANNOTATION)
    return json.loads(text) if text else {}


def test_a_fatal_xid_takes_its_card_out_of_service_on_the_node_until_an_admin_clears_it(node):
    """The agent counted Xids and nothing acted on them: a card that fell off the bus kept taking
    slices. A fatal Xid (79, 94, ...) is published on the Node for the hub's pool, and as a gauge;
    a non-fatal one (13: an application's graphics exception) is only counted."""
    def shown_every_fatal_xid(m: dict) -> bool:  # (earlier tests' Xids are published, not pending)
        fatal = {la["gpu_uuid"] for la, n in m.get("elastic_gpu_xid_errors_total", []) if n and int(la["xid"]) in FATAL}
        return fatal <= {la["gpu_uuid"] for la, _ in m.get("elastic_gpu_out_of_service", [])}

    wait_for(lambda: shown_every_fatal_xid(node.metrics()), 10, "every card with a fatal Xid so far shown")
    node.emu.patch("nodes", NODE, {"metadata": {"annotations": {L.NODE_GPU_HEALTH_ANNOTATION: None}}}, None)
    wait_for(lambda: not sample(node.metrics(), "elastic_gpu_out_of_service"), 10, "no card out of service")
    with node.xid_file.open("a") as f:
        f.write("1 13\n1 94\n")
    health = wait_for(lambda: _health(node).get(GPU1), 10, "GPU 1 out of service on the Node")
    assert health["xid"] == 94 and health["index"] == 1 and abs(health["since"] - time.time()) < 60, health
    assert GPU0 not in _health(node)
    assert sample(node.metrics(), "elastic_gpu_xid_errors_total", gpu_uuid=GPU1, xid="13") == 1
    labels = {"gpu_uuid": GPU1, "gpu_index": "1", "xid": "94"}
    wait_for(lambda: sample(node.metrics(), "elastic_gpu_out_of_service", **labels) == 1, 10, "the gauge")
    assert "GPU 1 (" + GPU1 + ") out of service: Xid 94 (a contained ECC error)" in node.log()
    # the admin resets the card and clears it: the agent forgets it (and does not put it back)
    node.emu.patch("nodes", NODE, {"metadata": {"annotations": {L.NODE_GPU_HEALTH_ANNOTATION: None}}}, None)
    wait_for(lambda: not sample(node.metrics(), "elastic_gpu_out_of_service", **labels), 10, "the gauge cleared")
    assert GPU1 not in _health(node)



def test_a_card_that_fell_off_the_bus_comes_back_by_itself_once_reset_and_free_of_fatal_xids_for_the_hold_down(node):
    """Only an admin brought a card back. Now: after Xid 79 the card answers NVML nothing (the
    double's GPU_IS_LOST); once reset it answers again, and after the hold-down (4 s here) with no
    new fatal Xid the agent takes it off the Node and says so; a fatal Xid during the hold-down
    restarts it."""
    node.emu.patch("nodes", NODE, {"metadata": {"annotations": {L.NODE_GPU_HEALTH_ANNOTATION: None}}}, None)
    wait_for(lambda: not _health(node) and not sample(node.metrics(), "elastic_gpu_out_of_service"), 10,
             "earlier tests' cards cleared")
    lost, card = node.root / "lost", f"GPU 1 ({GPU1})"
    lost.write_text("1\n")  # it fell off the bus
    with node.xid_file.open("a") as f:
        f.write("1 79\n")
    wait_for(lambda: _health(node).get(GPU1, {}).get("xid") == 79, 10, "GPU 1 out of service after Xid 79")
    wait_for(lambda: f"{card} answers NVML nothing (lost after Xid 79" in node.log(), 10, "the agent to see it lost")
    assert GPU1 in _health(node)
    lost.write_text("")  # an admin reset it (nvidia-smi -r): it answers again
    wait_for(lambda: f"{card} answers NVML again" in node.log(), 10, "the hold-down to start")
    with node.xid_file.open("a") as f:
        f.write("1 48\n")  # a double-bit ECC error within the hold-down
    wait_for(lambda: f"{card} stays out of service: Xid 48" in node.log(), 10, "the hold-down restarted")
    assert GPU1 in _health(node)
    wait_for(lambda: GPU1 not in _health(node), 30, "GPU 1 back in service")
    log = node.log()
    assert log.index(f"{card} stays out of service: Xid 48 (a double-bit ECC error) restarts its 4 s hold-down") < (
        log.index(f"{card} back in service: it was reset after Xid 79 (the GPU has fallen off the bus) and answered "
                  "NVML for 4 s without a fatal Xid")), log[-3000:]
    assert log.count(f"{card} answers NVML again") == 2, log[-3000:]
    wait_for(lambda: not sample(node.metrics(), "elastic_gpu_out_of_service", gpu_uuid=GPU1), 10, "the gauge cleared")


def test_allocation_usage_comes_from_the_shims_node_region(node):
    labels = {"node": NODE, "gpu_uuid": GPU0, "allocation_id": "a-ok", "user": "alice", "workspace": "vision",
              "namespace": "default", "kind": "kernel", "pod": "pod-a"}
    m = wait_for(lambda: (lambda m: m if sample(m, "elastic_gpu_allocation_memory_used_bytes", **labels) else None)(
        node.metrics()), 15, "pod-a's allocation series")
    assert sample(m, "elastic_gpu_allocation_memory_used_bytes", **labels) == 300 * MIB
    assert sample(m, "elastic_gpu_allocation_memory_limit_bytes", **labels) == 1024 * MIB
    last = sample(m, "elastic_gpu_allocation_last_activity_timestamp_seconds", **labels)
    assert last is not None and node.started_at <= last <= time.time()


# ---- the enforcement backstop --------------------------------------------------------------------


def test_a_pod_over_its_slice_gets_an_event_a_metric_and_is_killed(node):
    events = wait_for(lambda: [e for e in node.events(NS) if e["reason"] == "GPUMemoryOverSlice"], 20,
                      "an over-slice Event on pod-b")
    assert len(events) == 1
    e = events[0]
    assert e["involvedObject"]["kind"] == "Pod" and e["involvedObject"]["name"] == "pod-b"
    assert e["type"] == "Warning"
    assert "allocation b-over" in e["message"] and "1 GiB" in e["message"] and "256 MiB" in e["message"]
    assert f"Killed process {node.pids['pod-b']}" in e["message"]
    phase = node.emu.wait_for_pod_phase("pod-b", "Failed", NS, timeout=10)
    assert phase
    m = node.metrics()
    assert sample(m, "elastic_gpu_enforcement_violations_total", gpu_uuid=GPU0, reason="over-limit") == 1
    assert sample(m, "elastic_gpu_enforcement_kills_total", gpu_uuid=GPU0, reason="over-limit") == 1


def test_a_pod_whose_program_bypassed_the_shim_is_reported(node):
    events = wait_for(lambda: [e for e in node.events(NS) if e["reason"] == "GPUShimBypassed"], 20,
                      "a shim-bypassed Event on pod-b")
    assert [e["involvedObject"]["name"] for e in events] == ["pod-b"]
    assert sample(node.metrics(), "elastic_gpu_enforcement_violations_total", reason="no-shim") == 1


def test_a_process_no_shim_registered_gets_a_node_event_and_is_killed(node):
    events = wait_for(lambda: [e for e in node.events("default") if e["reason"] == "GPUProcessWithoutSlice"], 20,
                      "an Event on the Node")
    assert len(events) == 1
    e = events[0]
    assert e["involvedObject"]["kind"] == "Node" and e["involvedObject"]["name"] == NODE
    stray = node.others[0]
    assert f"Process {stray.pid}" in e["message"] and "512 MiB" in e["message"]
    assert stray.wait(timeout=10) == -signal.SIGKILL
    assert sample(node.metrics(), "elastic_gpu_enforcement_violations_total", gpu_uuid=GPU0,
                  reason="unregistered") == 1


def test_a_pod_within_its_slice_is_left_alone(node):
    # by now the checks above have run many times over pod-a's process
    wait_for(lambda: node.emu.get("pods", "pod-b", NS)["status"]["phase"] == "Failed", 20, "pod-b to be stopped")
    time.sleep(1.0)
    assert node.emu.get("pods", "pod-a", NS)["status"]["phase"] == "Running"
    about_a = [e for e in node.events(NS) if e["involvedObject"]["name"] == "pod-a"]
    assert about_a == []
    # nor is the other hub's pod on the same card: the agent matched it to its slice
    assert node.emu.get("pods", "pod-c", NS_OTHER_HUB)["status"]["phase"] == "Running"
    assert node.events(NS_OTHER_HUB) == []
    assert sample(node.metrics(), "elastic_gpu_enforcement_kills_total", gpu_uuid=GPU0, reason="unregistered") == 1


def test_a_pod_of_another_workload_on_a_managed_card_is_named_and_killed(node):
    """A training job's pod that reaches a sliced card by itself (no slice, not one of the hub's
    pods): the Node event names the pod (the agent may not write Events in its namespace)."""
    run_pod(node, "train", None, ["init", "ctx", "alloc:400M", "wait"], {}, namespace="ml")
    events = wait_for(
        lambda: [e for e in node.events("default") if "pod ml/train" in e["message"]], 20, "an Event naming ml/train"
    )
    assert events[0]["reason"] == "GPUProcessWithoutSlice" and events[0]["involvedObject"]["kind"] == "Node"
    assert f"Process {node.pids['train']}" in events[0]["message"]
    assert "not one of the hub's GPU pods" in events[0]["message"]
    node.emu.wait_for_pod_phase("train", "Failed", "ml", timeout=15)


# ---- failures at start-up: one line, non-zero exit --------------------------------------------------


def _run_agent(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "libvgpu.agent", "--node-name", NODE, "--metrics-port", str(free_port()),
         "--host-lib-dir", str(tmp_path / "host"), *args],
        env={**clean_env(), **(env or {})}, cwd=REPO, capture_output=True, text=True, timeout=60,
    )


def test_missing_nvml_is_one_clear_line_and_a_non_zero_exit(tmp_path):
    proc = _run_agent(tmp_path, "--NodeAgent.nvml_library=/nonexistent/libnvidia-ml.so.1")
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "/nonexistent/libnvidia-ml.so.1" in lines[0] and "cannot be loaded" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout

    import ctypes.util

    if ctypes.util.find_library("nvidia-ml"):
        return  # a real driver is installed here: the default search would find it
    proc = _run_agent(tmp_path, env={"LD_LIBRARY_PATH": str(tmp_path)})
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines() == [
        "elastic-gpu node agent: NVML (libnvidia-ml.so.1) was not found: run the agent on a GPU node with the "
        "NVIDIA container runtime (NVIDIA_VISIBLE_DEVICES=all, NVIDIA_DRIVER_CAPABILITIES=utility) or set "
        "nodeAgent.runtimeClassName"
    ]


def test_a_bad_config_file_is_one_line_naming_the_setting(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("Backstop: {action: explode}\n")
    proc = _run_agent(tmp_path, "--config", str(cfg))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for word in (str(cfg), "action", "Backstop", "'report'", "'kill'", "'explode'"):
        assert word in lines[0], lines[0]


# ---- swap: the hub's requests on a kernel pod -------------------------------------------------


def ask_swap(node: Node, pod: str, request: dict | str) -> dict:
    """Annotate the pod as the hub does and wait for the agent's answer of that generation."""
    text = request if isinstance(request, str) else json.dumps(request)
    node.emu.patch("pods", pod, {"metadata": {"annotations": {L.A_SWAP: text}}}, NS)
    generation = request.get("generation") if isinstance(request, dict) else -1

    def answered():
        status = (node.emu.get("pods", pod, NS)["metadata"].get("annotations") or {}).get(L.A_SWAP_STATUS)
        data = json.loads(status) if status else None
        return data if data and data.get("generation") == generation else None

    return wait_for(answered, 20, f"the agent's answer to {text}")


def driver_state(node: Node, pid: int) -> str:
    """The process's checkpoint state, asked of the driver (the double) by another process."""
    code = "import sys; from libvgpu.checkpoint import CudaCheckpoint as C; print(C().state(int(sys.argv[1])).name)"
    out = subprocess.run([sys.executable, "-c", code, str(pid)], env={**clean_env(), **node.gpu_env}, cwd=REPO,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_agent_holds_one_watch_of_its_nodes_pods_per_namespace(node):
    """Swap requests and elastic pods being deleted both come from this node's pods: one watch
    stream per namespace wakes both jobs (an API server counts its watch connections per node)."""
    mine = f"spec.nodeName={NODE}"

    def watches() -> dict[str, int] | None:
        got = {ns: node.emu.store.open_watches("", "pods", ns).count(mine) for ns in (NS, NS_OTHER_HUB)}
        return got if all(got.values()) else None

    assert wait_for(watches, 20, "the agent's watches of its pods") == {NS: 1, NS_OTHER_HUB: 1}


def test_the_agent_swaps_a_pods_cuda_processes_out_and_in_when_the_hub_asks(node):
    pid = node.pids["pod-a"]
    status = ask_swap(node, "pod-a", {"action": "suspend", "generation": 1, "lock_timeout_ms": 5000})
    assert status["ok"] is True, (status, node.log())
    assert status["processes"] == [pid] and status["host_mib"] >= 300, status
    assert driver_state(node, pid) == "CHECKPOINTED"  # as the driver sees it: its GPU memory is in host memory
    assert node.emu.get("pods", "pod-a", NS)["status"]["phase"] == "Running"

    # a second suspend of a checkpointed pod is refused by the driver and changes nothing
    again = ask_swap(node, "pod-a", {"action": "suspend", "generation": 2})
    assert again["ok"] is False and "CUDA_ERROR_ILLEGAL_STATE" in again["message"] and not again["stuck"], again
    assert driver_state(node, pid) == "CHECKPOINTED"

    status = ask_swap(node, "pod-a", {"action": "resume", "generation": 3})
    assert status["ok"] is True and status["processes"] == [pid], status
    assert driver_state(node, pid) == "RUNNING"
    assert "resume of pod jhub/pod-a" in node.log()

    # what is not the hub's request shape gets a sentence, and nothing is done
    bad = ask_swap(node, "pod-a", '{"action": "freeze"}')
    assert bad == {"generation": -1, "ok": False, "message": f"the {L.A_SWAP} annotation's action must be "
                   "'suspend' or 'resume'"}, bad


def test_a_swapped_out_kernel_pod_has_its_marker_and_the_host_memory_cap_refuses_a_suspend_leaving_it_running(node):
    pid, kernel = node.pids["pod-a"], "0123456789abcdef0123456789abcdef"
    node.emu.patch("pods", "pod-a", {"metadata": {"annotations": {L.A_KERNEL_ID: kernel}}}, NS)
    markers = node.host_dir / "regions" / L.SWAP_MARKER_DIR
    # a pod planted a file where the agent keeps its markers (the region dir is every pod's)
    markers.parent.mkdir(exist_ok=True)
    (markers.parent / L.SWAP_MARKER_DIR).write_text("planted")
    os.chown(markers.parent / L.SWAP_MARKER_DIR, 1000, 1000)

    # over the cap (a ten-thousandth of the node's RAM: less than the pod's 300 MiB): refused, still running
    status = ask_swap(node, "pod-a", {"action": "suspend", "generation": 11, "host_memory_percent": 0.0001})
    assert status["ok"] is False and not status["stuck"], status
    assert "over the cap of" in status["message"] and "of the node's" in status["message"], status
    assert driver_state(node, pid) == "RUNNING"
    assert not (markers / kernel).exists()  # no marker left behind: the next cell does not ask

    status = ask_swap(node, "pod-a", {"action": "suspend", "generation": 12, "host_memory_percent": 90})
    assert status["ok"] is True, (status, node.log())
    assert driver_state(node, pid) == "CHECKPOINTED"
    assert (markers / kernel).is_file() and markers.stat().st_uid == 0, list(markers.iterdir())
    assert stat.S_IMODE(markers.stat().st_mode) == 0o711  # a kernel finds its own marker, lists none

    status = ask_swap(node, "pod-a", {"action": "resume", "generation": 13})
    assert status["ok"] is True and driver_state(node, pid) == "RUNNING", status
    assert not (markers / kernel).exists()

    # the marker of a kernel whose pod went while swapped out (or was restarted) does not stay
    (markers / ("f" * 32)).touch()
    wait_for(lambda: not (markers / ("f" * 32)).exists(), 15, "the stray marker to be swept")


# ---- elastic slices: owners waiting for burst memory (issue 27) ---------------------------------


def test_an_owner_waiting_for_burst_memory_is_published_on_its_pod_and_the_hub_takes_it_from_the_burster(node):
    # erin's kernel is guaranteed 1 GiB and may grow to the whole card; it bursts to 70 GiB while
    # the card is free. olga's kernel then asks for 16 GiB within its own 16 GiB guarantee: its shim
    # waits (reclaim_wait_ms) and says so in the node region; the agent publishes the wait on
    # olga's pod, where the hub's Kubernetes pool reads it and plans to take the burst from erin.
    from dataclasses import replace

    from hubext.broker.reclaim import plan_takes
    from libvgpu.elastic import pod_reclaims

    shim = "/usr/local/lib/elastic-gpu/libvgpu.so"
    burster = replace(allocation("e-burst", "erin", 1024), memory_limit_mib=81559)
    owner = allocation("o-owner", "olga", 16384)
    run_pod(node, "pod-burst", burster, ["init", "ctx", "alloc:70G", "wait"], {"LD_PRELOAD": shim})
    wait_for(lambda: any(c.name == "e-burst" and c.memory_used_bytes > 60 << 30
                         for g in read_node_regions(node.host_dir / "regions").values() for c in g.containers),
             20, "erin's burst in the node region")
    run_pod(node, "pod-owner", owner, ["init", "ctx", "alloc:16G", "wait"], {"LD_PRELOAD": shim})
    try:
        published = wait_for(
            lambda: node.emu.get("pods", "pod-owner", NS)["metadata"].get("annotations", {}).get(L.A_GPU_RECLAIM),
            20, "the wait published on olga's pod",
        )
        wait = json.loads(published)
        # the backstop lets a slice use up to its limit: the burster runs on (it was killed at 1 GiB)
        assert node.emu.get("pods", "pod-burst", NS)["status"]["phase"] == "Running", node.log()[-2000:]
        assert [(w["gpu_uuid"], w["wanted_mib"], w["burster"]) for w in wait] == [(GPU0, 16384, "e-burst")], wait
        reclaims = pod_reclaims(node.emu.list("pods", NS))
        assert [(r.card_uuid, r.owner, r.burster, r.wanted_mib) for r in reclaims] == [
            (GPU0, "o-owner", "e-burst", 16384)], reclaims
        assert reclaims[0].burst_mib >= 70 * 1024 - 1024, reclaims
        takes = plan_takes(reclaims, {a.id: a for a in (burster, owner)})
        assert [(t.burster.id, t.owner.id) for t in takes] == [("e-burst", "o-owner")]
        # the burster goes: olga's allocation succeeds and her pod no longer says she waits
        node.emu.delete("pods", "pod-burst", NS)
        wait_for(lambda: not node.emu.get("pods", "pod-owner", NS)["metadata"].get("annotations", {}).get(
            L.A_GPU_RECLAIM), 40, "the wait gone from olga's pod")
        assert pod_reclaims(node.emu.list("pods", NS)) == []
    finally:
        for pod in ("pod-burst", "pod-owner"):
            try:
                node.emu.delete("pods", pod, NS)
            except Exception:  # noqa: BLE001 - gone already
                pass
