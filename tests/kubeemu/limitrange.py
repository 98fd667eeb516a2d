"""LimitRange: the object's defaulting and the LimitRanger admission plugin for pods.

As kube-apiserver (plugin/pkg/admission/limitranger): a container's missing limits come from
``default`` and its missing requests from ``defaultRequest`` of each ``Container`` item (the pod
is annotated ``kubernetes.io/limit-ranger`` with what was set), then ``min``/``max`` and
``maxLimitRequestRatio`` are checked per container and, for ``Pod`` items, over the pod's sum.
"""

from __future__ import annotations

from fractions import Fraction

from . import quantity

ANNOTATION = "kubernetes.io/limit-ranger"


def default_limit_range(obj: dict) -> None:
    """API defaulting of a LimitRange: for Container items, ``default`` falls back to ``max``
    and ``defaultRequest`` to ``default`` (then ``min``)."""
    for item in ((obj.get("spec") or {}).get("limits") or []):
        if not isinstance(item, dict) or item.get("type") != "Container":
            continue
        default = item.setdefault("default", {})
        for k, v in (item.get("max") or {}).items():
            default.setdefault(k, v)
        request = item.setdefault("defaultRequest", {})
        for k, v in default.items():
            request.setdefault(k, v)
        for k, v in (item.get("min") or {}).items():
            request.setdefault(k, v)
        if not default:
            item.pop("default")
        if not request:
            item.pop("defaultRequest")


def _containers(spec: dict) -> list[tuple[str, dict]]:
    return ([("init container", c) for c in spec.get("initContainers") or []]
            + [("container", c) for c in spec.get("containers") or []])


def _apply_defaults(pod: dict, item: dict) -> None:
    notes = []
    for what, c in _containers(pod.get("spec") or {}):
        res = c.setdefault("resources", {})
        set_req = [k for k, v in (item.get("defaultRequest") or {}).items()
                   if k not in (res.get("requests") or {})]
        set_lim = [k for k, v in (item.get("default") or {}).items()
                   if k not in (res.get("limits") or {})]
        for k in set_req:
            res.setdefault("requests", {})[k] = item["defaultRequest"][k]
        for k in set_lim:
            res.setdefault("limits", {})[k] = item["default"][k]
        if set_req:
            notes.append(f"{', '.join(set_req)} request for {what} {c.get('name')}")
        if set_lim:
            notes.append(f"{', '.join(set_lim)} limit for {what} {c.get('name')}")
    if notes:
        pod["metadata"].setdefault("annotations", {})[ANNOTATION] = (
            "LimitRanger plugin set: " + "; ".join(notes))


def _check(kind: str, requests: dict[str, str], limits: dict[str, str], item: dict) -> list[str]:
    errs = []
    for k, v in (item.get("min") or {}).items():
        low = quantity.parse(v)
        if k not in requests:
            errs.append(f"minimum {k} usage per {kind} is {v}.  No request is specified")
        elif quantity.parse(requests[k]) < low:
            errs.append(f"minimum {k} usage per {kind} is {v}, but request is {requests[k]}")
    for k, v in (item.get("max") or {}).items():
        high = quantity.parse(v)
        if k not in limits:
            errs.append(f"maximum {k} usage per {kind} is {v}.  No limit is specified")
        elif quantity.parse(limits[k]) > high:
            errs.append(f"maximum {k} usage per {kind} is {v}, but limit is {limits[k]}")
    for k, v in (item.get("maxLimitRequestRatio") or {}).items():
        if k in limits and k in requests and quantity.parse(requests[k]) > 0:
            ratio = quantity.parse(limits[k]) / quantity.parse(requests[k])
            if ratio > quantity.parse(v):
                errs.append(f"{k} max limit to request ratio per {kind} is {v}, but provided "
                            f"ratio is {float(ratio):f}")
    return errs


def _sum(containers: list[dict], section: str) -> dict[str, str]:
    total: dict[str, Fraction] = {}
    for c in containers:
        for k, v in ((c.get("resources") or {}).get(section) or {}).items():
            total[k] = total.get(k, Fraction(0)) + quantity.parse(v)
    return {k: quantity.fmt(v) for k, v in total.items()}


def admit_pod(pod: dict, limit_ranges: list[dict]) -> str | None:
    """Default ``pod``'s resources from the namespace's LimitRanges (in place) and return the
    refusal message when it breaks one, else None."""
    errs: list[str] = []
    for lr in sorted(limit_ranges, key=lambda o: o["metadata"]["name"]):
        for item in ((lr.get("spec") or {}).get("limits") or []):
            if item.get("type") == "Container":
                _apply_defaults(pod, item)
    spec = pod.get("spec") or {}
    for lr in sorted(limit_ranges, key=lambda o: o["metadata"]["name"]):
        for item in ((lr.get("spec") or {}).get("limits") or []):
            if item.get("type") == "Container":
                for _, c in _containers(spec):
                    res = c.get("resources") or {}
                    errs += _check("Container", res.get("requests") or {},
                                   res.get("limits") or {}, item)
            elif item.get("type") == "Pod":
                main = spec.get("containers") or []
                errs += _check("Pod", _sum(main, "requests"), _sum(main, "limits"), item)
    if not errs:
        return None
    return errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"
