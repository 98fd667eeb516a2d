"""Pure builders of the Kubernetes objects a GPU slice needs, as KubeSpawner's ``objects.py``:
plain arguments in, a Kubernetes object out, no I/O (unit-testable without a cluster).

- :func:`apply_gpu_to_pod`: write an allocation into a pod (notebooks and kernels) the way the
  GPU backend expects ('native': the libvgpu shim; 'hami', 'mig', 'whole': scheduler resources);
- :func:`make_kernel_pod`, :func:`make_kernel_secret`, :func:`make_kernel_network_policy`:
  the objects of one GPU kernel.
"""

from __future__ import annotations

import base64
import json
from importlib import resources

from kubernetes_asyncio.client import models as k8s

from quotas import Allocation

from .. import contract as C
from ..gpu_spawner import GPUSpawnError
from ..kernels import KernelRecord

BACKENDS = ("native", "hami", "mig", "whole")

#: where the kernel's connection Secret is mounted in its pod
SECRET_MOUNT = "/var/run/elastic-gpu/kernel"
SECRET_FILE = "connection.json"


def bootstrap_source() -> str:
    """The kernel pod's bootstrap program (``bootstrap.py`` of this package), passed with ``python -c``
    so kernel images need nothing of ours."""
    return resources.files(__package__).joinpath("bootstrap.py").read_text()


def slug(value: str, limit: int = 24) -> str:
    """A DNS-label-safe fragment of ``value``."""
    out = "".join(c if c.isalnum() else "-" for c in value.lower()).strip("-")
    return (out[:limit].strip("-")) or "x"


def kernel_base_name(record: KernelRecord) -> str:
    return f"kernel-{slug(record.user)}-{record.id[:8]}"


def kernel_pod_name(record: KernelRecord) -> str:
    return f"{kernel_base_name(record)}-{record.generation}"


def kernel_ports(base: int, generation: int) -> dict[str, int]:
    """The ZMQ ports of a kernel pod of this generation (two alternating sets, so that
    jupyter-server sees the ports change after a restart and reconnects)."""
    first = base + 10 * (generation % 2)
    return {name: first + i for i, name in enumerate(C.PORT_NAMES)}


def owner_references(pod_name: str, pod_uid: str) -> list[k8s.V1OwnerReference] | None:
    """Owned by the user's server pod, so Kubernetes garbage-collects kernels with their server."""
    if not pod_uid or not pod_name:
        return None
    return [k8s.V1OwnerReference(api_version="v1", kind="Pod", name=pod_name, uid=pod_uid, block_owner_deletion=False)]


def _kernel_labels(record: KernelRecord) -> dict[str, str]:
    return {C.KERNEL_ID: record.id, C.MANAGED: "true", C.USER: C.label_value(record.user)}


def make_kernel_secret(record: KernelRecord, key: str, owners: list | None) -> k8s.V1Secret:
    """The kernel's connection key, mounted as a file in its pod only."""
    payload = json.dumps({"key": key, "signature_scheme": record.signature_scheme, "transport": record.transport})
    return k8s.V1Secret(
        api_version="v1",
        kind="Secret",
        metadata=k8s.V1ObjectMeta(
            name=kernel_base_name(record) + "-key",
            namespace=record.namespace,
            labels=_kernel_labels(record),
            owner_references=owners,
        ),
        type="Opaque",
        data={SECRET_FILE: base64.b64encode(payload.encode()).decode()},
    )


def make_kernel_network_policy(
    record: KernelRecord, server_labels: dict[str, str], ports: list[int], owners: list | None
) -> k8s.V1NetworkPolicy:
    """Ingress to the kernel pod from the user's server pod (``server_labels``) only, on ``ports``."""
    return k8s.V1NetworkPolicy(
        api_version="networking.k8s.io/v1",
        kind="NetworkPolicy",
        metadata=k8s.V1ObjectMeta(
            name=kernel_base_name(record) + "-ingress",
            namespace=record.namespace,
            labels=_kernel_labels(record),
            owner_references=owners,
        ),
        spec=k8s.V1NetworkPolicySpec(
            pod_selector=k8s.V1LabelSelector(match_labels={C.KERNEL_ID: record.id}),
            policy_types=["Ingress"],
            ingress=[
                k8s.V1NetworkPolicyIngressRule(
                    _from=[k8s.V1NetworkPolicyPeer(pod_selector=k8s.V1LabelSelector(match_labels=server_labels))],
                    ports=[k8s.V1NetworkPolicyPort(protocol="TCP", port=p) for p in ports],
                )
            ],
        ),
    )


def make_kernel_pod(
    record: KernelRecord,
    *,
    image: str,
    image_pull_policy: str,
    kernel_cmd: list[str],
    service_account: str = "",
    environment: dict[str, str] | None = None,
    cpu_request: str = "",
    memory_request: str = "",
    memory_limit: str = "",
    extra_labels: dict[str, str] | None = None,
    owners: list | None = None,
) -> k8s.V1Pod:
    """A kernel pod (without its GPU: :func:`apply_gpu_to_pod` adds the slice)."""
    env = [
        k8s.V1EnvVar(
            name="POD_IP",
            value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="status.podIP")),
        ),
        k8s.V1EnvVar(name="JUPYTERHUB_USER", value=record.user),
        k8s.V1EnvVar(name=C.ENV_KERNEL_ID, value=record.id),
    ] + [k8s.V1EnvVar(name=k, value=v) for k, v in sorted((environment or {}).items())]
    requests = {k: v for k, v in (("cpu", cpu_request), ("memory", memory_request)) if v}
    limits = {"memory": memory_limit} if memory_limit else {}
    ports_arg = json.dumps(record.ports, sort_keys=True)
    container = k8s.V1Container(
        name="kernel",
        image=image,
        image_pull_policy=image_pull_policy,
        command=[kernel_cmd[0], "-c", bootstrap_source(), f"{SECRET_MOUNT}/{SECRET_FILE}", ports_arg, *kernel_cmd],
        env=env,
        ports=[k8s.V1ContainerPort(container_port=p, name=n.split("_")[0][:15]) for n, p in record.ports.items()],
        resources=k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None),
        volume_mounts=[k8s.V1VolumeMount(name="connection", mount_path=SECRET_MOUNT, read_only=True)],
        security_context=k8s.V1SecurityContext(allow_privilege_escalation=False),
    )
    annotations = {
        C.A_KERNEL_ID: record.id,
        C.A_SERVER_NAME: record.server_name,
        C.A_SERVER_IDENTITY: record.server_identity,
        C.A_GENERATION: str(record.generation),
        C.A_PORTS: json.dumps(record.ports, sort_keys=True),
        C.A_SIZE: record.size,
        C.A_SIGNATURE_SCHEME: record.signature_scheme,
        C.A_KERNEL_CREATED_AT: repr(record.created_at),
        C.A_JUPYTER_KERNEL_ID: record.jupyter_kernel_id,
    }
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=kernel_pod_name(record),
            namespace=record.namespace,
            labels={C.KERNEL_ID: record.id, **(extra_labels or {})},
            annotations=annotations,
            owner_references=owners,
        ),
        spec=k8s.V1PodSpec(
            restart_policy="Never",
            automount_service_account_token=False,
            enable_service_links=False,
            service_account_name=service_account or None,
            containers=[container],
            volumes=[
                k8s.V1Volume(
                    name="connection",
                    secret=k8s.V1SecretVolumeSource(secret_name=kernel_base_name(record) + "-key", default_mode=0o400),
                )
            ],
        ),
    )


def apply_gpu_to_pod(
    pod: k8s.V1Pod,
    allocation: Allocation,
    *,
    backend: str,
    section: dict,
    priority_value: int,
    priority_class_name: str,
    runtime_class: str,
    host_dir: str,
    server: str = "",
) -> None:
    """Write an allocation into a pod the way ``backend`` expects (used for notebooks and kernels)."""
    if backend not in BACKENDS:
        raise GPUSpawnError(f"gpu_backend {backend!r} is not one of {', '.join(BACKENDS)}.", 500)
    meta = pod.metadata
    meta.labels = {**(meta.labels or {}), **C.allocation_labels(allocation, server)}
    annotations = {**(meta.annotations or {}), **C.allocation_annotations(allocation)}
    annotations[C.A_LIMITS] = C.limits_file_text(
        allocation,
        priority_value,
        container_region="/var/run/libvgpu/container.region",
        node_region_dir="/var/run/libvgpu/node",
        activity_file="/var/run/libvgpu/activity",
    )
    meta.annotations = annotations
    spec = pod.spec
    spec.priority_class_name = priority_class_name
    container = spec.containers[0]
    env = list(container.env or [])
    resources = container.resources or k8s.V1ResourceRequirements()
    limits = dict(resources.limits or {})
    count = len(allocation.gpu_uuids)

    if backend == "native":
        spec.node_selector = {**(spec.node_selector or {}), "kubernetes.io/hostname": allocation.node}
        if runtime_class:
            spec.runtime_class_name = runtime_class
        env += [
            k8s.V1EnvVar(name="NVIDIA_VISIBLE_DEVICES", value=",".join(allocation.gpu_uuids)),
            k8s.V1EnvVar(name=C.ENV_CONFIG, value="/etc/libvgpu/limits.conf"),
            k8s.V1EnvVar(name="CUDA_DEVICE_ORDER", value="PCI_BUS_ID"),
        ]
        spec.volumes = list(spec.volumes or []) + [
            k8s.V1Volume(
                name="elastic-gpu-limits",
                downward_api=k8s.V1DownwardAPIVolumeSource(
                    default_mode=0o444,
                    items=[
                        k8s.V1DownwardAPIVolumeFile(
                            path="limits.conf",
                            field_ref=k8s.V1ObjectFieldSelector(field_path=f"metadata.annotations['{C.A_LIMITS}']"),
                        )
                    ],
                ),
            ),
            k8s.V1Volume(
                name="elastic-gpu-lib",
                host_path=k8s.V1HostPathVolumeSource(path=f"{host_dir}/lib", type="Directory"),
            ),
            k8s.V1Volume(
                name="elastic-gpu-preload",
                host_path=k8s.V1HostPathVolumeSource(path=f"{host_dir}/ld.so.preload", type="File"),
            ),
            k8s.V1Volume(
                name="elastic-gpu-node-regions",
                host_path=k8s.V1HostPathVolumeSource(path=f"{host_dir}/regions", type="DirectoryOrCreate"),
            ),
            k8s.V1Volume(name="elastic-gpu-region", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory")),
        ]
        container.volume_mounts = list(container.volume_mounts or []) + [
            k8s.V1VolumeMount(name="elastic-gpu-limits", mount_path="/etc/libvgpu", read_only=True),
            k8s.V1VolumeMount(name="elastic-gpu-lib", mount_path="/usr/local/lib/elastic-gpu", read_only=True),
            k8s.V1VolumeMount(name="elastic-gpu-preload", mount_path="/etc/ld.so.preload", read_only=True),
            k8s.V1VolumeMount(name="elastic-gpu-node-regions", mount_path="/var/run/libvgpu/node"),
            k8s.V1VolumeMount(name="elastic-gpu-region", mount_path="/var/run/libvgpu"),
        ]
    elif backend == "hami":
        limits["nvidia.com/gpu"] = str(count)
        if not allocation.whole:
            limits["nvidia.com/gpumem"] = str(allocation.memory_mib)
            limits["nvidia.com/gpucores"] = str(allocation.cores_percent)
    elif backend == "mig":
        profile = section.get("mig_profile")
        if not profile:
            raise GPUSpawnError(
                "This profile uses the 'mig' GPU backend but its gpu section has no mig_profile "
                "(e.g. '1g.10gb'). Ask an admin to fix the profile.",
                500,
            )
        limits[f"nvidia.com/mig-{profile}"] = str(count)
    else:  # whole
        limits["nvidia.com/gpu"] = str(count)

    container.env = env
    resources.limits = limits or None
    container.resources = resources
    annotations[C.A_BACKEND] = backend
    annotations[C.A_SECTION] = json.dumps(section, sort_keys=True)
