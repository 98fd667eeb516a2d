"""The node agent's RBAC grants what its code calls and nothing more (least privilege for a root,
host-PID DaemonSet on every GPU node): the Kubernetes API calls of libvgpu/agent/kube.py, read
from its source, against the rules of the Roles and ClusterRole the chart binds to the agent."""

from __future__ import annotations

import re

from tests.helm import tools

KUBE = tools.REPO / "libvgpu" / "agent" / "kube.py"

# kubernetes_asyncio CoreV1Api method -> (resource, verb)
METHODS = {
    "read_node": ("nodes", "get"),
    "list_node": ("nodes", "list"),
    "patch_node": ("nodes", "patch"),
    "read_namespaced_pod": ("pods", "get"),
    "list_namespaced_pod": ("pods", "list"),
    "list_pod_for_all_namespaces": ("pods", "list"),
    "patch_namespaced_pod": ("pods", "patch"),
    "create_namespaced_event": ("events", "create"),
    "patch_namespaced_event": ("events", "patch"),
}


def _called() -> set[tuple[str, str]]:
    source = KUBE.read_text()
    names = set(re.findall(r"self\.core\.(\w+)", source))
    unknown = names - set(METHODS)
    assert not unknown, f"kube.py calls {sorted(unknown)}: add them to METHODS"
    called = {METHODS[n] for n in names}
    if "watch.Watch()" in source and "list_namespaced_pod" in names:
        called.add(("pods", "watch"))  # a watch of the pod list
    if "watch.Watch()" in source and "list_node" in names:
        called.add(("nodes", "watch"))  # a watch of its Node (the node list narrowed to its name)
    return called


def _granted(docs: list[dict]) -> set[tuple[str, str]]:
    """(resource, verb) of every rule bound to the node agent's ServiceAccount."""
    account = tools.one(docs, "ServiceAccount", f"{tools.RELEASE}-elastic-gpu-node-agent")["metadata"]["name"]
    bound = {
        (b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace"))
        for b in docs
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s.get("kind") == "ServiceAccount" and s["name"] == account for s in b["subjects"])
    }
    granted = set()
    for d in docs:
        if d["kind"] not in ("Role", "ClusterRole"):
            continue
        key = (d["kind"], d["metadata"]["name"], d["metadata"].get("namespace") if d["kind"] == "Role" else None)
        if key not in bound and (d["kind"], d["metadata"]["name"], None) not in bound:
            continue
        for rule in d["rules"]:
            assert rule["apiGroups"] == [""], rule
            granted |= {(r, v) for r in rule["resources"] for v in rule["verbs"]}
    return granted


def test_the_node_agents_roles_grant_only_the_calls_its_code_makes():
    docs = tools.render()
    called, granted = _called(), _granted(docs)
    assert granted, "no Role is bound to the node agent"
    assert not granted - called, f"granted but never called: {sorted(granted - called)}"
    assert not called - granted, f"called but not granted: {sorted(called - granted)}"
