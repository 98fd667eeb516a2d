"""The Kubernetes pool feeds the admission core each GPU node's CPU and memory: allocatable from
the Node, what pods outside the ledger request from the pods, and what a ledger pod holds from
its own requests (through the Kubernetes API emulator)."""

from __future__ import annotations

import asyncio
import json
import uuid

from hubext import contract as C
from hubext.kubernetes.pool import KubernetesPool, pod_requests
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
                           allocatable={"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"})
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
