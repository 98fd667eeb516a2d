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


UNAUTHORIZED = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "Unauthorized", "reason": "Unauthorized", "code": 401}


def test_a_token_the_cluster_never_issued_is_unauthorized_not_an_admin(kube_emulator, kube_namespace):
    """kube-apiserver answers a bearer token no authenticator accepts with 401 Unauthorized, on
    every path (authentication runs before authorization; the token is not downgraded to
    anonymous). The emulator made any such token a cluster admin, so a client configured with a
    wrong or stale token (a hub's mistyped kubeconfig, a token copied from another cluster) passed
    every test and failed on a real cluster."""
    emu, ns = kube_emulator, kube_namespace
    core = kubernetes.client.CoreV1Api(
        kubernetes.config.new_client_from_config(emu.kubeconfig_for("made-up-token", ns)))
    try:
        with pytest.raises(ApiException) as err:
            core.list_namespaced_pod(ns)
        assert err.value.status == 401
        assert json.loads(err.value.body) == UNAUTHORIZED
        with pytest.raises(ApiException) as err:
            core.create_namespaced_config_map(ns, {"metadata": {"name": "planted"}})
        assert err.value.status == 401
        assert emu.get("configmaps", "planted", ns) is None
        with pytest.raises(ApiException) as err:  # not even the public paths
            kubernetes.client.VersionApi(core.api_client).get_code()
        assert err.value.status == 401
    finally:
        core.api_client.close()


def test_a_token_of_a_deleted_service_account_is_unauthorized(kube_emulator, kube_namespace):
    """A service-account token is valid while its service account exists (kube-apiserver looks
    the account up on every request); deleting the account revokes its tokens."""
    emu, ns = kube_emulator, kube_namespace
    emu.create({"metadata": {"name": "gone"}}, "serviceaccounts", ns)
    core = kubernetes.client.CoreV1Api(
        kubernetes.config.new_client_from_config(emu.kubeconfig_for(emu.service_account_token(ns, "gone"), ns)))
    try:
        with pytest.raises(ApiException) as err:
            core.list_namespaced_pod(ns)
        assert err.value.status == 403  # known, merely not allowed
        emu.delete("serviceaccounts", "gone", ns)
        emu.wait_for(lambda: emu.get("serviceaccounts", "gone", ns) is None)
        with pytest.raises(ApiException) as err:
            core.list_namespaced_pod(ns)
        assert err.value.status == 401
        assert json.loads(err.value.body) == UNAUTHORIZED
    finally:
        core.api_client.close()
