"""Garbage collection by ownerReferences and finalizers ("Garbage Collection" in the docs)."""

from __future__ import annotations

import time

import kubernetes
import pytest

from tests.kubeemu.helpers import leftovers, pod, py


@pytest.fixture(scope="module")
def core(kube_emulator):
    api_client = kubernetes.config.new_client_from_config(kube_emulator.kubeconfig_path)
    yield kubernetes.client.CoreV1Api(api_client)
    api_client.close()


def _owner_ref(obj) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "name": obj.metadata.name,
            "uid": obj.metadata.uid, "blockOwnerDeletion": True}


def test_deleting_a_server_pod_collects_its_kernel_pods_and_secrets(kube_emulator, core,
                                                                    kube_namespace):
    ns = kube_namespace
    # "up" once the program handles SIGTERM: a container's pid 1 gets no SIGTERM it has no
    # handler for (container.signal_state), and Running comes before the interpreter has
    # started; the kernel pod, deleted with the default 30 s grace, would outlast the wait
    up = py("print('up', flush=True); import time; time.sleep(60)")
    server = core.create_namespaced_pod(ns, pod("server", up))
    ref = _owner_ref(server)
    kernel = pod("kernel", up)
    kernel["metadata"]["ownerReferences"] = [ref]
    core.create_namespaced_pod(ns, kernel)
    core.create_namespaced_secret(ns, {"metadata": {"name": "conn", "ownerReferences": [ref]},
                                       "stringData": {"key": "x"}})
    kube_emulator.wait_for_pod_phase("kernel", "Running", ns)
    kube_emulator.wait_for(lambda: all("up" in kube_emulator.pod_log(p, ns)
                                       for p in ("server", "kernel")),
                           message="both programs to handle SIGTERM")
    core.delete_namespaced_pod("server", ns, grace_period_seconds=1)
    kube_emulator.wait_for(
        lambda: not kube_emulator.list("pods", ns) and not kube_emulator.list("secrets", ns),
        message="server, kernel and secret to be gone", explain=lambda: leftovers(kube_emulator, ns))


def test_orphan_propagation_keeps_dependents_and_drops_the_reference(kube_emulator, core,
                                                                     kube_namespace):
    ns = kube_namespace
    owner = core.create_namespaced_config_map(ns, {"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(ns, {"metadata": {
        "name": "dep", "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap",
                                            "name": "owner", "uid": owner.metadata.uid}]}})
    core.delete_namespaced_config_map("owner", ns, propagation_policy="Orphan")
    time.sleep(0.2)  # give the garbage collector a chance to do the wrong thing
    dep = core.read_namespaced_config_map("dep", ns)
    assert dep.metadata.owner_references is None


def test_dependent_with_a_missing_owner_is_collected(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    core.create_namespaced_config_map(ns, {"metadata": {
        "name": "dangling", "ownerReferences": [{"apiVersion": "v1", "kind": "Pod",
                                                 "name": "gone", "uid": "no-such-uid"}]}})
    kube_emulator.wait_for(lambda: kube_emulator.get("configmaps", "dangling", ns) is None,
                           message="dangling dependent collected")


def test_foreground_deletion_waits_for_dependents(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    owner = core.create_namespaced_config_map(ns, {"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(ns, {"metadata": {
        "name": "dep", "finalizers": ["example.com/hold"],
        "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                             "uid": owner.metadata.uid, "blockOwnerDeletion": True}]}})
    core.delete_namespaced_config_map("owner", ns, propagation_policy="Foreground")
    held = kube_emulator.wait_for(
        lambda: (d := kube_emulator.get("configmaps", "dep", ns))
        and d["metadata"].get("deletionTimestamp") and d, message="dependent being deleted")
    assert held["metadata"]["finalizers"] == ["example.com/hold"]
    owner_now = kube_emulator.get("configmaps", "owner", ns)
    assert owner_now["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert owner_now["metadata"]["deletionTimestamp"]
    core.patch_namespaced_config_map("dep", ns, {"metadata": {"finalizers": None}})
    kube_emulator.wait_for(lambda: kube_emulator.get("configmaps", "owner", ns) is None,
                           message="owner removed after its dependent")


def test_finalizers_hold_deletion_until_removed(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    core.create_namespaced_config_map(ns, {"metadata": {"name": "held",
                                                        "finalizers": ["example.com/x"]}})
    core.delete_namespaced_config_map("held", ns)
    held = core.read_namespaced_config_map("held", ns)
    assert held.metadata.deletion_timestamp is not None
    with pytest.raises(kubernetes.client.ApiException) as err:
        core.patch_namespaced_config_map("held", ns, {"metadata": {
            "finalizers": ["example.com/x", "example.com/y"]}})
    assert err.value.status == 422
    core.patch_namespaced_config_map("held", ns, {"metadata": {"finalizers": None}})
    with pytest.raises(kubernetes.client.ApiException) as err:
        core.read_namespaced_config_map("held", ns)
    assert err.value.status == 404
