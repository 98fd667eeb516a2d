"""RBAC: a service account's token may do what its Roles and ClusterRoles allow, nothing else
(403 bodies as kube-apiserver writes them); the emulator's own token stays a cluster admin."""

from __future__ import annotations

import json

import kubernetes
import pytest
from kubernetes.client.rest import ApiException


def _client(emu, ns: str, name: str):
    token = emu.service_account_token(ns, name)
    return kubernetes.config.new_client_from_config(emu.kubeconfig_for(token, ns))


def test_a_service_account_may_only_what_its_bindings_grant(kube_emulator, kube_namespace):
    emu, ns = kube_emulator, kube_namespace
    rbac = "rbac.authorization.k8s.io/v1"
    emu.create({"apiVersion": rbac, "kind": "Role", "metadata": {"name": "pods", "namespace": ns},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                          {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"],
                           "resourceNames": ["mine"]}]})
    emu.create({"apiVersion": rbac, "kind": "RoleBinding", "metadata": {"name": "hub", "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
                "subjects": [{"kind": "ServiceAccount", "name": "hub", "namespace": ns}]})
    emu.create({"metadata": {"name": "mine"}, "data": {"a": "1"}}, "configmaps", ns)
    emu.create({"metadata": {"name": "other"}, "data": {"a": "1"}}, "configmaps", ns)
    api_client = _client(emu, ns, "hub")
    core = kubernetes.client.CoreV1Api(api_client)
    try:
        assert core.list_namespaced_pod(ns).items == []
        assert core.read_namespaced_config_map("mine", ns).data == {"a": "1"}
        with pytest.raises(ApiException) as err:
            core.list_pod_for_all_namespaces()
        assert err.value.status == 403
        assert json.loads(err.value.body)["message"] == (
            f'pods is forbidden: User "system:serviceaccount:{ns}:hub" cannot list resource "pods" '
            'in API group "" at the cluster scope'
        )
        with pytest.raises(ApiException) as err:
            core.read_namespaced_config_map("other", ns)
        assert json.loads(err.value.body)["message"] == (
            f'configmaps "other" is forbidden: User "system:serviceaccount:{ns}:hub" cannot get '
            f'resource "configmaps" in API group "" in the namespace "{ns}"'
        )
        with pytest.raises(ApiException) as err:
            core.delete_namespaced_pod("x", ns)
        assert err.value.status == 403
        # another service account of the namespace holds nothing; a ClusterRoleBinding gives it all pods
        other = kubernetes.client.CoreV1Api(_client(emu, ns, "reader"))
        with pytest.raises(ApiException):
            other.list_namespaced_pod(ns)
        emu.create({"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": f"pods-{ns}"},
                    "rules": [{"apiGroups": ["*"], "resources": ["pods"], "verbs": ["*"]}]})
        emu.create({"apiVersion": rbac, "kind": "ClusterRoleBinding", "metadata": {"name": f"reader-{ns}"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                "name": f"pods-{ns}"},
                    "subjects": [{"kind": "Group", "name": f"system:serviceaccounts:{ns}"}]})
        assert isinstance(other.list_pod_for_all_namespaces().items, list)
        # the emulator's own token is not restricted
        admin = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(emu.kubeconfig_path))
        assert admin.read_namespaced_config_map("other", ns).data == {"a": "1"}
    finally:
        api_client.close()
