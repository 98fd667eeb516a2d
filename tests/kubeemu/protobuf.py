"""Request bodies in Kubernetes' protobuf encoding (``application/vnd.kubernetes.protobuf``).

client-go's typed clients may send built-in objects as protobuf: helm does for its release
Secrets. A body is the magic ``k8s\\0`` and a ``runtime.Unknown`` (typeMeta, raw) whose raw is
the object's message (k8s.io/api/core/v1/generated.proto). The messages decoded here are the
ones such clients send (Secret, ConfigMap, with ObjectMeta and OwnerReference, and
DeleteOptions); others get the
API server's 415. Answers stay JSON (clients also accept it).
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

from . import errors as E

MAGIC = b"k8s\x00"
MEDIA_TYPE = "application/vnd.kubernetes.protobuf"

# message -> field number -> (json name, kind); kinds: str, bytes, int, bool, time, a message
# name, "map:<value kind>", or "list:<kind>"
_MESSAGES: dict[str, dict[int, tuple[str, str]]] = {
    "Unknown": {1: ("typeMeta", "TypeMeta"), 2: ("raw", "bytes"),
                3: ("contentEncoding", "str"), 4: ("contentType", "str")},
    "TypeMeta": {1: ("apiVersion", "str"), 2: ("kind", "str")},
    "ObjectMeta": {1: ("name", "str"), 2: ("generateName", "str"), 3: ("namespace", "str"),
                   4: ("selfLink", "str"), 5: ("uid", "str"), 6: ("resourceVersion", "str"),
                   7: ("generation", "int"), 8: ("creationTimestamp", "time"),
                   9: ("deletionTimestamp", "time"), 10: ("deletionGracePeriodSeconds", "int"),
                   11: ("labels", "map:str"), 12: ("annotations", "map:str"),
                   13: ("ownerReferences", "list:OwnerReference"),
                   14: ("finalizers", "list:str")},
    "OwnerReference": {1: ("kind", "str"), 3: ("name", "str"), 4: ("uid", "str"),
                       5: ("apiVersion", "str"), 6: ("controller", "bool"),
                       7: ("blockOwnerDeletion", "bool")},
    "Time": {1: ("seconds", "int"), 2: ("nanos", "int")},
    "Secret": {1: ("metadata", "ObjectMeta"), 2: ("data", "map:bytes"), 3: ("type", "str"),
               4: ("stringData", "map:str"), 5: ("immutable", "bool")},
    "ConfigMap": {1: ("metadata", "ObjectMeta"), 2: ("data", "map:str"),
                  3: ("binaryData", "map:bytes"), 4: ("immutable", "bool")},
    "DeleteOptions": {1: ("gracePeriodSeconds", "int"), 2: ("preconditions", "Preconditions"),
                      3: ("orphanDependents", "bool"), 4: ("propagationPolicy", "str"),
                      5: ("dryRun", "list:str")},
    "Preconditions": {1: ("uid", "str"), 2: ("resourceVersion", "str")},
}


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            out.append((number, value))
        elif wire == 2:
            size, i = _varint(buf, i)
            out.append((number, buf[i:i + size]))
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def _value(kind: str, raw: int | bytes) -> Any:
    if kind == "str":
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    if kind == "bytes":
        return base64.b64encode(raw).decode() if isinstance(raw, bytes) else ""
    if kind == "int":
        return raw if isinstance(raw, int) else 0
    if kind == "bool":
        return bool(raw)
    if kind == "time":
        t = decode("Time", raw) if isinstance(raw, bytes) else {}
        if not t.get("seconds"):
            return None
        return datetime.datetime.fromtimestamp(t["seconds"], datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
    return decode(kind, raw) if isinstance(raw, bytes) else {}


def decode(message: str, buf: bytes) -> dict:
    """A protobuf message as the JSON object it stands for (empty strings left out)."""
    spec = _MESSAGES[message]
    out: dict[str, Any] = {}
    for number, raw in _fields(buf):
        if number not in spec:
            continue
        name, kind = spec[number]
        if kind.startswith("map:"):
            entry = dict(_fields(raw)) if isinstance(raw, bytes) else {}
            key = _value("str", entry.get(1, b""))
            out.setdefault(name, {})[key] = _value(kind[4:], entry.get(2, b""))
        elif kind.startswith("list:"):
            out.setdefault(name, []).append(_value(kind[5:], raw))
        else:
            value = _value(kind, raw)
            if value not in ("", None):
                out[name] = value
    return out


def decode_body(body: bytes) -> dict:
    """The JSON object of a protobuf request body, or the API server's 415/400."""
    if not body.startswith(MAGIC):
        raise E.bad_request("the body of the request was in an unknown format: missing the "
                            "protobuf magic prefix")
    try:
        unknown = decode("Unknown", body[len(MAGIC):])
        type_meta = unknown.get("typeMeta") or {}
        kind = type_meta.get("kind", "")
        if kind not in ("Secret", "ConfigMap", "DeleteOptions"):
            raise E.unsupported_media_type(MEDIA_TYPE)
        obj = decode(kind, base64.b64decode(unknown.get("raw", "")))
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise E.bad_request(f"the body of the request was in an unknown format: {e}") from None
    return {"apiVersion": type_meta.get("apiVersion", "v1"), "kind": kind, **obj}
