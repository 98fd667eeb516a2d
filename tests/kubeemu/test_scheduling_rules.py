"""Inter-pod affinity, preferred-affinity scoring and NoExecute taint eviction, as kube-scheduler
and the taint-eviction controller do them."""

from __future__ import annotations

import pytest

from tests.kubeemu import KubeEmulator, NodeSpec


@pytest.fixture(scope="module")
def emu():
    nodes = [NodeSpec(name, labels={"kubernetes.io/hostname": name, "zone": zone})
             for name, zone in (("node-a", "a"), ("node-b", "b"))]
    with KubeEmulator(nodes=nodes, restart_backoff_seconds=1.0) as emu:
        emu.create({"metadata": {"name": "rules"}}, "namespaces")
        yield emu


def _pod(name: str, labels: dict | None = None, **spec) -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "rules", "labels": labels or {}},
            "spec": {"containers": [{"name": "c", "image": "pause"}],
                     "terminationGracePeriodSeconds": 0, **spec}}


def _node_of(emu: KubeEmulator, name: str) -> str:
    return emu.wait_for(lambda: (emu.get("pods", name, "rules") or {}).get("spec", {})
                        .get("nodeName"), message=f"{name} to be scheduled")


def _scheduled_condition(emu: KubeEmulator, name: str) -> dict:
    def check():
        p = emu.get("pods", name, "rules")
        cond = next((c for c in p["status"].get("conditions") or []
                     if c["type"] == "PodScheduled"), None)
        return cond if cond and cond["status"] == "False" else None

    return emu.wait_for(check, message=f"{name} to be unschedulable")


def _clean(emu: KubeEmulator, *names: str) -> None:
    for n in names:
        if emu.get("pods", n, "rules"):
            emu.delete("pods", n, "rules", grace_period_seconds=0)
    emu.wait_for(lambda: not any(emu.get("pods", n, "rules") for n in names),
                 message="the pods to go")


def test_required_pod_anti_affinity_spreads_pods_and_refuses_a_third(emu):
    spread = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "web"}},
         "topologyKey": "kubernetes.io/hostname"}]}}
    names = ["web-1", "web-2", "web-3"]
    try:
        for n in names[:2]:
            emu.create(_pod(n, {"app": "web"}, affinity=spread))
            _node_of(emu, n)
        assert {_node_of(emu, n) for n in names[:2]} == {"node-a", "node-b"}
        emu.create(_pod("web-3", {"app": "web"}, affinity=spread))
        cond = _scheduled_condition(emu, "web-3")
        assert cond["message"].startswith(
            "0/2 nodes are available: 2 node(s) didn't match pod anti-affinity rules.")
    finally:
        _clean(emu, *names)


def test_required_pod_affinity_places_a_pod_beside_its_peer(emu):
    try:
        emu.create(_pod("db", {"app": "db"}, nodeSelector={"zone": "b"}))
        assert _node_of(emu, "db") == "node-b"
        emu.create(_pod("cache", affinity={"podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "zone"}]}}))
        assert _node_of(emu, "cache") == "node-b"
    finally:
        _clean(emu, "db", "cache")


def test_preferred_node_affinity_scores_the_preferred_node_first(emu):
    try:
        emu.create(_pod("picky", affinity={"nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 80, "preference": {"matchExpressions": [
                    {"key": "zone", "operator": "In", "values": ["b"]}]}}]}}))
        assert _node_of(emu, "picky") == "node-b"
    finally:
        _clean(emu, "picky")


def test_no_execute_taint_evicts_the_pods_that_do_not_tolerate_it(emu):
    names = ["plain", "tolerant", "brief"]
    try:
        emu.create(_pod("plain", nodeSelector={"zone": "a"}))
        emu.create(_pod("tolerant", nodeSelector={"zone": "a"}, tolerations=[
            {"key": "maintenance", "operator": "Exists", "effect": "NoExecute"}]))
        emu.create(_pod("brief", nodeSelector={"zone": "a"}, tolerations=[
            {"key": "maintenance", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 1}]))
        for n in names:
            emu.wait_for_pod_phase(n, "Running", "rules", timeout=15)
        emu.patch("nodes", "node-a", {"spec": {"taints": [
            {"key": "maintenance", "value": "true", "effect": "NoExecute"}]}}, None)
        emu.wait_for(lambda: emu.get("pods", "plain", "rules") is None, timeout=15,
                     message="the pod without a toleration to be evicted")
        events = emu.list("events", "rules", field_selector="involvedObject.name=plain")
        assert ("TaintManagerEviction", "Marking for deletion Pod rules/plain") in {
            (e["reason"], e["message"]) for e in events}
        emu.wait_for(lambda: emu.get("pods", "brief", "rules") is None, timeout=15,
                     message="the pod tolerating it for 1 s to be evicted")
        tolerant = emu.get("pods", "tolerant", "rules")
        assert tolerant is not None and not tolerant["metadata"].get("deletionTimestamp")
    finally:
        emu.patch("nodes", "node-a", {"spec": {"taints": None}}, None)
        _clean(emu, *names)
