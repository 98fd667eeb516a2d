"""The agent's few Kubernetes calls (kubernetes_asyncio): its Node, the pods on it, Events.

RBAC the agent needs: nodes get/list/watch/patch (cluster; the watch only of its own Node), pods
list and patch (the pods' namespace, or cluster-wide when ``NodeAgent.pod_namespace`` is empty),
events create (the pods' namespace, and the namespace of Node events, ``default`` unless
configured). Optional: pods list cluster-wide, to name the pod
of another workload whose process uses a managed card (else it is named by its uid).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client import models as k8s
from kubernetes_asyncio.client.rest import ApiException

from libvgpu import contract as L

COMPONENT = "elastic-gpu-node-agent"


class KubeError(RuntimeError):
    """A Kubernetes call failed; the message names the call and the answer."""


@dataclass(frozen=True)
class ObjectRef:
    """What an Event is about."""

    kind: str  # "Pod" | "Node"
    name: str
    namespace: str = ""  # "" for a Node
    uid: str = ""


async def load_client_config() -> None:
    """In-cluster config in a pod (service account), else KUBECONFIG / ~/.kube/config."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        await config.load_kube_config()


class Kube:
    """One API client; every call has a timeout and raises :class:`KubeError` on failure."""

    def __init__(self, node_name: str, timeout_seconds: float = 10.0) -> None:
        self.node_name = node_name
        self.timeout = timeout_seconds
        self._api_client: client.ApiClient | None = None
        self.node_uid = ""
        self.uninstall_requested = ""  # the uninstall annotation's value, as last read

    async def connect(self) -> None:
        await load_client_config()
        self._api_client = client.ApiClient()

    @property
    def core(self) -> client.CoreV1Api:
        if self._api_client is None:
            raise RuntimeError("Kube.connect() was not called")
        return client.CoreV1Api(self._api_client)

    async def close(self) -> None:
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None

    async def _call(self, what: str, coro: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, self.timeout)
        except ApiException as e:
            reason = e.reason
            try:
                reason = json.loads(e.body).get("message") or reason
            except (TypeError, ValueError, AttributeError):
                pass
            raise KubeError(f"{what}: {e.status} {reason}") from e
        except asyncio.TimeoutError as e:
            raise KubeError(f"{what}: no answer within {self.timeout:g} s") from e
        except OSError as e:  # connection refused, DNS, ...
            raise KubeError(f"{what}: {e}") from e

    # -- the Node

    async def node_inventory(self) -> tuple[str | None, str | None]:
        """The node's current (gpu-node label, gpus annotation); records its uid for Events."""
        node = await self._call(f"get node {self.node_name}", self.core.read_node(self.node_name))
        self.node_uid = node.metadata.uid or ""
        self.uninstall_requested = (node.metadata.annotations or {}).get(L.NODE_UNINSTALL_ANNOTATION, "")
        return (
            (node.metadata.labels or {}).get(L.NODE_GPU_LABEL),
            (node.metadata.annotations or {}).get(L.NODE_GPUS_ANNOTATION),
        )

    async def publish_inventory(self, gpus_json: str, has_gpus: bool) -> None:
        """Label and annotate the node (a strategic merge patch of those two keys only)."""
        body = {
            "metadata": {
                "labels": {L.NODE_GPU_LABEL: "true" if has_gpus else None},
                "annotations": {L.NODE_GPUS_ANNOTATION: gpus_json},
            }
        }
        await self._call(f"patch node {self.node_name}", self.core.patch_node(self.node_name, body))

    async def node_annotation(self, key: str) -> str | None:
        """One annotation of the node (None: not set)."""
        node = await self._call(f"get node {self.node_name}", self.core.read_node(self.node_name))
        return (node.metadata.annotations or {}).get(key)

    async def annotate_node(self, key: str, value: str | None) -> None:
        """Set (None: remove) one annotation of the node."""
        body = {"metadata": {"annotations": {key: value}}}
        await self._call(f"patch node {self.node_name}", self.core.patch_node(self.node_name, body))

    async def watch_node(self, timeout_seconds: int = 300) -> AsyncIterator[Any]:
        """This node as it changes (a watch of the node list narrowed to its name, which the API
        server ends after ``timeout_seconds``): the node as it is first, then at each change."""
        kw = {"field_selector": f"metadata.name={self.node_name}", "timeout_seconds": timeout_seconds}
        async with watch.Watch() as w:
            async for event in w.stream(self.core.list_node, **kw):
                if isinstance(event, dict) and event.get("type") in ("ADDED", "MODIFIED"):
                    yield event["object"]

    async def publish_checkpoint(self, text: str) -> bool:
        """Annotate the node with its checkpoint capability (JSON) unless it says so already or
        the chart is being uninstalled; whether it was patched."""
        node = await self._call(f"get node {self.node_name}", self.core.read_node(self.node_name))
        annotations = node.metadata.annotations or {}
        self.uninstall_requested = annotations.get(L.NODE_UNINSTALL_ANNOTATION, "")
        if annotations.get(L.NODE_CHECKPOINT_ANNOTATION) == text or (
            self.uninstall_requested and not self.uninstall_requested.startswith("done")
        ):
            return False  # said already, or being uninstalled (withdraw removes it)
        body = {"metadata": {"annotations": {L.NODE_CHECKPOINT_ANNOTATION: text}}}
        await self._call(f"patch node {self.node_name}", self.core.patch_node(self.node_name, body))
        return True

    async def withdraw_inventory(self, answer: str) -> None:
        """Remove the label, the inventory and the checkpoint capability; answer the uninstall hook ("done: ...")."""
        body = {
            "metadata": {
                "labels": {L.NODE_GPU_LABEL: None},
                "annotations": {
                    L.NODE_GPUS_ANNOTATION: None,
                    L.NODE_CHECKPOINT_ANNOTATION: None,
                    L.NODE_GPU_HEALTH_ANNOTATION: None,
                    L.NODE_UNINSTALL_ANNOTATION: answer,
                },
            }
        }
        await self._call(f"patch node {self.node_name}", self.core.patch_node(self.node_name, body))

    # -- pods

    async def node_pods(self, namespace: str = "") -> list[Any]:
        """Our pods (``managed=true``) scheduled on this node."""
        kw = {"field_selector": f"spec.nodeName={self.node_name}", "label_selector": f"{L.MANAGED}=true"}
        if namespace:
            result = await self._call(
                f"list pods in {namespace} on node {self.node_name}",
                self.core.list_namespaced_pod(namespace, **kw),
            )
        else:
            result = await self._call(
                f"list pods on node {self.node_name}", self.core.list_pod_for_all_namespaces(**kw)
            )
        return list(result.items)

    async def watch_node_pods(self, namespace: str = "", timeout_seconds: int = 300) -> AsyncIterator[Any]:
        """Our pods on this node as they change (a watch from now, which the API server ends after
        ``timeout_seconds``): each changed pod."""
        kw = {
            "field_selector": f"spec.nodeName={self.node_name}",
            "label_selector": f"{L.MANAGED}=true",
            "timeout_seconds": timeout_seconds,
        }
        lister = self.core.list_namespaced_pod if namespace else self.core.list_pod_for_all_namespaces
        async with watch.Watch() as w:
            async for event in w.stream(lister, *([namespace] if namespace else []), **kw):
                if isinstance(event, dict) and event.get("type") in ("ADDED", "MODIFIED"):
                    yield event["object"]

    async def pods_on_node(self) -> dict[str, str]:
        """Every pod on this node, of any workload: uid -> "namespace/name" (needs a cluster-wide
        pod list right; the agent asks only to name a GPU process that is not one of ours)."""
        result = await self._call(
            f"list all pods on node {self.node_name}",
            self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node_name}"),
        )
        return {(p.metadata.uid or "").lower(): f"{p.metadata.namespace}/{p.metadata.name}" for p in result.items}

    async def annotate_pod(self, namespace: str, name: str, key: str, value: str | None) -> None:
        """Set one annotation of a pod (a merge patch of that key only); None removes it."""
        body = {"metadata": {"annotations": {key: value}}}
        await self._call(
            f"patch pod {namespace}/{name}", self.core.patch_namespaced_pod(name, namespace, body)
        )

    # -- events

    async def event(self, about: ObjectRef, reason: str, message: str, *, namespace: str,
                    type_: str = "Warning") -> str:
        """Record an Event; returns its name."""
        now = datetime.now(timezone.utc)
        prefix = about.name if about.kind == "Pod" else f"{about.name}.gpu"
        body = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(generate_name=f"{prefix}.", namespace=namespace),
            involved_object=k8s.V1ObjectReference(
                kind=about.kind,
                name=about.name,
                namespace=about.namespace or None,
                uid=about.uid or None,
                api_version="v1",
            ),
            reason=reason,
            message=message[:1024],
            type=type_,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=k8s.V1EventSource(component=COMPONENT, host=self.node_name),
            reporting_component=COMPONENT,
            reporting_instance=self.node_name,
        )
        created = await self._call(
            f"create event {reason} about {about.kind.lower()} {about.name}",
            self.core.create_namespaced_event(namespace, body),
        )
        return str(created.metadata.name or "")


def dump_gpus(gpus: Sequence[dict]) -> str:
    """The annotation value: compact JSON, keys sorted, so equal inventories compare equal."""
    return json.dumps(list(gpus), sort_keys=True, separators=(",", ":"))
