"""ResourceQuota accounting for pods (the quota admission plugin and the quota controller)."""

from __future__ import annotations

from fractions import Fraction

from . import quantity

_COMPUTE = ("cpu", "memory", "ephemeral-storage")


def pod_requests(pod: dict) -> dict[str, Fraction]:
    """Effective requests of a pod: sum over containers, max with each init container."""
    spec = pod.get("spec") or {}
    total: dict[str, Fraction] = {}
    for c in spec.get("containers") or []:
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            total[k] = total.get(k, Fraction(0)) + quantity.parse(v)
    for c in spec.get("initContainers") or []:
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            total[k] = max(total.get(k, Fraction(0)), quantity.parse(v))
    return total


def _pod_limits(pod: dict) -> dict[str, Fraction]:
    total: dict[str, Fraction] = {}
    for c in (pod.get("spec") or {}).get("containers") or []:
        for k, v in ((c.get("resources") or {}).get("limits") or {}).items():
            total[k] = total.get(k, Fraction(0)) + quantity.parse(v)
    return total


def is_terminal(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def pod_usage(pod: dict) -> dict[str, Fraction]:
    """What a pod counts against a quota, keyed by quota resource names."""
    if is_terminal(pod):
        return {}
    usage: dict[str, Fraction] = {"pods": Fraction(1), "count/pods": Fraction(1)}
    for k, v in pod_requests(pod).items():
        usage[f"requests.{k}"] = v
        if k in _COMPUTE:
            usage[k] = v
    for k, v in _pod_limits(pod).items():
        usage[f"limits.{k}"] = v
    return usage


def _applies_to_pods(resource: str) -> bool:
    return (resource in ("pods", "count/pods") or resource in _COMPUTE
            or resource.startswith("requests.") or resource.startswith("limits."))


def quota_violation(quota: dict, new: dict[str, Fraction],
                    existing: list[dict[str, Fraction]]) -> str | None:
    """The API server's refusal message if `new` does not fit in `quota`, else None."""
    name = quota["metadata"]["name"]
    hard = {k: quantity.parse(v) for k, v in ((quota.get("spec") or {}).get("hard")
                                              or {}).items()}
    missing = []
    for res in sorted(hard):
        base = res.split(".", 1)[1] if "." in res and res.split(".", 1)[0] in (
            "requests", "limits") else res
        if base in ("cpu", "memory") and res not in new:
            missing.append(res)
    if missing:
        return f"failed quota: {name}: must specify {','.join(missing)}"
    exceeded = []
    for res in sorted(hard):
        if res not in new or (not _applies_to_pods(res) and counted_type(res) is None):
            continue
        used = sum((u.get(res, Fraction(0)) for u in existing), Fraction(0))
        if used + new[res] > hard[res]:
            exceeded.append((res, new[res], used, hard[res]))
    if not exceeded:
        return None

    def fmt(i: int) -> str:
        return ",".join(f"{e[0]}={quantity.fmt(e[i])}" for e in exceeded)

    return f"exceeded quota: {name}, requested: {fmt(1)}, used: {fmt(2)}, limited: {fmt(3)}"


#: core types a quota also counts by their plain plural ("secrets": "10")
_LEGACY_COUNTS = frozenset({"configmaps", "secrets", "services", "persistentvolumeclaims",
                            "resourcequotas", "replicationcontrollers"})


def count_names(plural: str, group: str) -> tuple[str, ...]:
    """The quota resource names that count objects of a type: ``count/<plural>[.<group>]``."""
    names = [f"count/{plural}.{group}" if group else f"count/{plural}"]
    if not group and plural in _LEGACY_COUNTS:
        names.append(plural)
    return tuple(names)


def counted_type(resource: str) -> tuple[str, str] | None:
    """(group, plural) of the objects a quota resource name counts; None when it is not an
    object count (or counts pods, which pod_usage covers)."""
    if resource in _LEGACY_COUNTS:
        return "", resource
    if not resource.startswith("count/") or resource == "count/pods":
        return None
    plural, _, group = resource.removeprefix("count/").partition(".")
    return group, plural


def quota_status(quota: dict, pods: list[dict], counts: dict[str, int] | None = None) -> dict:
    """The status the quota controller writes: ``counts`` holds the number of objects for
    each object-count resource of the quota."""
    hard = (quota.get("spec") or {}).get("hard") or {}
    usages = [pod_usage(p) for p in pods]
    used = {}
    for res in hard:
        if _applies_to_pods(res):
            used[res] = quantity.fmt(sum((u.get(res, Fraction(0)) for u in usages), Fraction(0)))
        else:
            used[res] = str((counts or {}).get(res, 0))
    return {"hard": dict(hard), "used": used}
