"""KubeSpawner 7's own client code against the emulator: its client configuration
(kubespawner.clients), its reflectors (list + watch with resourceVersion, label and field
selectors, timeoutSeconds restarts) and a pod manifest from kubespawner.objects.make_pod."""

from __future__ import annotations

import asyncio
import sys
import urllib.request

import pytest
from kubespawner import clients
from kubespawner.objects import make_pod
from kubespawner.spawner import EventReflector, KubeSpawner, PodReflector

LABELS = {"component": "singleuser-server"}


@pytest.fixture
async def api(kube_emulator):
    # What KubeSpawner.__init__ does: load the kubeconfig (KUBECONFIG, set by the fixture)
    # and take the shared client of the running loop.
    clients.load_config()
    return clients.shared_client("CoreV1Api")


async def _until(predicate, timeout: float = 10.0, what: str = "condition"):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := predicate()):
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return value


def _pause_pod(name: str, labels: dict) -> dict:
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "notebook", "image": "jupyter/base"}]}}


async def test_pod_reflector_lists_and_watches_through_watch_restarts(api, kube_namespace):
    ns = kube_namespace
    await api.create_namespaced_pod(ns, _pause_pod("jupyter-early", LABELS))
    await api.create_namespaced_pod(ns, _pause_pod("other", {"component": "hub"}))
    reflector = PodReflector(namespace=ns, labels=LABELS)
    reflector.timeout_seconds = 1  # restart (and re-list from a resourceVersion) every second
    await reflector.start()
    try:
        await reflector.first_load_future
        assert sorted(reflector.pods) == [f"{ns}/jupyter-early"]
        await _until(lambda: reflector.pods[f"{ns}/jupyter-early"]["status"].get("phase")
                     == "Running", what="Running seen through the watch")
        await asyncio.sleep(1.5)  # across a watch timeout and a re-list
        await api.create_namespaced_pod(ns, _pause_pod("jupyter-late", LABELS))
        late = await _until(lambda: reflector.pods.get(f"{ns}/jupyter-late"),
                            what="new pod in the reflector")
        assert late["metadata"]["labels"] == LABELS
        running = await _until(
            lambda: (p := reflector.pods.get(f"{ns}/jupyter-late"))
            and KubeSpawner.is_pod_running(None, p) and p, what="is_pod_running")
        assert running["status"]["podIP"].startswith("127.")
        await api.delete_namespaced_pod("jupyter-early", ns, grace_period_seconds=1)
        await _until(lambda: f"{ns}/jupyter-early" not in reflector.pods, what="pod removal")
        assert f"{ns}/other" not in reflector.pods
        assert reflector.watch_task is not None and not reflector.watch_task.done()
    finally:
        await reflector.stop()


async def test_multi_namespace_and_event_reflectors(api, kube_namespace):
    ns = kube_namespace
    pods = PodReflector(namespace=None, omit_namespace=True, labels=LABELS)
    events = EventReflector(namespace=ns, fields={"involvedObject.kind": "Pod"})
    await pods.start()
    await events.start()
    try:
        await api.create_namespaced_pod(ns, _pause_pod("jupyter-ev", LABELS))
        await _until(lambda: f"{ns}/jupyter-ev" in pods.pods, what="pod across namespaces")
        reasons = await _until(
            lambda: (r := [e["reason"] for e in events.events
                           if e["involvedObject"]["name"] == "jupyter-ev"])
            and "Started" in r and r, what="kubelet events")
        assert reasons[0] == "Scheduled"
        # the sort key KubeSpawner's progress() uses works on these events
        assert all(e["lastTimestamp"] or e["eventTime"] for e in events.events)
    finally:
        await pods.stop()
        await events.stop()


async def test_make_pod_manifest_runs_and_serves_on_its_pod_ip(kube_emulator, api,
                                                               kube_namespace):
    ns = kube_namespace
    manifest = make_pod(
        name="jupyter-alice", image="quay.io/jupyter/base-notebook:latest",
        cmd=[sys.executable, "-m", "http.server", "--bind", "0.0.0.0", "8888"], port=8888,
        labels=LABELS, annotations={"hub.jupyter.org/username": "alice"},
        env={"JUPYTERHUB_USER": "alice"}, cpu_guarantee=0.1, mem_limit="1G",
        extra_resource_limits={"nvidia.com/gpu": "1"}, working_dir="/home/jovyan",
        volumes=[{"name": "home", "emptyDir": {}}],
        volume_mounts=[{"name": "home", "mountPath": "/home/jovyan"}],
        node_selector={}, uid=1000, fs_gid=100)
    created = await api.create_namespaced_pod(ns, manifest)
    assert created.spec.restart_policy == "OnFailure"
    pod = kube_emulator.wait_for_pod_phase("jupyter-alice", "Running", ns)
    assert pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "1"

    def get():
        url = f"http://{pod['status']['podIP']}:8888/"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status
        except OSError:
            return None

    assert await asyncio.to_thread(kube_emulator.wait_for, get, 10) == 200
    await api.delete_namespaced_pod("jupyter-alice", ns, grace_period_seconds=1)
    await _until(lambda: kube_emulator.get("pods", "jupyter-alice", ns) is None,
                 what="pod removal")
