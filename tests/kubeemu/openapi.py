"""The OpenAPI v3 documents kubectl and helm read: the index and one document per group-version.

client-go reads ``/openapi/v3`` (group-version -> document URL) and, before it sends an object,
looks in that group-version's document for the PATCH operation of the object's kind
(``x-kubernetes-group-version-kind``) and its ``fieldValidation`` query parameter: when the
server declares it, client-side schema validation is skipped and the server validates
(``fieldValidation=Strict``, ``schema.py``). The documents list every path and verb served,
with the query parameters of each, and no schemas (the clients here do not need them).
"""

from __future__ import annotations

import hashlib
import json
from functools import cache

from . import resources as R

_WRITE_PARAMS = ("dryRun", "fieldManager", "fieldValidation")


def _gv_key(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _params(names: tuple[str, ...]) -> list[dict]:
    return [{"name": n, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
            for n in names]


def _op(rt: R.ResourceType, action: str, params: tuple[str, ...]) -> dict:
    gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
    return {"operationId": f"{action}{rt.kind}", "tags": [_gv_key(rt.group, rt.version)],
            "parameters": _params(params), "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": gvk,
            "responses": {"200": {"description": "OK"}, "401": {"description": "Unauthorized"}}}


def _paths(rt: R.ResourceType) -> dict[str, dict]:
    prefix = "/" + _gv_key(rt.group, rt.version)
    base = f"{prefix}/namespaces/{{namespace}}/{rt.plural}" if rt.namespaced \
        else f"{prefix}/{rt.plural}"
    out = {
        base: {"get": _op(rt, "list", ("labelSelector", "fieldSelector", "limit", "continue",
                                       "resourceVersion", "watch")),
               "post": _op(rt, "post", _WRITE_PARAMS),
               "delete": _op(rt, "deletecollection", ("labelSelector", "dryRun"))},
        f"{base}/{{name}}": {"get": _op(rt, "get", ()),
                             "put": _op(rt, "put", _WRITE_PARAMS),
                             "patch": _op(rt, "patch", (*_WRITE_PARAMS, "force")),
                             "delete": _op(rt, "delete", ("dryRun", "gracePeriodSeconds",
                                                          "propagationPolicy"))},
    }
    if rt.namespaced:
        out[f"{prefix}/{rt.plural}"] = {"get": _op(rt, "list", ("labelSelector",
                                                               "fieldSelector"))}
    if "status" in rt.subresources:
        out[f"{base}/{{name}}/status"] = {"get": _op(rt, "get", ()),
                                          "put": _op(rt, "put", _WRITE_PARAMS),
                                          "patch": _op(rt, "patch", _WRITE_PARAMS)}
    return out


@cache
def document(group: str, version: str) -> str | None:
    """The OpenAPI v3 document of one group-version (JSON text), or None when not served."""
    types = [r for r in R.RESOURCES if r.group == group and r.version == version]
    if not types:
        return None
    paths: dict[str, dict] = {}
    for rt in types:
        paths.update(_paths(rt))
    return json.dumps({"openapi": "3.0.0",
                       "info": {"title": "Kubernetes", "version": "v1.31.0-kubeemu"},
                       "paths": paths, "components": {"schemas": {}}})


@cache
def index() -> str:
    """``/openapi/v3``: each group-version and the URL of its document."""
    out = {}
    for group, version in sorted({(r.group, r.version) for r in R.RESOURCES}):
        doc = document(group, version) or ""
        digest = hashlib.sha512(doc.encode()).hexdigest()[:64].upper()
        key = _gv_key(group, version)
        out[key] = {"serverRelativeURL": f"/openapi/v3/{key}?hash={digest}"}
    return json.dumps({"paths": out})
