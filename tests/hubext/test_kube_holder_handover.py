"""A kernel restart in Kubernetes mode has the race of the local one: the old kernel pod ends on
its own (jupyter_client's shutdown_request) before the pool has listed the new pod. The pool's
reconciliation then finds no live pod for the allocation and reports its holder gone. Inside the
broker's handover that report keeps the slice; the new pod's own end is still reported.

A real GPUAllocator with a real KubernetesPool, through the Kubernetes API emulator.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from traitlets.config import Config

from hubext.allocator import GPUAllocator
from libvgpu import contract as C
from quotas import GPURequest, Owner
from tests.kubeemu.fixtures import kube_emulator, kube_namespace  # noqa: F401


def _kernel_pod(name: str, allocation) -> dict:
    return {
        "metadata": {
            "name": name,
            "labels": C.allocation_labels(allocation),
            "annotations": C.allocation_annotations(allocation),
        },
        "spec": {"nodeName": allocation.node, "containers": [{"name": "kernel", "image": "registry.invalid/none:1"}]},
    }


async def _until(predicate, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_an_old_kernel_pod_that_ends_before_the_new_one_is_listed_keeps_the_slice_in_a_handover(
    kube_emulator,  # noqa: F811
    kube_namespace,  # noqa: F811
):
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node = f"gpu-handover-{tag}"
    gpus = [{"uuid": f"GPU-{tag}", "model": "H100-80GB", "memory_mib": 81920, "index": 0}]
    emu.add_node(
        node,
        labels={C.NODE_GPU_LABEL: "true", "handover-test": tag},
        annotations={C.NODE_GPUS_ANNOTATION: json.dumps(gpus)},
        allocatable={"cpu": "16", "memory": "64Gi"},
    )
    c = Config()
    c.GPUAllocator.pool_backend_class = "kubernetes"
    c.KubernetesPool.namespace = kube_namespace
    c.KubernetesPool.node_label_selector = f"handover-test={tag}"
    c.KubernetesPool.reconcile_interval_seconds = 0.05
    allocator = GPUAllocator(config=c)
    reports: list[tuple[str, str]] = []
    holder_gone = allocator._holder_gone

    async def spy(allocation_id: str, why: str) -> None:  # what the pool reports, then the allocator's own handling
        reports.append((allocation_id, why))
        await holder_gone(allocation_id, why)

    allocator._holder_gone = spy
    try:
        await allocator.ensure_started()
        pool = allocator.backend

        async def restart(allocation, old: str, new: str) -> None:
            """The old pod ends first; the reconciliation runs before the new one is created and listed."""
            emu.delete("pods", old, kube_namespace, grace_period_seconds=0)
            await _until(lambda: (allocation.id, "its pod is gone") in reports, "the old pod reported gone")
            emu.create(_kernel_pod(new, allocation), "pods", kube_namespace)
            # listed, and seen live by a reconciliation round (as a running kernel pod is)
            await _until(lambda: allocation.id in pool._seen, "the new pod to be seen live")

        kept = await allocator.allocate(
            GPURequest(owner=Owner("alice"), memory_mib=10240, cores_percent=25, kind="kernel"), queue=False
        )
        emu.create(_kernel_pod("k1-g0", kept), "pods", kube_namespace)
        await _until(lambda: kept.id in pool._seen, "the kernel pod to be seen live")
        async with allocator.handover(kept.id):
            await restart(kept, "k1-g0", "k1-g1")
        assert allocator.get(kept.id) is not None, "the restarted kernel's slice was released"
        # the new pod's own end is still noticed: the slice goes back
        emu.delete("pods", "k1-g1", kube_namespace, grace_period_seconds=0)
        await _until(lambda: allocator.get(kept.id) is None, "the slice to be released after the new pod ended")

        # the same sequence outside a handover (what a restart did before): the slice is lost
        lost = await allocator.allocate(
            GPURequest(owner=Owner("alice"), memory_mib=10240, cores_percent=25, kind="kernel"), queue=False
        )
        emu.create(_kernel_pod("k2-g0", lost), "pods", kube_namespace)
        await _until(lambda: lost.id in pool._seen, "the kernel pod to be seen live")
        await restart(lost, "k2-g0", "k2-g1")
        assert allocator.get(lost.id) is None
    finally:
        await allocator.backend.stop()
        emu.remove_node(node)
