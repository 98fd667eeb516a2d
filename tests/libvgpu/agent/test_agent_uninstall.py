"""helm uninstall: the chart's pre-delete hook (``python -m libvgpu.agent.uninstall``, run as
the Job would) and a real node agent clean a GPU node — host files, label, inventory — and a
node whose agent does not answer is cleaned of its label and named. The agent answers as soon as
its watch of the Node sees the hook's annotation, not at its next inventory read (60 s by
default): `helm uninstall` waits for that answer."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from libvgpu import contract as L
from tests.kubeemu import KubeEmulator, NodeSpec
from tests.kubeemu.helpers import create_host_claim
from tests.kubeemu.images import Image
from tests.libvgpu.agent.test_agent import (
    HOST_PROC,
    NODE,
    NS,
    REPO,
    Node,
    add_default_priority_class,
    allocation,
    clean_env,
    gpu_node_root,
    gpu_pod,
    start_agent,
    stop_agent,
    wait_for,
)

ORPHAN = "gpu-node-without-agent"
CONFIG = f"""
NodeAgent:
  pod_namespace: {NS}
  metrics_ip: 127.0.0.1
  inventory_interval_seconds: 1
  pod_refresh_seconds: 0.3
Backstop:
  interval_seconds: 3600
"""
# the chart's agent: its inventory read every 60 s (the default), the uninstall seen by its watch
CHART_CONFIG = CONFIG.replace("  inventory_interval_seconds: 1\n", "")



@pytest.fixture(scope="module")
def unode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root, build, gpu_env = gpu_node_root(tmp_path_factory, "uninstall-node")
    orphan = NodeSpec(ORPHAN, labels={L.NODE_GPU_LABEL: "true"}, annotations={L.NODE_GPUS_ANNOTATION: "[]"})
    emu = KubeEmulator(
        nodes=[NodeSpec(NODE, labels={"nvidia.com/gpu.present": "true"}), orphan], namespaces=[NS],
        pod_env=gpu_env, node_mounts=[str(root), f"/proc:{HOST_PROC}"], images={"jupyter/gpu*": Image()},
    )  # fmt: skip
    emu.start()
    add_default_priority_class(emu)
    create_host_claim(emu, NS, root / "host")
    n = Node(root, build, emu, root / "host", root / "proc", root / "xid", gpu_env)
    n.proc_root.mkdir()
    try:
        yield n
    finally:
        stop_agent(n)
        emu.stop()


def hook(n: Node, timeout_s: float) -> str:
    """The Job's command, with the Job's arguments."""
    proc = subprocess.run(
        [sys.executable, "-m", "libvgpu.agent.uninstall", "--release", "jhub", "--timeout-seconds", str(timeout_s)],
        env={**clean_env(), **n.emu.env()}, cwd=REPO, capture_output=True, text=True, timeout=timeout_s + 60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def node_meta(n: Node, name: str = NODE) -> tuple[dict, dict]:
    meta = n.emu.get("nodes", name, None)["metadata"]
    return meta.get("labels") or {}, meta.get("annotations") or {}


def published(n: Node) -> bool:
    labels, annotations = node_meta(n)
    return labels.get(L.NODE_GPU_LABEL) == "true" and L.NODE_GPUS_ANNOTATION in annotations


def test_uninstall_keeps_host_files_under_running_gpu_pods_then_removes_them(unode):
    n = unode
    start_agent(n, CONFIG)
    wait_for(lambda: published(n), 15, "the inventory on the node")
    assert (n.host_dir / "lib" / "libvgpu.so").is_file() and (n.host_dir / "ld.so.preload").is_file()
    n.emu.create(gpu_pod(n, "still-running", allocation("a-run", "alice", 1024), ["/bin/sleep", "600"], {}))
    n.emu.wait_for_pod_phase("still-running", "Running", NS, timeout=20)

    started = time.monotonic()
    out = hook(n, timeout_s=8)
    lines = dict(line.split(": ", 1) for line in out.strip().splitlines())
    # a new process in a running GPU pod would start without the shim (unlimited): files stay
    assert lines[f"node {NODE}"].startswith("done: host files kept in"), out
    assert f"{NS}/still-running" in lines[f"node {NODE}"], out
    assert (n.host_dir / "lib" / "libvgpu.so").is_file() and (n.host_dir / "regions").is_dir()
    # the node without an agent: the hook itself removes its label and inventory, and says so
    assert "did not answer" in lines[f"node {ORPHAN}"] and time.monotonic() - started >= 8
    for name in (NODE, ORPHAN):
        labels, annotations = node_meta(n, name)
        assert L.NODE_GPU_LABEL not in labels, name
        assert not {L.NODE_GPUS_ANNOTATION, L.NODE_UNINSTALL_ANNOTATION} & set(annotations), name
    assert "Uninstall of node" in n.log()

    # the GPU pod ended; the agent restarts (as after a node reboot) and a second uninstall runs
    n.emu.delete("pods", "still-running", NS, grace_period_seconds=0)
    wait_for(lambda: n.emu.get("pods", "still-running", NS) is None, 20, "the pod to be gone")
    stop_agent(n)
    start_agent(n, CHART_CONFIG)
    wait_for(lambda: published(n), 15, "the inventory on the node again")
    # the agent's next inventory read is a minute away: it answers on its watch of the Node
    out = hook(n, timeout_s=20)
    assert out.strip() == f"node {NODE}: done: removed ld.so.preload, lib, regions from {n.host_dir}", out
    assert not n.host_dir.exists()
    labels, annotations = node_meta(n)
    assert L.NODE_GPU_LABEL not in labels and not {L.NODE_GPUS_ANNOTATION, L.NODE_UNINSTALL_ANNOTATION} & set(
        annotations
    )
