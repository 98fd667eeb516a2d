"""apps/v1 and batch/v1 with their controllers: what a chart's Deployment, DaemonSet and hook
Job become on a cluster."""

from __future__ import annotations

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from tests.kubeemu import KubeEmulator, NodeSpec
from tests.kubeemu.helpers import py

SLEEP = py("import time; time.sleep(600)")


@pytest.fixture(scope="module")
def emu():
    nodes = [NodeSpec("cpu-1", labels={"pool": "cpu"}),
             NodeSpec("gpu-1", labels={"pool": "gpu"}),
             NodeSpec("gpu-2", labels={"pool": "gpu"})]
    with KubeEmulator(nodes=nodes, namespaces=["apps"], restart_backoff_seconds=1.0) as emu:
        yield emu


@pytest.fixture(scope="module")
def apps(emu):
    client = kubernetes.config.new_client_from_config(emu.kubeconfig_path)
    yield kubernetes.client.AppsV1Api(client)
    client.close()


def _template(labels: dict, command: list[str], **spec) -> dict:
    return {"metadata": {"labels": labels},
            "spec": {"containers": [{"name": "c", "image": "python:3.11", "command": command}],
                     "terminationGracePeriodSeconds": 1, **spec}}


def _pods(emu: KubeEmulator, selector: str) -> list[dict]:
    return [p for p in emu.list("pods", "apps", label_selector=selector)
            if not p["metadata"].get("deletionTimestamp")]


def test_deployment_runs_its_replicas_through_a_replica_set_and_rolls_out_a_new_template(
        emu, apps):
    apps.create_namespaced_deployment("apps", {
        "metadata": {"name": "hub"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "hub"}},
                 "template": _template({"app": "hub"}, SLEEP)}})
    emu.wait_for(lambda: (apps.read_namespaced_deployment("hub", "apps").status.ready_replicas
                          or 0) == 2, timeout=30, message="two ready replicas")
    (rs,) = apps.list_namespaced_replica_set("apps").items
    assert rs.metadata.owner_references[0].kind == "Deployment"
    assert rs.metadata.annotations["deployment.kubernetes.io/revision"] == "1"
    pods = _pods(emu, "app=hub")
    assert len(pods) == 2 and all(p["metadata"]["ownerReferences"][0]["uid"] ==
                                  rs.metadata.uid for p in pods)
    first = {p["metadata"]["name"] for p in pods}
    apps.patch_namespaced_deployment("hub", "apps", {"spec": {"template": {"metadata": {
        "annotations": {"rev": "2"}}}}})

    def rolled():
        d = apps.read_namespaced_deployment("hub", "apps")
        names = {p["metadata"]["name"] for p in _pods(emu, "app=hub")
                 if p["status"].get("phase") == "Running"}
        return (d.status.updated_replicas == 2 and d.status.replicas == 2
                and len(names) == 2 and not names & first)

    emu.wait_for(rolled, timeout=40, message="the rollout to replace both pods")
    sets = {r.metadata.annotations["deployment.kubernetes.io/revision"]: r.spec.replicas
            for r in apps.list_namespaced_replica_set("apps").items}
    assert sets == {"1": 0, "2": 2}
    apps.delete_namespaced_deployment("hub", "apps")
    emu.wait_for(lambda: not emu.list("pods", "apps", label_selector="app=hub")
                 and not apps.list_namespaced_replica_set("apps").items, timeout=30,
                 message="the garbage collector to remove the replica sets and pods")


def test_daemon_set_runs_one_pod_on_each_matching_node(emu, apps):
    apps.create_namespaced_daemon_set("apps", {
        "metadata": {"name": "agent"},
        "spec": {"selector": {"matchLabels": {"app": "agent"}},
                 "template": _template({"app": "agent"}, SLEEP, nodeSelector={"pool": "gpu"})}})
    emu.wait_for(lambda: (apps.read_namespaced_daemon_set("agent", "apps").status.number_ready
                          or 0) == 2, timeout=30, message="an agent on each GPU node")
    nodes = sorted(p["spec"]["nodeName"] for p in _pods(emu, "app=agent"))
    assert nodes == ["gpu-1", "gpu-2"]
    emu.add_node("gpu-3", labels={"pool": "gpu"})
    emu.wait_for(lambda: sorted(p["spec"].get("nodeName") or "" for p in _pods(emu, "app=agent"))
                 == ["gpu-1", "gpu-2", "gpu-3"], timeout=30, message="an agent on the new node")
    apps.delete_namespaced_daemon_set("agent", "apps")
    emu.wait_for(lambda: not emu.list("pods", "apps", label_selector="app=agent"), timeout=30,
                 message="the agents to go")


def test_job_runs_to_completion(emu):
    batch = kubernetes.client.BatchV1Api(kubernetes.config.new_client_from_config(
        emu.kubeconfig_path))
    batch.create_namespaced_job("apps", {
        "metadata": {"name": "hook"},
        "spec": {"template": _template({}, py("print('done')"), restartPolicy="Never")}})

    def complete():
        job = batch.read_namespaced_job("hook", "apps")
        return job.status.succeeded == 1 and any(
            c.type == "Complete" and c.status == "True" for c in job.status.conditions or [])

    emu.wait_for(complete, timeout=30, message="the job to complete")
    (p,) = emu.list("pods", "apps", label_selector="job-name=hook")
    assert emu.pod_log(p["metadata"]["name"], "apps") == "done\n"


def test_selector_not_matching_the_template_is_invalid(apps):
    with pytest.raises(ApiException) as err:
        apps.create_namespaced_deployment("apps", {
            "metadata": {"name": "bad"},
            "spec": {"selector": {"matchLabels": {"app": "x"}},
                     "template": _template({"app": "y"}, SLEEP)}})
    assert err.value.status == 422
    assert "`selector` does not match template `labels`" in err.value.body
