"""REST behaviours of the emulator, checked through the official clients and raw HTTP.

Expected bodies are the ones the real kube-apiserver sends (k8s.io/apimachinery errors)."""

from __future__ import annotations

import json

import kubernetes
import kubernetes_asyncio
import pytest
from kubernetes.client.rest import ApiException

from tests.kubeemu.helpers import http


@pytest.fixture(scope="module")
def core(kube_emulator):
    api_client = kubernetes.config.new_client_from_config(kube_emulator.kubeconfig_path)
    yield kubernetes.client.CoreV1Api(api_client)
    api_client.close()


def _status(exc: ApiException) -> dict:
    return json.loads(exc.body)


def test_discovery_documents_describe_the_served_resources(kube_emulator):
    code, version = http(kube_emulator, "GET", "/version")
    assert code == 200 and version["major"] == "1" and version["gitVersion"].startswith("v1.")
    code, api = http(kube_emulator, "GET", "/api")
    assert api["kind"] == "APIVersions" and api["versions"] == ["v1"]
    code, core = http(kube_emulator, "GET", "/api/v1")
    resources = {r["name"]: r for r in core["resources"]}
    assert resources["pods"]["namespaced"] is True
    assert resources["nodes"]["namespaced"] is False
    assert "watch" in resources["pods"]["verbs"]
    assert {"pods/status", "pods/log", "nodes/status"} <= set(resources)
    code, groups = http(kube_emulator, "GET", "/apis")
    assert "events.k8s.io" in {g["name"] for g in groups["groups"]}
    code, ev = http(kube_emulator, "GET", "/apis/events.k8s.io/v1")
    assert ev["groupVersion"] == "events.k8s.io/v1"
    code, missing = http(kube_emulator, "GET", "/api/v1/widgets")
    assert code == 404 and missing["reason"] == "NotFound"


def test_configmap_crud_with_the_sync_client(core, kube_namespace):
    ns = kube_namespace
    created = core.create_namespaced_config_map(
        ns, {"metadata": {"name": "cfg", "labels": {"app": "x"}}, "data": {"a": "1"}})
    assert created.metadata.uid and created.metadata.creation_timestamp
    got = core.read_namespaced_config_map("cfg", ns)
    assert got.data == {"a": "1"} and got.metadata.resource_version == \
        created.metadata.resource_version
    got.data["b"] = "2"
    replaced = core.replace_namespaced_config_map("cfg", ns, got)
    assert replaced.data == {"a": "1", "b": "2"}
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)
    patched = core.patch_namespaced_config_map("cfg", ns, {"data": {"a": None, "c": "3"}})
    assert patched.data == {"b": "2", "c": "3"}
    json_patched = core.patch_namespaced_config_map(
        "cfg", ns, [{"op": "replace", "path": "/data/b", "value": "20"}])
    assert json_patched.data == {"b": "20", "c": "3"}
    names = [c.metadata.name for c in core.list_namespaced_config_map(ns).items]
    assert names == ["cfg", "kube-root-ca.crt"]  # the root-CA publisher's, in every namespace
    status = core.delete_namespaced_config_map("cfg", ns)
    assert status["status"] == "Success" and status["details"]["name"] == "cfg"
    with pytest.raises(ApiException) as err:
        core.read_namespaced_config_map("cfg", ns)
    assert err.value.status == 404


async def test_secret_and_service_crud_with_the_asyncio_client(kube_emulator, kube_namespace):
    ns = kube_namespace
    api_client = await kubernetes_asyncio.config.new_client_from_config(
        config_file=kube_emulator.kubeconfig_path)
    async with api_client:
        core = kubernetes_asyncio.client.CoreV1Api(api_client)
        secret = await core.create_namespaced_secret(
            ns, {"metadata": {"name": "tok"}, "stringData": {"token": "s3cret"}})
        assert secret.type == "Opaque"
        assert secret.data == {"token": "czNjcmV0"}  # stringData is folded into data
        svc = await core.create_namespaced_service(ns, {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8888}]}})
        assert svc.spec.cluster_ip.startswith("10.") and svc.spec.type == "ClusterIP"
        listed = await core.list_namespaced_secret(ns)
        assert [s.metadata.name for s in listed.items] == ["tok"]
        await core.delete_namespaced_secret("tok", ns)
        deleted = await core.delete_namespaced_service("web", ns)
        assert deleted.metadata.name == "web"  # services answer DELETE with the object
        with pytest.raises(kubernetes_asyncio.client.ApiException) as err:
            await core.read_namespaced_service("web", ns)
        assert err.value.status == 404


def test_not_found_and_already_exists_bodies_are_api_server_status_objects(core, kube_namespace):
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod("ghost", kube_namespace)
    assert _status(err.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'pods "ghost" not found', "reason": "NotFound",
        "details": {"name": "ghost", "kind": "pods"}, "code": 404}
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "dup"}})
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "dup"}})
    assert err.value.status == 409
    assert _status(err.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'configmaps "dup" already exists', "reason": "AlreadyExists",
        "details": {"name": "dup", "kind": "configmaps"}, "code": 409}


def test_missing_name_and_bad_label_are_invalid_with_causes(core, kube_namespace):
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(kube_namespace, {"metadata": {}})
    body = _status(err.value)
    assert err.value.status == 422 and body["reason"] == "Invalid"
    assert body["message"] == ('ConfigMap "" is invalid: metadata.name: Required value: name or '
                               "generateName is required")
    assert body["details"]["causes"] == [{"reason": "FieldValueRequired",
                                          "message": "Required value: name or generateName is "
                                                     "required",
                                          "field": "metadata.name"}]
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(kube_namespace, {
            "metadata": {"name": "bad", "labels": {"team": "not ok!"}}})
    body = _status(err.value)
    assert err.value.status == 422
    assert body["message"].startswith('ConfigMap "bad" is invalid: metadata.labels: Invalid '
                                      'value: "not ok!": a valid label must be an empty string')
    assert body["details"]["kind"] == "ConfigMap" and body["details"]["name"] == "bad"
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "Upper_Case"}})
    assert err.value.status == 422
    assert "a lowercase RFC 1123 subdomain" in _status(err.value)["message"]


def test_pod_without_containers_or_image_is_invalid(core, kube_namespace):
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(kube_namespace, {
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c"}],
                     "volumes": [{"name": "v", "emptyDir": {}}]}})
    body = _status(err.value)
    assert err.value.status == 422
    assert body["message"] == 'Pod "p" is invalid: spec.containers[0].image: Required value'
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(kube_namespace, {
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "image": "i", "resources": {
                "limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "2"}}}]}})
    assert err.value.status == 422
    assert "must be less than or equal to nvidia.com/gpu limit of 1" in _status(
        err.value)["message"]


def test_stale_resource_version_update_conflicts(core, kube_namespace):
    ns = kube_namespace
    first = core.create_namespaced_config_map(ns, {"metadata": {"name": "c"}, "data": {"v": "1"}})
    core.patch_namespaced_config_map("c", ns, {"data": {"v": "2"}})
    first.data = {"v": "stale"}
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_config_map("c", ns, first)
    body = _status(err.value)
    assert err.value.status == 409 and body["reason"] == "Conflict"
    assert body["message"] == ('Operation cannot be fulfilled on configmaps "c": the object has '
                               "been modified; please apply your changes to the latest version "
                               "and try again")


def test_resource_versions_increase_and_noop_writes_keep_them(core, kube_namespace):
    ns = kube_namespace
    rvs = []
    for i in range(3):
        obj = core.create_namespaced_config_map(ns, {"metadata": {"name": f"c{i}"}})
        rvs.append(int(obj.metadata.resource_version))
    assert rvs == sorted(rvs) and len(set(rvs)) == 3
    listed = core.list_namespaced_config_map(ns)
    assert int(listed.metadata.resource_version) >= rvs[-1]
    same = core.patch_namespaced_config_map("c0", ns, {"metadata": {}})
    assert int(same.metadata.resource_version) == rvs[0]


def test_generate_name_gives_a_unique_suffix(core, kube_namespace):
    names = {core.create_namespaced_config_map(
        kube_namespace, {"metadata": {"generateName": "job-"}}).metadata.name for _ in range(3)}
    assert len(names) == 3
    assert all(n.startswith("job-") and len(n) == len("job-") + 5 for n in names)


def test_pod_spec_is_immutable_but_image_and_labels_may_change(kube_emulator, core,
                                                               kube_namespace):
    ns = kube_namespace
    # bound to a node that does not exist: no process, the pod just stays Pending
    core.create_namespaced_pod(ns, {"metadata": {"name": "p"}, "spec": {
        "nodeName": "nowhere", "containers": [{"name": "c", "image": "busybox:1"}]}})
    p = core.read_namespaced_pod("p", ns)
    assert p.metadata.generation == 1 and p.spec.restart_policy == "Always"
    assert p.spec.containers[0].image_pull_policy == "IfNotPresent"
    labeled = core.patch_namespaced_pod("p", ns, {"metadata": {"labels": {"x": "y"}}})
    assert labeled.metadata.generation == 1
    imaged = core.patch_namespaced_pod(
        "p", ns, {"spec": {"containers": [{"name": "c", "image": "busybox:2"}]}})
    assert imaged.spec.containers[0].image == "busybox:2" and imaged.metadata.generation == 2
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod("p", ns, {"spec": {"restartPolicy": "Never"}})
    assert err.value.status == 422
    assert "pod updates may not change fields other than" in _status(err.value)["message"]


def test_status_subresource_is_separate_from_the_main_resource(core, kube_namespace):
    ns = kube_namespace
    core.create_namespaced_pod(ns, {"metadata": {"name": "p"}, "spec": {
        "nodeName": "nowhere", "containers": [{"name": "c", "image": "i"}]}})
    ignored = core.patch_namespaced_pod("p", ns, {"status": {"phase": "Running"}})
    assert ignored.status.phase == "Pending"
    updated = core.patch_namespaced_pod_status(
        "p", ns, {"status": {"phase": "Running"}, "metadata": {"labels": {"ignored": "yes"}}})
    assert updated.status.phase == "Running" and not updated.metadata.labels


def test_create_in_a_missing_namespace_is_not_found(core):
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map("no-such-ns", {"metadata": {"name": "c"}})
    assert err.value.status == 404
    assert _status(err.value)["message"] == 'namespaces "no-such-ns" not found'


def test_raw_protocol_errors(kube_emulator, kube_namespace):
    base = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    http(kube_emulator, "POST", base, {"metadata": {"name": "c"}})
    code, body = http(kube_emulator, "PATCH", base + "/c", {"data": {}}, "text/plain")
    assert code == 415 and body["reason"] == "UnsupportedMediaType"
    code, body = http(kube_emulator, "POST", base, "{not json")
    assert code == 400 and body["reason"] == "BadRequest"
    code, body = http(kube_emulator, "POST", base,
                      {"metadata": {"name": "d", "namespace": "other"}})
    assert code == 400 and "does not match the namespace" in body["message"]
    code, body = http(kube_emulator, "PATCH", base + "/c", {"data": {"k": "v"}},
                      "application/merge-patch+json")
    assert code == 200 and body["data"] == {"k": "v"}
    code, body = http(kube_emulator, "PATCH", base + "/c",
                      [{"op": "test", "path": "/data/k", "value": "other"}],
                      "application/json-patch+json")
    assert code == 422
    code, body = http(kube_emulator, "POST", base + "?dryRun=All", {"metadata": {"name": "dry"}})
    assert code == 201 and http(kube_emulator, "GET", base + "/dry")[0] == 404


def test_delete_collection_by_label_and_pagination(core, kube_namespace):
    ns = kube_namespace
    for i in range(5):
        core.create_namespaced_secret(
            ns, {"metadata": {"name": f"c{i}", "labels": {"batch": "a" if i < 3 else "b"}}})
    page = core.list_namespaced_secret(ns, limit=2)
    assert [c.metadata.name for c in page.items] == ["c0", "c1"]
    assert page.metadata.remaining_item_count == 3
    rest = core.list_namespaced_secret(ns, limit=10, _continue=page.metadata._continue)
    assert [c.metadata.name for c in rest.items] == ["c2", "c3", "c4"]
    core.delete_collection_namespaced_secret(ns, label_selector="batch=a")
    assert [c.metadata.name for c in core.list_namespaced_secret(ns).items] == ["c3", "c4"]


def test_pod_admission_priority_class_runtime_class_and_service_account(kube_emulator, core,
                                                                        kube_namespace):
    ns = kube_namespace
    spec = {"nodeName": "nowhere", "containers": [{"name": "c", "image": "i"}]}
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(ns, {"metadata": {"name": "a"},
                                        "spec": {**spec, "priorityClassName": "gpu-high"}})
    assert err.value.status == 403
    assert _status(err.value)["message"] == ('pods "a" is forbidden: no PriorityClass with name '
                                             "gpu-high was found")
    kube_emulator.create({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                          "metadata": {"name": f"gpu-high-{ns}"}, "value": 1000})
    p = core.create_namespaced_pod(ns, {"metadata": {"name": "a"},
                                        "spec": {**spec, "priorityClassName": f"gpu-high-{ns}"}})
    assert p.spec.priority == 1000 and p.spec.service_account_name == "default"
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(ns, {"metadata": {"name": "b"},
                                        "spec": {**spec, "runtimeClassName": "nvidia"}})
    assert _status(err.value)["message"] == 'pod rejected: RuntimeClass "nvidia" not found'
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(ns, {"metadata": {"name": "c"},
                                        "spec": {**spec, "serviceAccountName": "hub"}})
    assert err.value.status == 403 and 'serviceaccount "hub" not found' in _status(
        err.value)["message"]


def test_resource_quota_refuses_pods_over_hard_limits_and_reports_usage(kube_emulator, core,
                                                                        kube_namespace):
    ns = kube_namespace
    core.create_namespaced_resource_quota(ns, {"metadata": {"name": "gpu"},
                                               "spec": {"hard": {"requests.nvidia.com/gpu": "1"}}})
    gpu = {"limits": {"nvidia.com/gpu": "1"}}
    spec = {"nodeName": "nowhere", "containers": [{"name": "c", "image": "i", "resources": gpu}]}
    core.create_namespaced_pod(ns, {"metadata": {"name": "one"}, "spec": spec})
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(ns, {"metadata": {"name": "two"}, "spec": spec})
    assert err.value.status == 403
    assert _status(err.value)["message"] == (
        'pods "two" is forbidden: exceeded quota: gpu, requested: requests.nvidia.com/gpu=1, '
        "used: requests.nvidia.com/gpu=1, limited: requests.nvidia.com/gpu=1")
    quota = kube_emulator.wait_for(
        lambda: (q := kube_emulator.get("resourcequotas", "gpu", ns))
        and q.get("status", {}).get("used") and q, message="quota status")
    assert quota["status"] == {"hard": {"requests.nvidia.com/gpu": "1"},
                               "used": {"requests.nvidia.com/gpu": "1"}}


def test_events_are_served_by_both_event_apis(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    core.create_namespaced_event(ns, {
        "metadata": {"name": "e1"}, "involvedObject": {"kind": "Pod", "name": "p",
                                                       "namespace": ns},
        "reason": "Preempted", "message": "made room for alice", "type": "Warning",
        "source": {"component": "elastic-gpu"}})
    code, ev = http(kube_emulator, "GET", f"/apis/events.k8s.io/v1/namespaces/{ns}/events/e1")
    assert code == 200 and ev["apiVersion"] == "events.k8s.io/v1"
    assert ev["note"] == "made room for alice" and ev["regarding"]["name"] == "p"
    assert ev["reportingController"] == "elastic-gpu" and ev["type"] == "Warning"
    # created through events.k8s.io/v1, read back through core/v1
    code, _ = http(kube_emulator, "POST", f"/apis/events.k8s.io/v1/namespaces/{ns}/events", {
        "apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e2"},
        "eventTime": "2024-01-01T00:00:00.000000Z", "reportingController": "elastic-gpu",
        "reportingInstance": "hub", "action": "Preempt", "reason": "Preempted",
        "regarding": {"kind": "Pod", "name": "q", "namespace": ns}, "note": "n", "type": "Normal"})
    assert code == 201
    assert core.read_namespaced_event("e2", ns).involved_object.name == "q"
    raw = core.list_namespaced_event(ns, field_selector="involvedObject.kind=Pod,type=Warning",
                                     _preload_content=False)
    items = json.loads(raw.data)["items"]
    assert [e["metadata"]["name"] for e in items] == ["e1"]
    assert items[0]["eventTime"] is None  # the keys exist, as KubeSpawner's reflector needs


def test_namespace_deletion_removes_its_content(kube_emulator, core):
    core.create_namespace({"metadata": {"name": "doomed"}})
    core.create_namespaced_config_map("doomed", {"metadata": {"name": "c"}})
    ns = core.delete_namespace("doomed")
    assert ns["status"]["phase"] == "Terminating"
    kube_emulator.wait_for(lambda: kube_emulator.get("namespaces", "doomed", None) is None,
                           message="namespace gone")
    assert kube_emulator.get("configmaps", "c", "doomed") is None
    with pytest.raises(ApiException) as err:
        core.delete_namespace("default")
    assert err.value.status == 403


def test_server_side_apply_creates_then_updates(kube_emulator, kube_namespace):
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps/applied?fieldManager=test"
    doc = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: applied\ndata:\n  a: '1'\n"
    code, body = http(kube_emulator, "PATCH", path, doc, "application/apply-patch+yaml")
    assert code == 201 and body["data"] == {"a": "1"}
    code, body = http(kube_emulator, "PATCH", path, doc.replace("'1'", "'2'"),
                      "application/apply-patch+yaml")
    assert code == 200 and body["data"] == {"a": "2"}
    code, body = http(kube_emulator, "PATCH", path.split("?")[0], doc,
                      "application/apply-patch+yaml")
    assert code == 400 and "fieldManager is required" in body["message"]
