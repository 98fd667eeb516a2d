"""GPU pods on a real cluster next to zero-to-jupyterhub (issue 14), checked on the pure builders
(``hubext.kubernetes.objects``) and on the pod the kernel launcher writes:

- placement goes through kube-scheduler: the node admission chose is a required node affinity on
  the Node's name (``matchFields metadata.name``, as the DaemonSet controller pins), never
  ``nodeName``; GPU pods tolerate the ``nvidia.com/gpu`` taint and z2jh's dedicated user pools;
- kernel pods are sandboxed like z2jh's user pods: the "restricted" Pod Security fields, CPU and
  memory requests/limits, pull secrets, z2jh's labels;
- kernel pods see the user's files: the server's home volume and the working directory.
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from kubernetes_asyncio.client import models as k8s
from kubespawner.objects import make_pod

from hubext.allocator import GPUAllocator
from hubext.backends import LaunchError, ServerRef
from hubext.kernels import KernelRecord
from hubext.kubernetes.launcher import KubernetesKernelLauncher
from hubext.kubernetes.objects import apply_gpu_to_pod, shared_server_volumes, volume_sharing_problem
from hubext.kubernetes.spawner import ElasticGPUSpawner
from libvgpu import contract as L
from quotas import Allocation, Owner
from tests.kubeemu.podsecurity import violations

VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
Z2JH_DEDICATED = {"key": "hub.jupyter.org/dedicated", "operator": "Equal", "value": "user", "effect": "NoSchedule"}

ALLOCATION = Allocation(
    id="kernel-alice-01234567-0",
    owner=Owner(user="alice"),
    node="gpu-node-1",
    gpu_uuids=("GPU-1",),
    memory_mib=10240,
    cores_percent=25,
    priority_class="default",
    kind="kernel",
)


@pytest.fixture()
def no_allocator():
    yield
    GPUAllocator.clear_instance()


def manifest(obj) -> dict:
    """A client model as the JSON the API server receives (camelCase, no nulls)."""

    def prune(value):
        if isinstance(value, dict):
            return {k: prune(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [prune(v) for v in value]
        return value

    return prune(obj.to_dict(serialize=True))


def validate_all_versions(obj: dict) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def node_terms(pod: dict) -> list[dict]:
    return pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]


# ---- the notebook pod ---------------------------------------------------------------------------


def notebook_pod(**kw) -> k8s.V1Pod:
    return make_pod(
        name="jupyter-alice",
        cmd=["jupyterhub-singleuser"],
        port=8888,
        image="quay.io/jupyter/base-notebook:latest",
        labels={"app": "jupyterhub", "component": "singleuser-server"},
        annotations={},
        **kw,
    )


def gpu_notebook(pod: k8s.V1Pod, backend: str = "native", tolerations=None) -> dict:
    apply_gpu_to_pod(
        pod,
        ALLOCATION,
        backend=backend,
        section={"memory_mib": 10240, "cores_percent": 25},
        priority_value=100,
        priority_class_name="elastic-gpu-default",
        runtime_class="nvidia",
        tolerations=[GPU_TAINT] if tolerations is None else tolerations,
    )
    return {"apiVersion": "v1", "kind": "Pod", **manifest(pod)}


def test_native_gpu_notebook_goes_through_the_scheduler_to_the_chosen_node_and_tolerates_the_gpu_taint():
    pod = gpu_notebook(notebook_pod(tolerations=[Z2JH_DEDICATED]))
    validate_all_versions(pod)
    spec = pod["spec"]
    assert "nodeName" not in spec, "nodeName bypasses kube-scheduler (taints, CPU/memory, preemption)"
    assert "kubernetes.io/hostname" not in spec.get("nodeSelector", {})
    assert node_terms(pod) == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-1"]}]}]
    assert GPU_TAINT in spec["tolerations"] and Z2JH_DEDICATED in spec["tolerations"]


def test_node_pin_is_added_to_every_required_term_of_the_profile():
    """Terms are ORed: the node must be ANDed into each, or a pod could leave the chosen node."""
    purpose = {"key": "hub.jupyter.org/node-purpose", "operator": "In", "values": ["user"]}
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}
    pod = gpu_notebook(
        notebook_pod(node_affinity_required=[{"matchExpressions": [purpose]}, {"matchExpressions": [zone]}])
    )
    validate_all_versions(pod)
    pin = {"key": "metadata.name", "operator": "In", "values": ["gpu-node-1"]}
    assert node_terms(pod) == [
        {"matchExpressions": [purpose], "matchFields": [pin]},
        {"matchExpressions": [zone], "matchFields": [pin]},
    ]


@pytest.mark.parametrize("backend", ["hami", "whole"])
def test_scheduler_backends_are_not_pinned_but_tolerate_the_gpu_taint(backend):
    pod = gpu_notebook(notebook_pod(), backend=backend)
    assert "affinity" not in pod["spec"] and "nodeName" not in pod["spec"]
    assert pod["spec"]["tolerations"] == [GPU_TAINT]


def test_a_toleration_already_present_is_not_repeated():
    pod = gpu_notebook(notebook_pod(tolerations=[GPU_TAINT]))
    assert pod["spec"]["tolerations"] == [GPU_TAINT]


def test_native_gpu_notebook_pod_passes_pod_security_baseline():
    """No hostPath: the node agent's directory (libvgpu.so, ld.so.preload, the node regions) comes
    through the chart's claim; the limits file through the downward API; the preload file and
    the region from the pod's own volume, which a restricted init container fills."""
    pod = gpu_notebook(notebook_pod(tolerations=[Z2JH_DEDICATED]))
    assert violations(pod, "baseline") == []
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["elastic-gpu-host"] == {
        "name": "elastic-gpu-host",
        "persistentVolumeClaim": {"claimName": "elastic-gpu-host"},
    }
    mounts = {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/etc/ld.so.preload"] == {
        "name": "elastic-gpu-region", "mountPath": "/etc/ld.so.preload", "subPath": "etc/ld.so.preload",
        "readOnly": True,
    }  # fmt: skip
    [init] = pod["spec"]["initContainers"]
    assert violations({"spec": {"containers": [init]}}, "restricted") == []
    assert mounts["/usr/local/lib/elastic-gpu"]["subPath"] == "lib" and mounts["/usr/local/lib/elastic-gpu"]["readOnly"]
    assert mounts["/var/run/libvgpu/node"]["subPath"] == "regions" and mounts["/var/run/libvgpu/node"]["readOnly"]


def test_pod_security_check_refuses_what_baseline_forbids():
    """The checker itself: the old design's hostPath volumes and z2jh's iptables init container
    (singleuser.cloudMetadata.blockWithIptables, privileged + NET_ADMIN) are refused."""
    old = {"spec": {"containers": [{"name": "notebook"}], "volumes": [
        {"name": "elastic-gpu-lib", "hostPath": {"path": "/var/lib/elastic-gpu/lib"}},
        {"name": "elastic-gpu-preload", "hostPath": {"path": "/var/lib/elastic-gpu/ld.so.preload"}},
    ]}}  # fmt: skip
    assert violations(old, "baseline") == ['hostPath volumes (volumes "elastic-gpu-lib", "elastic-gpu-preload")']
    iptables = {"spec": {"containers": [{"name": "notebook"}], "initContainers": [{
        "name": "block-cloud-metadata",
        "securityContext": {"privileged": True, "runAsUser": 0, "capabilities": {"add": ["NET_ADMIN"]}},
    }]}}  # fmt: skip
    found = violations(iptables, "baseline")
    assert len(found) == 2 and "privileged" in found[0] and "NET_ADMIN" in found[1]
    assert violations({"spec": {"hostPID": True, "containers": []}}, "baseline") == ["host namespaces (hostPID=true)"]


def test_spawner_tolerates_gpu_taints_by_default():
    assert GPU_TAINT in ElasticGPUSpawner.gpu_tolerations.default()


# ---- the kernel pod -----------------------------------------------------------------------------

HOME = k8s.V1Volume(
    name="home", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name="claim-alice")
)
SERVER_POD = k8s.V1Pod(
    metadata=k8s.V1ObjectMeta(
        name="jupyter-alice",
        uid="uid-1",
        labels={
            "app": "jupyterhub",
            "release": "jhub",
            "component": "singleuser-server",
            "hub.jupyter.org/username": "alice",
            "hub.jupyter.org/servername": "",
        },
    ),
    spec=k8s.V1PodSpec(
        node_name="cpu-node-1",
        containers=[
            k8s.V1Container(
                name="notebook",
                working_dir="/home/jovyan",
                volume_mounts=[
                    k8s.V1VolumeMount(name="home", mount_path="/home/jovyan"),
                    k8s.V1VolumeMount(name="shared", mount_path="/home/jovyan/shared", read_only=True),
                    k8s.V1VolumeMount(name="scratch", mount_path="/tmp/scratch"),
                    k8s.V1VolumeMount(
                        name="kube-api-access", mount_path="/var/run/secrets/kubernetes.io/serviceaccount"
                    ),
                ],
            )
        ],
        volumes=[
            HOME,
            k8s.V1Volume(name="shared", nfs=k8s.V1NFSVolumeSource(server="nfs.example.org", path="/shared")),
            k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource()),
            k8s.V1Volume(name="kube-api-access", projected=k8s.V1ProjectedVolumeSource(sources=[])),
        ],
        security_context=k8s.V1PodSecurityContext(run_as_user=1000, fs_group=100),
    ),
)


def kernel_record(cwd: str = "/home/jovyan/project") -> KernelRecord:
    return KernelRecord(
        id="0123456789abcdef0123456789abcdef",
        user="alice",
        server_name="",
        size="gpu-10g",
        allocation_id=ALLOCATION.id,
        section={"memory_mib": 10240, "cores_percent": 25},
        namespace="jhub",
        ports={"shell_port": 50001, "iopub_port": 50002, "stdin_port": 50003, "control_port": 50004, "hb_port": 50005},
        cwd=cwd,
    )


def server_ref(pod: k8s.V1Pod = SERVER_POD) -> ServerRef:
    return ServerRef(
        user="alice",
        pod_name=pod.metadata.name,
        pod_uid=pod.metadata.uid,
        namespace="jhub",
        pod_labels=dict(pod.metadata.labels),
        pod=pod,
    )


def kernel_pod(launcher: KubernetesKernelLauncher | None = None, record: KernelRecord | None = None) -> dict:
    launcher = launcher or KubernetesKernelLauncher(namespace="jhub", image="kernel:1")
    pod = launcher._pod(record or kernel_record(), ALLOCATION, server_ref())
    return {"apiVersion": "v1", "kind": "Pod", **manifest(pod)}


def test_kernel_pod_lands_on_a_tainted_gpu_node_through_the_scheduler(no_allocator):
    pod = kernel_pod()
    validate_all_versions(pod)
    spec = pod["spec"]
    assert "nodeName" not in spec
    assert node_terms(pod) == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-1"]}]}]
    # nvidia.com/gpu, and z2jh's dedicated user pools (both spellings z2jh tolerates)
    assert GPU_TAINT in spec["tolerations"]
    assert Z2JH_DEDICATED in spec["tolerations"]
    assert {**Z2JH_DEDICATED, "key": "hub.jupyter.org_dedicated"} in spec["tolerations"]


def test_kernel_tolerations_and_node_selector_are_configurable(no_allocator):
    custom = {"key": "gpu-pool", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}
    launcher = KubernetesKernelLauncher(namespace="jhub", tolerations=[custom], node_selector={"pool": "gpu"})
    spec = kernel_pod(launcher)["spec"]
    assert spec["tolerations"] == [custom]
    assert spec["nodeSelector"] == {"pool": "gpu"}


def test_kernel_pod_meets_the_restricted_pod_security_profile(no_allocator):
    pod = kernel_pod()
    spec = pod["spec"]
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 1000
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert psc["fsGroup"] == 100
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc.get("privileged") is not True
        assert "add" not in sc["capabilities"]
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")


def test_kernel_pod_passes_the_restricted_pod_security_profile_as_checked_by_the_standard(no_allocator):
    """Only the volumes the user's server brings (its NFS share: not a restricted volume type, so
    the server pod is not 'restricted' either) stand between a kernel pod and the profile."""
    assert violations(kernel_pod(), "restricted") == ['restricted volume types (volumes "shared")']
    launcher = KubernetesKernelLauncher(
        namespace="jhub", image="kernel:1", shared_volume_kinds=["persistentVolumeClaim"]
    )
    assert violations(kernel_pod(launcher), "restricted") == []


def test_kernel_pod_does_not_share_the_servers_gpu_volumes(no_allocator):
    """A GPU notebook's own GPU volumes (the host claim is a PVC) are not the user's files: the
    kernel gets its own, once (a duplicate volume name is refused by the API server)."""
    server = copy.deepcopy(SERVER_POD)
    server_manifest = gpu_notebook(server)
    assert "elastic-gpu-host" in {v["name"] for v in server_manifest["spec"]["volumes"]}
    launcher = KubernetesKernelLauncher(namespace="jhub", image="kernel:1")
    pod = launcher._pod(kernel_record(), ALLOCATION, server_ref(server))
    manifest_ = {"apiVersion": "v1", "kind": "Pod", **manifest(pod)}
    names = [v["name"] for v in manifest_["spec"]["volumes"]]
    assert names.count("elastic-gpu-host") == 1 and "home" in names
    validate_all_versions(manifest_)


def test_kernel_pod_has_cpu_and_memory_requests_and_limits_by_default(no_allocator):
    resources = kernel_pod()["spec"]["containers"][0]["resources"]
    assert set(resources["requests"]) >= {"cpu", "memory"}
    assert set(resources["limits"]) >= {"memory"}


def test_kernel_pod_pull_secrets_and_user_id_are_configurable(no_allocator):
    launcher = KubernetesKernelLauncher(
        namespace="jhub", image_pull_secrets=["regcred"], uid=1234, cpu_limit="4", memory_limit="2Gi"
    )
    pod = kernel_pod(launcher)
    spec = pod["spec"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["securityContext"]["runAsUser"] == 1234
    assert spec["containers"][0]["resources"]["limits"]["cpu"] == "4"
    assert spec["containers"][0]["resources"]["limits"]["memory"] == "2Gi"


def test_root_uid_is_refused_with_a_sentence(no_allocator):
    with pytest.raises(Exception, match="uid"):
        KubernetesKernelLauncher(uid=0)


def test_kernel_pod_carries_z2jh_labels_but_not_the_server_component(no_allocator):
    """z2jh's release/app labels (so z2jh-wide selectors and `kubectl -l release=` find kernels), the
    user's labels; never component=singleuser-server, which KubeSpawner's pod reflector lists as servers."""
    labels = kernel_pod()["metadata"]["labels"]
    assert labels["app"] == "jupyterhub" and labels["release"] == "jhub"
    assert labels["hub.jupyter.org/username"] == "alice"
    assert labels["component"] == "elastic-gpu-kernel"
    assert labels[L.KIND] == "kernel"


def test_kernel_pod_mounts_the_servers_home_and_starts_in_the_working_directory(no_allocator):
    pod = kernel_pod()
    validate_all_versions(pod)
    spec = pod["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["home"]["persistentVolumeClaim"] == {"claimName": "claim-alice"}
    assert volumes["shared"]["nfs"] == {"server": "nfs.example.org", "path": "/shared"}
    assert "scratch" not in volumes, "an emptyDir is the server pod's own, not shareable"
    assert "kube-api-access" not in volumes, "never the server's API token"
    c = spec["containers"][0]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/home/jovyan"]["name"] == "home"
    assert mounts["/home/jovyan/shared"]["readOnly"] is True
    assert c["workingDir"] == "/home/jovyan/project"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"] == "/home/jovyan"


def test_working_directory_outside_the_shared_volumes_falls_back_to_the_home(no_allocator):
    c = kernel_pod(record=kernel_record(cwd="/etc"))["spec"]["containers"][0]
    assert c["workingDir"] == "/home/jovyan"


def test_volume_sharing_can_be_switched_off(no_allocator):
    launcher = KubernetesKernelLauncher(namespace="jhub", share_server_volumes=False)
    spec = kernel_pod(launcher)["spec"]
    assert "home" not in {v["name"] for v in spec["volumes"]}
    assert "workingDir" not in spec["containers"][0]


def test_shared_server_volumes_is_pure():
    before = copy.deepcopy(SERVER_POD.to_dict())
    volumes, mounts = shared_server_volumes(SERVER_POD, ("persistentVolumeClaim",))
    assert [v.name for v in volumes] == ["home"] and [m.mount_path for m in mounts] == ["/home/jovyan"]
    assert SERVER_POD.to_dict() == before


@pytest.mark.parametrize(
    ("modes", "server_node", "kernel_node", "expected"),
    [
        (["ReadWriteMany"], "cpu-1", "gpu-1", None),
        (["ReadOnlyMany"], "cpu-1", "gpu-1", None),
        (["ReadWriteOnce"], "gpu-1", "gpu-1", None),
        (["ReadWriteOnce"], "cpu-1", "gpu-1", "ReadWriteOnce"),
        (["ReadWriteOncePod"], "gpu-1", "gpu-1", "ReadWriteOncePod"),
    ],
)
def test_volume_sharing_problem_says_which_storage_works(modes, server_node, kernel_node, expected):
    problem = volume_sharing_problem("claim-alice", modes, server_node, kernel_node)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem and "claim-alice" in problem and "ReadWriteMany" in problem


async def test_launch_refuses_a_home_it_cannot_mount_with_a_sentence(no_allocator):
    launcher = KubernetesKernelLauncher(namespace="jhub")

    async def read_claim(name: str, namespace: str) -> list[str]:
        return ["ReadWriteOnce"]

    launcher._claim_access_modes = read_claim
    with pytest.raises(LaunchError) as e:
        await launcher.check_volumes(kernel_record(), ALLOCATION, server_ref())
    assert "claim-alice" in e.value.message and "cpu-node-1" in e.value.message and "gpu-node-1" in e.value.message


def test_hami_gpu_pod_leaves_z2jhs_user_scheduler_to_hamis_webhook():
    """HAMi's webhook hands only default-scheduler pods to HAMi's scheduler: a GPU pod that keeps
    z2jh's user-scheduler would stay Pending. CPU pods keep the user-scheduler."""
    pod = gpu_notebook(notebook_pod(scheduler_name="jhub-user-scheduler"), backend="hami")
    assert "schedulerName" not in pod["spec"]
    for backend in ("native", "whole"):
        pod = gpu_notebook(notebook_pod(scheduler_name="jhub-user-scheduler"), backend=backend)
        assert pod["spec"]["schedulerName"] == "jhub-user-scheduler"


def test_kernel_pod_settings_per_size_override_the_launchers(no_allocator):
    """Per kernel size (as KubeSpawner's kubespawner_override per profile): tolerations, node
    selector, required node affinity (the native pin is ANDed into it) and CPU/memory; admission
    counts the size's own requests."""
    pool = {"key": "pool", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}
    zone = {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]}
    launcher = KubernetesKernelLauncher(
        namespace="jhub",
        image="kernel:1",
        size_overrides={
            "gpu-10g": {
                "tolerations": [pool],
                "node_selector": {"gpu": "a100"},
                "node_affinity_required": [zone],
                "cpu_request": "2",
                "cpu_limit": "4",
                "memory_request": "8Gi",
                "memory_limit": "16Gi",
            }
        },
    )
    pod = kernel_pod(launcher)
    validate_all_versions(pod)
    spec = pod["spec"]
    assert pool in spec["tolerations"] and GPU_TAINT in spec["tolerations"]
    assert spec["nodeSelector"] == {"gpu": "a100"}
    pin = {"key": "metadata.name", "operator": "In", "values": ["gpu-node-1"]}
    assert node_terms(pod) == [{**zone, "matchFields": [pin]}]
    resources = spec["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "4", "memory": "16Gi"}}
    assert launcher.node_resources("gpu-10g") == (2000, 8192)
    assert launcher.node_resources("gpu-20g") == launcher.node_resources()  # another size: the defaults


def test_a_size_override_with_an_unknown_key_is_refused_with_a_sentence(no_allocator):
    with pytest.raises(Exception, match=r"size_overrides\['gpu-10g'\].*'gpus'.*allowed"):
        KubernetesKernelLauncher(size_overrides={"gpu-10g": {"gpus": 2}})


def test_a_kernel_pod_carries_its_resume_hook_and_a_restarted_hub_reads_its_swap_state_back(no_allocator):
    import json

    from hubext.kubernetes.status import apply_pod_status, record_from_pod

    record = kernel_record()
    record.resume_url, record.key_sha256 = "http://hub:8081/hub/api/gpu/kernels/x/resume", "ab" * 32
    launcher = KubernetesKernelLauncher(namespace="jhub", image="kernel:1")
    pod = launcher._pod(record, ALLOCATION, server_ref())
    [c] = pod.spec.containers
    env = {e.name: e.value for e in c.env}
    assert env["ELASTIC_GPU_RESUME_URL"] == record.resume_url
    assert env["ELASTIC_GPU_SWAP_FILE"] == f"/var/run/libvgpu/node/{L.SWAP_MARKER_DIR}/{record.id}"
    assert "def resume_if_swapped" in c.command[5] and c.command[-1] == "--ext=elastic_gpu_resume"
    # a pod whose marker it could not see (not 'native') is started without the hook
    assert not launcher.resumes_itself(record, "hami") and launcher.resumes_itself(record, "native")

    # as the hub's suspend and the node agent's answer leave the pod
    pod.metadata.annotations[L.A_SWAP] = json.dumps(
        {"action": "suspend", "generation": 7, "since": 1700000000.5, "reason": "idle 2 h", "model": "H100-80GB"}
    )
    pod.metadata.annotations[L.A_SWAP_STATUS] = json.dumps(
        {"generation": 7, "action": "suspend", "ok": True, "processes": [41], "host_mib": 2048}
    )
    again = record_from_pod(record.id, pod)
    assert (again.key_sha256, again.resume_url) == (record.key_sha256, record.resume_url)
    apply_pod_status(again, pod, {}, 0.0)
    assert again.swap == {
        "state": "swapped", "since": 1700000000.5, "host_mib": 2048, "processes": [41],
        "gpu_uuids": list(ALLOCATION.gpu_uuids), "model": "H100-80GB", "position": None, "reason": "idle 2 h",
    }  # fmt: skip
    # the agent's answer to another generation (or a refusal) is no swapped-out pod
    pod.metadata.annotations[L.A_SWAP_STATUS] = json.dumps({"generation": 7, "ok": False, "message": "no"})
    fresh = record_from_pod(record.id, pod)
    apply_pod_status(fresh, pod, {}, 0.0)
    assert fresh.swap == {}


def test_a_kernel_the_broker_ended_while_its_pod_was_read_keeps_its_state_and_reason(no_allocator):
    # the burst reclaim (or a preemption) stops a kernel while a refresh is reading its pod: the
    # pod read back (being deleted, or still running) must not turn the failed kernel, with the
    # sentence its notebook shows, into a 'stopped' one that jupyter-server then restarts
    import datetime

    from hubext.kubernetes.status import apply_pod_status

    launcher = KubernetesKernelLauncher(namespace="jhub", image="kernel:1")
    for deleting in (True, False):
        record = kernel_record()
        pod = launcher._pod(record, ALLOCATION, server_ref())
        pod.status = k8s.V1PodStatus(phase="Running", pod_ip="10.0.0.9")
        if deleting:
            pod.metadata.deletion_timestamp = datetime.datetime.now(datetime.UTC)
        why = "stopped: it held 7 GiB of GPU memory above its 1 GiB guarantee"
        record.state, record.reason = "failed", why
        apply_pod_status(record, pod, {}, 0.0)
        assert (record.state, record.reason) == ("failed", why)
