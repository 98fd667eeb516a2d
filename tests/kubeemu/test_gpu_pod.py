"""A GPU pod of the native backend as a real container: its own pid namespace, the shim loaded
only through the node's /etc/ld.so.preload (a subPath of the chart's claim of the agent's host
directory), the CUDA/NVML doubles as the node's GPU. The compute limit must hold there as on a
real node, where NVML reports host pids and the container's getpid() is not one."""

from __future__ import annotations

import dataclasses

import pytest

from libvgpu.agent.install import install_shim
from tests.kubeemu import KubeEmulator, NodeSpec
from tests.kubeemu.helpers import create_host_claim
from tests.kubeemu.images import Image
from tests.libvgpu.agent.test_agent import HOST_PROC, NODE, NS, Node, allocation, gpu_node_root, gpu_pod
from tests.libvgpu.harness import Result


@pytest.fixture(scope="module")
def gpu_node(tmp_path_factory: pytest.TempPathFactory):
    root, build, gpu_env = gpu_node_root(tmp_path_factory, "gpu-pod")
    host_dir = root / "host"
    install_shim(host_dir)  # what the node agent puts on the host (lib/, ld.so.preload, regions/)
    emu = KubeEmulator(
        nodes=[NodeSpec(NODE, labels={"nvidia.com/gpu.present": "true"})], namespaces=[NS],
        pod_env={**gpu_env, "CUDA_DOUBLE_HOST_PROC": HOST_PROC},
        # the double's state is the node's GPU; like a driver it knows processes by host pid
        node_mounts=[str(root), f"/proc:{HOST_PROC}"],
        images={"jupyter/gpu*": Image()},  # the probe is in pytest's private (0700) tmp dir
        restart_backoff_seconds=1.0)
    emu.start()
    emu.create({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": "elastic-gpu-default"}, "value": 100},
               "priorityclasses", None, group="scheduling.k8s.io")
    create_host_claim(emu, NS, host_dir)
    try:
        yield Node(root, build, emu, host_dir, root / "proc", root / "xid", gpu_env)
    finally:
        emu.stop()


def test_compute_limit_holds_in_a_gpu_pods_pid_namespace(gpu_node):
    alloc = dataclasses.replace(allocation("pidns-30", "alice", 1024), cores_percent=30)
    steps = ["init", "ctx", "util:1:2:500:kernel"]
    # pid 1 of the container is the probe; the env names no shim: only /etc/ld.so.preload does
    pod = gpu_pod(gpu_node, "gpu-pidns", alloc, [str(gpu_node.build.probe), *steps], {})
    mounts = [m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]]
    assert "/etc/ld.so.preload" in mounts
    gpu_node.emu.create(pod, "pods", NS)
    done = gpu_node.emu.wait_for_pod_phase("gpu-pidns", ("Succeeded", "Failed"), NS, timeout=60)
    out = gpu_node.emu.pod_log("gpu-pidns", NS)
    assert done["status"]["phase"] == "Succeeded", out
    util = Result.parse(0, out, "").num("util", "util")
    assert 20 <= util <= 40, f"a 30 % compute slice used {util} % of the GPU:\n{out}"
