"""The controllers of kube-controller-manager that tests depend on: garbage collector,
namespace lifecycle, service accounts and resource-quota status."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .errors import ApiError
from .quota import counted_type, quota_status
from .resources import BY_KEY, STORAGE_TYPES, ResourceType
from .store import Event

if TYPE_CHECKING:
    from .emulator import KubeEmulator

log = logging.getLogger("kubeemu.controllers")


class Controllers:
    def __init__(self, emu: KubeEmulator) -> None:
        self.emu = emu
        self.store = emu.store
        self.store.subscribe(self._on_event)

    def _on_event(self, srt: ResourceType, ev: Event) -> None:
        # Runs under the store lock in the writer's thread: hop onto the emulator loop.
        if srt.kind == "Namespace" and ev.type == "ADDED":
            self._ensure_default_service_account(ev.obj["metadata"]["name"])
        self.emu.call_soon(self._handle, srt, ev)

    def _ensure_default_service_account(self, namespace: str) -> None:
        # The service-account controller; done synchronously so that a pod created right
        # after its namespace is not refused (clients such as KubeSpawner do not retry).
        sa = BY_KEY[("", "serviceaccounts")]
        try:
            self.store.create(sa, namespace, {"metadata": {"name": "default"}})
        except ApiError:
            pass
        # the root-CA publisher: the cluster CA in every namespace, for in-cluster clients
        try:
            self.store.create(BY_KEY[("", "configmaps")], namespace, {
                "metadata": {"name": "kube-root-ca.crt"},
                "data": {"ca.crt": self.emu.ca_path.read_text()}})
        except (ApiError, OSError):
            pass

    def _handle(self, srt: ResourceType, ev: Event) -> None:
        try:
            self._gc(srt, ev)
            self._namespaces(srt, ev)
            self._quotas(srt, ev)
        except Exception:  # a controller must never take the loop down
            log.exception("controller failed on %s %s", ev.type, srt.plural)

    # ---------------------------------------------------------------- garbage collector

    def _exists(self, uid: str) -> bool:
        return self.store.by_uid(uid) is not None

    def _delete(self, rt: ResourceType, obj: dict, propagation: str | None = None) -> None:
        meta = obj["metadata"]
        try:
            self.store.delete(rt, meta.get("namespace"), meta["name"],
                              propagation_policy=propagation,
                              preconditions={"uid": meta["uid"]})
        except ApiError:
            pass

    def _gc(self, srt: ResourceType, ev: Event) -> None:
        meta = ev.obj["metadata"]
        uid = meta.get("uid", "")
        if ev.type == "DELETED":
            # Owner gone: collect dependents whose owners are all gone.
            for rt, dep in self.store.dependents(uid):
                refs = dep["metadata"].get("ownerReferences") or []
                if not any(self._exists(r.get("uid", "")) for r in refs):
                    self._delete(rt, dep)
        elif ev.type == "ADDED" and meta.get("ownerReferences"):
            refs = meta["ownerReferences"]
            if not any(self._exists(r.get("uid", "")) for r in refs):
                self._delete(srt, ev.obj)
        if meta.get("deletionTimestamp") and "foregroundDeletion" in (meta.get("finalizers") or []):
            deps = self.store.dependents(uid)
            if ev.type != "DELETED" and not deps:
                self._drop_finalizer(srt, ev.obj, "foregroundDeletion")
            for rt, dep in deps:
                if not dep["metadata"].get("deletionTimestamp"):
                    self._delete(rt, dep, "Foreground")
        # A dependent went (or is going) away: foreground-deleting owners may now finish.
        if ev.type == "DELETED" or meta.get("deletionTimestamp"):
            for ref in meta.get("ownerReferences") or []:
                owner = self.store.by_uid(ref.get("uid", ""))
                if owner is None:
                    continue
                om = owner["metadata"]
                if ("foregroundDeletion" in (om.get("finalizers") or [])
                        and not self.store.dependents(om["uid"])):
                    owner_rt = self._type_of(owner)
                    if owner_rt is not None:
                        self._drop_finalizer(owner_rt, owner, "foregroundDeletion")

    def _type_of(self, obj: dict) -> ResourceType | None:
        for rt in STORAGE_TYPES:
            if rt.kind == obj.get("kind") and rt.api_version == obj.get("apiVersion"):
                return rt
        return None

    def _drop_finalizer(self, rt: ResourceType, obj: dict, name: str) -> None:
        def drop(o: dict) -> None:
            fins = [f for f in o["metadata"].get("finalizers") or [] if f != name]
            if fins:
                o["metadata"]["finalizers"] = fins
            else:
                o["metadata"].pop("finalizers", None)

        meta = obj["metadata"]
        self.store.mutate(rt, meta.get("namespace"), meta["name"], drop, uid=meta["uid"])

    # ---------------------------------------------------------------- namespaces

    def _namespaces(self, srt: ResourceType, ev: Event) -> None:
        if srt.kind == "Namespace" and ev.type == "MODIFIED" and ev.obj["metadata"].get(
                "deletionTimestamp"):
            self._finalize_namespace(ev.obj["metadata"]["name"])
        elif srt.namespaced and ev.type == "DELETED":
            ns = self.store.namespace_exists(ev.obj["metadata"].get("namespace", ""))
            if ns is not None and ns["metadata"].get("deletionTimestamp"):
                self._finalize_namespace(ns["metadata"]["name"])

    def _finalize_namespace(self, name: str) -> None:
        remaining = 0
        for rt in STORAGE_TYPES:
            if not rt.namespaced:
                continue
            items, _, _, _ = self.store.list(rt, name)
            for item in items:
                remaining += 1
                if not item["metadata"].get("deletionTimestamp"):
                    try:
                        self.store.delete(rt, name, item["metadata"]["name"])
                    except ApiError:
                        pass
        if remaining and any(self.store.list(rt, name)[0] for rt in STORAGE_TYPES
                             if rt.namespaced):
            return  # the last DELETED event in the namespace brings us back here

        def finalize(o: dict) -> None:
            o.setdefault("spec", {})["finalizers"] = []
            o["metadata"]["deletionGracePeriodSeconds"] = 0
            o["metadata"].pop("finalizers", None)

        self.store.mutate(BY_KEY[("", "namespaces")], None, name, finalize)

    # ---------------------------------------------------------------- resource quotas

    def _quotas(self, srt: ResourceType, ev: Event) -> None:
        if srt.kind == "ResourceQuota" and ev.type == "DELETED":
            return
        if srt.kind not in ("Pod", "ResourceQuota") and (
                not srt.namespaced or ev.type == "MODIFIED"):
            return
        ns = ev.obj["metadata"].get("namespace")
        self.refresh_quotas(ns)

    def refresh_quotas(self, namespace: str | None) -> None:
        quotas_rt = BY_KEY[("", "resourcequotas")]
        with self.store.lock:
            quotas = [q for q in self.store.raw_objects("resourcequotas")
                      if q["metadata"].get("namespace") == namespace]
            pods = [p for p in self.store.raw_objects("pods")
                    if p["metadata"].get("namespace") == namespace]
            for q in quotas:
                counts = {}
                for res in (q.get("spec") or {}).get("hard") or {}:
                    counted = counted_type(res)
                    if counted is not None and counted in BY_KEY:
                        counts[res] = sum(1 for o in self.store.raw_objects(counted[1], counted[0])
                                          if o["metadata"].get("namespace") == namespace)
                status = quota_status(q, pods, counts)

                def set_status(o: dict, status: dict = status) -> None:
                    o["status"] = status

                self.store.mutate(quotas_rt, namespace, q["metadata"]["name"], set_status)
