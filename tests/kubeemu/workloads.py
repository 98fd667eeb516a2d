"""Workload controllers of kube-controller-manager: Deployment, ReplicaSet, DaemonSet and Job.

- Deployment -> ReplicaSet ``<name>-<pod-template-hash>`` per pod template; a template change
  makes a new ReplicaSet (revision annotation +1) scaled to ``replicas``, and the old ones are
  scaled to 0 once the new one's pods are ready (RollingUpdate) or before it starts
  (Recreate). Status: replicas, updated/ready/available replicas, Available and Progressing.
- ReplicaSet -> ``replicas`` pods ``<name>-xxxxx`` from its template, owned by it (controller
  reference); extra pods go, newest first.
- DaemonSet -> one pod per node that matches its template (nodeSelector, required node
  affinity, taints it tolerates; on the virtual node when the cluster has no Node objects),
  pinned with required node affinity on ``metadata.name`` as the real controller does; a
  template change replaces the pods (``controller-revision-hash``).
- Job -> pods until ``completions`` succeed (``parallelism`` at a time), then Complete (with
  SuccessCriteriaMet); more than ``backoffLimit`` failures: Failed (BackoffLimitExceeded).
Pods are made through the API's admission (quota, service account, Pod Security ...); a
refusal becomes a ``FailedCreate`` event on the owner, retried on the next change.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from typing import TYPE_CHECKING

from .errors import ApiError
from .resources import BY_KEY, ResourceType
from .scheduler import matches_node_selector, set_condition, tolerates
from .store import Event, rfc3339

if TYPE_CHECKING:
    from .emulator import KubeEmulator

log = logging.getLogger("kubeemu.workloads")
PODS = BY_KEY[("", "pods")]
RS = BY_KEY[("apps", "replicasets")]
KINDS = ("Deployment", "ReplicaSet", "DaemonSet", "Job")
_SAFE = "bcdfghjklmnpqrstvwxz2456789"


def template_hash(template: dict) -> str:
    """A stable short hash of a pod template (the pod-template-hash label's role)."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    return "".join(_SAFE[b % len(_SAFE)] for b in digest[:10])


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _phase(pod: dict) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def _owner_ref(owner: dict) -> dict:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"],
            "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _controller_uid(obj: dict) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


class Workloads:
    def __init__(self, emu: KubeEmulator) -> None:
        self.emu = emu
        self.store = emu.store
        self._queued: set[tuple[str, str, str]] = set()
        self._failed: dict[str, str] = {}
        self.store.subscribe(self._on_event)

    # ------------------------------------------------------------------ queue

    def _on_event(self, srt: ResourceType, ev: Event) -> None:
        meta = ev.obj["metadata"]
        if srt.kind in KINDS and ev.type != "DELETED":
            self._enqueue(srt.kind, meta.get("namespace") or "", meta["name"])
        if srt.kind in ("Pod", "ReplicaSet"):
            owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")),
                         None)
            if owner and owner.get("kind") in KINDS:
                self._enqueue(owner["kind"], meta.get("namespace") or "", owner["name"])
        if srt.kind == "Node":
            for ds in self.store.raw_objects("daemonsets", "apps"):
                self._enqueue("DaemonSet", ds["metadata"]["namespace"], ds["metadata"]["name"])

    def _enqueue(self, kind: str, ns: str, name: str) -> None:
        key = (kind, ns, name)
        if key not in self._queued:
            self._queued.add(key)
            self.emu.call_soon(self._run, key)

    def _run(self, key: tuple[str, str, str]) -> None:
        self._queued.discard(key)
        kind, ns, name = key
        plural = {"Deployment": ("apps", "deployments"), "ReplicaSet": ("apps", "replicasets"),
                  "DaemonSet": ("apps", "daemonsets"), "Job": ("batch", "jobs")}[kind]
        rt = BY_KEY[plural]
        try:
            obj = self.store.get(rt, ns, name)
        except ApiError:
            return
        if obj["metadata"].get("deletionTimestamp"):
            return
        try:
            getattr(self, f"_sync_{kind.lower()}")(rt, obj)
        except Exception:  # a controller must never take the loop down
            log.exception("%s %s/%s: sync failed", kind, ns, name)

    # ------------------------------------------------------------------ helpers

    def _owned(self, plural: str, group: str, owner: dict) -> list[dict]:
        uid = owner["metadata"]["uid"]
        with self.store.lock:
            return [copy.deepcopy(o) for o in self.store.raw_objects(plural, group)
                    if o["metadata"].get("namespace") == owner["metadata"]["namespace"]
                    and _controller_uid(o) == uid]

    def _create_pod(self, owner: dict, template: dict, name_prefix: str,
                    extra_labels: dict | None = None, spec_patch: dict | None = None) -> None:
        meta = copy.deepcopy(template.get("metadata") or {})
        labels = {**(meta.get("labels") or {}), **(extra_labels or {})}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"generateName": f"{name_prefix}-", "labels": labels,
                            "annotations": meta.get("annotations") or {},
                            "ownerReferences": [_owner_ref(owner)]},
               "spec": {**copy.deepcopy(template.get("spec") or {}), **(spec_patch or {})}}
        uid = owner["metadata"]["uid"]
        try:
            self.store.create(PODS, owner["metadata"]["namespace"], pod)
            self._failed.pop(uid, None)
        except ApiError as e:
            message = f"Error creating: {e.message}"
            if self._failed.get(uid) != message:
                self._failed[uid] = message
                self.emu.record_event(owner, "FailedCreate", message, type="Warning",
                                      component=f"{owner['kind'].lower()}-controller")

    def _delete(self, rt: ResourceType, obj: dict) -> None:
        meta = obj["metadata"]
        try:
            self.store.delete(rt, meta.get("namespace"), meta["name"],
                              preconditions={"uid": meta["uid"]})
        except ApiError:
            pass

    def _set_status(self, rt: ResourceType, obj: dict, status: dict) -> None:
        def write(o: dict) -> None:
            o["status"] = {**(o.get("status") or {}), **status,
                           "observedGeneration": o["metadata"].get("generation", 1)}

        self.store.mutate(rt, obj["metadata"]["namespace"], obj["metadata"]["name"], write,
                          uid=obj["metadata"]["uid"])

    @staticmethod
    def _active(pods: list[dict]) -> list[dict]:
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")
                and _phase(p) not in ("Succeeded", "Failed")]

    # ------------------------------------------------------------------ ReplicaSet

    def _sync_replicaset(self, rt: ResourceType, rs: dict) -> None:
        spec = rs.get("spec") or {}
        want = spec.get("replicas", 1)
        pods = self._active(self._owned("pods", "", rs))
        for _ in range(want - len(pods)):
            self._create_pod(rs, spec.get("template") or {}, rs["metadata"]["name"])
        if len(pods) > want:
            newest = sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "",
                            reverse=True)
            for p in newest[:len(pods) - want]:
                self._delete(PODS, p)
        pods = self._active(self._owned("pods", "", rs))
        ready = sum(1 for p in pods if _ready(p))
        self._set_status(rt, rs, {"replicas": len(pods), "fullyLabeledReplicas": len(pods),
                                  "readyReplicas": ready, "availableReplicas": ready})

    # ------------------------------------------------------------------ Deployment

    def _sync_deployment(self, rt: ResourceType, d: dict) -> None:
        spec, meta = d.get("spec") or {}, d["metadata"]
        template = spec.get("template") or {}
        want = spec.get("replicas", 1)
        h = template_hash(template)
        sets = self._owned("replicasets", "apps", d)
        new = next((s for s in sets if (s["metadata"].get("labels") or {})
                    .get("pod-template-hash") == h), None)
        old = [s for s in sets if s is not new]
        recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
        old_pods = sum(len(self._active(self._owned("pods", "", s))) for s in old)
        for s in old:
            if (s.get("spec") or {}).get("replicas", 1) and (recreate or (
                    new is not None and (new.get("status") or {}).get("readyReplicas", 0)
                    >= want)):
                self.store.mutate(RS, meta["namespace"], s["metadata"]["name"],
                                  lambda o: o["spec"].__setitem__("replicas", 0))
        if new is None and not (recreate and old_pods):
            revision = 1 + max((int((s["metadata"].get("annotations") or {})
                                    .get("deployment.kubernetes.io/revision", "0"))
                                for s in sets), default=0)
            tmpl = copy.deepcopy(template)
            tmpl.setdefault("metadata", {}).setdefault("labels", {})["pod-template-hash"] = h
            selector = copy.deepcopy(spec.get("selector") or {})
            selector.setdefault("matchLabels", {})["pod-template-hash"] = h
            body = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "metadata": {"name": f"{meta['name']}-{h}",
                                 "labels": dict(tmpl["metadata"]["labels"]),
                                 "annotations": {"deployment.kubernetes.io/revision":
                                                 str(revision)},
                                 "ownerReferences": [_owner_ref(d)]},
                    "spec": {"replicas": want, "selector": selector, "template": tmpl}}
            try:
                self.store.create(RS, meta["namespace"], body)
            except ApiError as e:
                log.info("deployment %s/%s: %s", meta["namespace"], meta["name"], e.message)
        elif new is not None and (new.get("spec") or {}).get("replicas") != want:
            self.store.mutate(RS, meta["namespace"], new["metadata"]["name"],
                              lambda o: o["spec"].__setitem__("replicas", want))
        self._deployment_status(rt, d, h, want)

    def _deployment_status(self, rt: ResourceType, d: dict, h: str, want: int) -> None:
        sets = self._owned("replicasets", "apps", d)
        total = sum((s.get("status") or {}).get("replicas", 0) for s in sets)
        ready = sum((s.get("status") or {}).get("readyReplicas", 0) for s in sets)
        new = next((s for s in sets if (s["metadata"].get("labels") or {})
                    .get("pod-template-hash") == h), None)
        updated = (new.get("status") or {}).get("replicas", 0) if new else 0
        new_ready = (new.get("status") or {}).get("readyReplicas", 0) if new else 0
        done = new_ready >= want and total == updated
        status = {"replicas": total, "updatedReplicas": updated, "readyReplicas": ready,
                  "availableReplicas": ready, "unavailableReplicas": max(0, want - ready)}
        name = new["metadata"]["name"] if new else ""

        def write(o: dict) -> None:
            o["status"] = {**(o.get("status") or {}), **status,
                           "observedGeneration": o["metadata"].get("generation", 1)}
            set_condition(o, "Available", "True" if ready >= want else "False",
                          "MinimumReplicasAvailable" if ready >= want
                          else "MinimumReplicasUnavailable",
                          "Deployment has minimum availability." if ready >= want
                          else "Deployment does not have minimum availability.")
            set_condition(o, "Progressing", "True",
                          "NewReplicaSetAvailable" if done else "ReplicaSetUpdated",
                          f'ReplicaSet "{name}" has successfully progressed.' if done
                          else f'ReplicaSet "{name}" is progressing.')
            for c in o["status"]["conditions"]:
                c.pop("lastProbeTime", None)
                c.setdefault("lastUpdateTime", rfc3339())

        self.store.mutate(rt, d["metadata"]["namespace"], d["metadata"]["name"], write,
                          uid=d["metadata"]["uid"])

    # ------------------------------------------------------------------ DaemonSet

    def _eligible_nodes(self, template: dict) -> list[str]:
        with self.store.lock:
            nodes = [copy.deepcopy(n) for n in self.store.raw_objects("nodes")]
        if not nodes:
            return [self.emu.default_node_name]
        pod = {"spec": template.get("spec") or {}}
        tolerations = (pod["spec"].get("tolerations") or []) + [
            {"key": "node.kubernetes.io/unschedulable", "operator": "Exists",
             "effect": "NoSchedule"}]
        out = []
        for n in nodes:
            taints = [t for t in (n.get("spec") or {}).get("taints") or []
                      if t.get("effect") in ("NoSchedule", "NoExecute")]
            if all(tolerates(tolerations, t) for t in taints) and matches_node_selector(pod, n):
                out.append(n["metadata"]["name"])
        return out

    def _sync_daemonset(self, rt: ResourceType, ds: dict) -> None:
        template = (ds.get("spec") or {}).get("template") or {}
        h = template_hash(template)
        pods = self._active(self._owned("pods", "", ds))
        nodes = self._eligible_nodes(template)
        by_node: dict[str, list[dict]] = {}
        for p in pods:
            node = self._pinned_node(p)
            if node not in nodes or (p["metadata"].get("labels") or {}).get(
                    "controller-revision-hash") != h:
                self._delete(PODS, p)
            else:
                by_node.setdefault(node, []).append(p)
        for node in nodes:
            if node in by_node:
                continue
            pin = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
            affinity = {**((template.get("spec") or {}).get("affinity") or {}), **pin}
            self._create_pod(ds, template, ds["metadata"]["name"],
                             {"controller-revision-hash": h}, {"affinity": affinity})
        current = [p for ps in by_node.values() for p in ps]
        ready = sum(1 for p in current if _ready(p))
        self._set_status(rt, ds, {"desiredNumberScheduled": len(nodes),
                                  "currentNumberScheduled": len(current),
                                  "updatedNumberScheduled": len(current), "numberReady": ready,
                                  "numberAvailable": ready,
                                  "numberMisscheduled": 0,
                                  "numberUnavailable": len(nodes) - ready})

    @staticmethod
    def _pinned_node(pod: dict) -> str | None:
        terms = ((((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get(
                     "nodeSelectorTerms") or []
        for term in terms:
            for f in term.get("matchFields") or []:
                if f.get("key") == "metadata.name" and f.get("values"):
                    return f["values"][0]
        return (pod.get("spec") or {}).get("nodeName")

    # ------------------------------------------------------------------ Job

    def _sync_job(self, rt: ResourceType, job: dict) -> None:
        spec, status = job.get("spec") or {}, job.get("status") or {}
        if any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in status.get("conditions") or []):
            return
        completions = spec.get("completions", 1)
        parallelism = spec.get("parallelism", 1)
        pods = [p for p in self._owned("pods", "", job)]
        succeeded = sum(1 for p in pods if _phase(p) == "Succeeded")
        failed = sum(1 for p in pods if _phase(p) == "Failed")
        active = self._active(pods)
        name = job["metadata"]["name"]
        now = rfc3339()
        if succeeded >= completions:
            def complete(o: dict) -> None:
                o["status"] = {**(o.get("status") or {}), "succeeded": succeeded,
                               "failed": failed, "active": 0, "ready": 0,
                               "completionTime": now}
                set_condition(o, "SuccessCriteriaMet", "True", "CompletionsReached",
                              "Reached expected number of succeeded pods")
                set_condition(o, "Complete", "True", "CompletionsReached",
                              "Reached expected number of succeeded pods")

            self.store.mutate(rt, job["metadata"]["namespace"], name, complete,
                              uid=job["metadata"]["uid"])
            return
        if failed > spec.get("backoffLimit", 6):
            for p in active:
                self._delete(PODS, p)

            def fail(o: dict) -> None:
                o["status"] = {**(o.get("status") or {}), "failed": failed, "active": 0}
                set_condition(o, "FailureTarget", "True", "BackoffLimitExceeded",
                              "Job has reached the specified backoff limit")
                set_condition(o, "Failed", "True", "BackoffLimitExceeded",
                              "Job has reached the specified backoff limit")

            self.store.mutate(rt, job["metadata"]["namespace"], name, fail,
                              uid=job["metadata"]["uid"])
            return
        missing = min(parallelism, completions - succeeded) - len(active)
        labels = {"batch.kubernetes.io/controller-uid": job["metadata"]["uid"],
                  "batch.kubernetes.io/job-name": name, "controller-uid": job["metadata"]["uid"],
                  "job-name": name}
        for _ in range(max(0, missing)):
            self._create_pod(job, spec.get("template") or {}, name, labels)
        self._set_status(rt, job, {"active": len(self._active(self._owned("pods", "", job))),
                                   "succeeded": succeeded, "failed": failed,
                                   "startTime": status.get("startTime") or now})
