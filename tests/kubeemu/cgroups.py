"""Memory cgroups for the emulated containers (cgroup v1 or v2), as the kubelet sets them.

Each container with a memory limit gets ``<our own memory cgroup>/kubeemu-<pid>-<emulator>/<id>`` with
``resources.limits.memory`` as its hard limit (swap included); when the kernel's OOM killer
acts in it, the container's exit is reported ``OOMKilled``.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


def _own_path(controller: str) -> str | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if (controller and controller in ctrls.split(",")) or (not controller and ctrls == ""):
            return path
    return None


def base_dir(tag: str) -> Path | None:
    """Where this process may create memory cgroups, or None (then limits are not enforced)."""
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        own = _own_path("memory") or "/"
        base = V1_ROOT / own.lstrip("/") / f"kubeemu-{os.getpid()}-{tag}"
    elif "memory" in ((V2_ROOT / "cgroup.controllers").read_text().split()
                      if (V2_ROOT / "cgroup.controllers").exists() else []):
        # v2 allows controllers only in cgroups without processes: one beside ours
        own = _own_path("") or "/"
        parent = V2_ROOT / own.lstrip("/")
        parent = parent.parent if own != "/" else parent
        base = parent / f"kubeemu-{os.getpid()}-{tag}"
    else:
        return None
    try:
        base.mkdir(exist_ok=True)
        if not (V1_ROOT / "memory.limit_in_bytes").exists():
            (base.parent / "cgroup.subtree_control").write_text("+memory")
            (base / "cgroup.subtree_control").write_text("+memory")
    except OSError:
        return None
    return base


class MemoryCgroup:
    def __init__(self, path: Path, limit_bytes: int | None) -> None:
        self.path = path
        self.v1 = (path / "memory.limit_in_bytes").exists() or str(path).startswith(str(V1_ROOT))
        path.mkdir(exist_ok=True)
        if limit_bytes:
            if self.v1:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            else:
                (path / "memory.max").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):
                    (path / "memory.swap.max").write_text("0")

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.v1 else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)  # the last processes are still exiting


def remove_base(base: Path | None) -> None:
    if base is not None:
        for child in base.iterdir() if base.exists() else []:
            if child.is_dir():
                with contextlib.suppress(OSError):
                    child.rmdir()
        with contextlib.suppress(OSError):
            base.rmdir()
