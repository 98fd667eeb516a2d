"""A default-scheduler: filters nodes like kube-scheduler's default plugins and binds pods.

Filters (in kube-scheduler's order): NodeUnschedulable, TaintToleration, NodeAffinity
(nodeSelector + required node affinity), NodeResourcesFit (cpu, memory, pods and extended
resources such as nvidia.com/gpu against node allocatable), VolumeBinding (PVC exists and is
bound), InterPodAffinity (affinity.py). Scores: preferred node affinity and preferred pod
(anti-)affinity (affinity.py), then "fewest pods, then name"; no preemption. A pod that fits nowhere gets
PodScheduled=False/Unschedulable and a FailedScheduling event, and is retried whenever
nodes, pods or PVCs change.
"""

from __future__ import annotations

import logging
from collections import Counter
from fractions import Fraction
from typing import TYPE_CHECKING

from . import quantity
from .affinity import Topology
from .quota import is_terminal, pod_requests
from .resources import BY_KEY, ResourceType
from .selectors import Requirement
from .store import Event, rfc3339
from .volumes import is_bound

if TYPE_CHECKING:
    from .emulator import KubeEmulator

log = logging.getLogger("kubeemu.scheduler")
PODS = BY_KEY[("", "pods")]


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    for t in tolerations or []:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        op = t.get("operator") or "Equal"
        if not t.get("key"):
            if op == "Exists":
                return True
            continue
        if t["key"] != taint.get("key"):
            continue
        if op == "Exists" or (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _term_matches(term: dict, node: dict) -> bool:
    labels = node["metadata"].get("labels") or {}
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!",
           "Gt": "gt", "Lt": "lt"}
    exprs = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not exprs and not fields:
        return False
    for e in exprs:
        if not Requirement(e["key"], ops.get(e.get("operator"), "in"),
                           tuple(e.get("values") or ())).matches(labels):
            return False
    for f in fields:
        if f.get("key") != "metadata.name":
            return False
        if not Requirement("n", ops.get(f.get("operator"), "in"),
                           tuple(f.get("values") or ())).matches(
                {"n": node["metadata"]["name"]}):
            return False
    return True


def matches_node_selector(pod: dict, node: dict) -> bool:
    spec = pod.get("spec") or {}
    labels = node["metadata"].get("labels") or {}
    for k, v in (spec.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if required is not None:
        terms = required.get("nodeSelectorTerms") or []
        if not any(_term_matches(t, node) for t in terms):
            return False
    return True


def node_usage(pods: list[dict], node_name: str, exclude_uid: str | None = None,
               ) -> dict[str, Fraction]:
    used: dict[str, Fraction] = {"pods": Fraction(0)}
    for p in pods:
        if (p.get("spec") or {}).get("nodeName") != node_name or is_terminal(p):
            continue
        if p["metadata"].get("uid") == exclude_uid:
            continue
        used["pods"] += 1
        for k, v in pod_requests(p).items():
            used[k] = used.get(k, Fraction(0)) + v
    return used


def insufficient(pod: dict, node: dict, pods: list[dict]) -> list[tuple[str, Fraction,
                                                                        Fraction, Fraction]]:
    """Resources the node lacks for the pod: (name, requested, used, allocatable)."""
    alloc = {k: quantity.parse(v) for k, v in
             ((node.get("status") or {}).get("allocatable") or {}).items()}
    used = node_usage(pods, node["metadata"]["name"], pod["metadata"].get("uid"))
    out = []
    if "pods" in alloc and used["pods"] + 1 > alloc["pods"]:
        out.append(("pods", Fraction(1), used["pods"], alloc["pods"]))
    for res, req in sorted(pod_requests(pod).items()):
        if req == 0:
            continue
        if res not in alloc and res in ("cpu", "memory", "ephemeral-storage"):
            continue  # a node that does not report it is not limited in it
        have = alloc.get(res, Fraction(0))
        if used.get(res, Fraction(0)) + req > have:
            out.append((res, req, used.get(res, Fraction(0)), have))
    return out


class Scheduler:
    def __init__(self, emu: KubeEmulator) -> None:
        self.emu = emu
        self.store = emu.store
        self._last_message: dict[str, str] = {}
        self.store.subscribe(self._on_event)

    def _on_event(self, srt: ResourceType, ev: Event) -> None:
        kind = srt.kind
        if kind == "Pod":
            spec = ev.obj.get("spec") or {}
            if ev.type == "ADDED" and not spec.get("nodeName"):
                self.emu.call_soon(self.schedule, ev.obj["metadata"]["namespace"],
                                   ev.obj["metadata"]["name"], ev.obj["metadata"]["uid"])
            elif ev.type == "DELETED" or (ev.type == "MODIFIED" and is_terminal(ev.obj)
                                          and not is_terminal(ev.old or {})):
                self._last_message.pop(ev.obj["metadata"]["uid"], None)
                if spec.get("nodeName"):
                    self.emu.call_soon(self.retry_pending)
        elif kind in ("Node", "PersistentVolumeClaim") and ev.type in ("ADDED", "MODIFIED"):
            self.emu.call_soon(self.retry_pending)

    def retry_pending(self) -> None:
        with self.store.lock:
            pending = [(p["metadata"]["namespace"], p["metadata"]["name"], p["metadata"]["uid"])
                       for p in self.store.raw_objects("pods")
                       if not (p.get("spec") or {}).get("nodeName")
                       and not p["metadata"].get("deletionTimestamp")]
        for ns, name, uid in sorted(pending):
            self.schedule(ns, name, uid)

    def schedule(self, namespace: str, name: str, uid: str) -> None:
        with self.store.lock:
            pod = next((p for p in self.store.raw_objects("pods")
                        if p["metadata"]["uid"] == uid), None)
            if pod is None or (pod.get("spec") or {}).get("nodeName"):
                return
            if (pod.get("spec") or {}).get("schedulerName",
                                           "default-scheduler") not in self.emu.scheduler_names:
                return  # another scheduler's pod: stays Pending, as on a real cluster
            if pod["metadata"].get("deletionTimestamp"):
                return
            nodes = sorted(self.store.raw_objects("nodes"), key=lambda n: n["metadata"]["name"])
            pods = self.store.raw_objects("pods")
            message = self._volume_problem(pod, len(nodes) or 1)
            if not nodes and message is None:
                self._bind(pod, self.emu.default_node_name)
                return
            topology = Topology(nodes, pods, self.store.raw_objects("namespaces"))
            fitting: list[dict] = []
            reasons: Counter[str] = Counter()
            if message is None:
                for node in nodes:
                    why = self._filter(pod, node, pods)
                    refusal = None if why else topology.refusal(pod, node["metadata"]["name"])
                    if refusal:
                        why = [refusal]
                    if not why:
                        fitting.append(node)
                    for r in why:
                        reasons[r] += 1
            if fitting:
                best = min(fitting, key=lambda n: (
                    -topology.score(pod, n, _term_matches),
                    node_usage(pods, n["metadata"]["name"])["pods"], n["metadata"]["name"]))
                self._bind(pod, best["metadata"]["name"])
                return
            if message is None:
                n = len(nodes)
                parts = ", ".join(f"{c} {r}" for r, c in sorted(reasons.items()))
                message = (f"0/{n} nodes are available: {parts}. preemption: 0/{n} nodes are "
                           f"available: {n} Preemption is not helpful for scheduling.")
            self._unschedulable(pod, message)

    def _volume_problem(self, pod: dict, n: int) -> str | None:
        ns = pod["metadata"]["namespace"]
        claims = {(o["metadata"]["namespace"], o["metadata"]["name"]): o
                  for o in self.store.raw_objects("persistentvolumeclaims")}
        why = None
        for v in (pod.get("spec") or {}).get("volumes") or []:
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and (ns, claim) not in claims:
                why = f'persistentvolumeclaim "{claim}" not found'
                break
            if claim and not is_bound(claims[(ns, claim)]):
                why = "pod has unbound immediate PersistentVolumeClaims"
        if why is None:
            return None
        return (f"0/{n} nodes are available: {why}. preemption: 0/{n} nodes are available: {n} "
                "Preemption is not helpful for scheduling.")

    def _filter(self, pod: dict, node: dict, pods: list[dict]) -> list[str]:
        spec = pod.get("spec") or {}
        nspec = node.get("spec") or {}
        if nspec.get("unschedulable"):
            tol = tolerates(spec.get("tolerations") or [],
                            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
            if not tol:
                return ["node(s) were unschedulable"]
        for taint in nspec.get("taints") or []:
            if taint.get("effect") not in ("NoSchedule", "NoExecute"):
                continue
            if not tolerates(spec.get("tolerations") or [], taint):
                value = taint.get("value")
                shown = f"{taint['key']}: {value}" if value else f"{taint['key']}: "
                return [f"node(s) had untolerated taint {{{shown}}}"]
        if not matches_node_selector(pod, node):
            return ["node(s) didn't match Pod's node affinity/selector"]
        short = insufficient(pod, node, pods)
        return ["Too many pods" if r == "pods" else f"Insufficient {r}"
                for r, _, _, _ in short]

    def _bind(self, pod: dict, node_name: str) -> None:
        meta = pod["metadata"]

        def bind(p: dict) -> None:
            p["spec"]["nodeName"] = node_name
            set_condition(p, "PodScheduled", "True")

        if self.store.mutate(PODS, meta["namespace"], meta["name"], bind, uid=meta["uid"]):
            self._last_message.pop(meta["uid"], None)
            self.emu.record_event(pod, "Scheduled",
                                  f"Successfully assigned {meta['namespace']}/{meta['name']} "
                                  f"to {node_name}", component="default-scheduler")

    def _unschedulable(self, pod: dict, message: str) -> None:
        meta = pod["metadata"]
        if self._last_message.get(meta["uid"]) == message:
            return
        self._last_message[meta["uid"]] = message

        def mark(p: dict) -> None:
            set_condition(p, "PodScheduled", "False", "Unschedulable", message)

        self.store.mutate(PODS, meta["namespace"], meta["name"], mark, uid=meta["uid"])
        log.info("pod %s/%s unschedulable: %s", meta["namespace"], meta["name"], message)
        self.emu.record_event(pod, "FailedScheduling", message, type="Warning",
                              component="default-scheduler")


def set_condition(pod: dict, ctype: str, status: str, reason: str | None = None,
                  message: str | None = None) -> None:
    conds = pod.setdefault("status", {}).setdefault("conditions", [])
    for c in conds:
        if c["type"] == ctype:
            if c["status"] != status:
                c["lastTransitionTime"] = rfc3339()
            c["status"] = status
            c.pop("reason", None)
            c.pop("message", None)
            break
    else:
        c = {"type": ctype, "status": status, "lastProbeTime": None,
             "lastTransitionTime": rfc3339()}
        conds.append(c)
    if reason:
        c["reason"] = reason
    if message:
        c["message"] = message
