"""Each placement backend writes a pod that the Kubernetes OpenAPI schema accepts, with the
allocation recorded under one label prefix."""

import kubernetes_validate
import pytest
from kubernetes_asyncio.client import ApiClient
from kubespawner.objects import make_pod

from hubext.gpu_spawner import GPUSpawnError
from hubext.kubernetes.spawner import apply_gpu_to_pod
from libvgpu import contract as L
from quotas import Allocation, Owner

K8S_VERSION = "1.33.0"

ALLOCATION = Allocation(
    id="nb-alice-default-abc123",
    owner=Owner(user="alice@example.org", namespace="vision-dev", workspace="vision"),
    node="gpu-node-3",
    gpu_uuids=("GPU-aaaa", "GPU-bbbb"),
    memory_mib=20480,
    cores_percent=25,
    priority_class="default",
    created_at=1700000000.5,
)


def base_pod():
    return make_pod(
        name="jupyter-alice",
        cmd=["jupyterhub-singleuser"],
        port=8888,
        image="quay.io/jupyter/base-notebook:latest",
        labels={"app": "jupyterhub", "component": "singleuser-server"},
        annotations={},
    )


async def render(backend, section=None):
    pod = base_pod()
    apply_gpu_to_pod(
        pod,
        ALLOCATION,
        backend=backend,
        section=section or {"memory_mib": 20480, "cores_percent": 25, "count": 2},
        priority_value=100,
        priority_class_name="elastic-gpu-default",
        runtime_class="nvidia",
        server="",
    )
    async with ApiClient() as api:
        return api.sanitize_for_serialization(pod)


@pytest.mark.parametrize(
    "backend,section",
    [
        ("native", None),
        ("hami", None),
        ("mig", {"mig_profile": "1g.10gb", "count": 2}),
        ("whole", {"whole": True, "count": 2}),
    ],
)
async def test_pod_written_by_each_backend_validates_against_kubernetes_schema(backend, section):
    manifest = {"apiVersion": "v1", "kind": "Pod", **await render(backend, section)}
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)  # raises on any schema error
    meta = manifest["metadata"]
    assert meta["labels"][L.MANAGED] == "true"
    assert meta["annotations"][L.A_GPU_UUIDS] == "GPU-aaaa,GPU-bbbb"
    assert all(k.startswith(L.PREFIX) for k in meta["labels"] if k not in ("app", "component"))
    assert manifest["spec"]["priorityClassName"] == "elastic-gpu-default"


async def test_native_backend_pins_node_exposes_only_granted_gpus_and_mounts_read_only_limits():
    pod = await render("native")
    spec = pod["spec"]
    # pinned through kube-scheduler (node affinity on the Node's name), never nodeName
    [term] = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-3"]}]
    assert "nodeName" not in spec
    assert spec["runtimeClassName"] == "nvidia"
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb"
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["/etc/libvgpu"]["readOnly"] is True
    assert mounts["/etc/ld.so.preload"]["readOnly"] is True
    limits_volume = next(v for v in spec["volumes"] if v["name"] == "elastic-gpu-limits")
    field = limits_volume["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"]
    assert field == f"metadata.annotations['{L.A_LIMITS}']"
    limits_text = pod["metadata"]["annotations"][L.A_LIMITS]
    assert "memory_mib.0=20480" in limits_text and "memory_mib.1=20480" in limits_text
    assert "cores_percent.1=25" in limits_text and "priority=100" in limits_text
    # region paths and the allocation name come from the read-only file, not only from env a user can edit
    assert f"name={ALLOCATION.id}" in limits_text
    assert "container_region=/var/run/libvgpu/container.region" in limits_text
    assert not any(e["name"].startswith("LIBVGPU_CONTAINER") for e in spec["containers"][0]["env"])
    assert "nvidia.com/gpu" not in (spec["containers"][0].get("resources", {}).get("limits") or {})


async def test_hami_backend_writes_hami_resource_names():
    limits = (await render("hami"))["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "20480", "nvidia.com/gpucores": "25"}


async def test_mig_backend_requests_the_mig_resource_and_refuses_a_profile_without_mig_profile():
    pod = await render("mig", {"mig_profile": "3g.40gb", "count": 2})
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/mig-3g.40gb": "2"}
    with pytest.raises(GPUSpawnError, match="mig_profile"):
        await render("mig", {"count": 1})


async def test_whole_backend_requests_plain_gpus():
    limits = (await render("whole", {"whole": True, "count": 2}))["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "2"}


async def test_allocation_round_trips_through_pod_metadata():
    meta = (await render("native"))["metadata"]
    assert L.allocation_from_metadata(meta["labels"], meta["annotations"]) == ALLOCATION


def test_label_values_are_always_valid_and_stable():
    for raw in ["alice", "alice@example.org", "x" * 200, "Ünïcode user", "-lead-"]:
        value = L.label_value(raw)
        assert L._LABEL_OK.match(value), value
        assert value == L.label_value(raw)
    assert L.label_value("alice@example.org") != L.label_value("alice-example.org")
