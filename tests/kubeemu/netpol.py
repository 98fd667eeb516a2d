"""NetworkPolicy semantics, evaluated (not enforced: the emulator has no CNI).

A test asks what a policy means for given pods: does it select a pod, and would the
policies of a namespace let pod A connect to pod B's port? The rules are the API's:

- a policy applies to the pods its ``podSelector`` selects in its own namespace, for the
  ``policyTypes`` it lists (default: Ingress, plus Egress when it has egress rules);
- a pod no policy applies to (for a direction) allows all traffic in that direction; a pod
  some policy applies to allows only what one of those policies' rules allows;
- a rule allows a peer when one of its ``from``/``to`` entries matches (``podSelector`` alone:
  pods of the policy's namespace; ``namespaceSelector`` alone: all pods of the matching
  namespaces; both: the matching pods of the matching namespaces; ``ipBlock``: the pod IP
  in the CIDR and not in ``except``) and one of its ``ports`` matches (number, or a named
  container port of the destination; protocol TCP by default; ``endPort`` ranges).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from .selectors import matches_selector_object


def policy_types(policy: Mapping[str, Any]) -> list[str]:
    spec = policy.get("spec") or {}
    if spec.get("policyTypes"):
        return list(spec["policyTypes"])
    return ["Ingress"] + (["Egress"] if spec.get("egress") else [])


def selects(policy: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether the policy applies to the pod (same namespace, podSelector matches)."""
    if policy["metadata"].get("namespace") != pod["metadata"].get("namespace"):
        return False
    selector = (policy.get("spec") or {}).get("podSelector") or {}
    return matches_selector_object(selector, pod["metadata"].get("labels") or {})


def _peer_matches(peer: Mapping[str, Any], policy_ns: str, pod: Mapping[str, Any],
                  namespaces: Mapping[str, Mapping[str, str]]) -> bool:
    if peer.get("ipBlock"):
        ip = ((pod.get("status") or {}).get("podIP"))
        if not ip:
            return False
        block = peer["ipBlock"]
        addr = ipaddress.ip_address(ip)
        if addr not in ipaddress.ip_network(block["cidr"], strict=False):
            return False
        return not any(addr in ipaddress.ip_network(e, strict=False)
                       for e in block.get("except") or [])
    pod_ns = pod["metadata"].get("namespace")
    labels = pod["metadata"].get("labels") or {}
    if "namespaceSelector" in peer and peer["namespaceSelector"] is not None:
        ns_labels = dict(namespaces.get(pod_ns) or {})
        ns_labels.setdefault("kubernetes.io/metadata.name", pod_ns)
        if not matches_selector_object(peer["namespaceSelector"], ns_labels):
            return False
    elif pod_ns != policy_ns:
        return False
    if "podSelector" in peer and peer["podSelector"] is not None:
        return matches_selector_object(peer["podSelector"], labels)
    return True


def _port_matches(rule_port: Mapping[str, Any], port: int, protocol: str,
                  dest: Mapping[str, Any]) -> bool:
    if (rule_port.get("protocol") or "TCP") != protocol:
        return False
    want = rule_port.get("port")
    if want is None:
        return True
    if isinstance(want, str) and not want.isdigit():
        named = [p.get("containerPort") for c in (dest.get("spec") or {}).get("containers") or []
                 for p in c.get("ports") or [] if p.get("name") == want]
        return port in named
    low = int(want)
    high = int(rule_port.get("endPort") or low)
    return low <= port <= high


def _allows(policies: list[Mapping[str, Any]], direction: str, peer: Mapping[str, Any],
            dest: Mapping[str, Any], port: int, protocol: str,
            namespaces: Mapping[str, Mapping[str, str]]) -> bool:
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in policies:
        ns = policy["metadata"].get("namespace")
        for rule in (policy.get("spec") or {}).get(rules_key) or []:
            ports = rule.get("ports")
            if ports and not any(_port_matches(p, port, protocol, dest) for p in ports):
                continue
            peers = rule.get(peers_key)
            if not peers or any(_peer_matches(p, ns, peer, namespaces) for p in peers):
                return True
    return False


def allowed(policies: Iterable[Mapping[str, Any]], source: Mapping[str, Any],
            dest: Mapping[str, Any], port: int, protocol: str = "TCP",
            namespaces: Mapping[str, Mapping[str, str]] | None = None) -> bool:
    """Whether the policies let ``source`` open ``port`` on ``dest`` (both pod objects).

    ``namespaces``: namespace name -> its labels (for namespaceSelectors).
    """
    policies = list(policies)
    namespaces = namespaces or {}
    ingress = [p for p in policies if selects(p, dest) and "Ingress" in policy_types(p)]
    if ingress and not _allows(ingress, "Ingress", source, dest, port, protocol, namespaces):
        return False
    egress = [p for p in policies if selects(p, source) and "Egress" in policy_types(p)]
    return not egress or _allows(egress, "Egress", dest, dest, port, protocol, namespaces)
