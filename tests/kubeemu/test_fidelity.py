"""Behaviours where the emulator used to accept what a real cluster refuses (issue #31's probes).

Each expected answer is kube-apiserver's or the kubelet's, as their documentation states it:
a stand-in that is more lenient than the real thing hides the product's bugs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from email.message import Message

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from tests.kubeemu import KubeEmulator
from tests.kubeemu.helpers import pod, py


@pytest.fixture(scope="module")
def core(kube_emulator):
    api_client = kubernetes.config.new_client_from_config(kube_emulator.kubeconfig_path)
    yield kubernetes.client.CoreV1Api(api_client)
    api_client.close()


def _raw(emu: KubeEmulator, method: str, path: str, body: object = None,
         headers: dict | None = None, token: str | None = "kubeemu-token",
         ) -> tuple[int, Message, object]:
    """(status, response headers, decoded body) of one request, with or without a token."""
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if token:
        hdrs["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(emu.url + path, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            code, head, raw = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        code, head, raw = e.code, e.headers, e.read()
    try:
        return code, head, json.loads(raw)
    except ValueError:
        return code, head, raw.decode()


def test_configmap_over_one_mebibyte_is_invalid(core, kube_namespace):
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(kube_namespace, {
            "metadata": {"name": "big"}, "data": {"blob": "x" * (1024 * 1024)}})
    body = json.loads(err.value.body)
    assert err.value.status == 422 and body["reason"] == "Invalid"
    assert body["message"] == ('ConfigMap "big" is invalid: []: Too long: must have at most '
                               "1048576 bytes")


def test_a_request_without_a_token_is_system_anonymous(kube_emulator, kube_namespace):
    code, _, body = _raw(kube_emulator, "GET", f"/api/v1/namespaces/{kube_namespace}/pods",
                         token=None)
    assert code == 403, body
    assert body["message"] == (f'pods is forbidden: User "system:anonymous" cannot list resource '
                               f'"pods" in API group "" in the namespace "{kube_namespace}"')
    code, _, body = _raw(kube_emulator, "POST", f"/api/v1/namespaces/{kube_namespace}/configmaps",
                         {"metadata": {"name": "x"}}, token=None)
    assert code == 403
    # system:public-info-viewer lets anyone read the version and health endpoints
    assert _raw(kube_emulator, "GET", "/version", token=None)[0] == 200
    assert _raw(kube_emulator, "GET", "/healthz", token=None)[0] == 200


def test_strategic_merge_delete_removes_the_named_service_port(core, kube_namespace):
    core.create_namespaced_service(kube_namespace, {
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [
            {"name": "http", "port": 80, "targetPort": 8080},
            {"name": "https", "port": 443, "targetPort": 8443}]}})
    patched = core.patch_namespaced_service("web", kube_namespace, {
        "spec": {"ports": [{"port": 443, "$patch": "delete"}]}})
    assert [p.port for p in patched.spec.ports] == [80]


def test_pod_log_is_the_current_container_and_previous_the_one_before(kube_emulator, core,
                                                                      kube_namespace):
    code = ("import os, sys, time; p = '/data/n'; n = int(open(p).read()) if os.path.exists(p) "
            "else 0; open(p, 'w').write(str(n + 1)); print('run', n, flush=True)\n"
            "if n < 2: sys.exit(1)\n"
            "while True: time.sleep(1)")
    core.create_namespaced_pod(kube_namespace, pod(
        "restarts", py(code), volumeMounts=[{"name": "work", "mountPath": "/data"}],
        volumes=[{"name": "work", "emptyDir": {}}]))

    def third_run_logged():
        p = core.read_namespaced_pod("restarts", kube_namespace)
        st = (p.status.container_statuses or [None])[0]
        if not (st and st.restart_count == 2 and st.state.running):
            return False
        return "run 2" in core.read_namespaced_pod_log("restarts", kube_namespace)

    kube_emulator.wait_for(third_run_logged, timeout=30, message="the third run")
    assert core.read_namespaced_pod_log("restarts", kube_namespace) == "run 2\n"
    assert core.read_namespaced_pod_log("restarts", kube_namespace, previous=True) == "run 1\n"


def test_previous_log_of_a_container_that_never_restarted_is_a_bad_request(kube_emulator, core,
                                                                            kube_namespace):
    core.create_namespaced_pod(kube_namespace, pod("once", py("print('hi', flush=True)"),
                                                   restartPolicy="Never"))
    kube_emulator.wait_for_pod_phase("once", "Succeeded", kube_namespace, timeout=15)
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod_log("once", kube_namespace, previous=True)
    assert err.value.status == 400
    assert json.loads(err.value.body)["message"] == (
        'previous terminated container "main" in pod "once" not found')


def test_unknown_fields_are_dropped_with_a_warning_or_refused_when_strict(kube_emulator,
                                                                          kube_namespace):
    cm = {"metadata": {"name": "cfg", "colour": "red"}, "data": {"a": "1"}, "extra": {"b": 2}}
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    code, head, body = _raw(kube_emulator, "POST", path + "?fieldValidation=Strict", cm)
    assert code == 400, body
    assert body["message"] == ('ConfigMap in version "v1" cannot be handled as a ConfigMap: '
                               'strict decoding error: unknown field "metadata.colour", '
                               'unknown field "extra"')
    code, head, body = _raw(kube_emulator, "POST", path, cm)
    assert code == 201
    assert "extra" not in body and "colour" not in body["metadata"]
    assert body["data"] == {"a": "1"}
    warnings = head.get_all("Warning")
    assert warnings == ['299 - "unknown field \\"metadata.colour\\""',
                        '299 - "unknown field \\"extra\\""']
    stored = kube_emulator.get("configmaps", "cfg", kube_namespace)
    assert "extra" not in stored
    code, _, body = _raw(kube_emulator, "POST", f"/api/v1/namespaces/{kube_namespace}/pods"
                         "?fieldValidation=Strict", pod("p", None, nodeName="nowhere") | {
                             "spec": {"nodeName": "nowhere", "containers": [
                                 {"name": "c", "image": "busybox:1", "imagePolicy": "x"}]}})
    assert code == 400
    assert body["message"].endswith('strict decoding error: unknown field '
                                    '"spec.containers[0].imagePolicy"')
    code, _, body = _raw(kube_emulator, "POST", path + "?fieldValidation=Ignore",
                         {"metadata": {"name": "quiet"}, "extra": 1})
    assert code == 201 and "extra" not in body


def test_watch_from_a_resource_version_the_watch_cache_no_longer_holds_is_gone():
    # kube-apiserver keeps at least 100 events, more while the oldest is under 75 s old; here
    # 10, and none is fresh for long
    with KubeEmulator(watch_cache_capacity=10, watch_cache_fresh_seconds=0.0) as emu:
        first = emu.create({"metadata": {"name": "c0"}}, "configmaps")
        rv = first["metadata"]["resourceVersion"]
        for i in range(1, 30):
            emu.create({"metadata": {"name": f"c{i}"}}, "configmaps")
        code, _, body = _raw(emu, "GET", f"/api/v1/namespaces/default/configmaps?watch=1"
                             f"&resourceVersion={rv}&timeoutSeconds=1")
        assert code == 200
        event = json.loads(body.splitlines()[0]) if isinstance(body, str) else body
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
        assert event["object"]["message"].startswith(f"too old resource version: {rv} (")


def test_pod_with_an_unbound_claim_stays_pending_until_the_claim_binds(kube_emulator, core,
                                                                      kube_namespace):
    ns = kube_namespace
    core.create_namespaced_persistent_volume_claim(ns, {
        "metadata": {"name": "home"},
        "spec": {"storageClassName": "no-such-class", "accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": "1Gi"}}}})
    core.create_namespaced_pod(ns, pod("user", py("import time; time.sleep(60)"),
                                       volumeMounts=[{"name": "h", "mountPath": "/home/x"}],
                                       volumes=[{"name": "h", "persistentVolumeClaim":
                                                 {"claimName": "home"}}]))

    def unschedulable():
        p = core.read_namespaced_pod("user", ns)
        cond = next((c for c in p.status.conditions or [] if c.type == "PodScheduled"), None)
        return cond and cond.status == "False" and cond

    cond = kube_emulator.wait_for(unschedulable, message="the pod to be unschedulable")
    assert "pod has unbound immediate PersistentVolumeClaims" in cond.message
    assert core.read_namespaced_pod("user", ns).status.phase == "Pending"
    pvc = core.read_namespaced_persistent_volume_claim("home", ns)
    assert pvc.status.phase == "Pending"
    events = kube_emulator.list("events", ns, field_selector="involvedObject.name=home")
    assert any(e["reason"] == "ProvisioningFailed" and 'storageclass.storage.k8s.io '
               '"no-such-class" not found' in e["message"] for e in events)
    kube_emulator.create({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                          "metadata": {"name": "no-such-class"}, "provisioner": "example.com/x"})
    try:
        kube_emulator.wait_for_pod_phase("user", "Running", ns, timeout=15)
        assert core.read_namespaced_persistent_volume_claim("home", ns).status.phase == "Bound"
    finally:
        kube_emulator.delete("storageclasses", "no-such-class", None, group="storage.k8s.io")


def test_claim_of_the_default_storage_class_binds_and_its_pod_runs(kube_emulator, core,
                                                                   kube_namespace):
    ns = kube_namespace
    core.create_namespaced_persistent_volume_claim(ns, {
        "metadata": {"name": "home"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    pvc = core.read_namespaced_persistent_volume_claim("home", ns)
    assert pvc.spec.storage_class_name == "standard"  # DefaultStorageClass admission
    core.create_namespaced_pod(ns, pod("user", py("import time; time.sleep(60)"),
                                       volumeMounts=[{"name": "h", "mountPath": "/home/x"}],
                                       volumes=[{"name": "h", "persistentVolumeClaim":
                                                 {"claimName": "home"}}]))
    kube_emulator.wait_for_pod_phase("user", "Running", ns, timeout=15)
    pvc = core.read_namespaced_persistent_volume_claim("home", ns)
    assert pvc.status.phase == "Bound" and pvc.spec.volume_name


def test_limit_range_defaults_and_maximum_apply_at_admission(core, kube_namespace):
    ns = kube_namespace
    core.create_namespaced_limit_range(ns, {
        "metadata": {"name": "limits"},
        "spec": {"limits": [{"type": "Container", "default": {"memory": "512Mi"},
                             "defaultRequest": {"memory": "256Mi"}, "max": {"memory": "1Gi"}}]}})
    p = core.create_namespaced_pod(ns, pod("plain", None, nodeName="nowhere"))
    res = p.spec.containers[0].resources
    assert res.limits == {"memory": "512Mi"} and res.requests == {"memory": "256Mi"}
    assert p.metadata.annotations["kubernetes.io/limit-ranger"] == (
        "LimitRanger plugin set: memory request for container main; memory limit for "
        "container main")
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(ns, pod("huge", None, nodeName="nowhere",
                                           resources={"limits": {"memory": "2Gi"}}))
    assert err.value.status == 403
    assert json.loads(err.value.body)["message"] == (
        'pods "huge" is forbidden: maximum memory usage per Container is 1Gi, but limit is 2Gi')


def test_count_quota_refuses_the_object_over_it(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    core.create_namespaced_resource_quota(ns, {
        "metadata": {"name": "objects"}, "spec": {"hard": {"count/secrets": "2"}}})
    core.create_namespaced_secret(ns, {"metadata": {"name": "a"}})
    core.create_namespaced_secret(ns, {"metadata": {"name": "b"}})
    with pytest.raises(ApiException) as err:
        core.create_namespaced_secret(ns, {"metadata": {"name": "c"}})
    assert err.value.status == 403
    assert json.loads(err.value.body)["message"] == (
        'secrets "c" is forbidden: exceeded quota: objects, requested: count/secrets=1, '
        "used: count/secrets=2, limited: count/secrets=2")
    kube_emulator.wait_for(lambda: (kube_emulator.get("resourcequotas", "objects", ns)
                                    .get("status") or {}).get("used") == {"count/secrets": "2"},
                           message="the quota's status to count the secrets")


def test_pod_security_warn_and_audit_modes_admit_the_pod_and_say_why(kube_emulator,
                                                                      kube_namespace):
    ns = kube_namespace
    kube_emulator.patch("namespaces", ns, {"metadata": {"labels": {
        "pod-security.kubernetes.io/warn": "restricted",
        "pod-security.kubernetes.io/audit": "baseline"}}}, None)
    manifest = pod("loose", None, nodeName="nowhere", hostNetwork=True)
    code, head, body = _raw(kube_emulator, "POST", f"/api/v1/namespaces/{ns}/pods", manifest)
    assert code == 201, body
    (warning,) = head.get_all("Warning")
    assert warning.startswith('299 - "would violate PodSecurity \\"restricted:latest\\": '
                              "host namespaces (hostNetwork=true), allowPrivilegeEscalation != "
                              "false")
    audited = [e for e in kube_emulator.audit_events
               if e["objectRef"] == {"resource": "pods", "namespace": ns, "name": "loose",
                                     "apiVersion": "v1"}]
    assert [e["annotations"] for e in audited] == [{
        "pod-security.kubernetes.io/audit-violations":
            'would violate PodSecurity "baseline:latest": host namespaces (hostNetwork=true)'}]
