"""The pod a hub process runs in, as its claims entries name it.

A hub process that runs in a pod writes that pod (namespace, name, uid) in its claims entries
beside its instance id. Another process of the same hub id that finds those entries renewed
within the TTL reads that pod: when it is provably gone, the entries' writer is too, and the
reader takes them over at once (a hub Deployment's restart: strategy Recreate deletes the old
pod first, and JupyterHub's shutdown stops no pool, so the old entries name a live-looking
instance). Only what proves the process gone counts: the pod is not there (404), the name is
another pod's (another uid), or the pod has ended (phase Succeeded or Failed). Anything else
(running, terminating, unreadable) leaves the writer live until the TTL says otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client.rest import ApiException

from .rest import call_json

_FIELDS = ("namespace", "name", "uid")


def entry_pods(obj: Mapping[str, Any] | None, prefix: str) -> dict[str, dict[str, str]]:
    """Per hub: the pod of the hub process that last wrote its entry in a claims object (keys
    ``prefix`` + hub id; entries written outside a pod, or handed over, name none)."""
    found = {}
    for key, raw in ((obj or {}).get("data") or {}).items():
        try:
            value = json.loads(raw).get("pod") if key.startswith(prefix) else None
        except (ValueError, AttributeError):
            continue
        if isinstance(value, dict) and all(isinstance(value.get(k), str) and value[k] for k in _FIELDS):
            found[key[len(prefix) :]] = {k: value[k] for k in _FIELDS}
    return found


async def own_pod(api: Any, name: str, namespace: str, timeout: float) -> dict[str, str]:
    """Called by the claims ledger at the pool's start: this process's pod (namespace, name,
    uid), read from the API server. Raises ApiException or TimeoutError when it cannot be read;
    then nothing is written (a successor waits the TTL rather than take over from a live
    process on a wrong name)."""
    pod = await call_json(api.read_namespaced_pod, name, namespace, timeout=timeout)
    uid = (pod.get("metadata") or {}).get("uid")
    if not uid:
        raise ApiException(status=500, reason=f"pod {namespace}/{name} has no uid")
    return {"namespace": namespace, "name": name, "uid": uid}


async def why_gone(api: Any, pod: Mapping[str, str], timeout: float) -> str:
    """Called by the claims ledger on another live instance of its hub id: why that instance's
    ``pod`` is provably gone ("is gone", "was replaced by another pod of that name", "has ended
    (phase Failed)"), or "" when it may still run. Errors other than 404 (403, timeouts) raise."""
    try:
        found = await call_json(api.read_namespaced_pod, pod["name"], pod["namespace"], timeout=timeout)
    except ApiException as e:
        if e.status == 404:
            return "is gone"
        raise
    phase = (found.get("status") or {}).get("phase")
    if (found.get("metadata") or {}).get("uid") != pod["uid"]:
        return "was replaced by another pod of that name"
    if phase in ("Succeeded", "Failed"):
        return f"has ended (phase {phase})"
    return ""


__all__ = ["entry_pods", "own_pod", "why_gone"]
