"""Validation of objects the way the API server does it (the subset that catches real bugs).

Messages are the ones of k8s.io/apimachinery/pkg/util/validation and
k8s.io/kubernetes/pkg/apis/core/validation, so a 422 from the emulator reads like a real one.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from . import quantity
from .errors import (
    FieldError,
    duplicate,
    field_not_found,
    forbidden,
    invalid,
    not_supported,
    required,
)

_QNAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = _DNS1123_LABEL + r"(\." + _DNS1123_LABEL + r")*"
_DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_ENV_NAME = r"[-._a-zA-Z][-._a-zA-Z0-9]*"
_CONFIG_KEY = r"[-._a-zA-Z0-9]+"

MSG_QNAME = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must "
             "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or "
             f"'123-abc', regex used for validation is '{_QNAME}')")
MSG_LABEL_VALUE = ("a valid label must be an empty string or consist of alphanumeric characters, "
                   "'-', '_' or '.', and must start and end with an alphanumeric character (e.g. "
                   "'MyValue',  or 'my_value',  or '12345', regex used for validation is "
                   f"'{_LABEL_VALUE}')")
MSG_DNS1123_LABEL = ("a lowercase RFC 1123 label must consist of lower case alphanumeric "
                     "characters or '-', and must start and end with an alphanumeric character "
                     "(e.g. 'my-name',  or '123-abc', regex used for validation is "
                     f"'{_DNS1123_LABEL}')")
MSG_DNS1123_SUBDOMAIN = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                         "characters, '-' or '.', and must start and end with an alphanumeric "
                         "character (e.g. 'example.com', regex used for validation is "
                         f"'{_DNS1123_SUBDOMAIN}')")
MSG_DNS1035_LABEL = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
                     "start with an alphabetic character, and end with an alphanumeric character "
                     "(e.g. 'my-name',  or 'abc-123', regex used for validation is "
                     f"'{_DNS1035_LABEL}')")
MSG_ENV_NAME = ("a valid environment variable name must consist of alphabetic characters, "
                "digits, '_', '-', or '.', and must not start with a digit (e.g. 'my.env-name',  "
                f"or 'MY_ENV.NAME',  or 'MyEnvName1', regex used for validation is '{_ENV_NAME}')")
MSG_CONFIG_KEY = ("a valid config key must consist of alphanumeric characters, '-', '_' or '.' "
                  f"(e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation "
                  f"is '{_CONFIG_KEY}')")


def _full(rx: str, s: str) -> bool:
    return re.fullmatch(rx, s) is not None


def dns1123_subdomain_errors(s: str) -> list[str]:
    errs = []
    if len(s) > 253:
        errs.append("must be no more than 253 characters")
    if not _full(_DNS1123_SUBDOMAIN, s):
        errs.append(MSG_DNS1123_SUBDOMAIN)
    return errs


def dns1123_label_errors(s: str) -> list[str]:
    errs = []
    if len(s) > 63:
        errs.append("must be no more than 63 characters")
    if not _full(_DNS1123_LABEL, s):
        errs.append(MSG_DNS1123_LABEL)
    return errs


def dns1035_label_errors(s: str) -> list[str]:
    errs = []
    if len(s) > 63:
        errs.append("must be no more than 63 characters")
    if not _full(_DNS1035_LABEL, s):
        errs.append(MSG_DNS1035_LABEL)
    return errs


def name_errors(name: str, rule: str) -> list[str]:
    if rule == "label":
        return dns1123_label_errors(name)
    if rule == "dns1035":
        return dns1035_label_errors(name)
    if rule == "path":
        if name in (".", ".."):
            return [f"may not be '{name}'"]
        if "/" in name or "%" in name:
            return [f"may not contain '{'/' if '/' in name else '%'}'"]
        return []
    return dns1123_subdomain_errors(name)


def label_key_errors(key: str) -> list[str]:
    """IsQualifiedName: optional DNS-subdomain prefix + '/' + name part."""
    parts = key.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            return ["prefix part must be non-empty"]
        errs = dns1123_subdomain_errors(prefix)
        if errs:
            return ["prefix part " + e for e in errs]
    else:
        return ["a qualified name must consist of alphanumeric characters, '-', '_' or '.', and "
                "must start and end with an alphanumeric character (e.g. 'MyName',  or "
                "'my.name',  or '123-abc', regex used for validation is "
                f"'{_QNAME}') with an optional DNS subdomain prefix and '/' (e.g. "
                "'example.com/MyName')"]
    if not name:
        return ["name part must be non-empty"]
    errs = []
    if len(name) > 63:
        errs.append("name part must be no more than 63 characters")
    if not _full(_QNAME, name):
        errs.append(MSG_QNAME)
    return errs


def label_value_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append("must be no more than 63 characters")
    if not _full(_LABEL_VALUE, value):
        errs.append(MSG_LABEL_VALUE)
    return errs


def validate_metadata(meta: Any, name_rule: str, namespaced: bool) -> list[FieldError]:
    errs: list[FieldError] = []
    if not isinstance(meta, dict):
        return [required("metadata", "")]
    name = meta.get("name")
    if not name:
        if not meta.get("generateName"):
            errs.append(required("metadata.name", "name or generateName is required"))
    else:
        if not isinstance(name, str):
            errs.append(invalid("metadata.name", name, "must be a string"))
        else:
            for e in name_errors(name, name_rule):
                errs.append(invalid("metadata.name", name, e))
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        errs.append(invalid("metadata.labels", labels, "must be a map of strings"))
        labels = {}
    for k, v in labels.items():
        for e in label_key_errors(k):
            errs.append(invalid("metadata.labels", k, e))
        if not isinstance(v, str):
            errs.append(invalid(f"metadata.labels.{k}", v, "must be a string"))
            continue
        for e in label_value_errors(v):
            errs.append(invalid("metadata.labels", v, e))
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict):
        errs.append(invalid("metadata.annotations", annotations, "must be a map of strings"))
        annotations = {}
    total = 0
    for k, v in annotations.items():
        for e in label_key_errors(k):
            errs.append(invalid("metadata.annotations", k, e))
        if not isinstance(v, str):
            errs.append(invalid(f"metadata.annotations.{k}", v, "must be a string"))
            continue
        total += len(k) + len(v)
    if total > 262144:
        errs.append(FieldError("metadata.annotations", "Too long",
                               detail="must have at most 262144 bytes"))
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for key in ("apiVersion", "kind", "name", "uid"):
            if not (isinstance(ref, dict) and ref.get(key)):
                errs.append(required(f"metadata.ownerReferences[{i}].{key}", ""))
    return errs


def _quantity_map(path: str, m: Any, errs: list[FieldError]) -> dict[str, Any]:
    if m is None:
        return {}
    if not isinstance(m, dict):
        errs.append(invalid(path, m, "must be a map of resource quantities"))
        return {}
    out = {}
    for k, v in m.items():
        out[k] = quantity.parse(v)  # QuantityError is a decoding error (400), raised upward
    return out


def _validate_resources(path: str, res: Any, errs: list[FieldError]) -> None:
    if not res:
        return
    limits = _quantity_map(path + ".limits", res.get("limits"), errs)
    requests = _quantity_map(path + ".requests", res.get("requests"), errs)
    for name, q in {**limits, **requests}.items():
        if q < 0:
            errs.append(invalid(f"{path}.requests[{name}]", str(q),
                                "must be greater than or equal to 0"))
    for name, req in requests.items():
        if name in limits and req > limits[name]:
            errs.append(invalid(f"{path}.requests", quantity.fmt(req),
                                f"must be less than or equal to {name} limit of "
                                f"{quantity.fmt(limits[name])}"))
        if quantity.is_extended(name):
            if name not in limits:
                errs.append(required(f"{path}.limits",
                                     "Limit must be set for non overcommitable resources"))
            elif req != limits[name]:
                errs.append(invalid(f"{path}.requests", quantity.fmt(req),
                                    f"must be equal to {name} limit of "
                                    f"{quantity.fmt(limits[name])}"))
            if req.denominator != 1:
                errs.append(invalid(f"{path}.requests[{name}]", quantity.fmt(req),
                                    "must be an integer"))


_VOLUME_SOURCES = (
    "hostPath", "emptyDir", "secret", "configMap", "downwardAPI", "projected",
    "persistentVolumeClaim", "nfs", "csi", "ephemeral", "iscsi", "cephfs", "gcePersistentDisk",
    "awsElasticBlockStore", "azureDisk", "azureFile", "image",
)


def _validate_container(path: str, c: Any, volumes: set[str], names: set[str],
                        errs: list[FieldError]) -> None:
    if not isinstance(c, dict):
        errs.append(invalid(path, c, "must be an object"))
        return
    name = c.get("name")
    if not name:
        errs.append(required(path + ".name", ""))
    else:
        for e in dns1123_label_errors(name):
            errs.append(invalid(path + ".name", name, e))
        if name in names:
            errs.append(duplicate(path + ".name", name))
        names.add(name)
    if not c.get("image"):
        errs.append(required(path + ".image", ""))
    for key in ("command", "args"):
        v = c.get(key)
        if v is not None and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
            errs.append(invalid(f"{path}.{key}", v, "must be a list of strings"))
    for i, env in enumerate(c.get("env") or []):
        p = f"{path}.env[{i}]"
        ename = env.get("name") if isinstance(env, dict) else None
        if not ename:
            errs.append(required(p + ".name", ""))
        elif not _full(_ENV_NAME, ename):
            errs.append(invalid(p + ".name", ename, MSG_ENV_NAME))
        vf = env.get("valueFrom") if isinstance(env, dict) else None
        if vf is not None:
            if env.get("value"):
                errs.append(invalid(p + ".valueFrom", "",
                                    "may not be specified when `value` is not empty"))
            kinds = [k for k in ("fieldRef", "resourceFieldRef", "configMapKeyRef",
                                 "secretKeyRef", "fileKeyRef") if vf.get(k) is not None]
            if len(kinds) != 1:
                errs.append(invalid(p + ".valueFrom", "",
                                    "must specify one of: `fieldRef`, `resourceFieldRef`, "
                                    "`configMapKeyRef` or `secretKeyRef`"))
            for k in ("configMapKeyRef", "secretKeyRef"):
                ref = vf.get(k)
                if ref is not None and not ref.get("key"):
                    errs.append(required(f"{p}.valueFrom.{k}.key", ""))
    ports = set()
    for i, port in enumerate(c.get("ports") or []):
        cp = port.get("containerPort") if isinstance(port, dict) else None
        if not isinstance(cp, int) or not 0 < cp < 65536:
            errs.append(invalid(f"{path}.ports[{i}].containerPort", cp,
                                "must be between 1 and 65535, inclusive"))
        key = (cp, (port or {}).get("protocol", "TCP"))
        if key in ports:
            errs.append(duplicate(f"{path}.ports[{i}]", f"{cp}/{key[1]}"))
        ports.add(key)
    mounts = set()
    for i, m in enumerate(c.get("volumeMounts") or []):
        p = f"{path}.volumeMounts[{i}]"
        if not m.get("name"):
            errs.append(required(p + ".name", ""))
        elif m["name"] not in volumes:
            errs.append(field_not_found(p + ".name", m["name"]))
        mp = m.get("mountPath")
        if not mp:
            errs.append(required(p + ".mountPath", ""))
        elif mp in mounts:
            errs.append(invalid(p + ".mountPath", mp, "must be unique"))
        mounts.add(mp)
        sp = m.get("subPath") or ""
        if sp.startswith("/") or ".." in sp.split("/"):
            errs.append(invalid(p + ".subPath", sp, "must be a relative path without '..'"))
    _validate_resources(path + ".resources", c.get("resources"), errs)


def validate_pod_spec(spec: Any, path: str = "spec") -> list[FieldError]:
    errs: list[FieldError] = []
    if not isinstance(spec, dict):
        return [required(path, "")]
    volumes: set[str] = set()
    for i, v in enumerate(spec.get("volumes") or []):
        p = f"{path}.volumes[{i}]"
        name = v.get("name") if isinstance(v, dict) else None
        if not name:
            errs.append(required(p + ".name", ""))
        else:
            for e in dns1123_label_errors(name):
                errs.append(invalid(p + ".name", name, e))
            if name in volumes:
                errs.append(duplicate(p + ".name", name))
            volumes.add(name)
        sources = [k for k in _VOLUME_SOURCES if isinstance(v, dict) and v.get(k) is not None]
        if not sources:
            errs.append(required(p, "must specify a volume type"))
        elif len(sources) > 1:
            errs.append(forbidden(p + "." + sources[1], "may not specify more than 1 volume type"))
        if isinstance(v, dict):
            if v.get("secret") is not None and not v["secret"].get("secretName"):
                errs.append(required(p + ".secret.secretName", ""))
            if v.get("configMap") is not None and not v["configMap"].get("name"):
                errs.append(required(p + ".configMap.name", ""))
            if v.get("hostPath") is not None and not v["hostPath"].get("path"):
                errs.append(required(p + ".hostPath.path", ""))
            if (v.get("persistentVolumeClaim") is not None
                    and not v["persistentVolumeClaim"].get("claimName")):
                errs.append(required(p + ".persistentVolumeClaim.claimName", ""))
    containers = spec.get("containers")
    if not containers:
        errs.append(required(path + ".containers", ""))
    names: set[str] = set()
    for i, c in enumerate(containers or []):
        _validate_container(f"{path}.containers[{i}]", c, volumes, names, errs)
    for i, c in enumerate(spec.get("initContainers") or []):
        _validate_container(f"{path}.initContainers[{i}]", c, volumes, names, errs)
    rp = spec.get("restartPolicy")
    if rp is not None and rp not in ("Always", "OnFailure", "Never"):
        errs.append(not_supported(path + ".restartPolicy", rp, ["Always", "Never", "OnFailure"]))
    for key in ("nodeName", "serviceAccountName", "priorityClassName", "runtimeClassName"):
        val = spec.get(key)
        if val:
            for e in dns1123_subdomain_errors(val):
                errs.append(invalid(f"{path}.{key}", val, e))
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is not None and (not isinstance(grace, int) or grace < 0):
        errs.append(invalid(path + ".terminationGracePeriodSeconds", grace,
                            "must be greater than or equal to 0"))
    for k, v in (spec.get("nodeSelector") or {}).items():
        for e in label_key_errors(k):
            errs.append(invalid(path + ".nodeSelector", k, e))
        for e in label_value_errors(str(v)):
            errs.append(invalid(path + ".nodeSelector", v, e))
    for i, t in enumerate(spec.get("tolerations") or []):
        op = t.get("operator", "Equal")
        if op not in ("Equal", "Exists"):
            errs.append(not_supported(f"{path}.tolerations[{i}].operator", op,
                                      ["Equal", "Exists"]))
        eff = t.get("effect")
        if eff and eff not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            errs.append(not_supported(f"{path}.tolerations[{i}].effect", eff,
                                      ["NoExecute", "NoSchedule", "PreferNoSchedule"]))
    return errs


# Fields of a pod's spec that may change after creation (ValidatePodUpdate).
def pod_spec_update_errors(old: dict, new: dict) -> list[FieldError]:
    def strip(spec: dict) -> dict:
        s = dict(spec)
        for key in ("containers", "initContainers"):
            s[key] = [{k: v for k, v in c.items() if k != "image"} for c in s.get(key) or []]
        for key in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds",
                    "schedulingGates"):
            s.pop(key, None)
        return s

    if strip(old) != strip(new):
        return [forbidden("spec", "pod updates may not change fields other than "
                                  "`spec.containers[*].image`,`spec.initContainers[*].image`,"
                                  "`spec.activeDeadlineSeconds`,`spec.tolerations` (only "
                                  "additions to existing tolerations),"
                                  "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 "
                                  "if it was previously negative)")]
    return []


def _validate_data_keys(path: str, data: Any, errs: list[FieldError]) -> None:
    if data is None:
        return
    if not isinstance(data, dict):
        errs.append(invalid(path, data, "must be a map"))
        return
    for k in data:
        if not _full(_CONFIG_KEY, k) or len(k) > 253:
            errs.append(invalid(path, k, MSG_CONFIG_KEY))


def validate_service_spec(spec: Any) -> list[FieldError]:
    errs: list[FieldError] = []
    if not isinstance(spec, dict):
        return errs
    typ = spec.get("type", "ClusterIP")
    if typ not in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"):
        errs.append(not_supported("spec.type", typ,
                                  ["ClusterIP", "ExternalName", "LoadBalancer", "NodePort"]))
    ports = spec.get("ports") or []
    if typ != "ExternalName" and not ports and spec.get("clusterIP") != "None":
        errs.append(required("spec.ports", ""))
    for i, p in enumerate(ports):
        port = p.get("port") if isinstance(p, dict) else None
        if not isinstance(port, int) or not 0 < port < 65536:
            errs.append(invalid(f"spec.ports[{i}].port", port,
                                "must be between 1 and 65535, inclusive"))
        if len(ports) > 1 and not (p or {}).get("name"):
            errs.append(required(f"spec.ports[{i}].name", ""))
    return errs


def _validate_workload(kind: str, spec: dict) -> list[FieldError]:
    errs: list[FieldError] = []
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    selector = spec.get("selector")
    if kind != "Job":
        if not selector:
            errs.append(required("spec.selector", ""))
        elif not all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()):
            shown = "map[string]string{" + ", ".join(
                f'"{k}":"{v}"' for k, v in sorted(labels.items())) + "}"
            errs.append(FieldError("spec.template.metadata.labels", "Invalid value",
                                   detail=f"{shown}: `selector` does not match template "
                                          "`labels`"))
    pod_spec = template.get("spec")
    if pod_spec is None:
        errs.append(required("spec.template.spec", ""))
        return errs
    errs += validate_pod_spec(pod_spec, "spec.template.spec")
    policy = pod_spec.get("restartPolicy")
    if kind == "Job" and policy not in ("OnFailure", "Never"):
        errs.append(not_supported("spec.template.spec.restartPolicy", policy,
                                  ["OnFailure", "Never"]))
    elif kind != "Job" and policy not in (None, "Always"):
        errs.append(not_supported("spec.template.spec.restartPolicy", policy, ["Always"]))
    return errs


MAX_DATA_BYTES = 1024 * 1024  # corev1.MaxSecretSize, also the limit of a ConfigMap


def _data_size(kind: str, obj: dict) -> int:
    total = 0
    for section in ("data", "binaryData"):
        values = obj.get(section)
        if not isinstance(values, dict):
            continue
        for k, v in values.items():
            if not isinstance(v, str):
                continue
            binary = section == "binaryData" or kind == "Secret"
            try:
                size = len(base64.b64decode(v)) if binary else len(v.encode())
            except ValueError:
                size = len(v)
            total += len(k) + size
    return total


def validate(kind: str, obj: dict, old: dict | None = None) -> list[FieldError]:
    """Kind-specific validation (metadata is validated separately)."""
    errs: list[FieldError] = []
    if kind == "Pod":
        errs += validate_pod_spec(obj.get("spec"))
        if old is not None and not errs:
            errs += pod_spec_update_errors(old.get("spec") or {}, obj.get("spec") or {})
    elif kind == "Service":
        errs += validate_service_spec(obj.get("spec"))
    elif kind in ("ConfigMap", "Secret"):
        _validate_data_keys("data", obj.get("data"), errs)
        _validate_data_keys("binaryData", obj.get("binaryData"), errs)
        _validate_data_keys("stringData", obj.get("stringData"), errs)
        if old is not None and old.get("immutable") and (
                obj.get("data") != old.get("data") or obj.get("binaryData") != old.get("binaryData")):
            errs.append(forbidden("data", "field is immutable when `immutable` is set"))
        if kind == "Secret" and old is not None and obj.get("type") != old.get("type"):
            errs.append(invalid("type", obj.get("type"), "field is immutable"))
        if _data_size(kind, obj) > MAX_DATA_BYTES:
            # ValidateConfigMap / ValidateSecret: keys plus (decoded) values, at most 1 MiB
            errs.append(FieldError("[]" if kind == "ConfigMap" else "data", "Too long",
                                   detail=f"must have at most {MAX_DATA_BYTES} bytes"))
    elif kind == "PersistentVolumeClaim":
        spec = obj.get("spec") or {}
        if not spec.get("accessModes"):
            errs.append(required("spec.accessModes", ""))
        storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
        if storage is None:
            errs.append(required("spec.resources[storage]", ""))
        else:
            quantity.parse(storage)
    elif kind == "PriorityClass":
        if not isinstance(obj.get("value"), int):
            errs.append(required("value", ""))
        if old is not None and obj.get("value") != old.get("value"):
            errs.append(forbidden("value", "may not be changed in an update."))
    elif kind == "RuntimeClass":
        if not obj.get("handler"):
            errs.append(required("handler", ""))
    elif kind == "ResourceQuota":
        for v in ((obj.get("spec") or {}).get("hard") or {}).values():
            quantity.parse(v)
    elif kind == "Node":
        for i, t in enumerate((obj.get("spec") or {}).get("taints") or []):
            if not t.get("key"):
                errs.append(required(f"spec.taints[{i}].key", ""))
            eff = t.get("effect")
            if eff not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
                errs.append(not_supported(f"spec.taints[{i}].effect", eff,
                                          ["NoExecute", "NoSchedule", "PreferNoSchedule"]))
        for section in ("capacity", "allocatable"):
            for v in ((obj.get("status") or {}).get(section) or {}).values():
                quantity.parse(v)
    elif kind in ("Deployment", "ReplicaSet", "DaemonSet", "Job"):
        errs += _validate_workload(kind, obj.get("spec") or {})
    elif kind == "Event":
        if not (obj.get("involvedObject") or {}).get("name") and not obj.get("regarding"):
            pass  # real API accepts events without involvedObject.name
    return errs
