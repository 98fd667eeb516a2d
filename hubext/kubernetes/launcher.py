"""GPU kernels as pods (Kubernetes mode).

A kernel pod holds the slice (written by :func:`~hubext.kubernetes.objects.apply_gpu_to_pod`),
its connection key in a Secret mounted as a file, owned by the user's server pod (so Kubernetes
garbage-collects it with the server), no service account token, and a per-kernel
NetworkPolicy admitting only the user's server. The labelled pods are the ledger.
A kernel keeps its slice across restarts: a restart creates the next generation's pod first
(new ports, same allocation), then deletes the old one, so the allocation always has a live holder.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Container
from typing import Any

from kubernetes_asyncio.client.rest import ApiException
from kubespawner.clients import load_config, shared_client
from traitlets import Bool, Dict, Float, Integer, List, TraitError, Unicode, default, validate

from libvgpu import contract as C
from quotas import Allocation

from ..backends import KernelLauncher, LaunchError, ServerRef
from ..kernels import KernelRecord
from .objects import (
    HOST_CLAIM,
    RESOURCE_KEYS,
    RESUME_EXT,
    PodDelivery,
    apply_gpu_to_pod,
    check_size_overrides,
    kernel_base_name,
    kernel_pod_name,
    kernel_ports,
    make_kernel_network_policy,
    make_kernel_pod,
    make_kernel_secret,
    owner_references,
    path_under_mounts,
    server_working_dir,
    shared_server_volumes,
    volume_sharing_problem,
)
from .quantities import cpu_and_memory
from .spawner import ElasticGPUSpawner
from .status import api_call, api_message, apply_pod_status, notebook_status, record_from_pod, server_identity
from .swap import PodSwapMixin

#: z2jh's tolerations of its dedicated user node pools (the key in both spellings z2jh uses)
Z2JH_USER_TOLERATIONS = [
    {"key": key, "operator": "Equal", "value": "user", "effect": "NoSchedule"}
    for key in ("hub.jupyter.org/dedicated", "hub.jupyter.org_dedicated")
]
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


class KubernetesKernelLauncher(PodSwapMixin, KernelLauncher):
    """GPU kernels as pods. The hub's service account needs pods, secrets and networkpolicies rights
    in the users' namespace (the Helm chart grants them); kernel pods need none."""

    namespace = Unicode(
        "",
        config=True,
        help="Namespace of kernel pods. Default: the user's server pod's namespace, else $POD_NAMESPACE or 'default'.",
    )
    image = Unicode("quay.io/jupyter/pytorch-notebook:cuda12-latest", config=True,
                    help="Container image of kernel pods (must have python and ipykernel).")  # fmt: skip
    image_pull_policy = Unicode("IfNotPresent", config=True, help="imagePullPolicy of kernel pods.")
    service_account = Unicode(
        "",
        config=True,
        help="serviceAccountName of kernel pods (its token is never mounted). Empty: the namespace default.",
    )
    cpu_request = Unicode(
        "500m", config=True, help="CPU request of the kernel container (kube-scheduler fits it). Default: '500m'."
    )
    cpu_limit = Unicode("", config=True, help="CPU limit of the kernel container, e.g. '4' (empty, default: none).")
    memory_request = Unicode("1Gi", config=True, help="Memory request of the kernel container. Default: '1Gi'.")
    memory_limit = Unicode(
        "16Gi",
        config=True,
        help="Memory limit of the kernel container (host memory, not GPU memory; empty: none). Default: '16Gi'.",
    )
    uid = Integer(
        1000,
        config=True,
        help="""runAsUser of kernel pods (runAsNonRoot is always set, so 0 is refused). Make it the
        uid your users' servers run as (z2jh: singleuser.uid, default 1000), or kernels cannot
        write the user's files. Default: 1000.""",
    )
    gid = Integer(
        None,
        allow_none=True,
        config=True,
        help="runAsGroup of kernel pods. None (default): the image's group (z2jh sets none either).",
    )
    fs_gid = Integer(
        100,
        allow_none=True,
        config=True,
        help="fsGroup of kernel pods (z2jh: singleuser.fsGid, default 100; None: none). Default: 100.",
    )
    image_pull_secrets = List(
        Unicode(),
        config=True,
        help="Names of Secrets (in the kernels' namespace) to pull the kernel image with (imagePullSecrets).",
    )
    tolerations = List(
        Dict(),
        [GPU_TOLERATION, *Z2JH_USER_TOLERATIONS],
        config=True,
        help="""Tolerations of kernel pods, as Kubernetes writes them (key, operator, value, effect).
        Default: the nvidia.com/gpu taint GPU node pools carry, and z2jh's
        hub.jupyter.org/dedicated=user:NoSchedule (both spellings) of dedicated user pools.""",
    )
    node_selector = Dict(
        Unicode(),
        config=True,
        help="""nodeSelector of kernel pods (ANDed with the node admission chose, for the 'native'
        backend; with 'hami'/'whole' it steers the scheduler). Default: none.""",
    )
    size_overrides = Dict(
        config=True,
        help="""Kernel pod settings per kernel size (by name), like kubespawner_override per profile: {size:
        {tolerations (added), node_selector, node_affinity_required (nodeSelectorTerms; the native pin
        is ANDed in), cpu_request, cpu_limit, memory_request, memory_limit}}. Default: none.""",
    )
    share_server_volumes = Bool(
        True,
        config=True,
        help="""Mount the user's server's volumes (the home PVC, NFS, configMaps...: see
        shared_volume_kinds) into kernel pods at the same paths, and start kernels in the
        notebook's directory. A ReadWriteOnce claim works only when the kernel lands on the
        server's node (the kernel is refused with a sentence otherwise), ReadWriteOncePod never.
        Default: True.""",
    )
    shared_volume_kinds = List(
        Unicode(),
        ["persistentVolumeClaim", "nfs", "configMap", "cephfs", "csi"],
        config=True,
        help="Kinds of the server pod's volumes a kernel pod mounts (never emptyDir, secrets or hostPath).",
    )
    inherited_server_labels = List(
        Unicode(),
        [
            "app",
            "release",
            "chart",
            "heritage",
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "hub.jupyter.org/username",
            "hub.jupyter.org/servername",
            "hub.jupyter.org/network-access-hub",
        ],
        config=True,
        help="""Labels copied from the user's server pod onto its kernel pods (z2jh's release labels, the
        user's, network-access-hub: a swapped-out kernel asks the hub for its GPU). 'component' is
        never copied: KubeSpawner lists pods with component=singleuser-server as servers.""",
    )
    component_label = Unicode(
        "elastic-gpu-kernel",
        config=True,
        help="The 'component' label of kernel pods (z2jh's convention). Default: 'elastic-gpu-kernel'.",
    )
    extra_pod_labels = Dict(Unicode(), config=True, help="Extra labels for kernel pods.")
    network_policy = Bool(
        True,
        config=True,
        help="""Create a NetworkPolicy per kernel that admits ingress only from the user's server
        pod (the chart's default-deny policy for kernel pods admits the hub). Default: True.""",
    )
    server_selector_labels = List(
        Unicode(),
        ["hub.jupyter.org/username", "hub.jupyter.org/servername", "component"],
        config=True,
        help="""Labels of the user's server pod that the per-kernel NetworkPolicy matches
        (those present on the pod; when none is present, all its labels).""",
    )
    gpu_backend = Unicode(
        "native",
        config=True,
        help="GPU backend of kernel pods when the user's spawner does not say ('native', 'hami', 'mig', 'whole').",
    )
    gpu_runtime_class = Unicode(
        "nvidia", config=True, help="runtimeClassName for the 'native' backend when the spawner does not say."
    )
    gpu_priority_class_prefix = Unicode(
        "elastic-gpu-", config=True, help="Prefix of the Kubernetes PriorityClass names when the spawner does not say."
    )
    gpu_host_claim = Unicode(
        HOST_CLAIM,
        config=True,
        help="""PersistentVolumeClaim of the node agent's host directory (see
        ElasticGPUSpawner.gpu_host_claim) when the spawner does not say. Default: 'elastic-gpu-host'.""",
    )
    unschedulable_grace_seconds = Float(
        0.0,
        config=True,
        help="""Seconds a kernel pod may stay Unschedulable before the kernel fails with the
        scheduler's message. 0 (default): fail at once — admission already placed it, so an
        unschedulable kernel pod means a node problem, not a wait.""",
    )
    kernel_port_base = Integer(
        50001,
        config=True,
        help="""First of the kernel pods' ZMQ ports. Each pod has its own address, so the ports are
        fixed: base..base+4, and base+10..base+14 after a restart (alternating, so that
        jupyter-server and JupyterLab see the ports change and reconnect). Default: 50001.""",
    )
    delete_grace_seconds = Integer(2, config=True, help="gracePeriodSeconds when deleting kernel pods. Default: 2.")
    k8s_api_request_timeout = Float(10.0, config=True, help="Seconds to wait for one Kubernetes API call.")

    @validate("uid")
    def _validate_uid(self, proposal: Any) -> int:
        if proposal["value"] <= 0:
            raise TraitError(
                f"KubernetesKernelLauncher.uid must be a non-root user id (> 0), got {proposal['value']}: "
                "kernel pods run with runAsNonRoot."
            )
        return proposal["value"]

    @validate("size_overrides")
    def _validate_size_overrides(self, proposal: Any) -> dict:
        return check_size_overrides(proposal["value"])  # TraitError with a sentence naming size and key

    @default("kernel_cmd")
    def _default_kernel_cmd(self) -> list[str]:
        return ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}", RESUME_EXT]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._unschedulable_since: dict[str, float] = {}

    def node_resources(self, size: str = "") -> tuple[int, int]:
        """The kernel container's CPU and memory requests (of ``size``), so admission places it where they fit."""
        over = {**{k: getattr(self, k) for k in RESOURCE_KEYS}, **self.size_overrides.get(size, {})}
        return cpu_and_memory({"cpu": over["cpu_request"] or 0, "memory": over["memory_request"] or 0})

    def pod_ports(self, generation: int) -> dict[str, int]:
        """The ZMQ ports of a kernel pod of this generation (two alternating sets)."""
        return kernel_ports(self.kernel_port_base, generation)

    # ---- clients -----------------------------------------------------------------------

    @property
    def core(self):
        return shared_client("CoreV1Api")

    @property
    def networking(self):
        return shared_client("NetworkingV1Api")

    def _ns(self, server_namespace: str = "") -> str:
        if self.namespace or server_namespace:
            return self.namespace or server_namespace
        pool_ns = self.pool.namespace if self.pool is not None else ""
        return pool_ns or os.environ.get("POD_NAMESPACE", "default")

    async def _call(self, coro: Any) -> Any:
        return await api_call(coro, self.k8s_api_request_timeout)

    # ---- ledger ------------------------------------------------------------------------

    async def start(self) -> list[KernelRecord]:
        load_config()
        selector = f"{C.KIND}=kernel,{C.MANAGED}=true"
        ns = self._ns()
        result = await self._call(self.core.list_namespaced_pod(ns, label_selector=selector))
        newest: dict[str, Any] = {}
        stale = []
        for pod in result.items:
            ann = pod.metadata.annotations or {}
            kid = ann.get(C.A_KERNEL_ID)
            if not kid:
                continue
            gen = int(ann.get(C.A_GENERATION, "0"))
            other = newest.get(kid)
            if other is None or gen > int(other.metadata.annotations.get(C.A_GENERATION, "0")):
                if other is not None:
                    stale.append(other)
                newest[kid] = pod
            else:
                stale.append(pod)
        for pod in stale:  # an interrupted restart left an older generation behind
            await self._delete_pod(pod.metadata.name, pod.metadata.namespace)
        records = []
        for kid, pod in newest.items():
            record = record_from_pod(kid, pod)
            if record is not None:
                self._apply_pod_status(record, pod)
                records.append(record)
        self.log.info("Kubernetes GPU kernels: %d kernel pods found in %s", len(records), ns)
        return records

    def _apply_pod_status(self, record: KernelRecord, pod: Any) -> None:
        apply_pod_status(record, pod, self._unschedulable_since, self.unschedulable_grace_seconds)

    # ---- the user's server ---------------------------------------------------------------

    def pod_delivery(self) -> PodDelivery:
        """This launcher's own settings, for a kernel whose server's spawner says none."""
        prefix = self.gpu_priority_class_prefix
        return PodDelivery(self.gpu_backend, self.gpu_runtime_class, prefix, self.gpu_host_claim)

    async def server_ref(self, spawner: Any) -> ServerRef:
        pod_name = getattr(spawner, "pod_name", "")
        namespace = getattr(spawner, "namespace", "") or self._ns()
        ref = ServerRef(user=spawner.user.name, name=spawner.name or "", pod_name=pod_name, namespace=namespace)
        if isinstance(spawner, ElasticGPUSpawner):  # its kernels get their slice as its pod does
            ref.delivery = spawner.pod_delivery()
        if pod_name:
            try:
                pod = await self._call(self.core.read_namespaced_pod(pod_name, namespace))
            except ApiException as e:
                if e.status == 404:
                    raise LaunchError(
                        f"The server pod {pod_name} of {spawner.user.name} does not exist; start the server again.", 409
                    ) from None
                raise
            ref.identity = server_identity(pod)
            ref.pod_uid = pod.metadata.uid or ""
            ref.pod_labels = dict(pod.metadata.labels or {})
            ref.pod = pod
        return ref

    async def server_alive(self, record: KernelRecord, spawner: Any | None) -> bool:
        if spawner is None or not spawner.active:
            return False
        if spawner.pending:
            return True
        pod_name = getattr(spawner, "pod_name", "")
        if not pod_name:
            return await spawner.poll() is None
        try:
            pod = await self._call(
                self.core.read_namespaced_pod(pod_name, getattr(spawner, "namespace", "") or record.namespace)
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        if record.server_identity and server_identity(pod) != record.server_identity:
            return False
        if pod.metadata.deletion_timestamp is not None:
            return False
        if (pod.status.phase if pod.status else "") in ("Succeeded", "Failed"):
            return False
        notebook = notebook_status(pod)
        # a server container that is not running (exited, restarting) has lost its kernels
        return notebook is None or notebook.state is None or notebook.state.running is not None

    # ---- objects -------------------------------------------------------------------------

    def _owners(self, server: ServerRef | None) -> list | None:
        return owner_references(server.pod_name, server.pod_uid) if server is not None else None

    def _network_policy(self, record: KernelRecord, server: ServerRef) -> Any:
        chosen = {k: v for k, v in server.pod_labels.items() if k in self.server_selector_labels}
        # both port sets: the policy outlives restarts, which alternate between them
        ports = [p for g in (0, 1) for p in self.pod_ports(g).values()]
        return make_kernel_network_policy(record, chosen or dict(server.pod_labels), ports, self._owners(server))

    def _shared(self, source_pod: Any) -> tuple[list, list, str]:
        """(volumes, mounts, home) a kernel pod shares with ``source_pod`` (the server pod, or on a
        restart without one the previous kernel pod)."""
        if not self.share_server_volumes or source_pod is None:
            return [], [], ""
        volumes, mounts = shared_server_volumes(source_pod, tuple(self.shared_volume_kinds))
        home = server_working_dir(source_pod)
        return volumes, mounts, home if path_under_mounts(home, mounts) else ""

    def _pod(
        self, record: KernelRecord, allocation: Allocation, server: ServerRef | None, source_pod: Any = None
    ) -> Any:
        delivery = (server.delivery if server else None) or self.pod_delivery()
        volumes, mounts, home = self._shared(source_pod if source_pod is not None else (server and server.pod))
        cwd = record.cwd if path_under_mounts(record.cwd, mounts) else home
        labels = {k: v for k, v in (server.pod_labels if server else {}).items() if k in self.inherited_server_labels}
        over = self.size_overrides.get(record.size, {})
        pod = make_kernel_pod(
            record,
            image=self.image,
            image_pull_policy=self.image_pull_policy,
            kernel_cmd=list(self.kernel_cmd),
            service_account=self.service_account,
            environment=dict(self.environment),
            **{k: over.get(k, getattr(self, k)) for k in RESOURCE_KEYS},
            extra_labels={**labels, "component": self.component_label, **self.extra_pod_labels},
            owners=self._owners(server),
            uid=self.uid,
            gid=self.gid,
            fs_gid=self.fs_gid,
            image_pull_secrets=list(self.image_pull_secrets),
            tolerations=[dict(t) for t in self.tolerations] + list(over.get("tolerations", [])),
            node_selector=dict(over.get("node_selector", self.node_selector)),
            node_affinity_required=over.get("node_affinity_required"),
            volumes=volumes,
            volume_mounts=mounts,
            working_dir=cwd,
            home=home,
            resume_hook=self.resumes_itself(record, delivery.backend),
        )
        apply_gpu_to_pod(
            pod,
            allocation,
            backend=delivery.backend,
            section=record.section,
            priority_value=self.priority_value(allocation.priority_class),
            priority_class_name=delivery.priority_class_prefix + allocation.priority_class,
            runtime_class=delivery.runtime_class,
            host_claim=delivery.host_claim,
            server=record.server_name,
        )
        return pod

    async def _claim_access_modes(self, claim: str, namespace: str) -> list[str] | None:
        """The access modes of a PersistentVolumeClaim (None when it cannot be read)."""
        try:
            pvc = await self._call(self.core.read_namespaced_persistent_volume_claim(claim, namespace))
        except ApiException as e:
            self.log.warning("Cannot read PersistentVolumeClaim %s/%s: %s", namespace, claim, api_message(e))
            return None
        return list((pvc.status.access_modes if pvc.status else None) or pvc.spec.access_modes or [])

    async def check_volumes(self, record: KernelRecord, allocation: Allocation, server: ServerRef) -> None:
        """Refuse (LaunchError, with a sentence) a kernel that could not mount the server's claims
        on the node admission chose. Called by :meth:`launch` before anything is created."""
        volumes, _, _ = self._shared(server.pod)
        server_node = (server.pod.spec.node_name or "") if server.pod is not None and server.pod.spec else ""
        namespace = record.namespace or server.namespace or self._ns()
        for v in volumes:
            if v.persistent_volume_claim is None:
                continue
            claim = v.persistent_volume_claim.claim_name
            modes = await self._claim_access_modes(claim, namespace)
            if modes is None:
                continue  # not readable: the scheduler/kubelet will say what is wrong
            problem = volume_sharing_problem(claim, modes, server_node, allocation.node)
            if problem:
                raise LaunchError(problem, 409)

    # ---- lifecycle -------------------------------------------------------------------------

    async def launch(self, record: KernelRecord, allocation: Allocation, key: str, server: ServerRef) -> None:
        record.namespace = self._ns(server.namespace)
        record.ports = self.pod_ports(record.generation)
        record.server_identity = server.identity
        await self.check_volumes(record, allocation, server)
        created: list[tuple[str, str]] = []
        try:
            await self._call(
                self.core.create_namespaced_secret(
                    record.namespace, make_kernel_secret(record, key, self._owners(server))
                )
            )
            created.append(("secret", kernel_base_name(record) + "-key"))
            if self.network_policy and server.pod_labels:
                try:
                    await self._call(
                        self.networking.create_namespaced_network_policy(
                            record.namespace, self._network_policy(record, server)
                        )
                    )
                except ApiException as e:
                    if e.status == 404:
                        raise LaunchError(
                            "This cluster does not serve NetworkPolicies (networking.k8s.io/v1), so the "
                            "GPU kernel could not be isolated. An admin can set "
                            "KubernetesKernelLauncher.network_policy = False to run kernels without one.",
                            500,
                        ) from None
                    raise
                created.append(("networkpolicy", kernel_base_name(record) + "-ingress"))
            pod = self._pod(record, allocation, server)
            await self._call(self.core.create_namespaced_pod(record.namespace, pod))
        except ApiException as e:
            await self._cleanup(record.namespace, created)
            raise LaunchError(f"The GPU kernel pod could not be created: {api_message(e)}", 500) from None
        except LaunchError:
            await self._cleanup(record.namespace, created)
            raise
        except asyncio.TimeoutError:
            await self._cleanup(record.namespace, created)
            raise LaunchError(
                "The Kubernetes API did not answer in time; the GPU kernel was not created.", 503
            ) from None
        except BaseException:
            await self._cleanup(record.namespace, created)
            raise
        record.holder = kernel_pod_name(record)
        record.state, record.reason = "pending", "waiting for the kernel pod to start"
        self.log.info("GPU kernel %s of %s: pod %s/%s created", record.id, record.user, record.namespace, record.holder)

    async def _cleanup(self, namespace: str, created: list[tuple[str, str]]) -> None:
        for kind, name in reversed(created):
            try:
                if kind == "secret":
                    await self._call(self.core.delete_namespaced_secret(name, namespace))
                elif kind == "networkpolicy":
                    await self._call(self.networking.delete_namespaced_network_policy(name, namespace))
                else:
                    await self._delete_pod(name, namespace)
            except (ApiException, asyncio.TimeoutError) as e:
                if getattr(e, "status", None) != 404:
                    self.log.warning("Could not delete %s %s/%s: %s", kind, namespace, name, e)

    async def _delete_pod(self, name: str, namespace: str) -> None:
        try:
            await self._call(
                self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=self.delete_grace_seconds)
            )
        except ApiException as e:
            if e.status != 404:
                raise

    async def restart(self, record: KernelRecord, allocation: Allocation, server: ServerRef | None) -> None:
        old = record.holder
        record.generation += 1
        record.ports = self.pod_ports(record.generation)
        record.ip, record.exit_code = "", None
        prev = None
        if (server is None or server.pod is None) and old:  # the previous generation's owner and volumes
            try:
                prev = await self._call(self.core.read_namespaced_pod(old, record.namespace))
            except ApiException as e:
                if e.status != 404:
                    raise
        pod = self._pod(record, allocation, server, source_pod=prev)
        if server is None and prev is not None:  # keep the owner (the server pod)
            pod.metadata.owner_references = prev.metadata.owner_references
        try:
            await self._call(self.core.create_namespaced_pod(record.namespace, pod))
        except ApiException as e:
            record.generation -= 1
            raise LaunchError(f"The GPU kernel pod could not be re-created: {api_message(e)}", 500) from None
        record.holder = kernel_pod_name(record)
        record.state, record.reason = "pending", "waiting for the restarted kernel pod to start"
        if old and old != record.holder:  # only now: the allocation always has a live holder
            await self._delete_pod(old, record.namespace)
        self.log.info("GPU kernel %s of %s restarted: pod %s (was %s)", record.id, record.user, record.holder, old)

    async def refresh(self, record: KernelRecord) -> None:
        if record.state not in ("pending", "running") or not record.holder:
            return
        try:
            pod = await self._call(self.core.read_namespaced_pod(record.holder, record.namespace))
        except ApiException as e:
            if e.status == 404:
                record.state, record.reason = "stopped", "the kernel pod is gone"
                return
            raise
        self._apply_pod_status(record, pod)

    async def delete(self, record: KernelRecord) -> None:
        ns = record.namespace or self._ns()
        if record.holder:
            await self._delete_pod(record.holder, ns)
        # older generations left by an interrupted restart, and the per-kernel objects
        try:
            pods = await self._call(self.core.list_namespaced_pod(ns, label_selector=f"{C.KERNEL_ID}={record.id}"))
            for pod in pods.items:
                if pod.metadata.name != record.holder:
                    await self._delete_pod(pod.metadata.name, ns)
        except ApiException as e:
            self.log.warning("Could not list pods of GPU kernel %s: %s", record.id, api_message(e))
        await self._cleanup(
            ns,
            [("secret", kernel_base_name(record) + "-key")]
            + ([("networkpolicy", kernel_base_name(record) + "-ingress")] if self.network_policy else []),
        )

    async def sweep(self, known: Container[str]) -> list[str]:
        ns = self._ns()
        swept: set[str] = set()
        pods = await self._call(self.core.list_namespaced_pod(ns, label_selector=f"{C.KIND}=kernel,{C.MANAGED}=true"))
        for pod in pods.items:
            kid = (pod.metadata.annotations or {}).get(C.A_KERNEL_ID, "")
            if kid and kid not in known and pod.metadata.deletion_timestamp is None:
                self.log.warning("Deleting stray GPU kernel pod %s/%s (kernel %s)", ns, pod.metadata.name, kid)
                await self._delete_pod(pod.metadata.name, ns)
                swept.add(kid)
        selector = f"{C.KERNEL_ID},{C.MANAGED}=true"
        try:
            secrets = await self._call(self.core.list_namespaced_secret(ns, label_selector=selector))
            for obj in secrets.items:
                if obj.metadata.labels.get(C.KERNEL_ID) not in known:
                    await self._cleanup(ns, [("secret", obj.metadata.name)])
                    swept.add(obj.metadata.labels.get(C.KERNEL_ID))
            if self.network_policy:
                policies = await self._call(self.networking.list_namespaced_network_policy(ns, label_selector=selector))
                for obj in policies.items:
                    if obj.metadata.labels.get(C.KERNEL_ID) not in known:
                        await self._cleanup(ns, [("networkpolicy", obj.metadata.name)])
                        swept.add(obj.metadata.labels.get(C.KERNEL_ID))
        except ApiException as e:
            self.log.warning("Could not sweep GPU kernel secrets/policies in %s: %s", ns, api_message(e))
        return sorted(swept)
