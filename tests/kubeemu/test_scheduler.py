"""Scheduling against emulated nodes: fit, unschedulable reasons, retry when room appears."""

from __future__ import annotations

import pytest

from tests.kubeemu import KubeEmulator, NodeSpec
from tests.kubeemu.helpers import http


@pytest.fixture(scope="module")
def emu():
    nodes = [
        NodeSpec("gpu-a", labels={"elastic-gpu.jupyter.org/gpu-node": "true", "gpu": "h100"},
                 annotations={"elastic-gpu.jupyter.org/gpus": "[]"},
                 allocatable={"nvidia.com/gpu": "1"}),
        {"name": "cpu-a", "labels": {"pool": "cpu"}, "allocatable": {"cpu": "4"}},
    ]
    with KubeEmulator(nodes=nodes, restart_backoff_seconds=1.0) as emu:
        yield emu


def _pod(name: str, gpus: int = 0, node_selector: dict | None = None, **spec) -> dict:
    container = {"name": "c", "image": "pause"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {"kind": "Pod", "metadata": {"name": name}, "spec": {"containers": [container], **spec}}


def _condition(pod: dict, ctype: str) -> dict:
    return next(c for c in pod["status"].get("conditions") or [] if c["type"] == ctype)


def _unschedulable(emu: KubeEmulator, name: str) -> dict:
    def check():
        p = emu.get("pods", name)
        conds = {c["type"]: c for c in p["status"].get("conditions") or []}
        c = conds.get("PodScheduled")
        return c and c["status"] == "False" and p

    return emu.wait_for(check, message=f"{name} to be marked unschedulable")


def _events(emu: KubeEmulator, name: str) -> list[tuple[str, str]]:
    return [(e["reason"], e["message"]) for e in emu.list(
        "events", "default", field_selector=f"involvedObject.name={name}")]


def test_nodes_carry_labels_annotations_and_allocatable(emu):
    node = emu.get("nodes", "gpu-a", None)
    assert node["metadata"]["labels"]["gpu"] == "h100"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "gpu-a"
    assert node["metadata"]["annotations"] == {"elastic-gpu.jupyter.org/gpus": "[]"}
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    patched = emu.patch("nodes", "gpu-a", {"metadata": {"labels": {"extra": "yes"}}}, None)
    assert patched["metadata"]["labels"]["extra"] == "yes"
    status = emu.patch("nodes", "gpu-a", {"status": {"capacity": {"nvidia.com/gpu": "1"}}},
                       None, subresource="status")
    assert status["status"]["allocatable"]["nvidia.com/gpu"] == "1"


def test_gpu_pod_lands_on_the_gpu_node_and_a_second_waits_until_the_first_goes(emu):
    emu.create(_pod("first", gpus=1))
    first = emu.wait_for_pod_phase("first", "Running")
    assert first["spec"]["nodeName"] == "gpu-a"
    assert _condition(first, "PodScheduled")["status"] == "True"
    emu.create(_pod("second", gpus=1))
    second = _unschedulable(emu, "second")
    cond = _condition(second, "PodScheduled")
    assert cond["reason"] == "Unschedulable"
    assert cond["message"] == ("0/2 nodes are available: 2 Insufficient nvidia.com/gpu. "
                               "preemption: 0/2 nodes are available: 2 Preemption is not "
                               "helpful for scheduling.")
    assert second["status"]["phase"] == "Pending" and "nodeName" not in second["spec"]
    assert ("FailedScheduling", cond["message"]) in _events(emu, "second")
    emu.delete("pods", "first", grace_period_seconds=0)
    scheduled = emu.wait_for_pod_phase("second", "Running")
    assert scheduled["spec"]["nodeName"] == "gpu-a"
    emu.delete("pods", "second", grace_period_seconds=0)


def test_node_selector_matching_no_node_is_unschedulable_until_a_node_appears(emu):
    emu.create(_pod("picky", node_selector={"gpu": "a100"}))
    cond = _condition(_unschedulable(emu, "picky"), "PodScheduled")
    assert cond["message"].startswith(
        "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector.")
    emu.add_node("gpu-b", labels={"gpu": "a100"}, allocatable={"nvidia.com/gpu": "4"})
    placed = emu.wait_for_pod_phase("picky", "Running")
    assert placed["spec"]["nodeName"] == "gpu-b"
    emu.delete("pods", "picky", grace_period_seconds=0)
    emu.wait_for(lambda: emu.get("pods", "picky") is None, message="picky gone")
    emu.remove_node("gpu-b")


def test_required_node_affinity_and_taints(emu):
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["cpu"]}]}]}}}
    emu.create(_pod("affine", affinity=affinity))
    assert emu.wait_for_pod_phase("affine", "Running")["spec"]["nodeName"] == "cpu-a"
    emu.delete("pods", "affine", grace_period_seconds=0)
    emu.add_node("tainted", labels={"only": "me"},
                 taints=[{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}])
    emu.create(_pod("intolerant", node_selector={"only": "me"}))
    cond = _condition(_unschedulable(emu, "intolerant"), "PodScheduled")
    assert "1 node(s) had untolerated taint {dedicated: ml}" in cond["message"]
    emu.create(_pod("tolerant", node_selector={"only": "me"}, tolerations=[
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]))
    assert emu.wait_for_pod_phase("tolerant", "Running")["spec"]["nodeName"] == "tainted"
    for name in ("intolerant", "tolerant"):
        emu.delete("pods", name, grace_period_seconds=0)
    emu.remove_node("tainted")


def test_pod_bound_by_node_name_to_a_full_node_is_rejected_by_the_kubelet(emu):
    emu.create(_pod("holder", gpus=1))
    emu.wait_for_pod_phase("holder", "Running")
    emu.create(_pod("pinned", gpus=1, nodeName="gpu-a"))
    rejected = emu.wait_for_pod_phase("pinned", "Failed")
    assert rejected["status"]["reason"] == "OutOfnvidia.com/gpu"
    assert rejected["status"]["message"] == (
        "Pod was rejected: Node didn't have enough resource: nvidia.com/gpu, requested: 1, "
        "used: 1, capacity: 1")
    emu.delete("pods", "holder", grace_period_seconds=0)
    emu.delete("pods", "pinned")


def test_pod_for_another_scheduler_stays_pending_without_conditions(emu):
    emu.create(_pod("hami", schedulerName="hami-scheduler"))
    emu.create(_pod("marker"))
    emu.wait_for_pod_phase("marker", "Running")  # the default scheduler has run since
    hami = emu.get("pods", "hami")
    assert hami["status"]["phase"] == "Pending" and not hami["status"].get("conditions")
    assert "nodeName" not in hami["spec"]
    # that scheduler binds it through pods/binding, as kube-scheduler does
    code, _ = http(emu, "POST", "/api/v1/namespaces/default/pods/hami/binding", {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": "hami"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "cpu-a"}})
    assert code == 201
    assert emu.wait_for_pod_phase("hami", "Running")["spec"]["nodeName"] == "cpu-a"
    code, body = http(emu, "POST", "/api/v1/namespaces/default/pods/hami/binding", {
        "target": {"kind": "Node", "name": "gpu-a"}})
    assert code == 409 and body["reason"] == "Conflict"
    for name in ("hami", "marker"):
        emu.delete("pods", name, grace_period_seconds=0)
