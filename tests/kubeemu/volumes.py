"""The PersistentVolume controller (binder and provisioner) and DefaultStorageClass admission.

As kube-controller-manager's persistentvolume-binder: a Pending claim binds to the volume its
``spec.volumeName`` names, else to the smallest Available volume of its storage class (``""``:
no class) that fits its size and access modes and is not reserved (``claimRef``) for another
claim, else a volume is provisioned when its class exists (``ProvisioningFailed`` event when
it does not: the claim stays Pending, and so do the pods that use it). Deleting a claim
deletes a provisioned volume (reclaim policy ``Delete``) or releases a ``Retain`` one.
The emulator has one StorageClass at start, ``standard``, marked the default (as kind and
minikube clusters have), with ``Immediate`` binding.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import quantity
from .errors import ApiError
from .resources import BY_KEY, ResourceType
from .store import Event, rfc3339

if TYPE_CHECKING:
    from .emulator import KubeEmulator

log = logging.getLogger("kubeemu.volumes")
PVCS = BY_KEY[("", "persistentvolumeclaims")]
PVS = BY_KEY[("", "persistentvolumes")]
CLASSES = BY_KEY[("storage.k8s.io", "storageclasses")]
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
PROVISIONER = "kubeemu.io/local"
STANDARD_CLASS = {
    "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
    "metadata": {"name": "standard", "annotations": {DEFAULT_CLASS_ANNOTATION: "true"}},
    "provisioner": PROVISIONER, "reclaimPolicy": "Delete", "volumeBindingMode": "Immediate",
}


def default_storage_class(claim: dict, classes: list[dict]) -> None:
    """DefaultStorageClass admission: a claim that names no class (the field absent, not "")
    gets the default one, the newest when several are marked."""
    spec = claim.get("spec")
    if not isinstance(spec, dict) or spec.get("storageClassName") is not None:
        return
    marked = [c for c in classes if ((c["metadata"].get("annotations") or {})
                                     .get(DEFAULT_CLASS_ANNOTATION) == "true")]
    if marked:
        newest = max(marked, key=lambda c: (c["metadata"].get("creationTimestamp") or "",
                                            c["metadata"]["name"]))
        spec["storageClassName"] = newest["metadata"]["name"]


def is_bound(claim: dict) -> bool:
    return (claim.get("status") or {}).get("phase") == "Bound"


def _size(obj: dict, path: tuple[str, ...]) -> int:
    cur: object = obj
    for key in path:
        cur = (cur or {}).get(key) if isinstance(cur, dict) else None
    try:
        return int(quantity.parse(cur)) if cur is not None else 0
    except quantity.QuantityError:
        return 0


class VolumeController:
    """Binds and provisions volumes for claims; hooked on the store's events."""

    def __init__(self, emu: KubeEmulator) -> None:
        self.emu = emu
        self.store = emu.store
        self._reported: dict[str, str] = {}
        self.store.subscribe(self._on_event)

    def _on_event(self, srt: ResourceType, ev: Event) -> None:
        if srt.kind == "PersistentVolumeClaim" and ev.type == "DELETED":
            self.emu.call_soon(self._release, ev.obj)
        elif srt.kind in ("PersistentVolumeClaim", "PersistentVolume", "StorageClass"):
            self.emu.call_soon(self.sync)

    def sync(self) -> None:
        with self.store.lock:
            pending = [c for c in self.store.raw_objects("persistentvolumeclaims")
                       if not is_bound(c) and not c["metadata"].get("deletionTimestamp")]
        for claim in pending:
            try:
                self._sync_claim(claim)
            except ApiError as e:
                log.info("claim %s/%s: %s", claim["metadata"]["namespace"],
                         claim["metadata"]["name"], e.message)

    def _sync_claim(self, claim: dict) -> None:
        spec = claim.get("spec") or {}
        with self.store.lock:
            volume = self._find_volume(claim)
            if volume is None and not spec.get("volumeName") and spec.get("storageClassName"):
                volume = self._provision(claim)
            if volume is not None:
                self._bind(claim, volume)

    def _find_volume(self, claim: dict) -> dict | None:
        spec = claim.get("spec") or {}
        volumes = self.store.raw_objects("persistentvolumes")
        if spec.get("volumeName"):
            pv = next((v for v in volumes if v["metadata"]["name"] == spec["volumeName"]), None)
            return pv if pv is not None and self._reserved_for(pv, claim) else None
        wanted = _size(claim, ("spec", "resources", "requests", "storage"))
        modes = set(spec.get("accessModes") or [])
        fitting = []
        for pv in volumes:
            vspec = pv.get("spec") or {}
            if not self._reserved_for(pv, claim) or (
                    not vspec.get("claimRef")
                    and (pv.get("status") or {}).get("phase", "Available") != "Available"):
                continue
            if (vspec.get("storageClassName") or "") != (spec.get("storageClassName") or ""):
                continue
            if not modes <= set(vspec.get("accessModes") or []):
                continue
            size = _size(pv, ("spec", "capacity", "storage"))
            if size >= wanted:
                fitting.append((size, pv["metadata"]["name"], pv))
        return min(fitting)[2] if fitting else None

    @staticmethod
    def _reserved_for(pv: dict, claim: dict) -> bool:
        """Whether the volume may bind this claim: no claimRef, or one naming it (and, once
        bound, its uid: a Released volume does not bind the next claim of the same name)."""
        ref = (pv.get("spec") or {}).get("claimRef")
        meta = claim["metadata"]
        if not ref:
            return True
        if (ref.get("namespace"), ref.get("name")) != (meta["namespace"], meta["name"]):
            return False
        return not ref.get("uid") or ref["uid"] == meta["uid"]

    def _provision(self, claim: dict) -> dict | None:
        meta, spec = claim["metadata"], claim.get("spec") or {}
        cls_name = spec["storageClassName"]
        cls = next((c for c in self.store.raw_objects("storageclasses", "storage.k8s.io")
                    if c["metadata"]["name"] == cls_name), None)
        if cls is None:
            message = f'storageclass.storage.k8s.io "{cls_name}" not found'
            if self._reported.get(meta["uid"]) != message:
                self._reported[meta["uid"]] = message
                self.emu.record_event(claim, "ProvisioningFailed", message, type="Warning",
                                      component="persistentvolume-controller")
            return None
        pv = {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"pvc-{meta['uid']}",
                         "annotations": {"pv.kubernetes.io/provisioned-by": cls["provisioner"]}},
            "spec": {"capacity": {"storage": spec["resources"]["requests"]["storage"]},
                     "accessModes": list(spec.get("accessModes") or []),
                     "persistentVolumeReclaimPolicy": cls.get("reclaimPolicy") or "Delete",
                     "storageClassName": cls_name, "volumeMode": spec.get("volumeMode"),
                     "claimRef": {"kind": "PersistentVolumeClaim", "apiVersion": "v1",
                                  "namespace": meta["namespace"], "name": meta["name"],
                                  "uid": meta["uid"]},
                     "csi": {"driver": cls["provisioner"], "volumeHandle": meta["uid"]}},
        }
        created = self.store.create(PVS, None, pv)
        self.emu.record_event(claim, "ProvisioningSucceeded",
                              f"Successfully provisioned volume {pv['metadata']['name']}",
                              component="persistentvolume-controller")
        return created

    def _bind(self, claim: dict, volume: dict) -> None:
        meta = claim["metadata"]
        name = volume["metadata"]["name"]

        def bind_volume(v: dict) -> None:
            v["spec"]["claimRef"] = {"kind": "PersistentVolumeClaim", "apiVersion": "v1",
                                     "namespace": meta["namespace"], "name": meta["name"],
                                     "uid": meta["uid"],
                                     "resourceVersion": meta["resourceVersion"]}
            v.setdefault("status", {})["phase"] = "Bound"
            v["status"]["lastPhaseTransitionTime"] = rfc3339()

        def bind_claim(c: dict) -> None:
            c["spec"]["volumeName"] = name
            notes = c["metadata"].setdefault("annotations", {})
            notes["pv.kubernetes.io/bind-completed"] = "yes"
            notes["pv.kubernetes.io/bound-by-controller"] = "yes"
            c["status"] = {"phase": "Bound",
                           "accessModes": list(volume["spec"].get("accessModes") or []),
                           "capacity": dict(volume["spec"].get("capacity") or {})}

        self.store.mutate(PVS, None, name, bind_volume)
        self.store.mutate(PVCS, meta["namespace"], meta["name"], bind_claim, uid=meta["uid"])
        self._reported.pop(meta["uid"], None)

    def _release(self, claim: dict) -> None:
        self._reported.pop(claim["metadata"]["uid"], None)
        with self.store.lock:
            volumes = [v for v in self.store.raw_objects("persistentvolumes")
                       if ((v.get("spec") or {}).get("claimRef") or {}).get("uid")
                       == claim["metadata"]["uid"]]
        for v in volumes:
            if v["spec"].get("persistentVolumeReclaimPolicy") == "Delete":
                try:
                    self.store.delete(PVS, None, v["metadata"]["name"])
                except ApiError:
                    pass
            else:
                def release(o: dict) -> None:
                    o.setdefault("status", {})["phase"] = "Released"

                self.store.mutate(PVS, None, v["metadata"]["name"], release)
        self.sync()
