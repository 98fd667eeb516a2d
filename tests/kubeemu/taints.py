"""The taint-eviction controller: pods on a node with a NoExecute taint they do not tolerate go.

As kube-controller-manager's: a pod that does not tolerate one of its node's NoExecute taints
is deleted at once; one whose tolerations of them all carry ``tolerationSeconds`` is deleted
when the shortest runs out, unless the taint is gone by then. Each eviction gets the
``DisruptionTarget`` condition (``DeletionByTaintManager``) and a ``TaintManagerEviction``
event ("Marking for deletion Pod <ns>/<name>").
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .errors import ApiError
from .resources import BY_KEY, ResourceType
from .scheduler import set_condition, tolerates
from .store import Event

if TYPE_CHECKING:
    from .emulator import KubeEmulator

log = logging.getLogger("kubeemu.taints")
PODS = BY_KEY[("", "pods")]


def eviction_delay(pod: dict, taints: list[dict]) -> float | None:
    """Seconds until the pod must go (0: now), None when it tolerates every NoExecute taint
    for ever."""
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    delay: float | None = None
    for taint in taints:
        if taint.get("effect") != "NoExecute":
            continue
        matching = [t for t in tolerations if tolerates([t], taint)]
        if not matching:
            return 0.0
        limited = [t["tolerationSeconds"] for t in matching
                   if t.get("tolerationSeconds") is not None]
        if len(limited) == len(matching):
            seconds = max(0.0, float(min(limited)))
            delay = seconds if delay is None else min(delay, seconds)
    return delay


class TaintEviction:
    def __init__(self, emu: KubeEmulator) -> None:
        self.emu = emu
        self.store = emu.store
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.store.subscribe(self._on_event)

    def _on_event(self, srt: ResourceType, ev: Event) -> None:
        if srt.kind == "Node" and ev.type in ("ADDED", "MODIFIED"):
            old = ((ev.old or {}).get("spec") or {}).get("taints")
            if ev.type == "ADDED" or old != (ev.obj.get("spec") or {}).get("taints"):
                self.emu.call_soon(self.check_node, ev.obj["metadata"]["name"])
        elif srt.kind == "Pod" and ev.type == "MODIFIED":
            node = (ev.obj.get("spec") or {}).get("nodeName")
            if node and not ((ev.old or {}).get("spec") or {}).get("nodeName"):
                self.emu.call_soon(self.check_node, node)
        elif srt.kind == "Pod" and ev.type == "DELETED":
            timer = self._timers.pop(ev.obj["metadata"].get("uid", ""), None)
            if timer is not None:
                timer.cancel()

    def check_node(self, node_name: str) -> None:
        """Evict or schedule the eviction of the node's pods (on the emulator's loop)."""
        with self.store.lock:
            node = next((n for n in self.store.raw_objects("nodes")
                         if n["metadata"]["name"] == node_name), None)
            taints = ((node or {}).get("spec") or {}).get("taints") or []
            pods = [p for p in self.store.raw_objects("pods")
                    if (p.get("spec") or {}).get("nodeName") == node_name
                    and not p["metadata"].get("deletionTimestamp")]
        for pod in pods:
            uid = pod["metadata"]["uid"]
            delay = eviction_delay(pod, taints)
            timer = self._timers.pop(uid, None)
            if timer is not None:
                timer.cancel()
            if delay == 0:
                self._evict(pod)
            elif delay is not None and self.emu.loop is not None:
                self._timers[uid] = self.emu.loop.call_later(delay, self._expired, node_name,
                                                             pod)

    def _expired(self, node_name: str, pod: dict) -> None:
        self._timers.pop(pod["metadata"]["uid"], None)
        with self.store.lock:
            node = next((n for n in self.store.raw_objects("nodes")
                         if n["metadata"]["name"] == node_name), None)
            taints = ((node or {}).get("spec") or {}).get("taints") or []
        if eviction_delay(pod, taints) is not None:
            self._evict(pod)

    def _evict(self, pod: dict) -> None:
        meta = pod["metadata"]

        def mark(p: dict) -> None:
            set_condition(p, "DisruptionTarget", "True", "DeletionByTaintManager",
                          "Taint manager: deleting due to NoExecute taint")

        if self.store.mutate(PODS, meta["namespace"], meta["name"], mark,
                             uid=meta["uid"]) is None:
            return
        self.emu.record_event(pod, "TaintManagerEviction",
                              f"Marking for deletion Pod {meta['namespace']}/{meta['name']}",
                              component="taint-eviction-controller")
        try:
            self.store.delete(PODS, meta["namespace"], meta["name"],
                              preconditions={"uid": meta["uid"]})
        except ApiError as e:
            log.info("pod %s/%s: eviction: %s", meta["namespace"], meta["name"], e.message)
