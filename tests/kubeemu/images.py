"""The emulator's image table: image name -> how a container of that image runs here.

Every image's filesystem is this machine's root filesystem seen copy-on-write (the test
environment is the "image": the interpreter, the installed packages); what differs per
image is its user, home, working directory and environment, as the image's config would
set them. An image the table does not know cannot be pulled (``ErrImagePull``, then
``ImagePullBackOff``), as on a cluster whose registry lacks it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Image:
    """What an image's config says: USER (uid, gid), HOME, WORKDIR and ENV."""

    uid: int = 0
    gid: int = 0
    home: str = "/root"
    workdir: str = "/"
    env: Mapping[str, str] = field(default_factory=dict)


ROOT = Image()
JOVYAN = Image(uid=1000, gid=100, home="/home/jovyan", workdir="/home/jovyan",
               env={"NB_USER": "jovyan", "NB_UID": "1000", "NB_GID": "100"})

# Patterns (fnmatch) over the image reference; the first match wins. A reference without a
# tag or digest also matches "<name>:latest".
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
    """The image a reference names, or None when no entry of the table matches it."""
    full = normalize(ref)
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
