"""ElasticGPUSpawner end to end: a real JupyterHub and configurable-http-proxy, KubeSpawner
talking to the Kubernetes API emulator, whose kubelet runs each pod's jupyterhub-singleuser as
a local process on its own loopback address.

One hub and one emulator serve the whole module; each test stops the servers it started.
The card: one simulated H100 with 80 GiB on node gpu-node-1.
"""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from kubernetes import client as kclient
from kubernetes import config as kconfig

from hubext.metering.store import UsageStore
from libvgpu import contract as L
from libvgpu import health
from tests.hubrunner import HubRunner
from tests.kubeemu import KubeEmulator
from tests.kubeemu.helpers import create_host_claim

GPU_UUID = "GPU-11111111-2222-3333-4444-555555555555"
NODE = "gpu-node-1"
NAMESPACE = "jhub"
MAX_WAIT_S = 20
UNSCHEDULABLE_S = 4
#: the queue wait of the 'quarter-brief' profile (a spawn that is to wait until it runs out)
BRIEF_WAIT_S = 6

ADMISSION = {
    "priority_classes": {
        "high": {"value": 1000, "preempt": True, "borrow": False},
        "default": {"value": 100, "preempt": False, "borrow": False},
        "low": {"value": 10, "preempt": False, "borrow": False},
    },
    "default_priority_class": "default",
    "placement": {"node": "binpack", "gpu": "binpack"},
    "workspaces": {
        "default": {"namespaces": {"default": {}}},
        "small": {"limits": {"memory_mib": 10240}, "namespaces": {"default": {}}},
    },
}

PROFILES = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {"display_name": "1/4 H100", "slug": "quarter", "gpu": {"memory_mib": 20480, "cores_percent": 25}},
    {
        "display_name": "1/4 H100 (waits 6 s at most)",
        "slug": "quarter-brief",
        "gpu": {"memory_mib": 20480, "cores_percent": 25},
        "kubespawner_override": {"gpu_max_wait_seconds": BRIEF_WAIT_S},
    },
    {"display_name": "1/2 H100", "slug": "half", "gpu": {"memory_mib": 40960, "cores_percent": 50}},
    {
        "display_name": "1/2 H100 (low priority)",
        "slug": "half-low",
        "gpu": {"memory_mib": 40960, "cores_percent": 50, "priority_class": "low"},
    },
    {
        "display_name": "1/2 H100 (urgent)",
        "slug": "half-high",
        "allowed_groups": ["urgent"],
        "gpu": {"memory_mib": 40960, "cores_percent": 50, "priority_class": "high"},
    },
    {
        "display_name": "H100 by size",
        "slug": "sized",
        "gpu": {"model": "H100-80GB"},
        "profile_options": {
            "size": {
                "display_name": "Size",
                "choices": {
                    "quarter": {"display_name": "20 GiB", "gpu": {"memory_mib": 20480, "cores_percent": 25}},
                },
            }
        },
    },
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("kube-e2e")
    gpus = [{"uuid": GPU_UUID, "model": "H100-80GB", "memory_mib": 81920, "sm_count": 132, "index": 0}]
    emulator = KubeEmulator(
        nodes=[
            {
                "name": NODE,
                "labels": {L.NODE_GPU_LABEL: "true", "kubernetes.io/hostname": NODE},
                "annotations": {L.NODE_GPUS_ANNOTATION: json.dumps(gpus)},
            }
        ],
        data_dir=workdir / "emulator",
        keep_pod_dirs=True,
    )
    emulator.start()
    host_dir = workdir / "host-elastic-gpu"  # what the node agent installs on a GPU node
    (host_dir / "lib").mkdir(parents=True)
    (host_dir / "ld.so.preload").write_text("")
    admission_file = workdir / "admission.yaml"
    admission_file.write_text(yaml.safe_dump(ADMISSION))
    singleuser = Path(sys.executable).parent / "jupyterhub-singleuser"
    config = textwrap.dedent(
        f"""
        from hubext.hubconfig import configure_hub
        configure_hub(c, mode="kubernetes", admission_config_file={str(admission_file)!r}, culler=False)
        c.JupyterHub.cleanup_servers = False
        c.JupyterHub.load_groups = {{"urgent": {{"users": ["frank"]}}}}
        c.KubeSpawner.namespace = {NAMESPACE!r}
        c.KubernetesPool.namespace = {NAMESPACE!r}
        c.KubeSpawner.image = "quay.io/jupyter/base-notebook:emulated"
        c.KubeSpawner.cmd = [{str(singleuser)!r}]
        c.KubeSpawner.start_timeout = 90
        c.KubeSpawner.http_timeout = 60
        c.Spawner.poll_interval = 2
        c.ElasticGPUSpawner.gpu_max_wait_seconds = {MAX_WAIT_S}
        c.ElasticGPUSpawner.gpu_unschedulable_seconds = {UNSCHEDULABLE_S}
        c.ElasticGPUSpawner.gpu_owner_mapping = {{"eve": "small/default"}}
        c.ElasticGPUSpawner.profile_list = {PROFILES!r}
        c.Authenticator.admin_users = {{"gpu-admin"}}
        """
    )
    kconfig.load_kube_config(config_file=str(emulator.kubeconfig_path))
    api = kclient.CoreV1Api()
    api.create_namespace(kclient.V1Namespace(metadata=kclient.V1ObjectMeta(name=NAMESPACE)))
    kclient.NodeV1Api().create_runtime_class(  # as the NVIDIA GPU operator creates it
        kclient.V1RuntimeClass(metadata=kclient.V1ObjectMeta(name="nvidia"), handler="nvidia")
    )
    for name, pc in ADMISSION["priority_classes"].items():  # as the chart creates them
        kclient.SchedulingV1Api().create_priority_class(
            kclient.V1PriorityClass(metadata=kclient.V1ObjectMeta(name=f"elastic-gpu-{name}"), value=pc["value"])
        )
    create_host_claim(emulator, NAMESPACE, host_dir)  # the chart's claim of the agent's directory
    hub = HubRunner(workdir, config, env={"KUBECONFIG": str(emulator.kubeconfig_path)})
    hub.start()
    yield hub, api
    hub.stop()
    emulator.stop()


# ---- helpers ---------------------------------------------------------------------------------


class Progress(threading.Thread):
    """Reads a spawn's progress event stream in the background."""

    def __init__(self, hub: HubRunner, user: str) -> None:
        super().__init__(daemon=True)
        self.hub, self.user, self.events = hub, user, []

    def run(self) -> None:
        req = urllib.request.Request(f"{self.hub.hub_api}/users/{self.user}/server/progress")
        req.add_header("Authorization", f"token {self.hub.admin_token}")
        with urllib.request.urlopen(req, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    self.events.append(event)
                    if event.get("ready") or event.get("failed"):
                        return

    def messages(self) -> list[str]:
        return [e.get("message", "") for e in self.events]


def spawn(hub: HubRunner, user: str, options: dict) -> tuple[int, object]:
    hub.user_token(user)  # creates the user
    status, body = hub.api("POST", f"/users/{user}/server", body=options)
    assert status < 500, f"spawn of {user} with {options} broke the hub: {status} {body}\n{hub.log_tail(80)}"
    return status, body


def server(hub: HubRunner, user: str) -> dict | None:
    status, model = hub.api("GET", f"/users/{user}")
    return (model.get("servers") or {}).get("") if status == 200 else None


def wait_ready(hub: HubRunner, user: str, timeout: float = 90) -> dict:
    return hub.wait_for(
        lambda: (s := server(hub, user)) and s.get("ready") and s, timeout, what=f"{user}'s server ready"
    )


def stop(hub: HubRunner, *users: str) -> None:
    for user in users:
        hub.api("DELETE", f"/users/{user}/server")
    for user in users:
        hub.wait_for(lambda u=user: server(hub, u) is None, 60, what=f"{user}'s server stopped")


def gpu_pods(api) -> dict[str, kclient.V1Pod]:
    pods = api.list_namespaced_pod(NAMESPACE, label_selector=f"{L.MANAGED}=true").items
    return {p.metadata.annotations[L.A_USER]: p for p in pods if not p.metadata.deletion_timestamp}


def pool_slices(hub: HubRunner) -> dict[str, dict]:
    status, pool = hub.api("GET", "/gpu/pool")
    assert status == 200, pool
    return {s["allocation_id"]: s for n in pool["nodes"] for g in n["gpus"] for s in g["slices"]}


def failure_message(hub: HubRunner, user: str, status: int, body: object) -> str:
    """The refusal a user sees: the REST error, or the failed progress event."""
    if status >= 400:
        return body.get("message", "") if isinstance(body, dict) else str(body)
    progress = Progress(hub, user)
    progress.run()
    return progress.messages()[-1]


# ---- the tests -------------------------------------------------------------------------------


def test_two_users_share_one_card_and_pods_carry_the_slice(cluster):
    hub, api = cluster
    assert spawn(hub, "alice", {"profile": "quarter"})[0] in (201, 202)
    assert spawn(hub, "bob", {"profile": "sized", "size": "quarter"})[0] in (201, 202)
    wait_ready(hub, "alice")
    wait_ready(hub, "bob")
    pods = gpu_pods(api)
    for user in ("alice", "bob"):
        pod = pods[user]
        ann = pod.metadata.annotations
        assert ann[L.A_GPU_UUIDS] == GPU_UUID and ann[L.A_MEMORY_MIB] == "20480" and ann[L.A_CORES_PERCENT] == "25"
        [term] = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
        assert term.match_fields[0].values == [NODE] and pod.spec.node_name == NODE
        assert pod.spec.priority_class_name == "elastic-gpu-default"
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["NVIDIA_VISIBLE_DEVICES"] == GPU_UUID
        assert "memory_mib.0=20480" in ann[L.A_LIMITS]
        assert pod.metadata.labels[L.USER] == user and pod.metadata.labels[L.KIND] == "notebook"
    slices = pool_slices(hub)
    assert sorted(s["user"] for s in slices.values()) == ["alice", "bob"]
    stop(hub, "alice", "bob")
    hub.wait_for(lambda: not pool_slices(hub), 30, what="slices released")


def test_waiting_spawn_shows_its_position_and_starts_when_the_card_frees(cluster):
    hub, api = cluster
    spawn(hub, "alice", {"profile": "half"})
    spawn(hub, "bob", {"profile": "half"})
    wait_ready(hub, "alice")
    wait_ready(hub, "bob")
    status, _ = spawn(hub, "carol", {"profile": "quarter"})
    assert status == 202, "carol's spawn should be pending in the GPU queue"
    progress = Progress(hub, "carol")
    progress.start()
    hub.wait_for(lambda: any(m.startswith("Queued:") for m in progress.messages()), 15, what="queue event")
    queued = next(m for m in progress.messages() if m.startswith("Queued:"))
    assert "no requests ahead" in queued and ("MiB" in queued or "GiB" in queued), queued
    stop(hub, "alice")
    wait_ready(hub, "carol")
    progress.join(30)
    messages = progress.messages()
    placed = next(i for i, m in enumerate(messages) if m.startswith(f"Placed on {NODE} / {GPU_UUID}"))
    order = [messages.index("Checking GPU quota"), messages.index(queued), placed, messages.index("Waiting for pod")]
    assert order == sorted(order), messages
    stop(hub, "bob", "carol")


def test_wait_that_runs_out_fails_with_the_pool_full_message(cluster):
    hub, api = cluster
    spawn(hub, "alice", {"profile": "half"})
    spawn(hub, "bob", {"profile": "half"})
    wait_ready(hub, "alice")
    wait_ready(hub, "bob")
    started = time.monotonic()
    status, body = spawn(hub, "dave", {"profile": "quarter-brief"})
    message = failure_message(hub, "dave", status, body)
    assert time.monotonic() - started >= BRIEF_WAIT_S - 1
    assert "Waited" in message and "GPU queue" in message, message
    assert server(hub, "dave") is None
    assert "dave" not in {s["user"] for s in pool_slices(hub).values()}
    stop(hub, "alice", "bob")


def test_an_unschedulable_gpu_notebook_gives_its_slice_back_with_the_schedulers_reason(cluster):
    """Admission placed the slice, but kube-scheduler cannot put the pod there (here: the node is
    cordoned): after gpu_unschedulable_seconds the spawn fails with the scheduler's message, the
    slice goes back to the pool and the pod is deleted; not KubeSpawner's start_timeout later."""
    hub, api = cluster
    api.patch_node(NODE, {"spec": {"unschedulable": True}})
    try:
        started = time.monotonic()
        status, body = spawn(hub, "uma", {"profile": "quarter"})
        message = failure_message(hub, "uma", status, body)
        took = time.monotonic() - started
    finally:
        api.patch_node(NODE, {"spec": {"unschedulable": False}})
    assert "could not be scheduled" in message and "unschedulable" in message, message
    assert "GPU slice was given back" in message, message
    assert took < UNSCHEDULABLE_S + 30, f"took {took:.0f} s (start_timeout is 90 s)"
    hub.wait_for(lambda: server(hub, "uma") is None, 60, what="uma's failed server to be gone")
    assert "uma" not in {s["user"] for s in pool_slices(hub).values()}
    hub.wait_for(lambda: "uma" not in gpu_pods(api), 60, what="uma's pod to be deleted")


def test_user_over_workspace_quota_gets_the_quota_message(cluster):
    hub, api = cluster
    status, body = spawn(hub, "eve", {"profile": "quarter"})
    message = failure_message(hub, "eve", status, body)
    assert "Workspace 'small'" in message and ("10 GiB" in message or "10240 MiB" in message), message
    assert server(hub, "eve") is None
    assert "eve" not in gpu_pods(api)


def test_forged_or_hidden_profile_options_are_refused(cluster):
    hub, api = cluster
    cases = [
        ({"profile": "sized", "size": "eight-gpus"}, "no choice 'eight-gpus'"),
        ({"profile": "no-such-profile"}, "No such profile"),
        ({"profile": "half-high"}, "No such profile"),  # only group 'urgent' sees it
    ]
    for options, expected in cases:
        status, body = spawn(hub, "mallory", options)
        message = failure_message(hub, "mallory", status, body)
        assert expected in message, (options, message)
        assert server(hub, "mallory") is None
    assert "mallory" not in gpu_pods(api)
    assert not pool_slices(hub)


def test_high_priority_spawn_preempts_a_low_priority_one(cluster):
    hub, api = cluster
    started = time.time()
    spawn(hub, "grace", {"profile": "half-low"})
    spawn(hub, "bob", {"profile": "half"})
    wait_ready(hub, "grace")
    wait_ready(hub, "bob")
    victim_pod = gpu_pods(api)["grace"].metadata.name
    hub.user_token("frank")
    status, _ = spawn(hub, "frank", {"profile": "half-high"})
    assert status in (201, 202)
    wait_ready(hub, "frank")
    pods = gpu_pods(api)
    assert "grace" not in pods and "bob" in pods and "frank" in pods
    events = api.list_namespaced_event(NAMESPACE).items
    preempted = [e for e in events if e.reason == "Preempted" and e.involved_object.name == victim_pod]
    assert preempted and "high" in preempted[0].message
    hub.wait_for(lambda: server(hub, "grace") is None, 30, what="grace's server noticed as stopped")
    stop(hub, "bob", "frank")
    # the usage records (docs/metering.md): the notebooks' slices with their causes and frank's hub group
    store = UsageStore(f"sqlite:///{hub.workdir / 'jupyterhub.sqlite'}")
    try:

        def closed() -> dict:
            mine = [r for r in store.records(start=started - 1) if r.granted_at >= started - 1]
            records = {r.user: r for r in mine if r.user in ("grace", "bob", "frank")}
            return records if all(r.released_at is not None for r in records.values()) and len(records) == 3 else {}

        records = hub.wait_for(closed, 30, what="grace's, bob's and frank's usage records closed")
    finally:
        store.close()
    assert {u: (r.kind, r.release_cause) for u, r in records.items()} == {
        "grace": ("notebook", "preempted"),
        "bob": ("notebook", "stopped"),
        "frank": ("notebook", "stopped"),
    }
    assert records["frank"].hub_groups == "urgent" and records["frank"].priority_class == "high"


def _set_health(api, cards: dict) -> None:
    """What the node agent writes after a fatal Xid (an empty dict: what an admin's clearing leaves)."""
    api.patch_node(NODE, {"metadata": {"annotations": {L.NODE_GPU_HEALTH_ANNOTATION: health.dump(cards)}}})


def _card_out_of_service(hub: HubRunner) -> str | None:
    status, pool = hub.api("GET", "/gpu/pool")
    assert status == 200, pool
    return next(g.get("out_of_service") for n in pool["nodes"] for g in n["gpus"] if g["uuid"] == GPU_UUID)


def test_a_card_out_of_service_is_on_the_admin_page_and_in_the_sentence_of_a_request_it_holds_up(cluster):
    """The only card fell off the bus (Xid 79): the admin page shows which card, since when, the Xid
    and what it means, and how to clear it; a spawn that waits for it is told that this card is
    out of service, not to wait for a kernel to stop (clearing it: tests/hubext/test_card_health.py)."""
    hub, api = cluster
    clear = f"kubectl annotate node {NODE} {L.NODE_GPU_HEALTH_ANNOTATION}-"
    since = time.time() - 120
    _set_health(api, {GPU_UUID: health.OutOfService(79, since, 0)})
    try:
        hub.wait_for(lambda: _card_out_of_service(hub), 30, what="the hub to see the card out of service")
        page = hub.login("gpu-admin").open(hub.url + "/hub/gpu", timeout=60).read().decode()
        card = page.split(f'data-uuid="{GPU_UUID}"', 1)[1].split('class="col-lg-6', 1)[0]
        assert "egpu-out-of-service" in card, card
        block = card.split("egpu-out-of-service", 1)[1].split("</div>", 1)[0]
        assert "Out of service" in block and "Xid 79" in block and "the GPU has fallen off the bus" in block, block
        assert time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(since)) in block, block
        assert clear in block, block
        # a spawn only this card could hold waits, told that this card is out of service, then gives up
        message = failure_message(hub, "carol", *spawn(hub, "carol", {"profile": "quarter-brief"}))
        assert f"{GPU_UUID} on node {NODE} is out of service after Xid 79 (the GPU has fallen off the bus)" in message
        assert clear in message and "Wait for a kernel to stop" not in message and "Waited" in message, message
        assert server(hub, "carol") is None
    finally:
        _set_health(api, {})
    hub.wait_for(lambda: _card_out_of_service(hub) is None, 30, what="the hub to see the card cleared")


def test_hub_restart_keeps_every_allocation(cluster):
    hub, api = cluster
    spawn(hub, "alice", {"profile": "quarter"})
    spawn(hub, "bob", {"profile": "half"})
    wait_ready(hub, "alice")
    wait_ready(hub, "bob")
    before = pool_slices(hub)
    assert len(before) == 2
    hub.restart()
    after = pool_slices(hub)
    assert {k: (v["user"], v["memory_mib"]) for k, v in after.items()} == {
        k: (v["user"], v["memory_mib"]) for k, v in before.items()
    }
    # nothing duplicated or lost: exactly 20 GiB are left, so a half waits and a quarter fits
    status, _ = spawn(hub, "carol", {"profile": "quarter"})
    wait_ready(hub, "carol")
    assert len(pool_slices(hub)) == 3
    stop(hub, "alice", "bob", "carol")
