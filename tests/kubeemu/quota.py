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
        if not _applies_to_pods(res) or res not in new:
            continue
        used = sum((u.get(res, Fraction(0)) for u in existing), Fraction(0))
        if used + new[res] > hard[res]:
            exceeded.append((res, new[res], used, hard[res]))
    if not exceeded:
        return None

    def fmt(i: int) -> str:
        return ",".join(f"{e[0]}={quantity.fmt(e[i])}" for e in exceeded)

    return f"exceeded quota: {name}, requested: {fmt(1)}, used: {fmt(2)}, limited: {fmt(3)}"


def quota_status(quota: dict, pods: list[dict]) -> dict:
    hard = (quota.get("spec") or {}).get("hard") or {}
    usages = [pod_usage(p) for p in pods]
    used = {}
    for res in hard:
        if _applies_to_pods(res):
            used[res] = quantity.fmt(sum((u.get(res, Fraction(0)) for u in usages), Fraction(0)))
        else:
            used[res] = "0"
    return {"hard": dict(hard), "used": used}
