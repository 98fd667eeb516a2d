"""The resource types the emulator serves, and the discovery documents describing them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Field selectors the real API server accepts, per resource (``AddFieldLabelConversionFunc``
# registrations in k8s.io/kubernetes/pkg/apis/core/v1/conversion.go). Every resource accepts
# metadata.name and metadata.namespace.
_META_FIELDS = frozenset({"metadata.name", "metadata.namespace"})
_POD_FIELDS = _META_FIELDS | {
    "spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
    "spec.hostNetwork", "status.phase", "status.podIP", "status.podIPs",
    "status.nominatedNodeName",
}
_EVENT_FIELDS = _META_FIELDS | {
    "involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
    "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
    "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type",
}
_NEW_EVENT_FIELDS = _META_FIELDS | {
    "regarding.kind", "regarding.namespace", "regarding.name", "regarding.uid",
    "regarding.apiVersion", "regarding.resourceVersion", "regarding.fieldPath", "reason",
    "reportingController", "type",
}

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()
    field_labels: frozenset[str] = _META_FIELDS
    # DELETE answers with the object itself (pods, services, ...) rather than a Status.
    returns_deleted_object: bool = False
    # Name validation: "subdomain" (RFC 1123 subdomain), "label" (RFC 1123 label),
    # "dns1035" (services), "path" (events: any path segment name).
    name_rule: str = "subdomain"
    # Objects of this type keep a metadata.generation bumped on spec changes.
    has_generation: bool = False
    # Stored as another resource (events.k8s.io/v1 events are core/v1 events).
    storage: tuple[str, str] | None = None
    to_view: Callable[[dict], dict] | None = field(default=None, compare=False, hash=False)
    from_view: Callable[[dict], dict] | None = field(default=None, compare=False, hash=False)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def storage_key(self) -> tuple[str, str]:
        return self.storage or self.key

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources


def _event_to_new(obj: dict) -> dict:
    """core/v1 Event -> events.k8s.io/v1 Event (the conversion the API server does)."""
    out = {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": obj.get("metadata", {})}
    mapping = {
        "eventTime": "eventTime", "series": "series", "action": "action", "reason": "reason",
        "involvedObject": "regarding", "related": "related", "message": "note", "type": "type",
        "source": "deprecatedSource", "firstTimestamp": "deprecatedFirstTimestamp",
        "lastTimestamp": "deprecatedLastTimestamp", "count": "deprecatedCount",
        "reportingInstance": "reportingInstance",
    }
    for old, new in mapping.items():
        if obj.get(old) not in (None, "", {}, 0):
            out[new] = obj[old]
    controller = obj.get("reportingComponent") or (obj.get("source") or {}).get("component")
    if controller:
        out["reportingController"] = controller
    if "eventTime" not in out:
        out["eventTime"] = None
    return out


def _event_from_new(obj: dict) -> dict:
    """events.k8s.io/v1 Event -> core/v1 Event."""
    out = {"apiVersion": "v1", "kind": "Event", "metadata": obj.get("metadata", {})}
    mapping = {
        "eventTime": "eventTime", "series": "series", "action": "action", "reason": "reason",
        "regarding": "involvedObject", "related": "related", "note": "message", "type": "type",
        "deprecatedSource": "source", "deprecatedFirstTimestamp": "firstTimestamp",
        "deprecatedLastTimestamp": "lastTimestamp", "deprecatedCount": "count",
        "reportingController": "reportingComponent", "reportingInstance": "reportingInstance",
    }
    for new, old in mapping.items():
        if new in obj:
            out[old] = obj[new]
    out.setdefault("involvedObject", {})
    return out


RESOURCES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "Namespace", False, ("ns",), ("status", "finalize"),
                 _META_FIELDS | {"status.phase"}, returns_deleted_object=True,
                 name_rule="label"),
    ResourceType("", "v1", "pods", "Pod", True, ("po",),
                 ("status", "log", "binding", "eviction"), _POD_FIELDS,
                 returns_deleted_object=True, has_generation=True),
    ResourceType("", "v1", "services", "Service", True, ("svc",), ("status",),
                 returns_deleted_object=True, name_rule="dns1035"),
    ResourceType("", "v1", "secrets", "Secret", True, (), (), _META_FIELDS | {"type"}),
    ResourceType("", "v1", "configmaps", "ConfigMap", True, ("cm",)),
    ResourceType("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ("pvc",),
                 ("status",), returns_deleted_object=True),
    ResourceType("", "v1", "persistentvolumes", "PersistentVolume", False, ("pv",), ("status",),
                 returns_deleted_object=True),
    ResourceType("", "v1", "events", "Event", True, ("ev",), (), _EVENT_FIELDS,
                 name_rule="path"),
    ResourceType("", "v1", "nodes", "Node", False, ("no",), ("status",),
                 _META_FIELDS | {"spec.unschedulable"}),
    ResourceType("", "v1", "resourcequotas", "ResourceQuota", True, ("quota",), ("status",)),
    ResourceType("", "v1", "limitranges", "LimitRange", True, ("limits",)),
    ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, ("sa",), ("token",)),
    ResourceType("", "v1", "endpoints", "Endpoints", True, ("ep",)),
    ResourceType("events.k8s.io", "v1", "events", "Event", True, ("ev",), (), _NEW_EVENT_FIELDS,
                 name_rule="path", storage=("", "events"), to_view=_event_to_new,
                 from_view=_event_from_new),
    ResourceType("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False, ("pc",)),
    ResourceType("node.k8s.io", "v1", "runtimeclasses", "RuntimeClass", False, ()),
    ResourceType("storage.k8s.io", "v1", "storageclasses", "StorageClass", False, ("sc",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True, ()),
    ResourceType("apps", "v1", "deployments", "Deployment", True, ("deploy",), ("status",),
                 has_generation=True),
    ResourceType("apps", "v1", "replicasets", "ReplicaSet", True, ("rs",), ("status",),
                 has_generation=True),
    ResourceType("apps", "v1", "daemonsets", "DaemonSet", True, ("ds",), ("status",),
                 has_generation=True),
    ResourceType("batch", "v1", "jobs", "Job", True, (), ("status",), has_generation=True),
    # reviews: created and answered, never stored (server.py)
    ResourceType("authorization.k8s.io", "v1", "selfsubjectaccessreviews",
                 "SelfSubjectAccessReview", False, ()),
    ResourceType("authentication.k8s.io", "v1", "selfsubjectreviews", "SelfSubjectReview",
                 False, ()),
    ResourceType("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True,
                 ("netpol",)),
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role", True, ()),
    ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True, ()),
    ResourceType("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False, ()),
    ResourceType("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding",
                 False, ()),
)

BY_PATH: dict[tuple[str, str, str], ResourceType] = {
    (r.group, r.version, r.plural): r for r in RESOURCES
}
BY_KEY: dict[tuple[str, str], ResourceType] = {r.key: r for r in RESOURCES}
STORAGE_TYPES: tuple[ResourceType, ...] = tuple(r for r in RESOURCES if r.storage is None)


def lookup(group: str, version: str, plural: str) -> ResourceType | None:
    return BY_PATH.get((group, version, plural))


def by_plural(plural: str, group: str = "") -> ResourceType:
    """The resource type for a plural name such as 'pods' (core group unless given)."""
    try:
        return BY_KEY[(group, plural)]
    except KeyError:
        known = ", ".join(sorted(r.plural if not r.group else f"{r.plural}.{r.group}"
                                 for r in RESOURCES))
        raise KeyError(f"unknown resource {plural!r} in group {group!r}; known: {known}") from None


def groups() -> list[str]:
    return sorted({r.group for r in RESOURCES if r.group})


def api_resource_list(group: str, version: str) -> dict | None:
    items = [r for r in RESOURCES if r.group == group and r.version == version]
    if not items:
        return None
    resources = []
    for r in items:
        resources.append({
            "name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced,
            "kind": r.kind, "verbs": ["create"] if r.plural.startswith("self") else ALL_VERBS,
            **({"shortNames": list(r.short_names)} if r.short_names else {}),
        })
        for sub in r.subresources:
            verbs = {"status": ["get", "patch", "update"], "log": ["get"],
                     "binding": ["create"], "eviction": ["create"], "finalize": ["update"],
                     "token": ["create"]}[sub]
            kind = {"log": "Pod", "binding": "Binding", "eviction": "Eviction",
                    "token": "TokenRequest"}.get(sub, r.kind)
            resources.append({"name": f"{r.plural}/{sub}", "singularName": "",
                              "namespaced": r.namespaced, "kind": kind, "verbs": verbs})
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version, "resources": resources}


def api_group(group: str) -> dict | None:
    versions = sorted({r.version for r in RESOURCES if r.group == group})
    if not group or not versions:
        return None
    gv = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": gv,
            "preferredVersion": gv[0]}


def api_group_list() -> dict:
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [{k: v for k, v in api_group(g).items() if k not in ("kind", "apiVersion")}
                       for g in groups()]}
