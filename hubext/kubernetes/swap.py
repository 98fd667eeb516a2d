"""Swapping a GPU kernel pod out and back in (Kubernetes mode), for ``GPUBroker.suspend`` / ``resume``.

The driver's checkpoint API needs the kernel's *host* pids, which only its node knows: the hub
asks the node agent by annotating the kernel pod (``elastic-gpu.jupyter.org/swap``: action and
a generation) and waits for the agent's answer of that generation
(``elastic-gpu.jupyter.org/swap-status``; see :mod:`libvgpu.agent.swap`). While the answer says
suspended, the pod holds no slice (:func:`libvgpu.contract.swapped_out`: the ledger skips it).

A suspend the agent does not answer in ``swap_answer_timeout_seconds`` is given up: the hub
replaces it by a resume (a later generation), so an agent that acts late undoes it at once, and
the kernel keeps its slice. A resume takes the new allocation's labels and annotations in the
same patch, so the pod never names a slice it does not hold. A resume lands on the pod's own
card(s), or, where the node's agent says its driver can restore onto another card
(``elastic-gpu.jupyter.org/checkpoint``'s ``remap``: driver 580+), on any card of its node of the
same model (``resume_remap``; the broker's admission picks one, ``restorable_on`` checks it). A
restore the driver refuses leaves the kernel swapped out (the broker then asks for its own card).
The pod must be able to open the new card: the emulator's and the CUDA double's pods see every
card of their node; on a real node, a container started with ``NVIDIA_VISIBLE_DEVICES=<its card>``
has no device node of another card, and the driver refuses such a restore (docs/culler.md).

Whether a node's driver can checkpoint at all is its agent's answer, published on the Node
(``elastic-gpu.jupyter.org/checkpoint``; :class:`NodeCheckpoints` keeps the pool's view of it):
a kernel on a node that cannot, or has not said, is promised no swap (the culler's warning and
the pages say it will be stopped), and its suspend is refused without asking the agent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from jupyterhub.utils import exponential_backoff
from kubernetes_asyncio import watch
from kubernetes_asyncio.client.rest import ApiException
from traitlets import Bool, Float
from traitlets.config import LoggingConfigurable

from libvgpu import contract as C
from libvgpu.checkpoint import CheckpointError
from quotas import Allocation

from ..backends import Capabilities, Capability, SuspendAsk
from ..kernels import KernelRecord
from .objects import RESUME_EXT

#: a pod's container sees only the cards it started with (NVIDIA_VISIBLE_DEVICES is fixed at its start)
POD_MOVE = Capability(False, "a kernel pod sees only the card(s) its container started with")
POD_BURST = Capability(False, "kernel pods' slices do not burst")


class NodeCheckpoints:
    """Each GPU node's checkpoint capability as its agent published it, kept current by a watch
    of the Nodes (:meth:`watch`, started by the pool) and by each inventory read."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[bool, str] | None] = {}
        self.remaps: dict[str, tuple[bool, str]] = {}

    def update(self, node: Any) -> None:
        """Take ``node``'s answer (a ``V1Node``)."""
        self.nodes[node.metadata.name] = C.node_checkpoint(node.metadata.annotations)
        self.remaps[node.metadata.name] = C.node_remap(node.metadata.annotations)

    def remap(self, node: str) -> Capability:
        """Whether a resume on ``node`` may be restored onto another of its cards (same model)."""
        able, why_not = self.remaps.get(node, (False, "its node agent has not said that its driver can"))
        return Capability(True) if able else Capability(False, f"on node {node}, {why_not}")

    def capability(self, node: str) -> Capability:
        """Whether kernel pods on ``node`` can be swapped out, and why not."""
        said = self.nodes.get(node)
        if said is None:
            return Capability(
                False,
                f"the node agent on {node or 'its node'} has not said whether its driver can checkpoint "
                f"(no {C.NODE_CHECKPOINT_ANNOTATION} annotation on the Node)",
            )
        able, why_not = said
        return Capability(True) if able else Capability(False, f"on node {node}, {why_not}")

    def any_able(self) -> Capability:
        """Whether some GPU node can swap kernel pods out; else the reasons, node by node."""
        answers = {node: self.capability(node) for node in sorted(self.nodes)}
        if any(answers.values()):
            return Capability(True)
        if not answers:
            return Capability(False, f"no node agent has published {C.NODE_CHECKPOINT_ANNOTATION} yet")
        return Capability(False, "; ".join(c.why_not for c in answers.values()))

    async def watch(
        self, api: Any, label_selector: str, log: Any, on_node: Callable[[Any, bool], Awaitable[None]] | None = None
    ) -> None:
        """Follow the GPU nodes' annotations for ever (a broken watch is started again);
        ``on_node(node, deleted)`` sees each change too (the pool's card health)."""
        while True:
            try:
                stream = watch.Watch().stream(api.list_node, label_selector=label_selector, timeout_seconds=300)
                async for event in stream:
                    node = event["object"]
                    if event["type"] == "DELETED":
                        self.nodes.pop(node.metadata.name, None)
                        self.remaps.pop(node.metadata.name, None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self.update(node)
                    if on_node is not None and event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        await on_node(node, event["type"] == "DELETED")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("Watch of the GPU nodes' checkpoint capability broke (%s); watching again in 5 s", e)
                await asyncio.sleep(5)


class PodSwapMixin(LoggingConfigurable):
    """Suspend and resume through the node agent, for :class:`KubernetesKernelLauncher`."""

    swap_kernels = Bool(
        True,
        config=True,
        help="""Swap idle GPU kernel pods out (their GPU memory to the node's host memory, their
        slice back to the pool) when the culler or a user asks, instead of culling them; the
        kernel asks for its GPU back before its next cell (the resume hook its pod starts with:
        'native' GPU backend, kernel_cmd with --ext=elastic_gpu_resume). Needs the node agent's
        swap (NodeAgent.swap_interval_seconds > 0) and driver 570+; where the driver cannot
        checkpoint, the suspend is refused and the kernel culled as before. Default: True.""",
    )
    swap_answer_timeout_seconds = Float(
        60.0,
        config=True,
        help="""Seconds the hub waits for the node agent to carry out a suspend or resume of a kernel
        pod (it copies the kernel's GPU memory: about 1 s per 10 GiB on a GPU). A suspend not
        answered in time is withdrawn and the kernel keeps its slice; a resume not answered in
        time stops the kernel. Default: 60.""",
    )

    async def _ask_agent(self, record: KernelRecord, request: dict[str, Any], metadata: dict | None = None) -> dict:
        generation = time.time_ns() // 1000
        body: dict[str, Any] = {"metadata": {"annotations": {}}}
        if metadata:
            body["metadata"] = {"labels": metadata.get("labels", {}), "annotations": dict(metadata["annotations"])}
        body["metadata"]["annotations"][C.A_SWAP] = json.dumps({**request, "generation": generation})
        what = f"{request['action']} of kernel pod {record.namespace}/{record.holder}"
        try:
            await self._call(self.core.patch_namespaced_pod(record.holder, record.namespace, body))
        except (ApiException, asyncio.TimeoutError) as e:
            raise CheckpointError(f"the {what} could not be asked for ({e})", 0, request["action"], 0) from None

        async def answered() -> dict | bool:
            try:
                pod = await self._call(self.core.read_namespaced_pod(record.holder, record.namespace))
            except (ApiException, asyncio.TimeoutError) as e:
                if getattr(e, "status", 0) == 404:
                    raise CheckpointError(f"the kernel pod is gone ({what})", 0, request["action"], 0) from None
                return False
            text = (pod.metadata.annotations or {}).get(C.A_SWAP_STATUS)
            try:
                status = json.loads(text) if text else None
            except ValueError:
                return False
            return status if isinstance(status, dict) and status.get("generation") == generation else False

        try:
            return await exponential_backoff(
                answered, what, start_wait=0.1, max_wait=1.0, timeout=self.swap_answer_timeout_seconds
            )
        except asyncio.TimeoutError:
            if request["action"] == "suspend":  # withdrawn: an agent acting late restores it at once
                undo = {"action": "resume", "generation": generation + 1}
                body = {"metadata": {"annotations": {C.A_SWAP: json.dumps(undo)}}}
                await self._call(self.core.patch_namespaced_pod(record.holder, record.namespace, body))
            raise CheckpointError(
                f"the node agent did not answer the {what} within {self.swap_answer_timeout_seconds:g} s",
                0,
                request["action"],
                0,
            ) from None

    def node_checkpoints(self) -> NodeCheckpoints:
        """The pool's view of its nodes' checkpoint capability (an empty one without a pool)."""
        found = getattr(self.pool, "checkpoints", None)
        return found if isinstance(found, NodeCheckpoints) else NodeCheckpoints()

    def capabilities(self) -> Capabilities:
        """Pods swap through their node's agent when ``swap_kernels`` is on and some node's driver
        can checkpoint (its agent says so); a pod comes back only to its own card(s)."""
        if not self.swap_kernels:
            checkpoint = Capability(False, "swapping kernel pods is off (KubernetesKernelLauncher.swap_kernels)")
        else:
            checkpoint = self.node_checkpoints().any_able()
        return Capabilities(checkpoint=checkpoint, move=POD_MOVE, burst=POD_BURST)

    def node_checkpoint_capability(self, node: str) -> Capability:
        """Swapping kernel pods on, and ``node``'s agent says its driver can checkpoint."""
        if not self.swap_kernels:
            return self.capabilities().checkpoint
        return self.node_checkpoints().capability(node)

    def checkpoint_capability(self, record: KernelRecord) -> Capability:
        """The mode's answer, then the kernel's node (its agent's answer), then the pod: it must
        have started with the resume hook."""
        capability = self.capabilities().checkpoint
        if capability:
            capability = self.node_checkpoint_capability(str(record.allocation.get("node") or ""))
        if capability and not record.resume_url:
            return Capability(
                False,
                "its kernel would not ask for its GPU back by itself (a kernel pod started without the resume "
                f"hook: a GPU backend other than 'native', or a kernel_cmd without {RESUME_EXT})",
            )
        return capability

    async def suspend(self, record: KernelRecord, ask: SuspendAsk) -> tuple[list[int], int]:
        """Have the node agent checkpoint the pod's CUDA processes: (their host pids, MiB moved to host memory).

        The agent refuses when it would bring what the node's swapped-out pods hold in host memory
        over ``ask.host_memory_percent`` of the node's RAM. ``ask.why`` and ``ask.model`` stay on the
        pod (with the time): a hub started later knows the kernel is swapped out (``swap_from_pod``)."""
        capability = self.checkpoint_capability(record)
        if not capability:
            raise CheckpointError(capability.why_not, 0, "suspend", 0)
        request = {
            "action": "suspend",
            "lock_timeout_ms": ask.lock_timeout_ms,
            "host_memory_percent": ask.host_memory_percent,
            "since": time.time(),
            "reason": ask.why,
            "model": ask.model,
        }
        status = await self._ask_agent(record, request)
        if not status.get("ok"):
            raise CheckpointError(
                status.get("message") or "the node agent could not swap it out",
                0,
                "suspend",
                0,
                bool(status.get("stuck")),
            )
        return list(status.get("processes") or []), int(status.get("host_mib") or 0)

    def resumes_itself(self, record: KernelRecord, backend: str) -> bool:
        """Whether ``record``'s pod starts with the resume hook: it has the hub's URL, sees the node
        region dir with its marker ('native' pods) and loads the hook (``kernel_cmd``)."""
        return bool(record.resume_url) and backend == "native" and RESUME_EXT in self.kernel_cmd

    def resume_pins(self, record: KernelRecord) -> tuple[str, ...]:
        """The pod's own cards: its state goes back there, or (``resume_remap``) onto others of its node."""
        return tuple(record.swap.get("gpu_uuids") or record.allocation.get("gpu_uuids", []))

    def resume_remap(self, record: KernelRecord) -> Capability:
        """Whether ``record``'s resume may go onto another card of its node (of the same model): its
        node's driver restores there (its agent's answer) and no restore of it was refused there."""
        if record.swap.get("remap_refused"):
            return Capability(False, record.swap["remap_refused"])
        return self.node_checkpoints().remap(str(record.allocation.get("node") or ""))

    def restorable_on(self, record: KernelRecord, allocation: Allocation) -> str:
        """A resume must be granted on the pod's node: on its own card(s), or another card (which
        admission chose among the node's cards of its model) where ``resume_remap`` allows."""
        before = record.allocation
        own = set(record.swap.get("gpu_uuids") or before.get("gpu_uuids", []))
        if allocation.node == before.get("node") and (set(allocation.gpu_uuids) == own or self.resume_remap(record)):
            return ""
        return (
            f"its pod can use only the card(s) it started on ({', '.join(sorted(own))} on node "
            f"{before.get('node')}), and the slice free now is elsewhere; the next cell tries again"
        )

    async def resume(self, record: KernelRecord, allocation: Allocation, remap: dict[str, str]) -> None:
        """Have the node agent restore the pod's processes; the pod names ``allocation`` from then on."""
        metadata = {
            "labels": C.allocation_labels(allocation, record.server_name),
            "annotations": C.allocation_annotations(allocation),
        }
        try:  # what the pod says now: put back when the driver refuses the restore
            before = (await self._call(self.core.read_namespaced_pod(record.holder, record.namespace))).metadata
        except (ApiException, asyncio.TimeoutError) as e:
            raise CheckpointError(f"the kernel pod could not be read ({e})", 0, "resume", 0) from None
        status = await self._ask_agent(record, {"action": "resume", "remap": remap}, metadata)
        if not status.get("ok"):  # not stuck: the driver left it checkpointed (an agent of before: stuck)
            message = status.get("message") or "the node agent could not resume it"
            stuck = bool(status.get("stuck", True))
            if not stuck:  # still swapped out of its own slice, as the pod said before the resume
                swap_keys = [C.A_SWAP, C.A_SWAP_STATUS]
                keys = {"labels": [*metadata["labels"]], "annotations": [*metadata["annotations"], *swap_keys]}
                undo = {kind: {k: (getattr(before, kind) or {}).get(k) for k in names} for kind, names in keys.items()}
                await self._call(self.core.patch_namespaced_pod(record.holder, record.namespace, {"metadata": undo}))
            raise CheckpointError(message, 0, "resume", 0, stuck)
