"""Coexistence with the device plugin: a pod of another workload that asks for ``nvidia.com/gpu: 1``
never lands on a card holding slices (the Kubernetes API emulator's scheduler accounts extended
resources against node allocatable as kube-scheduler does).

A managed GPU node runs no device plugin, so it advertises no ``nvidia.com/gpu`` and
kube-scheduler places no whole-GPU pod there; where a device plugin does advertise cards on a
managed node, the hub slices none of that node's cards (the device plugin could hand any of
them out) and says so.
"""

from __future__ import annotations

import json
import logging
import uuid

import pytest
from traitlets.config import Config

from hubext.allocator import GPUAllocator
from libvgpu import contract as C
from quotas import GPURequest, Owner, PoolFull
from tests.hubext.test_claims_two_hubs import _pod
from tests.kubeemu.fixtures import kube_emulator, kube_namespace  # noqa: F401

CARD_MIB = 40960


def _gpu_node(emu, name: str, tag: str, device_plugin_gpus: int) -> None:
    gpus = [{"uuid": f"GPU-{name}-{i}", "model": "A100-40GB", "memory_mib": CARD_MIB, "index": i} for i in range(2)]
    allocatable = {"cpu": "32", "memory": "256Gi"}
    if device_plugin_gpus:
        allocatable["nvidia.com/gpu"] = str(device_plugin_gpus)
    emu.add_node(
        name,
        labels={C.NODE_GPU_LABEL: "true", "coexist-test": tag, "kubernetes.io/hostname": name},
        annotations={C.NODE_GPUS_ANNOTATION: json.dumps(gpus)},
        allocatable=allocatable,
    )


def _whole_gpu_pod(emu, name: str, namespace: str, selector: dict[str, str]) -> None:
    """A training job's pod as its own chart writes it: one whole card from the device plugin."""
    emu.create(
        {
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": selector,
                "containers": [
                    {
                        "name": "train",
                        "image": "registry.invalid/train:1",
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    }
                ],
            },
        },
        "pods",
        namespace,
    )


def _placement(emu, name: str, namespace: str) -> tuple[str | None, str]:
    """(node the scheduler bound the pod to, or None; its PodScheduled message)."""

    def decided():
        pod = emu.get("pods", name, namespace)
        scheduled = next((c for c in pod["status"].get("conditions") or [] if c["type"] == "PodScheduled"), None)
        return pod if pod["spec"].get("nodeName") or (scheduled and scheduled["status"] == "False") else None

    pod = emu.wait_for(decided, 10, message=f"pod {name} scheduled or unschedulable")
    scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
    return pod["spec"].get("nodeName"), scheduled.get("message", "")


def _hub(namespace: str, tag: str) -> GPUAllocator:
    c = Config()
    c.GPUAllocator.pool_backend_class = "kubernetes"
    c.KubernetesPool.namespace = namespace
    c.KubernetesPool.node_label_selector = f"coexist-test={tag}"
    return GPUAllocator(config=c)


async def test_a_whole_gpu_pod_of_another_workload_never_lands_on_a_card_holding_slices(
    kube_emulator,  # noqa: F811
    kube_namespace,  # noqa: F811
    caplog,
):
    emu, ns, tag = kube_emulator, kube_namespace, uuid.uuid4().hex[:6]
    managed, plain = f"gpu-managed-{tag}", f"gpu-plain-{tag}"
    _gpu_node(emu, managed, tag, device_plugin_gpus=0)  # the device plugin is off here
    emu.add_node(  # a GPU node of the cluster that the hub does not manage: the device plugin's
        plain, labels={"coexist-plain": tag}, allocatable={"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "2"}
    )
    hub = _hub(ns, tag)
    try:
        # the hub slices both cards of the managed node
        slices = [
            await hub.allocate(GPURequest(owner=Owner(f"u{i}"), memory_mib=16384, cores_percent=40), queue=False)
            for i in range(4)
        ]
        assert {u for a in slices for u in a.gpu_uuids} == {f"GPU-{managed}-0", f"GPU-{managed}-1"}
        for allocation in slices:
            _pod(emu, allocation, ns)
        # a training pod pinned to the managed node: kube-scheduler finds no nvidia.com/gpu there
        _whole_gpu_pod(emu, "train-pinned", ns, {"kubernetes.io/hostname": managed})
        node, message = _placement(emu, "train-pinned", ns)
        assert node is None and "Insufficient nvidia.com/gpu" in message
        # one that may go anywhere among these nodes lands on the device plugin's node
        emu.patch("nodes", managed, {"metadata": {"labels": {"coexist-plain": tag}}}, None)
        _whole_gpu_pod(emu, "train-anywhere", ns, {"coexist-plain": tag})
        assert _placement(emu, "train-anywhere", ns)[0] == plain
    finally:
        await hub.backend.stop()
        emu.remove_node(managed)
        emu.remove_node(plain)


async def test_a_managed_node_where_the_device_plugin_hands_out_cards_is_not_sliced_and_the_hub_says_why(
    kube_emulator,  # noqa: F811
    kube_namespace,  # noqa: F811
    caplog,
):
    emu, ns, tag = kube_emulator, kube_namespace, uuid.uuid4().hex[:6]
    node = f"gpu-plugin-{tag}"
    _gpu_node(emu, node, tag, device_plugin_gpus=2)  # labelled for the hub, but the device plugin runs
    hub = _hub(ns, tag)
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(PoolFull):
            await hub.allocate(GPURequest(owner=Owner("u"), memory_mib=4096, cores_percent=10), queue=False)
        assert hub.state.allocations == {}
        assert f"Node {node} advertises 2 nvidia.com/gpu: a device plugin hands its cards out whole" in caplog.text
        assert "nvidia.com/gpu.deploy.device-plugin=false" in caplog.text
        # so whichever card the device plugin gives a training pod, it holds no slice
        _whole_gpu_pod(emu, "train", ns, {"kubernetes.io/hostname": node})
        assert _placement(emu, "train", ns)[0] == node
        assert emu.list("pods", ns, label_selector=f"{C.MANAGED}=true") == []
    finally:
        await hub.backend.stop()
        emu.remove_node(node)
