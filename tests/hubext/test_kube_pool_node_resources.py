"""The Kubernetes pool feeds the admission core each GPU node's CPU and memory: allocatable from
the Node, what pods outside the ledger request from the pods, and what a ledger pod holds from
its own requests (through the Kubernetes API emulator)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

from hubext.kubernetes.pool import KubernetesPool, pod_requests
from libvgpu import contract as C
from quotas import AdmissionConfig, AdmissionState, Allocation, GPURequest, Owner
from tests.kubeemu.fixtures import kube_emulator, kube_namespace  # noqa: F401


def _pod(name: str, node: str, cpu: str, memory: str, labels=None, annotations=None) -> dict:
    return {
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "registry.invalid/none:1",
                            "resources": {"requests": {"cpu": cpu, "memory": memory}}}],
        },
    }


async def test_pool_reads_node_allocatable_other_pods_and_ledger_pods_requests(
    kube_emulator, kube_namespace  # noqa: F811
):
    node = f"gpu-res-{uuid.uuid4().hex[:6]}"
    gpus = [{"uuid": f"GPU-{node}", "model": "H100-80GB", "memory_mib": 81920, "index": 0}]
    kube_emulator.add_node(node, labels={C.NODE_GPU_LABEL: "true"},
                           annotations={C.NODE_GPUS_ANNOTATION: json.dumps(gpus)},
                           allocatable={"cpu": "8", "memory": "32Gi"})
    held = Allocation(id="nb-alice-1", owner=Owner("alice"), node=node, gpu_uuids=(f"GPU-{node}",),
                      memory_mib=10240, cores_percent=25, priority_class="default")
    pool = KubernetesPool(namespace=kube_namespace)
    try:
        kube_emulator.create(_pod("other", node, "1500m", "4Gi"), "pods", kube_namespace)
        kube_emulator.create(_pod("ledger", node, "2", "8Gi", C.allocation_labels(held),
                                  C.allocation_annotations(held)), "pods", kube_namespace)
        await pool.start(lambda *_: asyncio.sleep(0))
        pool_now = await pool.inventory()
        mine = pool_now.node(node)
        assert (mine.cpu_millicores, mine.host_memory_mib) == (8000, 32768)
        # the ledger's own pod is counted by its allocation, not twice
        assert (mine.cpu_requested_millicores, mine.host_memory_requested_mib) == (1500, 4096)
        for _ in range(100):
            ledger = {a.id: a for a in await pool.allocations()}
            if held.id in ledger:
                break
            await asyncio.sleep(0.05)
        got = ledger[held.id]
        assert (got.cpu_millicores, got.host_memory_mib) == (2000, 8192)
        # 8 CPUs - 1.5 for the other pod - 2 for alice's: a 5 CPU notebook must wait, 4 fits
        state = AdmissionState(AdmissionConfig(), pool_now, [got])
        ask = dict(owner=Owner("bob"), memory_mib=10240, cores_percent=25, model="H100-80GB")
        assert state.decide(GPURequest(**ask, cpu_millicores=5000)).kind in ("wait", "reject")
        granted = state.decide(GPURequest(**ask, cpu_millicores=4000))
        assert granted.kind == "grant" and granted.allocation.node == node
    finally:
        await pool.stop()
        kube_emulator.remove_node(node)


def test_a_pod_asks_its_containers_in_sum_or_its_largest_init_container():
    pod = {"spec": {
        "containers": [{"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
                       {"resources": {"requests": {"cpu": "250m"}}}, {}],
        "initContainers": [{"resources": {"requests": {"cpu": "2", "memory": "512Mi"}}}],
    }}
    assert pod_requests(pod) == (2000, 1024)
    assert pod_requests({"spec": {"containers": [{"resources": {"requests": {"cpu": "bad"}}}]}}) == (0, 0)


_INVENTORY = """
import asyncio, json, logging, sys
from kubespawner.clients import load_config
from hubext.kubernetes.pool import KubernetesPool
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

async def main():
    load_config()
    pool = KubernetesPool(namespace=sys.argv[1], node_label_selector=sys.argv[2])
    pool.log = logging.getLogger("pool")
    node = (await pool.inventory()).nodes[0]
    print(json.dumps([node.cpu_requested_millicores, node.host_memory_requested_mib]))

asyncio.run(main())
"""


def test_a_hub_that_may_not_list_pods_cluster_wide_counts_its_namespace_and_says_so(
    kube_emulator, kube_namespace, tmp_path  # noqa: F811
):
    """The hub's service account may list pods in its namespace only (RBAC): the API server
    answers the cluster-wide list with 403, and the pool counts its own namespace's pods."""
    emu, ns = kube_emulator, kube_namespace
    node = f"gpu-rbac-{uuid.uuid4().hex[:6]}"
    gpus = [{"uuid": f"GPU-{node}", "model": "H100-80GB", "memory_mib": 81920, "index": 0}]
    emu.add_node(node, labels={C.NODE_GPU_LABEL: "true", "rbac-test": node},
                 annotations={C.NODE_GPUS_ANNOTATION: json.dumps(gpus)}, allocatable={"cpu": "8", "memory": "32Gi"})
    rbac = "rbac.authorization.k8s.io/v1"
    ref = {"apiGroup": "rbac.authorization.k8s.io"}
    subjects = [{"kind": "ServiceAccount", "name": "hub", "namespace": ns}]
    try:
        emu.create({"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": f"nodes-{ns}"},
                    "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]})
        emu.create({"apiVersion": rbac, "kind": "ClusterRoleBinding", "metadata": {"name": f"nodes-{ns}"},
                    "roleRef": {**ref, "kind": "ClusterRole", "name": f"nodes-{ns}"}, "subjects": subjects})
        emu.create({"apiVersion": rbac, "kind": "Role", "metadata": {"name": "pods", "namespace": ns},
                    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})
        emu.create({"apiVersion": rbac, "kind": "RoleBinding", "metadata": {"name": "pods", "namespace": ns},
                    "roleRef": {**ref, "kind": "Role", "name": "pods"}, "subjects": subjects})
        emu.create(_pod("other", node, "1500m", "4Gi"), "pods", ns)
        script = tmp_path / "inventory.py"
        script.write_text(_INVENTORY)
        kubeconfig = emu.kubeconfig_for(emu.service_account_token(ns, "hub"), ns)
        done = subprocess.run([sys.executable, str(script), ns, f"rbac-test={node}"], capture_output=True,
                              text=True, timeout=60, env={**os.environ, **emu.env(kubeconfig)})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [1500, 4096]
        assert (
            "The hub may not list pods in all namespaces; counting only the CPU and memory requests "
            f"of pods in {ns}" in done.stderr
        )
    finally:
        emu.remove_node(node)
