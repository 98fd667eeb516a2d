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
import time
from collections.abc import Container, Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from kubernetes_asyncio.client import models as k8s
from kubernetes_asyncio.client.rest import ApiException
from kubespawner.clients import load_config, shared_client
from kubespawner.reflector import ResourceReflector
from traitlets import Bool, Dict, Float, List, Unicode, default, validate

from libvgpu import contract as C
from libvgpu.elastic import pod_reclaims
from quotas import GPU, Allocation, ConfigError, GPURequest, Node, Pool, load_pool

from ..backends import GoneCallback, PoolBackend, ReleaseCause
from .cardhealth import CardHealth
from .claimroom import Claim, without
from .claims import ClaimsLedger, valid_hub_id
from .launcher import KubernetesKernelLauncher
from .quantities import cpu_and_memory
from .rest import call_json
from .swap import NodeCheckpoints


def pod_requests(pod: Mapping[str, Any]) -> tuple[int, int]:
    """What a pod (API JSON) asks of its node, as the scheduler counts it: the containers' requests
    in sum, or the largest init container's if more."""
    spec = pod.get("spec") or {}

    def each(key: str) -> Iterable[tuple[int, int]]:
        for c in spec.get(key) or []:
            yield cpu_and_memory((c.get("resources") or {}).get("requests"))

    total = [sum(x) for x in zip(*each("containers"), strict=False)] or [0, 0]
    for cpu, memory in each("initContainers"):
        total = [max(total[0], cpu), max(total[1], memory)]
    return total[0], total[1]


#: how long a deleted pod's last gpu-activity annotation is still answered (metering's late burst)
DELETED_ACTIVITY_SECONDS = 300.0


class _PodsKeepingLastActivity(dict):
    """The reflector's pods; a pod the watch deletes leaves its node agent's last gpu-activity
    annotation in ``gone`` (allocation id -> (annotation, monotonic time)): the agent publishes it
    when it sees the deletion, often after the hub heard the release (issue 27)."""

    def __init__(self, pods: Mapping[str, Any], gone: dict[str, tuple[str, float]]) -> None:
        super().__init__(pods)
        self.gone = gone

    def pop(self, key: str, *default: Any) -> Any:
        pod = super().pop(key, *default)
        annotations = ((pod or {}).get("metadata") or {}).get("annotations") or {} if isinstance(pod, dict) else {}
        now = time.monotonic()
        for allocation_id in [k for k, (_, at) in self.gone.items() if now - at > DELETED_ACTIVITY_SECONDS]:
            del self.gone[allocation_id]
        if annotations.get(C.ALLOCATION_ID) and annotations.get(C.A_GPU_ACTIVITY):
            self.gone[annotations[C.ALLOCATION_ID]] = (annotations[C.A_GPU_ACTIVITY], now)
        return pod


class ManagedPodReflector(ResourceReflector):
    """Pods labelled as holders of an allocation (notebooks and kernels)."""

    kind = "pods"
    labels = {C.MANAGED: "true"}
    #: deleted pods' last gpu-activity annotation (_PodsKeepingLastActivity)
    gone_activity = Dict()

    @validate("resources")
    def _keep_last_activity(self, proposal: Any) -> dict:
        return _PodsKeepingLastActivity(proposal["value"], self.gone_activity)


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
    count_other_pods = Bool(
        True,
        config=True,
        help="""Count the CPU and memory requests of pods outside the GPU ledger on each GPU node
        (listing pods in all namespaces, else in the pool's namespace if the hub may not), so a
        slice is not granted where its pod could not be scheduled. Default: True.""",
    )

    claims_namespace = Unicode(
        "",
        config=True,
        help="""Namespace of the cluster-wide ledger of GPU claims, shared by every hub that
        slices the same nodes (one ConfigMap per GPU node; the hub needs get, list, create and
        update on configmaps there). Each grant is then claimed there by compare-and-swap before
        it is handed out, and other hubs' claims reduce what this hub may place. Empty (the
        default): this hub is the only one slicing its nodes and keeps no shared ledger.""",
    )
    hub_id = Unicode(
        config=True,
        help="""This hub's name in the claims ledger (letters, digits, '-', '_', '.'; unique among
        the hubs sharing claims_namespace). Default: the pool's namespace. A second hub process
        found writing the same id (two hubs in one namespace, two replicas) is detected: the
        later one grants nothing until the other has been silent for claims_ttl_seconds or its pod
        is gone (hub_pod_name).""",
    )
    claims_ttl_seconds = Float(
        60.0,
        config=True,
        help="""Seconds after which the claims of a hub that stopped renewing them are dropped by
        any other hub (each hub renews every third of it). Default: 60.""",
    )

    hub_pod_name = Unicode(
        config=True,
        help="""The pod this hub process runs in, written in its claims entries with the pod's uid,
        so that a process replacing it (a hub Deployment's restart) takes over at once when that
        pod is gone instead of waiting claims_ttl_seconds. Default: $HOSTNAME in a pod (where
        $KUBERNETES_SERVICE_HOST is set), else empty (not written). The hub needs get on pods in
        hub_pod_namespace (z2jh's hub Role has it).""",
    )
    hub_pod_namespace = Unicode(
        config=True,
        help="Namespace of hub_pod_name. Default: $POD_NAMESPACE (z2jh sets it), else the pool's namespace.",
    )

    @default("hub_pod_name")
    def _default_hub_pod_name(self) -> str:
        return os.environ.get("HOSTNAME", "") if os.environ.get("KUBERNETES_SERVICE_HOST") else ""

    @default("hub_pod_namespace")
    def _default_hub_pod_namespace(self) -> str:
        return os.environ.get("POD_NAMESPACE") or self.namespace

    device_plugin_resource = Unicode(
        config=True,
        help="""The extended resource through which a device plugin hands out whole cards. On a GPU
        node where it is allocatable, the device plugin may give any of the node's cards to a pod
        that asks for one, whichever card holds slices, and kube-scheduler counts none of our
        slices: so this hub slices no card of such a node (it says so in its log) until the device
        plugin is off there (GPU operator: label the node nvidia.com/gpu.deploy.device-plugin=false).
        Empty: not checked. Default: 'nvidia.com/gpu' with the 'native' GPU backend
        (ElasticGPUSpawner.gpu_backend), else empty ('whole', 'hami' and 'mig' pods ask the device
        plugin for their cards, so kube-scheduler accounts for them).""",
    )

    @default("device_plugin_resource")
    def _default_device_plugin_resource(self) -> str:
        backend = self.config.ElasticGPUSpawner.get("gpu_backend", "native") if self.config else "native"
        return "nvidia.com/gpu" if backend == "native" else ""

    def _default_namespace(self) -> str:
        return os.environ.get("POD_NAMESPACE", "default")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if not self.namespace:
            self.namespace = self._default_namespace()
        self.reflector: ManagedPodReflector | None = None
        self._seen: set[str] = set()
        #: lapsed grants this hub gave up (the allocator was told; see _give_up_lapsed) -> when a pod
        #: of it was last seen (monotonic)
        self._lapsed_told: dict[str, float] = {}
        self._task: asyncio.Task | None = None
        self._on_gone: GoneCallback | None = None
        #: the cluster-wide claims ledger (None when claims_namespace is empty)
        self.claims: ClaimsLedger | None = None
        #: every card as the inventory reads it, before other hubs' claims (what a claim is checked on)
        self._physical: dict[str, GPU] = {}
        self._others_seen: frozenset[Claim] = frozenset()
        self._physical_nodes: list[Node] = []
        self._claims_adopted = False
        #: GPU nodes where the device plugin advertises cards (said once per node)
        self._device_plugin_nodes: set[str] = set()
        #: each GPU node's checkpoint capability, as its agent published it (the launcher asks it)
        self.checkpoints = NodeCheckpoints()
        #: cards out of service after a fatal Xid, as the agents published them
        self.health = CardHealth(self.log)
        self._node_watch: asyncio.Task | None = None

    @property
    def api(self):
        return shared_client("CoreV1Api")

    async def start(self, on_gone: GoneCallback) -> None:
        hub_id = self.hub_id or self.namespace
        if self.claims_namespace and not valid_hub_id(hub_id):
            raise ConfigError(
                f"KubernetesPool.hub_id {hub_id!r} cannot name a claims entry; use letters, "
                "digits, '-', '_' and '.' (at most 200)."
            )
        load_config()
        self._on_gone = on_gone
        if self.claims_namespace and self.claims is None:
            self.claims = ClaimsLedger(
                self.api,
                self.claims_namespace,
                hub_id,
                self.claims_ttl_seconds,
                self.k8s_api_request_timeout,
                self.log,
                pod_namespace=self.namespace,
            )
            self.claims.pods_here = lambda: self._live().keys()
            if self.hub_pod_name:
                await self.claims.find_own_pod(self.hub_pod_name, self.hub_pod_namespace)
            await self.claims.refresh()  # this hub's own entries are renewed once allocations() is read
        self.reflector = ManagedPodReflector(parent=self, namespace=self.namespace)
        await self.reflector.start()
        self._task = asyncio.ensure_future(self._reconcile_forever())
        self._node_watch = asyncio.ensure_future(
            self.checkpoints.watch(self.api, self.node_label_selector, self.log, on_node=self._node_changed)
        )

    async def _node_changed(self, node: Any, deleted: bool) -> None:
        """A GPU node changed: when a card went out of service or came back, decide the waiters again."""
        if deleted:
            self.health.forget(node.metadata.name)
        elif self.health.update(node) and self.capacity_changed is not None:
            try:
                await self.capacity_changed()
            except Exception:
                self.log.exception("Deciding the GPU queue again after node %s changed failed", node.metadata.name)

    def out_of_service(self) -> Mapping[str, str]:
        return self.health.why()

    def explain_wait(self, request: GPURequest, pool: Pool, reason: str) -> str:
        return self.health.explain(request, pool, reason)

    async def stop(self) -> None:
        for task in (self._task, self._node_watch):
            if task:
                task.cancel()
        if self.reflector:
            await self.reflector.stop()
        if self.claims is not None and self._claims_adopted:
            await self.claims.hand_over()  # a successor with this hub id claims at once

    async def inventory(self) -> Pool:
        nodes: list[Node] = list(load_pool(self.static_inventory).nodes) if self.static_inventory else []
        known = {n.name for n in nodes}
        result = await asyncio.wait_for(
            self.api.list_node(label_selector=self.node_label_selector), self.k8s_api_request_timeout
        )
        for node in result.items:
            name = node.metadata.name
            self.checkpoints.update(node)
            self.health.update(node)
            raw = (node.metadata.annotations or {}).get(C.NODE_GPUS_ANNOTATION)
            if not raw or name in known:
                continue
            try:
                gpus = json.loads(raw)
                found = load_pool([{"name": name, "gpus": gpus}]).nodes[0]
            except (ValueError, ConfigError) as e:
                self.log.error("Node %s: ignoring its GPU annotation %s: %s", name, C.NODE_GPUS_ANNOTATION, e)
                continue
            allocatable = (node.status.allocatable if node.status else None) or {}
            found = self._without_device_plugin_cards(found, allocatable)
            cpu, memory = cpu_and_memory(allocatable)
            nodes.append(
                replace(
                    found,
                    cpu_millicores=cpu if "cpu" in allocatable else None,
                    host_memory_mib=memory if "memory" in allocatable else None,
                )
            )
        if self.count_other_pods and nodes:
            others = await self._requested_by_others({n.name for n in nodes})
            nodes = [
                replace(
                    n,
                    cpu_requested_millicores=others.get(n.name, (0, 0))[0],
                    host_memory_requested_mib=others.get(n.name, (0, 0))[1],
                )
                for n in nodes
            ]
        self._physical = {gpu.uuid: gpu for node in nodes for gpu in node.gpus}
        self._physical_nodes = nodes
        if self.claims is not None:
            self.claims.gpus = self._physical
            await self.claims.refresh()
            held = self.claims.others()
            self._others_seen = frozenset(held)
            nodes = without(nodes, held)
        return Pool(nodes=tuple(self.health.apply(nodes)))

    def _without_device_plugin_cards(self, node: Node, allocatable: Mapping[str, str]) -> Node:
        """``node`` as this hub may slice it: every card held (none sliced) where the device plugin
        hands out cards kube-scheduler does not know we slice."""
        advertised = str(allocatable.get(self.device_plugin_resource, "0")) if self.device_plugin_resource else "0"
        if advertised in ("", "0"):
            self._device_plugin_nodes.discard(node.name)
            return node
        if node.name not in self._device_plugin_nodes:
            self._device_plugin_nodes.add(node.name)
            self.log.error(
                "Node %s advertises %s %s: a device plugin hands its cards out whole to any pod that asks, "
                "and kube-scheduler does not count our slices, so this hub slices none of its cards. Turn "
                "the device plugin off on nodes labelled %s=true (GPU operator: label them "
                "nvidia.com/gpu.deploy.device-plugin=false), or set KubernetesPool.device_plugin_resource "
                "to '' with a backend whose pods ask the device plugin for their cards.",
                node.name,
                advertised,
                self.device_plugin_resource,
                C.NODE_GPU_LABEL,
            )
        return replace(node, gpus=tuple(replace(g, held_whole=True) for g in node.gpus))

    async def _requested_by_others(self, names: set[str]) -> dict[str, tuple[int, int]]:
        """Per node: CPU and memory requested by running pods that hold no allocation (the ledger's
        own pods are counted by their allocations)."""
        selector = "status.phase!=Succeeded,status.phase!=Failed"
        timeout = self.k8s_api_request_timeout
        try:
            result = await call_json(self.api.list_pod_for_all_namespaces, field_selector=selector, timeout=timeout)
        except ApiException as e:
            if e.status != 403:
                raise
            if not getattr(self, "_warned_pods", False):
                self._warned_pods = True
                self.log.warning(
                    "The hub may not list pods in all namespaces; counting only the CPU and memory "
                    "requests of pods in %s on GPU nodes (grant it 'list pods' cluster-wide to count all)",
                    self.namespace,
                )
            result = await call_json(
                self.api.list_namespaced_pod, self.namespace, field_selector=selector, timeout=timeout
            )
        pods = result.get("items", [])
        used: dict[str, list[int]] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if node not in names or labels.get(C.MANAGED) == "true":
                continue
            cpu, memory = pod_requests(pod)
            entry = used.setdefault(node, [0, 0])
            entry[0] += cpu
            entry[1] += memory
        return {node: (cpu, memory) for node, (cpu, memory) in used.items()}

    def slice_activity(self, allocation_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The node agent's ``gpu-activity`` annotation on the pod that holds each allocation."""
        wanted, found = set(allocation_ids), {}
        for pod in (self.reflector.resources if self.reflector else {}).values():
            annotations = pod.get("metadata", {}).get("annotations") or {}
            allocation_id = annotations.get(C.ALLOCATION_ID)
            if allocation_id in wanted:
                activity = C.gpu_activity(annotations.get(C.A_GPU_ACTIVITY))
                if activity:
                    found[allocation_id] = activity
        gone = self.reflector.gone_activity if self.reflector else {}
        for allocation_id in wanted - set(found):  # deleted: its agent's last word (issue 27)
            kept = gone.get(allocation_id)
            activity = C.gpu_activity(kept[0]) if kept else None
            if activity:
                found[allocation_id] = activity
        return found

    def pending_reclaims(self) -> list[Any]:
        """The waits for burst memory the node agents published on the pods this hub watches
        (``gpu-reclaim``, ``libvgpu.elastic.pod_reclaims``); the broker checks them against its
        ledger before it takes a burst back."""
        return pod_reclaims((self.reflector.resources if self.reflector else {}).values())

    def _live(self) -> dict[str, Allocation]:
        live: dict[str, Allocation] = {}
        for pod in (self.reflector.resources if self.reflector else {}).values():
            meta = pod.get("metadata", {})
            if meta.get("deletionTimestamp") or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            if C.swapped_out(meta.get("annotations")):
                continue  # a kernel swapped out holds no slice until its resume
            allocation = C.allocation_from_metadata(meta.get("labels"), meta.get("annotations"))
            if allocation is not None and not (self.claims and allocation.id in self.claims.lost):
                # the node CPU and memory it holds: what its pod asks of the node
                cpu, memory = pod_requests(pod)
                live[allocation.id] = replace(allocation, cpu_millicores=cpu, host_memory_mib=memory)
        return live

    async def allocations(self) -> list[Allocation]:
        live = self._live()
        self._seen.update(live)
        if self.claims is not None:
            # after a restart: what runs is claimed again (and what no longer runs is dropped)
            self.claims.mine = {a.id: self._claim(a) for a in live.values()}
            await self.claims.sync()
            self._claims_adopted = True
            live = self._live()  # less what could not be claimed again (deleted by the next reconcile)
        return list(live.values())

    def _claim(self, allocation: Allocation) -> Claim:
        return Claim(
            self.claims.hub_id if self.claims else "",
            allocation.id,
            allocation.node,
            tuple(allocation.gpu_uuids),
            allocation.memory_mib,
            allocation.cores_percent,
            allocation.whole,
        )

    async def record(self, allocation: Allocation) -> None:
        """Claim the slice in the cluster-wide ledger (raises ClaimConflict when another hub holds
        it); nothing else to write: the pod's labels and annotations will be the record."""
        if self.claims is not None:
            await self.claims.take(self._claim(allocation))

    async def bind(self, allocation_id: str, holder: str) -> None:
        """Nothing to write: the holder pod carries the allocation id."""

    async def forget(self, allocation_id: str, cause: ReleaseCause = ReleaseCause.STOPPED) -> None:
        self._seen.discard(allocation_id)
        if self.claims is not None:
            await self.claims.drop(allocation_id)

    async def claimed_inventory(self) -> Pool | None:
        if self.claims is None or not self._physical_nodes:
            return None
        held = self.claims.others()  # the node a claim was refused on was read just now
        self._others_seen = frozenset(held)
        return Pool(nodes=tuple(self.health.apply(without(self._physical_nodes, held))))

    def held_elsewhere(self) -> list[dict[str, Any]]:
        if self.claims is None:
            return []
        return [
            {
                "hub": c.hub,
                "node": c.node,
                "allocation_id": c.allocation_id,
                "gpu_uuids": list(c.gpu_uuids),
                "memory_mib": c.memory_mib,
                "cores_percent": c.cores_percent,
                "whole": c.whole,
            }
            for c in sorted(self.claims.others(), key=lambda c: (c.node, c.hub, c.allocation_id))
        ]

    async def _running_allocations(self) -> dict[str, tuple[str, Claim]] | None:
        """Allocation id -> (namespace, what it holds) of the GPU pods that run anywhere in the
        cluster (any hub's); None when the hub may not list pods in all namespaces."""
        try:
            result = await call_json(
                self.api.list_pod_for_all_namespaces,
                label_selector=f"{C.MANAGED}=true",
                timeout=self.k8s_api_request_timeout,
            )
        except (ApiException, asyncio.TimeoutError) as e:
            self.log.warning("Cannot list GPU pods in all namespaces (%s): claims of silent hubs expire by TTL", e)
            return None
        running = {}
        for pod in result.get("items", []):
            meta = pod.get("metadata") or {}
            if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            allocation = C.allocation_from_metadata(meta.get("labels"), meta.get("annotations"))
            if allocation is not None:
                running[allocation.id] = (meta.get("namespace", ""), replace(self._claim(allocation), hub=""))
        return running

    async def _sync_claims(self) -> None:
        """Renew this hub's claims, drop expired ones, and tell the allocator when what other
        hubs hold changed (so waiters are decided on the capacity left)."""
        if self.claims is None or not self._claims_adopted:
            return
        blocked = self.claims.rival is not None
        await self.claims.sync(self._running_allocations)
        held = frozenset(self.claims.others())
        if held != self._others_seen or (blocked and self.claims.rival is None):
            self._others_seen = held
            if self.capacity_changed is not None:
                await self.capacity_changed()

    async def _give_up_lapsed(self) -> None:
        """Grants whose claims lapsed while this hub did not renew them and that no longer fit
        (``ClaimsLedger.lost``): the allocator releases them (once), their pods are deleted (also
        one its launcher creates later) with an event that says why. One claims TTL after the
        last pod of such a grant was seen, the hub forgets it: a launcher's create call in flight
        has ended by then."""
        if self.claims is None or not self.claims.lost:
            return
        lost, now = self.claims.lost, time.monotonic()
        for allocation_id, why in sorted(lost.items()):
            if allocation_id not in self._lapsed_told:
                self._lapsed_told[allocation_id] = now
                self._seen.discard(allocation_id)
                if self._on_gone:
                    await self._on_gone(allocation_id, why)
        for meta in self._pods_of(lost):
            allocation_id = meta["annotations"][C.ALLOCATION_ID]
            self._lapsed_told[allocation_id] = now
            if not meta.get("deletionTimestamp"):
                await self._delete(meta, "GPUClaimLapsed", lost[allocation_id])
        for allocation_id, seen in list(self._lapsed_told.items()):
            if now - seen > self.claims.ttl:
                del self._lapsed_told[allocation_id]
                lost.pop(allocation_id, None)

    def _pods_of(self, allocation_ids: Container[str]) -> list[Mapping[str, Any]]:
        """The metadata of the pods (being deleted too) whose allocation is in ``allocation_ids``."""
        pods = list(self.reflector.resources.values()) if self.reflector else []
        metas = (pod.get("metadata", {}) for pod in pods)
        return [meta for meta in metas if (meta.get("annotations") or {}).get(C.ALLOCATION_ID) in allocation_ids]

    async def evict(self, allocation: Allocation, reason: str) -> None:
        for meta in self._pods_of({allocation.id}):
            await self._delete(meta, "Preempted", reason)

    async def _delete(self, meta: Mapping[str, Any], reason: str, message: str) -> None:
        """Delete a GPU pod (5 s grace) with a Warning event ``reason``: ``message``."""
        name, namespace = meta["name"], meta["namespace"]
        await self._event(namespace, name, meta.get("uid"), reason, message)
        try:
            await asyncio.wait_for(
                self.api.delete_namespaced_pod(name, namespace, grace_period_seconds=5),
                self.k8s_api_request_timeout,
            )
            self.log.warning("Deleted pod %s/%s (%s): %s", namespace, name, reason, message)
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
                    if self.claims is not None and allocation_id in self.claims.adopted:
                        self.claims.adopted.discard(allocation_id)  # another process's grant, taken over
                        await self.claims.drop(allocation_id)
                await self._sync_claims()
                await self._give_up_lapsed()
            except Exception:
                self.log.exception("GPU ledger reconciliation failed; retrying")
