"""The emulator's image table: image name -> how a container of that image runs here.

An image with a ``rootfs`` (a directory holding the image's unpacked filesystem, e.g. from
:func:`from_engine` for an image ``./dev images`` built) runs from that filesystem, seen
copy-on-write, with the image's entrypoint, command, user, working directory and environment,
as a container runtime runs it. Any other image's filesystem is this machine's root filesystem
(the test environment is the "image": the interpreter, the installed packages); what differs
per image is its user, home, working directory and environment, as the image's config would
set them. An image the table does not know cannot be pulled (``ErrImagePull``, then
``ImagePullBackOff``), as on a cluster whose registry lacks it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Image:
    """What an image's config says: USER (uid, gid), HOME, WORKDIR and ENV; with ``rootfs``,
    also its filesystem, ENTRYPOINT and CMD."""

    uid: int = 0
    gid: int = 0
    home: str = "/root"
    workdir: str = "/"
    env: Mapping[str, str] = field(default_factory=dict)
    rootfs: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    def argv(self, command: list[str], args: list[str]) -> list[str]:
        """The process a container of this image runs, as Kubernetes combines them: the pod's
        command replaces ENTRYPOINT (and drops CMD), its args replace CMD."""
        if command:
            return [*command, *args]
        return [*self.entrypoint, *(args or self.cmd)]


ROOT = Image()
JOVYAN = Image(uid=1000, gid=100, home="/home/jovyan", workdir="/home/jovyan",
               env={"NB_USER": "jovyan", "NB_UID": "1000", "NB_GID": "100"})

# Patterns (fnmatch) over the image reference; an entry naming the reference exactly wins, else
# the first matching pattern. A reference without a tag or digest also matches "<name>:latest".
DEFAULT_IMAGES: dict[str, Image] = {
    "quay.io/jupyter/*": JOVYAN,
    "jupyter/*": JOVYAN,
    "quay.io/jupyterhub/singleuser*": JOVYAN,
    "quay.io/jupyterhub/k8s-singleuser-sample*": JOVYAN,
    "python:*": ROOT,
    "docker.io/library/python:*": ROOT,
    "busybox:*": ROOT,
    "pause:*": ROOT,
    "registry.k8s.io/pause:*": ROOT,
    "elastic-gpu:*": ROOT,
    "*/elastic-gpu:*": ROOT,
    "*/jupyterhub-elastic-gpu:*": ROOT,
}


def normalize(ref: str) -> str:
    last = ref.rsplit("/", 1)[-1]
    if ":" not in last and "@" not in last:
        return ref + ":latest"
    return ref


def lookup(table: Mapping[str, Image], ref: str) -> Image | None:
    """The image a reference names, or None when no entry of the table matches it: an entry
    naming exactly that reference, else the first pattern that matches."""
    full = normalize(ref)
    for exact in (ref, full):
        if exact in table:
            return table[exact]
    for pattern, image in table.items():
        if fnmatch.fnmatchcase(ref, pattern) or fnmatch.fnmatchcase(full, pattern):
            return image
    return None


def pull_error(ref: str) -> str:
    """containerd's message for an image the registry does not have."""
    full = normalize(ref)
    if "/" not in full.split(":")[0] or "." not in full.split("/")[0]:
        full = ("docker.io/library/" if "/" not in full else "docker.io/") + full
    return (f'Failed to pull image "{ref}": rpc error: code = NotFound desc = failed to pull '
            f'and unpack image "{full}": failed to resolve reference "{full}": {full}: '
            "not found")


def _user(spec: str, rootfs: Path) -> tuple[int, int]:
    """An image's USER (``name``, ``uid``, ``uid:gid``, ``name:group``) as numbers."""
    user, _, group = (spec or "0").partition(":")

    def number(name: str, table: str) -> int:
        if name.isdigit():
            return int(name)
        for line in (rootfs / "etc" / table).read_text().splitlines():
            fields = line.split(":")
            if fields[0] == name:
                return int(fields[2])
        raise ValueError(f"the image's USER {spec!r}: no {name!r} in /etc/{table}")

    uid = number(user, "passwd")
    if group:
        return uid, number(group, "group")
    for line in (rootfs / "etc" / "passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) > 3 and fields[2] == str(uid):
            return uid, int(fields[3])
    return uid, 0


def from_engine(ref: str, dest: str | Path, docker: str = "docker") -> Image:
    """An image a local engine holds (``docker``/``podman`` CLI), unpacked under ``dest``: its
    filesystem (``docker export`` of a created, never started container) and its config (``docker
    image inspect``). Run as root, so files keep their owners."""
    dest = Path(dest)
    rootfs = dest / "rootfs"
    if rootfs.exists():
        shutil.rmtree(rootfs)
    rootfs.mkdir(parents=True)
    config = json.loads(subprocess.run([docker, "image", "inspect", ref], check=True, capture_output=True,
                                       text=True).stdout)[0]["Config"]
    # never started: the command only satisfies an image without ENTRYPOINT or CMD
    created = subprocess.run([docker, "create", ref, "/kubeemu-export"], capture_output=True, text=True)
    if created.returncode != 0:
        raise RuntimeError(f"docker create {ref} failed: {created.stderr.strip()}")
    cid = created.stdout.strip()
    try:
        export = subprocess.Popen([docker, "export", cid], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(rootfs), "--numeric-owner", "-p"], stdin=export.stdout, check=True)
        if export.wait() != 0:
            raise RuntimeError(f"docker export {ref} failed ({export.returncode})")
    finally:
        subprocess.run([docker, "rm", "-f", cid], capture_output=True)
    env = dict(e.split("=", 1) for e in config.get("Env") or [] if "=" in e)
    uid, gid = _user(config.get("User") or "", rootfs)
    home = "/root"
    for line in (rootfs / "etc" / "passwd").read_text().splitlines() if (rootfs / "etc/passwd").is_file() else []:
        fields = line.split(":")
        if len(fields) > 5 and fields[2] == str(uid):
            home = fields[5]
            break
    os.chmod(rootfs, 0o755)
    return Image(uid=uid, gid=gid, home=env.get("HOME", home), workdir=config.get("WorkingDir") or "/",
                 env=env, rootfs=str(rootfs), entrypoint=tuple(config.get("Entrypoint") or ()),
                 cmd=tuple(config.get("Cmd") or ()))
