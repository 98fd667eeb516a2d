"""The Kubernetes pool: GPU nodes from their labels/annotations, the ledger from labelled pods.

The live pods carrying our labels ARE the ledger: on start it is rebuilt by listing them, and
KubeSpawner's own reflector keeps it current from watch events. A hub restart therefore loses
and duplicates nothing. An allocation granted but whose pod does not exist yet lives only in
the allocator until its pod appears; a pod that existed and is gone (or has finished) releases
its allocation.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import datetime, timezone

from kubernetes_asyncio.client import models as k8s
from kubernetes_asyncio.client.rest import ApiException
from kubespawner.clients import load_config, shared_client
from kubespawner.reflector import ResourceReflector
from traitlets import Float, List, Unicode

from quotas import Allocation, ConfigError, Node, Pool, load_pool

from .. import contract as C
from ..backends import GoneCallback, PoolBackend
from .launcher import KubernetesKernelLauncher


class ManagedPodReflector(ResourceReflector):
    """Pods labelled as holders of an allocation (notebooks and kernels)."""

    kind = "pods"
    labels = {C.MANAGED: "true"}


class KubernetesPool(PoolBackend):
    """GPU inventory from Nodes, ledger from Pods."""

    mode = "kubernetes"
    launcher_class = KubernetesKernelLauncher

    namespace = Unicode(
        config=True,
        help="Namespace of the GPU pods (notebooks and kernels). Default: the hub's namespace "
        "($POD_NAMESPACE) or 'default'.",
    )
    static_inventory = List(
        config=True,
        help="""GPUs given by the admin instead of (or besides) node annotations: a list of
        {name, gpus: [{uuid, model, memory_mib, sm_count, mode, ...}]} (quotas.load_pool format).""",
    )
    node_label_selector = Unicode(
        f"{C.NODE_GPU_LABEL}=true",
        config=True,
        help="Label selector of the nodes whose GPU annotation the pool reads.",
    )
    reconcile_interval_seconds = Float(
        1.0, config=True, help="Seconds between checks for allocations whose pod is gone. Default: 1."
    )
    k8s_api_request_timeout = Float(10.0, config=True, help="Seconds to wait for one Kubernetes API call.")

    def _default_namespace(self) -> str:
        return os.environ.get("POD_NAMESPACE", "default")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if not self.namespace:
            self.namespace = self._default_namespace()
        self.reflector: ManagedPodReflector | None = None
        self._seen: set[str] = set()
        self._task: asyncio.Task | None = None
        self._on_gone: GoneCallback | None = None

    @property
    def api(self):
        return shared_client("CoreV1Api")

    async def start(self, on_gone: GoneCallback) -> None:
        load_config()
        self._on_gone = on_gone
        self.reflector = ManagedPodReflector(parent=self, namespace=self.namespace)
        await self.reflector.start()
        self._task = asyncio.ensure_future(self._reconcile_forever())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self.reflector:
            await self.reflector.stop()

    async def inventory(self) -> Pool:
        nodes: list[Node] = list(load_pool(self.static_inventory).nodes) if self.static_inventory else []
        known = {n.name for n in nodes}
        result = await asyncio.wait_for(
            self.api.list_node(label_selector=self.node_label_selector), self.k8s_api_request_timeout
        )
        for node in result.items:
            name = node.metadata.name
            raw = (node.metadata.annotations or {}).get(C.NODE_GPUS_ANNOTATION)
            if not raw or name in known:
                continue
            try:
                gpus = json.loads(raw)
                nodes.extend(load_pool([{"name": name, "gpus": gpus}]).nodes)
            except (ValueError, ConfigError) as e:
                self.log.error("Node %s: ignoring its GPU annotation %s: %s", name, C.NODE_GPUS_ANNOTATION, e)
        return Pool(nodes=tuple(nodes))

    def _live(self) -> dict[str, Allocation]:
        live: dict[str, Allocation] = {}
        for pod in (self.reflector.resources if self.reflector else {}).values():
            meta = pod.get("metadata", {})
            if meta.get("deletionTimestamp") or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            allocation = C.allocation_from_metadata(meta.get("labels"), meta.get("annotations"))
            if allocation is not None:
                live[allocation.id] = allocation
        return live

    async def allocations(self) -> list[Allocation]:
        live = self._live()
        self._seen.update(live)
        return list(live.values())

    async def record(self, allocation: Allocation) -> None:
        """Nothing to write: the pod's labels and annotations will be the record."""

    async def bind(self, allocation_id: str, holder: str) -> None:
        """Nothing to write: the holder pod carries the allocation id."""

    async def forget(self, allocation_id: str) -> None:
        self._seen.discard(allocation_id)

    async def evict(self, allocation: Allocation, reason: str) -> None:
        for key, pod in list((self.reflector.resources if self.reflector else {}).items()):
            meta = pod.get("metadata", {})
            if (meta.get("annotations") or {}).get(C.ALLOCATION_ID) != allocation.id:
                continue
            name, namespace = meta["name"], meta["namespace"]
            await self._event(namespace, name, meta.get("uid"), "Preempted", reason)
            try:
                await asyncio.wait_for(
                    self.api.delete_namespaced_pod(name, namespace, grace_period_seconds=5),
                    self.k8s_api_request_timeout,
                )
                self.log.warning("Preempted pod %s: %s", key, reason)
            except ApiException as e:
                if e.status != 404:
                    raise

    async def _event(self, namespace: str, name: str, uid: str | None, reason: str, message: str) -> None:
        now = datetime.now(timezone.utc)
        event = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(generate_name=f"{name}.", namespace=namespace),
            involved_object=k8s.V1ObjectReference(kind="Pod", name=name, namespace=namespace, uid=uid),
            reason=reason,
            message=message,
            type="Warning",
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=k8s.V1EventSource(component="elastic-gpu"),
        )
        try:
            await asyncio.wait_for(self.api.create_namespaced_event(namespace, event), self.k8s_api_request_timeout)
        except (ApiException, asyncio.TimeoutError) as e:
            self.log.warning("Could not record %s event for pod %s/%s: %s", reason, namespace, name, e)

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_interval_seconds)
            try:
                live = self._live()
                gone = self._seen - set(live)
                self._seen.update(live)
                for allocation_id in sorted(gone):
                    self._seen.discard(allocation_id)
                    if self._on_gone:
                        await self._on_gone(allocation_id, "its pod is gone")
            except Exception:
                self.log.exception("GPU ledger reconciliation failed; retrying")
