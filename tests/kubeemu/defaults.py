"""Defaulting as done by the API server's defaulters (k8s.io/kubernetes/pkg/apis/core/v1)."""

from __future__ import annotations

import base64
import ipaddress
from typing import Any

from .limitrange import default_limit_range


def _image_pull_policy(image: str) -> str:
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    return "Always" if tag == "latest" else "IfNotPresent"


def _default_container(c: dict) -> None:
    if not isinstance(c, dict):
        return
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    if c.get("image"):
        c.setdefault("imagePullPolicy", _image_pull_policy(c["image"]))
    res = c.setdefault("resources", {})
    if isinstance(res, dict):
        limits = res.get("limits") or {}
        if limits:
            requests = res.setdefault("requests", {})
            for k, v in limits.items():
                requests.setdefault(k, v)
    for p in c.get("ports") or []:
        if isinstance(p, dict):
            p.setdefault("protocol", "TCP")
    for env in c.get("env") or []:
        ref = (env.get("valueFrom") or {}).get("fieldRef") if isinstance(env, dict) else None
        if isinstance(ref, dict):
            ref.setdefault("apiVersion", "v1")
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        pr = c.get(probe)
        if isinstance(pr, dict):
            pr.setdefault("timeoutSeconds", 1)
            pr.setdefault("periodSeconds", 10)
            pr.setdefault("successThreshold", 1)
            pr.setdefault("failureThreshold", 3)
            if isinstance(pr.get("httpGet"), dict):
                pr["httpGet"].setdefault("path", "/")
                pr["httpGet"].setdefault("scheme", "HTTP")


def _default_volume(v: dict) -> None:
    if not isinstance(v, dict):
        return
    for key in ("secret", "configMap", "downwardAPI"):
        if isinstance(v.get(key), dict):
            v[key].setdefault("defaultMode", 0o644)
    if isinstance(v.get("projected"), dict):
        v["projected"].setdefault("defaultMode", 0o644)
    if isinstance(v.get("hostPath"), dict):
        v["hostPath"].setdefault("type", "")
    if isinstance(v.get("downwardAPI"), dict):
        for item in v["downwardAPI"].get("items") or []:
            if isinstance(item.get("fieldRef"), dict):
                item["fieldRef"].setdefault("apiVersion", "v1")


def default_pod(obj: dict) -> None:
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        return
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    if spec.get("serviceAccountName") and not spec.get("serviceAccount"):
        spec["serviceAccount"] = spec["serviceAccountName"]
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        _default_container(c)
    for v in spec.get("volumes") or []:
        _default_volume(v)
    for t in spec.get("tolerations") or []:
        if isinstance(t, dict) and t.get("operator") is None and t.get("key"):
            t.setdefault("operator", "Equal")
    status = obj.setdefault("status", {})
    if isinstance(status, dict):
        status.setdefault("phase", "Pending")
        status.setdefault("qosClass", qos_class(spec))


def qos_class(spec: dict) -> str:
    """BestEffort / Guaranteed / Burstable, from cpu and memory requests and limits."""
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    guaranteed = True
    for c in spec.get("containers") or []:
        res = c.get("resources") or {} if isinstance(c, dict) else {}
        req = {k: v for k, v in (res.get("requests") or {}).items() if k in ("cpu", "memory")}
        lim = {k: v for k, v in (res.get("limits") or {}).items() if k in ("cpu", "memory")}
        requests.update(req)
        limits.update(lim)
        if set(lim) != {"cpu", "memory"} or any(req.get(k) != lim.get(k) for k in lim):
            guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


class ClusterIPAllocator:
    """Service cluster IPs from 10.96.0.0/12, as a default cluster would give them."""

    def __init__(self) -> None:
        self._net = ipaddress.ip_network("10.96.0.0/12")
        self._next = 10

    def allocate(self) -> str:
        ip = str(self._net.network_address + self._next)
        self._next += 1
        return ip


def default_service(obj: dict, ips: ClusterIPAllocator) -> None:
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        return
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec["type"] != "ExternalName":
        if not spec.get("clusterIP"):
            spec["clusterIP"] = ips.allocate()
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
    for p in spec.get("ports") or []:
        if isinstance(p, dict):
            p.setdefault("protocol", "TCP")
            p.setdefault("targetPort", p.get("port"))
    obj.setdefault("status", {"loadBalancer": {}})


def default_secret(obj: dict) -> None:
    obj.setdefault("type", "Opaque")
    string_data = obj.pop("stringData", None)
    if string_data:
        data = obj.get("data") or {}
        for k, v in string_data.items():
            data[k] = base64.b64encode(str(v).encode()).decode()
        obj["data"] = data


def default_namespace(obj: dict) -> None:
    name = obj["metadata"].get("name")
    labels = obj["metadata"].setdefault("labels", {})
    if name:
        labels["kubernetes.io/metadata.name"] = name
    spec = obj.setdefault("spec", {})
    if isinstance(spec, dict):
        spec.setdefault("finalizers", ["kubernetes"])
    obj.setdefault("status", {})
    obj["status"].setdefault("phase", "Active")


def default_pvc(obj: dict) -> None:
    spec = obj.setdefault("spec", {})
    if isinstance(spec, dict):
        spec.setdefault("volumeMode", "Filesystem")
    obj.setdefault("status", {"phase": "Pending"})


def default_event(obj: dict) -> None:
    # The real server serialises these zero-valued times as null, and clients
    # (KubeSpawner's EventReflector) index them directly.
    for key in ("eventTime", "firstTimestamp", "lastTimestamp"):
        obj.setdefault(key, None)
    obj.setdefault("reportingComponent", "")
    obj.setdefault("reportingInstance", "")
    obj.setdefault("source", {})
    obj.setdefault("involvedObject", {})


def default_priority_class(obj: dict) -> None:
    obj.setdefault("preemptionPolicy", "PreemptLowerPriority")
    obj.setdefault("globalDefault", False)


def default_node(obj: dict) -> None:
    name = obj["metadata"].get("name", "")
    labels = obj["metadata"].setdefault("labels", {})
    labels.setdefault("kubernetes.io/hostname", name)
    labels.setdefault("kubernetes.io/os", "linux")
    labels.setdefault("kubernetes.io/arch", "amd64")
    labels.setdefault("beta.kubernetes.io/os", "linux")
    labels.setdefault("beta.kubernetes.io/arch", "amd64")
    obj.setdefault("spec", {})
    status = obj.setdefault("status", {})
    capacity = status.setdefault("capacity", {})
    allocatable = status.setdefault("allocatable", {})
    for k, v in {"cpu": "16", "memory": "64Gi", "pods": "110",
                 "ephemeral-storage": "100Gi"}.items():
        capacity.setdefault(k, allocatable.get(k, v))
    for k, v in capacity.items():
        allocatable.setdefault(k, v)
    status.setdefault("addresses", [{"type": "InternalIP", "address": "127.0.0.1"},
                                    {"type": "Hostname", "address": name}])
    status.setdefault("conditions", [{
        "type": "Ready", "status": "True", "reason": "KubeletReady",
        "message": "kubelet is posting ready status", "lastHeartbeatTime": None,
        "lastTransitionTime": None}])
    status.setdefault("nodeInfo", {
        "kubeletVersion": "v1.31.0-kubeemu", "containerRuntimeVersion": "kubeemu://1",
        "operatingSystem": "linux", "architecture": "amd64", "osImage": "kubeemu",
        "kernelVersion": "", "kubeProxyVersion": "", "machineID": "", "systemUUID": "",
        "bootID": ""})
    status.setdefault("daemonEndpoints", {"kubeletEndpoint": {"Port": 10250}})


def default_workload(kind: str, obj: dict) -> None:
    """apps/v1 and batch/v1 defaulting, and the pod defaults of their template's spec."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    template = spec.get("template")
    if isinstance(template, dict) and isinstance(template.get("spec"), dict):
        default_pod({"spec": template["spec"]})
    if kind in ("Deployment", "ReplicaSet"):
        spec.setdefault("replicas", 1)
    if kind == "Deployment":
        spec.setdefault("strategy", {"type": "RollingUpdate", "rollingUpdate": {
            "maxUnavailable": "25%", "maxSurge": "25%"}})
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
    elif kind == "DaemonSet":
        spec.setdefault("updateStrategy", {"type": "RollingUpdate", "rollingUpdate": {
            "maxUnavailable": 1, "maxSurge": 0}})
        spec.setdefault("revisionHistoryLimit", 10)
    elif kind == "Job":
        spec.setdefault("parallelism", 1)
        spec.setdefault("completions", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completionMode", "NonIndexed")
        spec.setdefault("suspend", False)


def apply_defaults(kind: str, obj: dict, cluster_ips: ClusterIPAllocator) -> None:
    if kind == "Pod":
        default_pod(obj)
    elif kind == "Service":
        default_service(obj, cluster_ips)
    elif kind == "Secret":
        default_secret(obj)
    elif kind == "Namespace":
        default_namespace(obj)
    elif kind == "PersistentVolumeClaim":
        default_pvc(obj)
    elif kind == "LimitRange":
        default_limit_range(obj)
    elif kind in ("Deployment", "ReplicaSet", "DaemonSet", "Job"):
        default_workload(kind, obj)
    elif kind == "Event":
        default_event(obj)
    elif kind == "PriorityClass":
        default_priority_class(obj)
    elif kind == "Node":
        default_node(obj)
    elif kind == "ResourceQuota":
        obj.setdefault("spec", {})
        obj.setdefault("status", {})
