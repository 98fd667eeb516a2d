"""Two releases on one cluster (issue 15): ``helm template --dry-run=server`` against the
Kubernetes API emulator, so the chart's ``lookup`` of the shared claims namespace sees what
the first release made. The second release renders no object of the first one's; the first
release still owns (and keeps rendering) the namespace it created; both hubs may write claims
there, each through its own Role.

The emulator serves no apps/v1 (no workload controllers), so these renders leave out the node
agent's DaemonSet and the culler's Deployment (test_cluster_fit renders them client-side).
"""

from __future__ import annotations

import uuid

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException

from tests.helm import tools
from tests.kubeemu.fixtures import kube_emulator  # noqa: F401

try:
    tools.helm_path()
except tools.HelmMissing as e:
    pytest.skip(str(e), allow_module_level=True)


def _render_on(emu, release: str, namespace: str, claims_ns: str) -> list[dict]:
    proc = tools.helm(
        "template",
        release,
        str(tools.CHART),
        "--namespace",
        namespace,
        "--dry-run=server",
        "--disable-openapi-validation",
        "--kubeconfig",
        emu.tls_kubeconfig_path,  # helm (client-go) sends no token over plain HTTP
        "--set",
        f"claims.namespace={claims_ns}",
        "--set",
        "nodeAgent.enabled=false",
        "--set",
        "culler.enabled=false",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _install_claims_objects(emu, docs: list[dict], claims_ns: str, release: str, namespace: str) -> None:
    """What ``helm install`` creates of the claims namespace and the Roles in it, with the
    ownership metadata Helm writes (and checks on the next install or upgrade)."""

    def owned(doc: dict) -> dict:
        meta = doc["metadata"]
        meta["labels"] = {**(meta.get("labels") or {}), "app.kubernetes.io/managed-by": "Helm"}
        meta["annotations"] = {
            **(meta.get("annotations") or {}),
            "meta.helm.sh/release-name": release,
            "meta.helm.sh/release-namespace": namespace,
        }
        return doc

    for doc in docs:
        if doc["kind"] == "Namespace" and doc["metadata"]["name"] == claims_ns:
            emu.create(owned(doc), "namespaces")
    for doc in docs:
        if doc["kind"] in ("Role", "RoleBinding") and doc["metadata"]["namespace"] == claims_ns:
            emu.create(owned(doc), doc["kind"].lower() + "s", claims_ns, group="rbac.authorization.k8s.io")


def _keys(docs: list[dict]) -> set[tuple[str, str, str]]:
    return {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in docs}


def test_claims_namespace_is_created_once_and_both_hubs_may_write_claims(kube_emulator):  # noqa: F811
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    claims_ns, ns_a, ns_b = f"claims-{tag}", f"team-a-{tag}", f"team-b-{tag}"
    for ns in (ns_a, ns_b):
        emu.create({"metadata": {"name": ns}}, "namespaces")
    try:
        a = _render_on(emu, "hub-a", ns_a, claims_ns)
        assert ("Namespace", "", claims_ns) in _keys(a)
        # helm install of hub-a: the namespace now exists, owned (as Helm marks it) by hub-a
        _install_claims_objects(emu, a, claims_ns, "hub-a", ns_a)
        b = _render_on(emu, "hub-b", ns_b, claims_ns)
        assert not _keys(a) & _keys(b), sorted(_keys(a) & _keys(b))
        _install_claims_objects(emu, b, claims_ns, "hub-b", ns_b)
        # each hub's service account may write claims through its release's Role, and no more
        for ns in (ns_a, ns_b):
            config = kubernetes.config.new_client_from_config(
                emu.kubeconfig_for(emu.service_account_token(ns, "hub"), ns)
            )
            core = kubernetes.client.CoreV1Api(config)
            try:
                body = {"metadata": {"name": f"elastic-gpu-claims.node-{ns}"}, "data": {"hub.x": "{}"}}
                made = core.create_namespaced_config_map(claims_ns, body)
                made.data = {"hub.x": '{"claims": {}}'}
                core.replace_namespaced_config_map(made.metadata.name, claims_ns, made)
                assert len(core.list_namespaced_config_map(claims_ns).items) >= 1
                with pytest.raises(ApiException) as refused:
                    core.delete_namespaced_config_map(made.metadata.name, claims_ns)
                assert refused.value.status == 403
            finally:
                config.close()
        # an upgrade of hub-a keeps rendering the namespace it owns (else Helm would delete it)
        assert ("Namespace", "", claims_ns) in _keys(_render_on(emu, "hub-a", ns_a, claims_ns))
    finally:
        for ns in (ns_a, ns_b, claims_ns):
            emu.delete("namespaces", ns, None)
