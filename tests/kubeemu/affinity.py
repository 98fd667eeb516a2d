"""kube-scheduler's InterPodAffinity filter, and the scores of preferred (anti-)affinity.

Filter (required terms): a node is refused when one of the incoming pod's required affinity
terms matches no pod in the node's topology domain ("node(s) didn't match pod affinity rules";
a term that no pod matches anywhere is satisfied by a pod that matches it itself, the first of
its group), when its required anti-affinity matches a pod there ("node(s) didn't match pod
anti-affinity rules"), or when an existing pod's required anti-affinity there matches it
("node(s) didn't satisfy existing pods anti-affinity rules").
Score: the weights of the preferred node-affinity terms the node matches, plus, per existing
pod in the node's domain, the weights of the preferred pod-affinity terms it matches, minus
those of the preferred anti-affinity terms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .selectors import matches_selector_object


def _affinity(pod: dict, kind: str) -> dict:
    return ((pod.get("spec") or {}).get("affinity") or {}).get(kind) or {}


def _required(pod: dict, kind: str) -> list[dict]:
    return _affinity(pod, kind).get("requiredDuringSchedulingIgnoredDuringExecution") or []


def _preferred(pod: dict, kind: str) -> list[dict]:
    return _affinity(pod, kind).get("preferredDuringSchedulingIgnoredDuringExecution") or []


class Topology:
    """The nodes, running pods and namespace labels one scheduling decision looks at."""

    def __init__(self, nodes: list[dict], pods: list[dict], namespaces: list[dict]) -> None:
        self.labels = {n["metadata"]["name"]: n["metadata"].get("labels") or {} for n in nodes}
        self.pods = [p for p in pods if (p.get("spec") or {}).get("nodeName")
                     and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
                     and not p["metadata"].get("deletionTimestamp")]
        self.ns_labels = {n["metadata"]["name"]: n["metadata"].get("labels") or {}
                          for n in namespaces}

    def same_domain(self, node: str, other: str, key: str) -> bool:
        a, b = self.labels.get(node) or {}, self.labels.get(other) or {}
        return key in a and key in b and a[key] == b[key]

    def term_matches(self, term: dict, owner_ns: str, pod: dict) -> bool:
        """Whether ``pod`` is selected by an affinity term of a pod in ``owner_ns``."""
        meta = pod["metadata"]
        if term.get("namespaceSelector") is not None:
            if not (meta["namespace"] in (term.get("namespaces") or []) or
                    matches_selector_object(term["namespaceSelector"],
                                            self.ns_labels.get(meta["namespace"]) or {})):
                return False
        elif meta["namespace"] not in (term.get("namespaces") or [owner_ns]):
            return False
        selector = term.get("labelSelector")
        return selector is not None and matches_selector_object(selector, meta.get("labels"))

    def _peers(self, term: dict, owner: dict, node: str) -> Iterator[dict]:
        for p in self.pods:
            if (p["metadata"].get("uid") != owner["metadata"].get("uid")
                    and self.same_domain(node, p["spec"]["nodeName"], term.get("topologyKey", ""))
                    and self.term_matches(term, owner["metadata"]["namespace"], p)):
                yield p

    def refusal(self, pod: dict, node: str) -> str | None:
        """Why the node is refused (in the filter's order: affinity, anti-affinity, existing
        pods' anti-affinity), or None."""
        ns = pod["metadata"]["namespace"]
        for term in _required(pod, "podAffinity"):
            if next(self._peers(term, pod, node), None) is not None:
                continue
            anywhere = any(self.term_matches(term, ns, p) for p in self.pods)
            if anywhere or not self.term_matches(term, ns, pod) or \
                    term.get("topologyKey", "") not in (self.labels.get(node) or {}):
                return "node(s) didn't match pod affinity rules"
        for term in _required(pod, "podAntiAffinity"):
            if next(self._peers(term, pod, node), None) is not None:
                return "node(s) didn't match pod anti-affinity rules"
        for p in self.pods:
            for term in _required(p, "podAntiAffinity"):
                if (self.same_domain(node, p["spec"]["nodeName"], term.get("topologyKey", ""))
                        and self.term_matches(term, p["metadata"]["namespace"], pod)):
                    return "node(s) didn't satisfy existing pods anti-affinity rules"
        return None

    def score(self, pod: dict, node: dict, node_term_matches: Callable[[dict, dict], bool]) -> int:
        name = node["metadata"]["name"]
        total = sum(t.get("weight", 0) for t in _preferred(pod, "nodeAffinity")
                    if node_term_matches(t.get("preference") or {}, node))
        for kind, sign in (("podAffinity", 1), ("podAntiAffinity", -1)):
            for wt in _preferred(pod, kind):
                term = wt.get("podAffinityTerm") or {}
                total += sign * wt.get("weight", 0) * sum(1 for _ in self._peers(term, pod, name))
        return total
