"""Pure builders of the Kubernetes objects a GPU slice needs, as KubeSpawner's ``objects.py``:
plain arguments in, a Kubernetes object out, no I/O (unit-testable without a cluster).

- :func:`apply_gpu_to_pod`: write an allocation into a pod (notebooks and kernels) the way the
  GPU backend expects ('native': the libvgpu shim; 'hami', 'mig', 'whole': scheduler resources);
- :func:`make_kernel_pod`, :func:`make_kernel_secret`, :func:`make_kernel_network_policy`:
  the objects of one GPU kernel;
- :func:`shared_server_volumes`, :func:`volume_sharing_problem`: which of the user's server pod's
  volumes a kernel pod mounts (the home), and when storage cannot be shared across nodes.

Placement: a slice lives on GPUs of one node (admission chose it), so a 'native' pod must run
there. It is pinned the way the DaemonSet controller pins: a *required node affinity* on the
Node's name (``matchFields metadata.name``), never ``nodeName``. The pod still goes through
kube-scheduler, which checks taints, CPU/memory/pod-count fit and may preempt lower-priority
pods; a pod that does not fit stays Pending with the scheduler's reason, which the launcher
reports (and the spawner's start timeout ends). The pin is on the Node's name, not on the
``kubernetes.io/hostname`` label, which some providers set to something else.
"""

from __future__ import annotations

import base64
import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from jupyter_client.connect import port_names
from kubernetes_asyncio.client import models as k8s
from traitlets import TraitError

from libvgpu import contract as C
from quotas import Allocation

from ..gpu_spawner import GPUSpawnError
from ..kernels import KernelRecord
from .quantities import quantity
from .shimfiles import REGION_DIR, add_shim_files

BACKENDS = ("native", "hami", "mig", "whole")

#: the volumes apply_gpu_to_pod adds are named with this prefix
GPU_VOLUME_PREFIX = "elastic-gpu-"
#: the default name of the PersistentVolumeClaim of the node agent's host directory (the chart's
#: ``<fullname>-host`` for a release named elastic-gpu)
HOST_CLAIM = "elastic-gpu-host"


@dataclass(frozen=True)
class PodDelivery:
    """How a slice reaches a pod: the GPU backend, the runtime class of 'native' pods, the prefix
    of the PriorityClass names and the claim of the node agent's host directory.

    ``ElasticGPUSpawner.pod_delivery()`` for a notebook's pod and its kernels' pods;
    ``KubernetesKernelLauncher.pod_delivery()`` (the launcher's own settings) for a kernel whose
    server's spawner says none."""

    backend: str = "native"
    runtime_class: str = "nvidia"
    priority_class_prefix: str = "elastic-gpu-"
    host_claim: str = HOST_CLAIM

#: where the kernel's connection Secret is mounted in its pod
SECRET_MOUNT = "/var/run/elastic-gpu/kernel"
SECRET_FILE = "connection.json"


#: the kernel pod's resume hook, as the bootstrap writes it (``kernelprovider/resume.py``)
RESUME_MODULE = "elastic_gpu_resume"
RESUME_EXT = f"--ext={RESUME_MODULE}"


def resume_hook_source() -> str:
    """``kernelprovider/resume.py``: the kernel asks the hub for its GPU back before a cell runs."""
    return resources.files("kernelprovider").joinpath("resume.py").read_text()


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
    return {name: first + i for i, name in enumerate(port_names)}


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


#: volume sources a kernel pod may share with the user's server pod: storage that lives outside
#: the server pod (an emptyDir, the server's token or its downward-API files do not)
SHAREABLE_VOLUME_KINDS = ("persistentVolumeClaim", "nfs", "configMap", "cephfs", "csi")

#: Kubernetes model attribute of each volume kind above
_VOLUME_ATTR = {
    "persistentVolumeClaim": "persistent_volume_claim",
    "nfs": "nfs",
    "configMap": "config_map",
    "cephfs": "cephfs",
    "csi": "csi",
    "emptyDir": "empty_dir",
    "hostPath": "host_path",
    "secret": "secret",
    "projected": "projected",
    "downwardAPI": "downward_api",
}


def _notebook_container(pod: k8s.V1Pod) -> k8s.V1Container | None:
    containers = (pod.spec.containers if pod.spec else None) or []
    return next((c for c in containers if c.name == "notebook"), containers[0] if containers else None)


def shared_server_volumes(
    server_pod: k8s.V1Pod | None, kinds: tuple[str, ...] | list[str] = SHAREABLE_VOLUME_KINDS
) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    """The server pod's volumes of ``kinds`` that its notebook container mounts, and those mounts
    (same paths, subPaths and read-only flags), for a kernel pod to see the user's files. The
    server's own GPU volumes (``elastic-gpu-*``) are not shared: the kernel gets its own."""
    if server_pod is None or server_pod.spec is None:
        return [], []
    container = _notebook_container(server_pod)
    attrs = [_VOLUME_ATTR[k] for k in kinds if k in _VOLUME_ATTR]
    wanted = {
        v.name: v
        for v in server_pod.spec.volumes or []
        if any(getattr(v, a, None) for a in attrs) and not v.name.startswith(GPU_VOLUME_PREFIX)
    }
    mounts = [m for m in (container.volume_mounts if container else None) or [] if m.name in wanted]
    used = {m.name for m in mounts}
    volumes = [copy.deepcopy(v) for n, v in wanted.items() if n in used]
    return volumes, [copy.deepcopy(m) for m in mounts]


def server_working_dir(server_pod: k8s.V1Pod | None) -> str:
    """The notebook container's working directory (z2jh: the home mount), or ''."""
    container = _notebook_container(server_pod) if server_pod is not None and server_pod.spec else None
    return (container.working_dir or "") if container else ""


def volume_sharing_problem(claim: str, access_modes: list[str], server_node: str, kernel_node: str) -> str | None:
    """Why a kernel pod on ``kernel_node`` cannot mount the claim the server on ``server_node`` has
    (a sentence for the user), or None when it can: ReadWriteMany/ReadOnlyMany anywhere,
    ReadWriteOnce on the server's node only, ReadWriteOncePod never."""
    modes = set(access_modes or [])
    if modes & {"ReadWriteMany", "ReadOnlyMany"}:
        return None
    advice = (
        "Ask an admin to use ReadWriteMany storage for homes (e.g. NFS), or to set "
        "KubernetesKernelLauncher.share_server_volumes = False (kernels then do not see your files)."
    )
    if "ReadWriteOncePod" in modes:
        return (
            f"Your server's volume claim {claim!r} is ReadWriteOncePod: no other pod may mount it, so a GPU "
            f"kernel pod cannot see your files. {advice}"
        )
    if "ReadWriteOnce" in modes and server_node and kernel_node and server_node != kernel_node:
        return (
            f"Your server's volume claim {claim!r} is ReadWriteOnce and your server runs on node "
            f"{server_node}, but the GPU kernel was placed on node {kernel_node}: a ReadWriteOnce volume "
            f"is mounted on one node only. {advice}"
        )
    return None


def pod_security_context(uid: int, gid: int | None, fs_gid: int | None) -> k8s.V1PodSecurityContext:
    """The 'restricted' Pod Security profile's pod-level fields (non-root, RuntimeDefault seccomp)."""
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=uid,
        run_as_group=gid,
        fs_group=fs_gid,
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def container_security_context() -> k8s.V1SecurityContext:
    """The 'restricted' profile's container fields: no escalation, every capability dropped."""
    return k8s.V1SecurityContext(
        allow_privilege_escalation=False,
        capabilities=k8s.V1Capabilities(drop=["ALL"]),
        run_as_non_root=True,
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def _toleration(t: dict | k8s.V1Toleration) -> k8s.V1Toleration:
    if isinstance(t, k8s.V1Toleration):
        return t
    return k8s.V1Toleration(
        key=t.get("key"),
        operator=t.get("operator"),
        value=t.get("value"),
        effect=t.get("effect"),
        toleration_seconds=t.get("tolerationSeconds", t.get("toleration_seconds")),
    )


def add_tolerations(spec: k8s.V1PodSpec, tolerations: list[dict | k8s.V1Toleration] | None) -> None:
    """Append tolerations (dicts in Kubernetes' camelCase or models) that the pod lacks."""
    have = list(spec.tolerations or [])
    for t in (_toleration(t) for t in tolerations or []):
        if t not in have:
            have.append(t)
    spec.tolerations = have or None


#: a kernel container's CPU/memory settings (KubernetesKernelLauncher traits, per size too)
RESOURCE_KEYS = ("cpu_request", "cpu_limit", "memory_request", "memory_limit")
#: what KubernetesKernelLauncher.size_overrides may set per kernel size
SIZE_OVERRIDE_KEYS = ("tolerations", "node_selector", "node_affinity_required", *RESOURCE_KEYS)


def check_size_overrides(overrides: Mapping[str, Any]) -> dict[str, dict]:
    """``KubernetesKernelLauncher.size_overrides`` checked: {size name: {key: value}} with the
    keys of SIZE_OVERRIDE_KEYS; TraitError with a sentence naming the size and the key."""
    for name, override in overrides.items():
        where = f"KubernetesKernelLauncher.size_overrides[{name!r}]"
        if not isinstance(override, Mapping):
            raise TraitError(f"{where} must be a mapping, got {override!r}")
        unknown = sorted(set(override) - set(SIZE_OVERRIDE_KEYS))
        if unknown:
            raise TraitError(f"{where} has unknown key(s) {unknown}; allowed: {', '.join(SIZE_OVERRIDE_KEYS)}")
        for key in RESOURCE_KEYS:
            if key in override and quantity(override[key]) is None:
                raise TraitError(f"{where}.{key} must be a Kubernetes quantity (e.g. '2', '500m', '8Gi')")
    return {name: dict(override) for name, override in overrides.items()}


def node_selector_term(term: Mapping[str, Any]) -> k8s.V1NodeSelectorTerm:
    """A nodeSelectorTerm in Kubernetes' camelCase form as a client model."""

    def requirements(key: str) -> list[k8s.V1NodeSelectorRequirement] | None:
        found = [
            k8s.V1NodeSelectorRequirement(key=r["key"], operator=r["operator"], values=r.get("values"))
            for r in term.get(key) or []
        ]
        return found or None

    return k8s.V1NodeSelectorTerm(
        match_expressions=requirements("matchExpressions"), match_fields=requirements("matchFields")
    )


def pin_to_node(spec: k8s.V1PodSpec, node: str) -> None:
    """Require ``node`` (a Node's name) through node affinity: ANDed into every required term the
    pod already has (terms are ORed), or one term of its own. Never ``nodeName``."""
    pin = k8s.V1NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])
    affinity = spec.affinity or k8s.V1Affinity()
    node_affinity = affinity.node_affinity or k8s.V1NodeAffinity()
    required = node_affinity.required_during_scheduling_ignored_during_execution or k8s.V1NodeSelector(
        node_selector_terms=[]
    )
    terms = [t for t in required.node_selector_terms or [] if t is not None] or [k8s.V1NodeSelectorTerm()]
    for term in terms:
        fields = [f for f in term.match_fields or [] if f.key != "metadata.name"]
        term.match_fields = [*fields, pin]
    required.node_selector_terms = terms
    node_affinity.required_during_scheduling_ignored_during_execution = required
    affinity.node_affinity = node_affinity
    spec.affinity = affinity


def make_kernel_pod(
    record: KernelRecord,
    *,
    image: str,
    image_pull_policy: str,
    kernel_cmd: list[str],
    service_account: str = "",
    environment: dict[str, str] | None = None,
    cpu_request: str = "",
    cpu_limit: str = "",
    memory_request: str = "",
    memory_limit: str = "",
    extra_labels: dict[str, str] | None = None,
    owners: list | None = None,
    uid: int = 1000,
    gid: int | None = None,
    fs_gid: int | None = None,
    image_pull_secrets: list[str] | None = None,
    tolerations: list[dict] | None = None,
    node_selector: dict[str, str] | None = None,
    node_affinity_required: list[dict] | None = None,
    volumes: list[k8s.V1Volume] | None = None,
    volume_mounts: list[k8s.V1VolumeMount] | None = None,
    working_dir: str = "",
    home: str = "",
    resume_hook: bool = False,
) -> k8s.V1Pod:
    """A kernel pod (without its GPU: :func:`apply_gpu_to_pod` adds the slice), sandboxed like a
    z2jh user pod: the 'restricted' Pod Security fields, resources, the user's volumes.

    ``resume_hook``: the bootstrap installs :func:`resume_hook_source` (the kernel command loads
    it; without the hook, ``--ext=elastic_gpu_resume`` is dropped from ``kernel_cmd``), and the
    kernel asks ``record.resume_url`` for its GPU back while the node agent's marker of it says it
    is swapped out (see :func:`resumes_itself`)."""
    env = [
        k8s.V1EnvVar(
            name="POD_IP",
            value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="status.podIP")),
        ),
        k8s.V1EnvVar(name="JUPYTERHUB_USER", value=record.user),
        k8s.V1EnvVar(name=C.ENV_KERNEL_ID, value=record.id),
    ] + [k8s.V1EnvVar(name=k, value=v) for k, v in sorted((environment or {}).items())]
    if home and not any(e.name == "HOME" for e in env):
        env.append(k8s.V1EnvVar(name="HOME", value=home))
    if resume_hook:
        env += [
            k8s.V1EnvVar(name="ELASTIC_GPU_RESUME_URL", value=record.resume_url),
            k8s.V1EnvVar(name="ELASTIC_GPU_SWAP_FILE", value=f"{REGION_DIR}/node/{C.SWAP_MARKER_DIR}/{record.id}"),
        ]
    else:
        # the bootstrap writes the hook's module only with the hook: a kernel told to load it
        # anyway logs a ModuleNotFoundError traceback at start
        kernel_cmd = [a for a in kernel_cmd if a != RESUME_EXT]
    requests = {k: v for k, v in (("cpu", cpu_request), ("memory", memory_request)) if v}
    limits = {k: v for k, v in (("cpu", cpu_limit), ("memory", memory_limit)) if v}
    ports_arg = json.dumps(record.ports, sort_keys=True)
    container = k8s.V1Container(
        name="kernel",
        image=image,
        image_pull_policy=image_pull_policy,
        command=[
            kernel_cmd[0],
            "-c",
            bootstrap_source(),
            f"{SECRET_MOUNT}/{SECRET_FILE}",
            ports_arg,
            resume_hook_source() if resume_hook else "",
            *kernel_cmd,
        ],
        env=env,
        ports=[k8s.V1ContainerPort(container_port=p, name=n.split("_")[0][:15]) for n, p in record.ports.items()],
        resources=k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None),
        volume_mounts=[
            k8s.V1VolumeMount(name="connection", mount_path=SECRET_MOUNT, read_only=True),
            *(volume_mounts or []),
        ],
        working_dir=working_dir or None,
        security_context=container_security_context(),
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
        C.A_KEY_SHA256: record.key_sha256,
        **({C.A_RESUME_URL: record.resume_url} if resume_hook else {}),
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
            security_context=pod_security_context(uid, gid, fs_gid),
            image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in image_pull_secrets or []] or None,
            tolerations=[_toleration(t) for t in tolerations or []] or None,
            node_selector=dict(node_selector) if node_selector else None,
            affinity=k8s.V1Affinity(
                node_affinity=k8s.V1NodeAffinity(
                    required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(
                        node_selector_terms=[node_selector_term(t) for t in node_affinity_required]
                    )
                )
            )
            if node_affinity_required
            else None,
            containers=[container],
            volumes=[
                k8s.V1Volume(
                    name="connection",
                    secret=k8s.V1SecretVolumeSource(secret_name=kernel_base_name(record) + "-key", default_mode=0o400),
                ),
                *(volumes or []),
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
    host_claim: str = HOST_CLAIM,
    server: str = "",
    tolerations: list[dict] | None = None,
) -> None:
    """Write an allocation into a pod the way ``backend`` expects (used for notebooks and kernels).

    ``tolerations`` (e.g. of the ``nvidia.com/gpu`` taint) are added to the pod's own; 'native'
    pods are pinned to the allocation's node by node affinity (see the module's docstring).

    A 'native' pod receives the node agent's host directory (``lib/libvgpu.so``,
    ``ld.so.preload``, ``regions/``) through the PersistentVolumeClaim ``host_claim``, which the
    chart binds to a hostPath PersistentVolume of that one directory: the pod itself has no
    hostPath volume, so its namespace can enforce Pod Security "baseline". Its own region and
    preload file come from an init container (:mod:`.shimfiles`)."""
    if backend not in BACKENDS:
        raise GPUSpawnError(f"gpu_backend {backend!r} is not one of {', '.join(BACKENDS)}.", 500)
    meta = pod.metadata
    meta.labels = {**(meta.labels or {}), **C.allocation_labels(allocation, server)}
    annotations = {**(meta.annotations or {}), **C.allocation_annotations(allocation)}
    annotations[C.A_LIMITS] = C.limits_file_text(
        allocation,
        priority_value,
        container_region=f"{REGION_DIR}/container.region",
        node_region_dir=f"{REGION_DIR}/node",
        activity_file=f"{REGION_DIR}/activity",
    )
    meta.annotations = annotations
    spec = pod.spec
    spec.priority_class_name = priority_class_name
    container = spec.containers[0]
    env = list(container.env or [])
    resources = container.resources or k8s.V1ResourceRequirements()
    limits = dict(resources.limits or {})
    count = len(allocation.gpu_uuids)

    add_tolerations(spec, tolerations)

    if backend == "native":
        pin_to_node(spec, allocation.node)
        if runtime_class:
            spec.runtime_class_name = runtime_class
        env += [
            k8s.V1EnvVar(name="NVIDIA_VISIBLE_DEVICES", value=",".join(allocation.gpu_uuids)),
            k8s.V1EnvVar(name=C.ENV_CONFIG, value="/etc/libvgpu/limits.conf"),
            k8s.V1EnvVar(name="CUDA_DEVICE_ORDER", value="PCI_BUS_ID"),
        ]
        add_shim_files(pod, host_claim, C.A_LIMITS)
    elif allocation.elastic:
        raise GPUSpawnError(
            f"This profile lets its GPU slice grow past its request (memory_limit_mib, "
            f"cores_limit_percent), which only the 'native' GPU backend enforces; with '{backend}' "
            "it could not grow. Ask an admin to remove the limits or use the 'native' backend.",
            500,
        )
    elif backend == "hami":
        # HAMi's admission webhook hands only pods of the default scheduler to HAMi's scheduler;
        # a GPU pod left with z2jh's user-scheduler would stay Pending
        spec.scheduler_name = None
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


def path_under_mounts(path: str, mounts: list) -> bool:
    """Whether ``path`` is at or below one of ``mounts``' mount paths."""
    if not path:
        return False
    path = os.path.normpath(path)
    return any(
        os.path.commonpath([path, os.path.normpath(m.mount_path)]) == os.path.normpath(m.mount_path) for m in mounts
    )
