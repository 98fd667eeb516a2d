"""In-cluster configuration inside pods: the API server's address in the environment, the
service account's token, CA and namespace mounted, and RBAC on that token; TokenRequest and
SelfSubjectAccessReview."""

from __future__ import annotations

import json

import kubernetes
import pytest

from tests.kubeemu.helpers import http, pod, py

CLIENT = """
import json, kubernetes
kubernetes.config.load_incluster_config()
ns = open('/var/run/secrets/kubernetes.io/serviceaccount/namespace').read()
try:
    kubernetes.client.CoreV1Api().list_namespaced_pod(ns)
    print('listed')
except kubernetes.client.ApiException as e:
    print('denied', e.status, json.loads(e.body)['message'])
review = kubernetes.client.AuthorizationV1Api().create_self_subject_access_review(
    {'spec': {'resourceAttributes': {'namespace': ns, 'verb': 'list', 'resource': 'pods'}}})
print('allowed', review.status.allowed)
"""


@pytest.fixture(scope="module")
def core(kube_emulator):
    api_client = kubernetes.config.new_client_from_config(kube_emulator.kubeconfig_path)
    yield kubernetes.client.CoreV1Api(api_client)
    api_client.close()


def _run(emu, ns: str, name: str) -> str:
    emu.create(pod(name, py(CLIENT), restartPolicy="Never"), namespace=ns)
    done = emu.wait_for_pod_phase(name, ("Succeeded", "Failed"), ns, timeout=30)
    log = emu.pod_log(name, ns)
    assert done["status"]["phase"] == "Succeeded", log
    return log


def test_a_pod_reaches_the_api_with_its_service_account_and_rbac_decides(kube_emulator,
                                                                         kube_namespace):
    ns = kube_namespace
    assert _run(kube_emulator, ns, "before") == (
        f'denied 403 pods is forbidden: User "system:serviceaccount:{ns}:default" cannot list '
        f'resource "pods" in API group "" in the namespace "{ns}"\nallowed False\n')
    kube_emulator.create({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                          "metadata": {"name": "read", "namespace": ns},
                          "rules": [{"apiGroups": [""], "resources": ["pods"],
                                     "verbs": ["list"]}]})
    kube_emulator.create({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                          "metadata": {"name": "read", "namespace": ns},
                          "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": "read"},
                          "subjects": [{"kind": "ServiceAccount", "name": "default",
                                        "namespace": ns}]})
    assert _run(kube_emulator, ns, "after") == "listed\nallowed True\n"
    spec = kube_emulator.get("pods", "after", ns)["spec"]
    (mount,) = spec["containers"][0]["volumeMounts"]
    assert mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    assert mount["readOnly"] is True and mount["name"].startswith("kube-api-access-")


def test_automount_false_mounts_no_token(kube_emulator, core, kube_namespace):
    p = core.create_namespaced_pod(kube_namespace, pod("quiet", None, nodeName="nowhere",
                                                       automountServiceAccountToken=False))
    assert not p.spec.volumes and not p.spec.containers[0].volume_mounts


def test_token_request_issues_a_token_of_the_service_account(kube_emulator, core,
                                                             kube_namespace):
    ns = kube_namespace
    answer = core.create_namespaced_service_account_token(
        "default", ns, {"spec": {"audiences": ["https://kubernetes.default.svc"]}})
    token = answer.status.token
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    import urllib.request
    req = urllib.request.Request(kube_emulator.url + "/apis/authentication.k8s.io/v1/"
                                 "selfsubjectreviews", data=json.dumps(review).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {token}",
                                                         "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        who = json.loads(resp.read())
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:default"
    code, cm = http(kube_emulator, "GET", f"/api/v1/namespaces/{ns}/configmaps/kube-root-ca.crt")
    assert code == 200 and cm["data"]["ca.crt"] == open(kube_emulator.ca_path).read()
