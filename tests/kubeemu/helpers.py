"""Shared helpers for the emulator's own tests."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import container as ctr
from .emulator import KubeEmulator
from .images import Image


def http(emu: KubeEmulator, method: str, path: str, body: Any = None,
         content_type: str = "application/json") -> tuple[int, Any]:
    """A raw request to the emulator as its admin: (status, decoded JSON body or text)."""
    data = None
    if body is not None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(emu.url + path, data=data, method=method,
                                 headers={"Content-Type": content_type,
                                          "Authorization": "Bearer kubeemu-token"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            code, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        code, raw = e.code, e.read()
    try:
        return code, json.loads(raw)
    except ValueError:
        return code, raw.decode()


def leftovers(emu: KubeEmulator, namespace: str,
              plurals: Sequence[str] = ("pods", "secrets", "configmaps")) -> str:
    """What of ``plurals`` is still in ``namespace``, one line each, for a timed-out wait to say
    why: deletion timestamp and grace, finalizers, owners (and whether they still exist); for a
    pod, its phase, whether the kubelet is stopping it and when it kills it, and its container's
    pid 1 (state, whether it handles SIGTERM: see ``container.signal_state``)."""
    lines = []
    for plural in plurals:
        for obj in emu.list(plural, namespace):
            meta = obj["metadata"]
            if plural == "configmaps" and meta["name"] == "kube-root-ca.crt":
                continue
            owners = ", ".join(
                f"{r.get('kind')}/{r.get('name')}"
                f"{'' if emu.store.by_uid(r.get('uid', '')) is not None else ' (gone)'}"
                for r in meta.get("ownerReferences") or []) or "none"
            line = (f"{plural}/{meta['name']}: deletionTimestamp={meta.get('deletionTimestamp')}"
                    f" grace={meta.get('deletionGracePeriodSeconds')}"
                    f" finalizers={meta.get('finalizers') or []} owners={owners}")
            if plural == "pods":
                line += f" phase={(obj.get('status') or {}).get('phase')}"
                rt = emu.kubelet.runtime_for(namespace, meta["name"])
                if rt is None or rt.uid != meta["uid"]:
                    line += "; no kubelet runtime"
                else:
                    kill_in = ("" if rt.kill_at is None
                               else f", kills in {rt.kill_at - time.monotonic():.1f}s")
                    line += f"; kubelet: stopping={rt.terminating.is_set()}{kill_in}"
                    state = ctr.signal_state(rt.pid1) if rt.pid1 else None
                    if state is not None:
                        term = ("handles" if signal.SIGTERM in state["caught"] else "ignores"
                                if signal.SIGTERM in state["ignored"] else "has no handler for")
                        line += f"; pid 1 (host pid {rt.pid1}) {state['state']}, {term} SIGTERM"
            lines.append(line)
    return "\n".join(lines) or f"nothing of {', '.join(plurals)} is left in {namespace}"


def pod(name: str, command: list[str] | None = None, **spec: Any) -> dict:
    """A minimal pod manifest running `command` (python by default) in one container."""
    container: dict[str, Any] = {"name": "main", "image": "python:3.11"}
    if command is not None:
        container["command"] = command
    for key in ("env", "volumeMounts", "resources", "readinessProbe", "livenessProbe", "ports",
                "workingDir", "envFrom", "args"):
        if key in spec:
            container[key] = spec.pop(key)
    labels = spec.pop("labels", None)
    annotations = spec.pop("annotations", None)
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [container], **spec}}


# A container's first process is pid 1 of its pid namespace, where SIGTERM without a handler
# is ignored (a real pod then waits its whole grace period): test programs exit on it.
EXIT_ON_TERM = "import signal as _s, sys as _y; _s.signal(_s.SIGTERM, lambda *a: _y.exit(143))\n"


def py(code: str, exit_on_term: bool = True) -> list[str]:
    """python -c code in a pod (exiting on SIGTERM unless exit_on_term is False)."""
    return [sys.executable, "-c", (EXIT_ON_TERM if exit_on_term else "") + code]


def host_path_claim(name: str, namespace: str, path: str) -> list[dict]:
    """A hostPath PersistentVolume of ``path`` and the claim bound to it (statically, reserved by
    claimRef), as the chart makes ``<fullname>-host`` for the node agent's directory: a pod that
    mounts the claim sees that directory of its own node and has no hostPath volume itself."""
    pv = f"{namespace}-{name}"
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "1Mi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "claimRef": {"namespace": namespace, "name": name},
                "hostPath": {"path": path, "type": "DirectoryOrCreate"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Mi"}},
            },
        },
    ]


def create_host_claim(emu: KubeEmulator, namespace: str, path: Any, name: str = "elastic-gpu-host") -> None:
    """Create :func:`host_path_claim`'s objects (the node agent's directory for 'native' GPU pods)."""
    for obj in host_path_claim(name, namespace, str(path)):
        emu.create(obj)


def tiny_image(root: str | Path, progs: Sequence[str] = ("sh", "cat", "ls", "id", "sleep")) -> Image:
    """An image's filesystem unlike this machine's (``Image(rootfs=...)``): a few of this machine's
    programs with their libraries (as ldd names them), a user of its own (1234), a file of its own
    (/etc/image-name) and no Python; ENTRYPOINT ``/bin/sh -c``, CMD ``echo default-cmd``."""
    import shutil
    import subprocess

    root = Path(root)
    for d in ("usr/bin", "usr/lib", "usr/lib64", "etc", "work", "home/imguser"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link, to in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        (root / link).symlink_to(to)
    for prog in progs:
        real = os.path.realpath(shutil.which(prog))
        shutil.copy2(real, root / "usr/bin" / prog)
        out = subprocess.run(["ldd", real], capture_output=True, text=True, check=True).stdout
        for lib in (w for line in out.splitlines() for w in line.split() if w.startswith("/")):
            target = root / lib.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(lib), target)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nimguser:x:1234:1234::/home/imguser:/bin/sh\n")
    (root / "etc/image-name").write_text("tiny-image\n")
    os.chown(root / "home/imguser", 1234, 1234)
    return Image(uid=1234, gid=1234, home="/home/imguser", workdir="/work", env={"IMAGE_VAR": "from-image"},
                 rootfs=str(root), entrypoint=("/bin/sh", "-c"), cmd=("echo default-cmd",))


def release_objects(emu: KubeEmulator, release: str, namespace: str) -> list[str]:
    """Every object of the Helm release ``release`` (installed in ``namespace``) still stored:
    those labelled with its instance, and helm's own release Secrets; but those the chart keeps
    on purpose (``helm.sh/resource-policy: keep``)."""
    from .resources import RESOURCES

    left = []
    for rt in RESOURCES:
        if rt.storage or rt.plural.startswith("self") or rt.plural == "events":
            continue
        for obj in emu.list(rt.plural, group=rt.group, label_selector=f"app.kubernetes.io/instance={release}"):
            meta = obj["metadata"]
            if (meta.get("annotations") or {}).get("helm.sh/resource-policy") == "keep":
                continue
            left.append(f"{rt.plural}/{meta.get('namespace', '')}/{meta['name']}")
        if rt.plural == "secrets":
            left += [f"secrets/{s['metadata']['namespace']}/{s['metadata']['name']}"
                     for s in emu.list("secrets", namespace, label_selector=f"owner=helm,name={release}")]
    return sorted(left)
