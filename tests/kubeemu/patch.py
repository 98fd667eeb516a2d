"""PATCH semantics: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge.

Strategic merge patch is implemented for the cases built-in types use: lists of objects
merged by their patch merge key (containers/env/volumes by ``name``, conditions by ``type``,
ownerReferences by ``uid`` ...), primitive lists merged as sets (finalizers), ``$patch:
delete|replace`` directives and ``null`` deletes. Other lists are replaced, as in a merge patch.
"""

from __future__ import annotations

import copy
from typing import Any


class PatchError(Exception):
    """A patch that cannot be applied; the server answers 422 (or 400 for malformed input)."""

    def __init__(self, message: str, code: int = 422) -> None:
        super().__init__(message)
        self.code = code


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


# list field name -> merge key (from the Go struct tags patchMergeKey/patchStrategy=merge)
MERGE_KEYS: dict[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "volumes": "name", "env": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "imagePullSecrets": "name", "conditions": "type", "ownerReferences": "uid",
    "taints": "key", "addresses": "type", "hostAliases": "ip", "containerStatuses": "name",
    "initContainerStatuses": "name", "resourceClaims": "name", "ports": "containerPort",
    "topologySpreadConstraints": "topologyKey",
}
# primitive lists merged as sets
SET_LISTS = {"finalizers"}


def _smp_list(field: str, target: list, patch: list) -> list:
    key = MERGE_KEYS.get(field)
    if field == "ports" and not any(isinstance(x, dict) and "containerPort" in x
                                    for x in [*target, *patch]):
        key = "port"  # a Service's ports merge on port (a container's on containerPort)
    if field in SET_LISTS:
        out = list(target)
        for item in patch:
            if item not in out:
                out.append(item)
        return out
    if key is None or not all(isinstance(x, dict) for x in patch):
        return copy.deepcopy(patch)
    if any(isinstance(x, dict) and x.get("$patch") == "replace" for x in patch):
        return [copy.deepcopy(x) for x in patch if x.get("$patch") != "replace"]
    out = [copy.deepcopy(x) for x in target]
    for item in patch:
        directive = item.get("$patch")
        kval = item.get(key)
        idx = next((i for i, x in enumerate(out) if isinstance(x, dict) and x.get(key) == kval),
                   None)
        if directive == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            out.append(strategic_merge_patch({}, item))
        else:
            out[idx] = strategic_merge_patch(out[idx], item)
    return out


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        if k.startswith("$deleteFromPrimitiveList/"):
            continue
        if v is None:
            result.pop(k, None)
        elif isinstance(v, list) and isinstance(result.get(k), list):
            result[k] = _smp_list(k, result[k], v)
        elif isinstance(v, list):
            result[k] = [strategic_merge_patch({}, x) if isinstance(x, dict) else x
                         for x in v if not (isinstance(x, dict) and x.get("$patch") == "delete")]
        else:
            result[k] = strategic_merge_patch(result.get(k), v)
    for k, v in patch.items():
        if k.startswith("$deleteFromPrimitiveList/"):
            name = k.split("/", 1)[1]
            if isinstance(result.get(name), list):
                result[name] = [x for x in result[name] if x not in v]
        elif k == "$setElementOrder" or k.startswith("$setElementOrder/"):
            pass
    return result


# ----------------------------------------------------------------------------- JSON patch


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _parts(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f'invalid JSON pointer "{path}": must start with "/"')
    return [_unescape(p) for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    cur = doc
    for p in parts:
        if isinstance(cur, dict):
            if p not in cur:
                raise PatchError(f'doc is missing path: "{path}": missing value')
            cur = cur[p]
        elif isinstance(cur, list):
            try:
                cur = cur[int(p)]
            except (ValueError, IndexError):
                raise PatchError(f'doc is missing path: "{path}": missing value') from None
        else:
            raise PatchError(f'doc is missing path: "{path}": missing value')
    return cur


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _parts(path)
    if not parts:
        return copy.deepcopy(value)
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = copy.deepcopy(value)
    elif isinstance(parent, list):
        if last == "-":
            parent.append(copy.deepcopy(value))
        else:
            try:
                i = int(last)
            except ValueError:
                raise PatchError(f'invalid array index "{last}" in "{path}"') from None
            if i < 0 or i > len(parent):
                raise PatchError(f'add operation does not apply: doc is missing path: "{path}": '
                                 "missing value")
            parent.insert(i, copy.deepcopy(value))
    else:
        raise PatchError(f'doc is missing path: "{path}": missing value')
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    parts = _parts(path)
    if not parts:
        raise PatchError("cannot remove the whole document")
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    try:
        if isinstance(parent, dict):
            return doc, parent.pop(last)
        if isinstance(parent, list):
            return doc, parent.pop(int(last))
    except (KeyError, ValueError, IndexError):
        pass
    raise PatchError(f'remove operation does not apply: doc is missing path: "{path}": '
                     "missing value")


def json_patch(target: Any, ops: Any) -> Any:
    if not isinstance(ops, list):
        raise PatchError("json: cannot unmarshal object into Go value of type jsonpatch.Patch",
                         code=400)
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op:
            raise PatchError("Unexpected kind: missing op", code=400)
        kind, path = op["op"], op.get("path", "")
        if kind == "add":
            doc = _add(doc, path, op.get("value"))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            _walk(doc, _parts(path), path)
            if _parts(path):
                doc, _ = _remove(doc, path)
            doc = _add(doc, path, op.get("value"))
        elif kind in ("move", "copy"):
            src = op.get("from", "")
            value = copy.deepcopy(_walk(doc, _parts(src), src))
            if kind == "move":
                doc, _ = _remove(doc, src)
            doc = _add(doc, path, value)
        elif kind == "test":
            if _walk(doc, _parts(path), path) != op.get("value"):
                raise PatchError(f'testing value {path} failed: test failed')
        else:
            raise PatchError(f"Unexpected kind: {kind}", code=400)
    return doc
