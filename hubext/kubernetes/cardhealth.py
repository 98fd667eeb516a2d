"""Cards out of service, as the Kubernetes pool applies them: the node agents publish a card's
fatal Xid on its Node (``libvgpu/health.py``); such a card takes no new slice (it is held whole,
so its slices stay counted and nothing else lands there) until its agent sees it recover or an
admin clears the entry."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from libvgpu import contract as C
from libvgpu import health
from quotas import GPU, GPURequest, Mode, Node, Pool
from quotas import messages as msg


class CardHealth:
    """The cards the GPU nodes' agents say are out of service, kept current by each inventory
    read and by the pool's watch of the Nodes."""

    def __init__(self, log: Any) -> None:
        self.log = log
        #: gpu uuid -> (its node, why it is out of service)
        self.cards: dict[str, tuple[str, health.OutOfService]] = {}

    def update(self, node: Any) -> bool:
        """Take a ``V1Node``'s annotation; whether what it says changed."""
        name = node.metadata.name
        try:
            said = health.parse((node.metadata.annotations or {}).get(C.NODE_GPU_HEALTH_ANNOTATION))
        except ValueError as e:
            self.log.error("Node %s: ignoring its annotation %s: %s", name, C.NODE_GPU_HEALTH_ANNOTATION, e)
            said = {}
        before = {u: card for u, (n, card) in self.cards.items() if n == name}
        if said == before:
            return False
        for uuid in before.keys() - said.keys():
            del self.cards[uuid]
            self.log.info("GPU %s of node %s is back in service (its node agent saw it recover, or an admin "
                          "cleared it)", uuid, name)
        for uuid, card in said.items():
            if before.get(uuid) != card:
                self.log.error("GPU %s of node %s is %s; no new slices go there", uuid, name, card.why())
            self.cards[uuid] = (name, card)
        return True

    def forget(self, name: str) -> None:
        """A node left the pool."""
        self.cards = {u: (n, card) for u, (n, card) in self.cards.items() if n != name}

    def apply(self, nodes: Iterable[Node]) -> list[Node]:
        """``nodes`` with every card out of service held whole."""
        return [
            replace(n, gpus=tuple(replace(g, held_whole=True) if g.uuid in self.cards else g for g in n.gpus))
            for n in nodes
        ]

    def why(self) -> Mapping[str, str]:
        """gpu uuid -> the sentence saying why it takes no new slice (and how an admin clears it)."""
        return {uuid: card.why(node) for uuid, (node, card) in sorted(self.cards.items())}

    def explain(self, request: GPURequest, pool: Pool, reason: str) -> str:
        """The wait sentence ``reason`` of ``request``, saying which cards that could hold it are
        out of service; when no node has enough cards in service that could, those cards alone
        are the reason (waiting for a kernel to stop cannot help)."""
        if not self.cards:
            return reason
        broken, enough = [], False
        for node in pool.nodes:
            fit = [g for g in node.gpus if _could_hold(g, request)]
            broken += [g for g in fit if g.uuid in self.cards]
            enough = enough or len([g for g in fit if g.uuid not in self.cards]) >= request.count
        if not broken:
            return reason
        cards = [(g.uuid, self.cards[g.uuid][0], self.cards[g.uuid][1].meaning(),
                  health.clear_command(self.cards[g.uuid][0])) for g in broken]
        if enough:
            return f"{reason} {msg.out_of_service(cards)}"
        return msg.only_out_of_service(request, cards, msg.what(request))


def _could_hold(gpu: GPU, request: GPURequest) -> bool:
    """Whether ``gpu`` could hold ``request`` were it empty (its size and model; not what it holds)."""
    if request.pinned_uuids and gpu.uuid not in request.pinned_uuids:
        return False
    if request.model and gpu.model != request.model or gpu.mode == Mode.MIG:
        return False
    if request.whole:
        return True
    return (gpu.mode == Mode.SHARED and int(gpu.memory_mib * gpu.memory_oversub) >= request.memory_mib
            and int(100 * gpu.cores_oversub) >= request.cores_percent)
