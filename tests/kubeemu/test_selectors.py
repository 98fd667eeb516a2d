"""Label and field selectors, as documented in "Labels and Selectors" and "Field Selectors"."""

from __future__ import annotations

import json

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from tests.kubeemu.errors import ApiError
from tests.kubeemu.selectors import label_matcher, parse_label_selector

LABELS = {"env": "prod", "tier": "frontend", "gpu": "a100"}


@pytest.mark.parametrize(("selector", "matches"), [
    ("env=prod", True),
    ("env==prod", True),
    ("env!=prod", False),
    ("env!=dev", True),
    ("missing!=x", True),  # != matches objects without the key
    ("env in (prod, qa)", True),
    ("env in (qa)", False),
    ("env notin (qa,dev)", True),
    ("missing notin (qa)", True),
    ("gpu", True),
    ("!gpu", False),
    ("!missing", True),
    ("env=prod,tier=frontend", True),
    ("env=prod,tier=backend", False),
    ("env in (prod),!missing,gpu", True),
    ("", True),
])
def test_label_selector_semantics(selector, matches):
    assert label_matcher(selector)(LABELS) is matches


@pytest.mark.parametrize("selector", ["env in prod", "env=", "=x", "a b", "env in (a",
                                      "env=bad value!"])
def test_malformed_label_selectors_are_bad_requests(selector):
    if selector == "env=":
        # an empty value is valid: env=""
        assert parse_label_selector(selector)[0].values == ("",)
        return
    with pytest.raises(ApiError) as err:
        parse_label_selector(selector)
    assert err.value.code == 400 and err.value.reason == "BadRequest"


@pytest.fixture(scope="module")
def core(kube_emulator):
    api_client = kubernetes.config.new_client_from_config(kube_emulator.kubeconfig_path)
    yield kubernetes.client.CoreV1Api(api_client)
    api_client.close()


def _names(items) -> list[str]:
    return sorted(i.metadata.name for i in items)


def test_list_filters_by_label_selector(core, kube_namespace):
    ns = kube_namespace
    for name, labels in [("a", {"app": "hub", "tier": "web"}), ("b", {"app": "hub"}),
                         ("c", {"app": "proxy", "tier": "web"}), ("d", {})]:
        core.create_namespaced_secret(ns, {"metadata": {"name": name, "labels": labels}})
    assert _names(core.list_namespaced_secret(ns, label_selector="app=hub").items) == [
        "a", "b"]
    assert _names(core.list_namespaced_secret(ns, label_selector="app!=hub").items) == [
        "c", "d"]
    assert _names(core.list_namespaced_secret(
        ns, label_selector="app in (hub,proxy),tier").items) == ["a", "c"]
    assert _names(core.list_namespaced_secret(ns, label_selector="!tier").items) == [
        "b", "d"]
    assert _names(core.list_namespaced_secret(
        ns, label_selector="app notin (hub)").items) == ["c", "d"]
    with pytest.raises(ApiException) as err:
        core.list_namespaced_secret(ns, label_selector="app in hub")
    assert err.value.status == 400


def test_list_filters_by_field_selector(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    for name in ("x", "y"):
        core.create_namespaced_secret(ns, {"metadata": {"name": name}})
    assert _names(core.list_namespaced_secret(
        ns, field_selector="metadata.name=x").items) == ["x"]
    assert _names(core.list_namespaced_secret(
        ns, field_selector="metadata.name!=x").items) == ["y"]
    across = core.list_secret_for_all_namespaces(field_selector=f"metadata.namespace={ns}")
    assert _names(across.items) == ["x", "y"]
    with pytest.raises(ApiException) as err:
        core.list_namespaced_secret(ns, field_selector="data.x=1")
    assert err.value.status == 400
    assert json.loads(err.value.body)["message"] == "field label not supported: data.x"


def test_pod_field_selectors_on_phase_and_node(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    # no command: a pause-like container that runs until deleted, on the virtual node
    core.create_namespaced_pod(ns, {"metadata": {"name": "runs"}, "spec": {
        "containers": [{"name": "c", "image": "pause"}]}})
    # bound to a node that does not exist: stays Pending
    core.create_namespaced_pod(ns, {"metadata": {"name": "stuck"}, "spec": {
        "nodeName": "elsewhere", "containers": [{"name": "c", "image": "pause"}]}})
    kube_emulator.wait_for_pod_phase("runs", "Running", ns)
    assert _names(core.list_namespaced_pod(ns, field_selector="status.phase=Running").items) \
        == ["runs"]
    assert _names(core.list_namespaced_pod(ns, field_selector="status.phase!=Running").items) \
        == ["stuck"]
    assert _names(core.list_namespaced_pod(ns, field_selector="spec.nodeName=elsewhere").items) \
        == ["stuck"]
    assert _names(core.list_namespaced_pod(
        ns, field_selector="spec.nodeName=emu-node,status.phase=Running").items) == ["runs"]
