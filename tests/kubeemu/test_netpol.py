"""NetworkPolicies are not enforced (no CNI): tests check them by their selectors."""

from __future__ import annotations

import pytest

from tests.kubeemu.netpol import allowed, selects


def _pod(name: str, ns: str, labels: dict, ip: str = "", ports: list | None = None) -> dict:
    return {"metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "python:3.11",
                                     "ports": ports or []}]},
            "status": {"podIP": ip} if ip else {}}


def _policy(ns: str, selector: dict, ingress: list | None = None, egress: list | None = None,
            types: list | None = None) -> dict:
    spec: dict = {"podSelector": selector}
    if ingress is not None:
        spec["ingress"] = ingress
    if egress is not None:
        spec["egress"] = egress
    if types:
        spec["policyTypes"] = types
    return {"metadata": {"name": "p", "namespace": ns}, "spec": spec}


# the shape of the per-kernel policy: only the owner's server may reach the kernel's ports
KERNEL = _policy("users", {"matchLabels": {"kernel-id": "k1"}},
                 ingress=[{"from": [{"podSelector": {"matchLabels": {
                     "component": "singleuser-server", "hub.jupyter.org/username": "alice"}}}],
                           "ports": [{"protocol": "TCP", "port": 5555},
                                     {"protocol": "TCP", "port": "shell"}]}],
                 types=["Ingress"])
KERNEL_POD = _pod("kernel-k1", "users", {"kernel-id": "k1"},
                  ports=[{"name": "shell", "containerPort": 5556}])
ALICE = _pod("jupyter-alice", "users", {"component": "singleuser-server",
                                        "hub.jupyter.org/username": "alice"})
BOB = _pod("jupyter-bob", "users", {"component": "singleuser-server",
                                    "hub.jupyter.org/username": "bob"})
ALICE_ELSEWHERE = _pod("jupyter-alice", "other", ALICE["metadata"]["labels"])


def test_a_policy_selects_by_namespace_and_pod_selector():
    assert selects(KERNEL, KERNEL_POD)
    assert not selects(KERNEL, ALICE)
    assert not selects(KERNEL, _pod("kernel-k1", "other", {"kernel-id": "k1"}))
    everything = _policy("users", {})
    assert selects(everything, ALICE) and selects(everything, KERNEL_POD)


def test_ingress_admits_only_the_selected_peers_on_the_listed_ports():
    assert allowed([KERNEL], ALICE, KERNEL_POD, 5555)
    assert allowed([KERNEL], ALICE, KERNEL_POD, 5556)  # the named port "shell"
    assert not allowed([KERNEL], ALICE, KERNEL_POD, 5557)
    assert not allowed([KERNEL], BOB, KERNEL_POD, 5555)
    # a bare podSelector peer means "in the policy's namespace"
    assert not allowed([KERNEL], ALICE_ELSEWHERE, KERNEL_POD, 5555)
    # pods no policy selects stay open
    assert allowed([KERNEL], BOB, ALICE, 8888)


def test_namespace_selectors_ip_blocks_and_egress():
    from_other = _policy("users", {"matchLabels": {"kernel-id": "k1"}}, ingress=[{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "a"}},
         "podSelector": {"matchLabels": {"component": "singleuser-server"}}}]}])
    namespaces = {"other": {"team": "a"}, "users": {}}
    assert allowed([from_other], ALICE_ELSEWHERE, KERNEL_POD, 1, namespaces=namespaces)
    assert not allowed([from_other], ALICE, KERNEL_POD, 1, namespaces=namespaces)
    by_name = _policy("users", {}, ingress=[{"from": [{"namespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": "other"}}}]}])
    assert allowed([by_name], ALICE_ELSEWHERE, KERNEL_POD, 1)
    block = _policy("users", {}, ingress=[{"from": [{"ipBlock": {
        "cidr": "127.64.0.0/16", "except": ["127.64.9.0/24"]}}]}])
    assert allowed([block], _pod("a", "x", {}, ip="127.64.1.1"), KERNEL_POD, 1)
    assert not allowed([block], _pod("a", "x", {}, ip="127.64.9.1"), KERNEL_POD, 1)
    deny_out = _policy("users", {"matchLabels": {"hub.jupyter.org/username": "bob"}},
                       egress=[{"to": [{"podSelector": {"matchLabels": {"kernel-id": "k1"}}}],
                                "ports": [{"port": 5555}]}], types=["Egress"])
    assert allowed([deny_out], BOB, KERNEL_POD, 5555)
    assert not allowed([deny_out], BOB, ALICE, 8888)
    assert allowed([deny_out], ALICE, BOB, 8888)  # ingress of bob is not restricted


def test_policies_stored_through_the_api_are_evaluated(kube_emulator, kube_namespace):
    ns = kube_namespace
    for p in (KERNEL_POD, ALICE, BOB):
        manifest = {"metadata": {"name": p["metadata"]["name"],
                                 "labels": p["metadata"]["labels"]},
                    "spec": {"nodeName": "not-a-node", "containers": p["spec"]["containers"]}}
        kube_emulator.create(manifest, "pods", ns)
    policy = {**KERNEL, "metadata": {"name": "kernel-k1-ingress", "namespace": ns}}
    kube_emulator.create(policy, "networkpolicies", ns, group="networking.k8s.io")
    assert kube_emulator.network_policy_allows((ns, "jupyter-alice"), (ns, "kernel-k1"), 5555)
    assert not kube_emulator.network_policy_allows((ns, "jupyter-bob"), (ns, "kernel-k1"), 5555)
    with pytest.raises(KeyError):
        kube_emulator.network_policy_allows((ns, "nobody"), (ns, "kernel-k1"), 5555)
