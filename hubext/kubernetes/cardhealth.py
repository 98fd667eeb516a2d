"""Cards out of service, as the Kubernetes pool applies them: the node agents publish a card's
fatal Xid on its Node (``libvgpu/health.py``); such a card takes no new slice (it is held whole,
so its slices stay counted and nothing else lands there) until an admin clears the entry."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from libvgpu import contract as C
from libvgpu import health
from quotas import Node


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
            self.log.info("GPU %s of node %s is back in service (its out-of-service entry was cleared)", uuid, name)
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
        """gpu uuid -> the sentence saying why it takes no new slice."""
        return {uuid: card.why() for uuid, (_, card) in sorted(self.cards.items())}
