"""Which cards a GPU pod's container can open, set by the node agent (Kubernetes mode).

A container's NVIDIA runtime gives it, at its start, the device nodes of the cards its
``NVIDIA_VISIBLE_DEVICES`` names (``/dev/nvidia<minor>``) and allows those in its device cgroup;
the driver shows a process the cards it can open. A swapped-out kernel that resumes on another
card of its node (:mod:`libvgpu.agent.swap`, remap) needs that card in its container: the agent
(root, in the host's pid namespace) grants it before the restore and takes the old card back
after it, or the new one when the restore is refused (:meth:`CardAccess.move`):

- the device node, made in the container's own /dev through ``<proc>/<pid>/root`` (the
  container's root as its process sees it), character device 195:<minor>, mode 0666 as the
  runtime makes it; removed to take the card back;
- the device cgroup, where the node runs cgroup v1: ``c 195:<minor> rw`` written to the
  container's ``devices.allow`` (``devices.deny`` to take it back). On cgroup v2 the runtime's
  device filter is an eBPF program fixed at the container's start, which the agent cannot widen:
  such a node says so (:meth:`CardAccess.why_not`), and its resumes go back to their own card.

Nothing a pod writes decides what is granted: the card comes from the hub's swap request (an
annotation the pod cannot write), the processes from their cgroup, and the container's /dev is
opened without following a link the container could have put there.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

#: the NVIDIA character devices' major number (nvidia-frontend in /proc/devices)
NVIDIA_MAJOR = 195


class CardAccessError(OSError):
    """A card could not be granted to (or taken back from) a container; says which and why."""


class CardAccess:
    """Grants and takes back cards in running containers (blocking: call it from a thread).

    ``proc_root``: the host's /proc (each process's ``root`` and ``cgroup``); ``cgroup_root``:
    the host's cgroup filesystem."""

    def __init__(
        self, proc_root: str | os.PathLike[str] = "/proc", cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup"
    ) -> None:
        self.proc_root, self.cgroup_root = Path(proc_root), Path(cgroup_root)

    def why_not(self) -> str | None:
        """Why the agent cannot grant a card to a running container on this node (None: it can)."""
        if not (self.cgroup_root / "devices").is_dir() and (self.cgroup_root / "cgroup.controllers").exists():
            return (
                "this node runs cgroup v2, whose device filter (the container runtime's eBPF program) "
                "the node agent cannot widen for a running container"
            )
        return None

    def grant(self, pids: Iterable[int], minor: int) -> None:
        """Give the containers of ``pids`` card ``minor`` (its device node, and its device cgroup
        rule on cgroup v1). CardAccessError when it cannot."""
        for pid in sorted(set(pids)):
            self._cgroup_rule(pid, minor, "devices.allow")
            with self._dev_dir(pid) as dev:
                try:
                    os.mknod(f"nvidia{minor}", stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, minor), dir_fd=dev.fd)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise CardAccessError(e.errno, f"the device node of card {minor} could not be made in the "
                                          f"container of process {pid} ({e.strerror})") from None  # fmt: skip
                os.chmod(f"nvidia{minor}", 0o666, dir_fd=dev.fd, follow_symlinks=False)

    def revoke(self, pids: Iterable[int], minor: int) -> None:
        """Take card ``minor`` back from the containers of ``pids`` (what is already gone: nothing)."""
        for pid in sorted(set(pids)):
            try:
                with self._dev_dir(pid) as dev:
                    os.unlink(f"nvidia{minor}", dir_fd=dev.fd)
            except FileNotFoundError:
                pass
            self._cgroup_rule(pid, minor, "devices.deny")

    def move(self, pids: list[int], remap: Mapping[str, str], minors: Mapping[str, int],
             restore: Callable[[], None]) -> None:  # fmt: skip
        """``restore()`` the processes onto other cards (``remap``: old uuid -> new uuid;
        ``minors``: uuid -> device minor): the new cards granted first, then the old ones taken
        back; when ``restore`` raises, the new cards are taken back and the error goes on."""
        unknown = sorted(u for pair in remap.items() for u in pair if u not in minors)
        if unknown:
            raise CardAccessError(0, f"no card {', '.join(unknown)} on this node")
        new = [minors[u] for u in remap.values() if minors[u] not in {minors[o] for o in remap}]
        granted: list[int] = []
        try:
            for minor in new:
                self.grant(pids, minor)
                granted.append(minor)
            restore()
        except BaseException:
            for minor in granted:
                self.revoke(pids, minor)
            raise
        for old in remap:
            if minors[old] not in [minors[u] for u in remap.values()]:
                self.revoke(pids, minors[old])

    # ---- the container's /dev and device cgroup ----------------------------------------------

    def _dev_dir(self, pid: int) -> _DirFd:
        """The container's /dev, opened without following links (a container's own /dev link
        would otherwise point the agent anywhere on the host)."""
        root = self.proc_root / str(pid) / "root"
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise CardAccessError(e.errno, f"process {pid} has no root to reach ({e.strerror})") from None
        try:
            fd = os.open("dev", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        except OSError as e:
            raise CardAccessError(e.errno, f"the /dev of process {pid}'s container is no directory "
                                  f"({e.strerror})") from None  # fmt: skip
        finally:
            os.close(root_fd)
        return _DirFd(fd)

    def _cgroup_rule(self, pid: int, minor: int, file: str) -> None:
        """Write ``c 195:<minor> rw`` to the process's v1 device cgroup ``file`` (no devices
        controller: nothing to write)."""
        if not (self.cgroup_root / "devices").is_dir():
            return
        try:
            lines = (self.proc_root / str(pid) / "cgroup").read_text().splitlines()
        except OSError as e:
            raise CardAccessError(e.errno, f"the cgroup of process {pid} cannot be read ({e.strerror})") from None
        fields = [line.split(":", 2) for line in lines if line.count(":") >= 2]
        for path in [f[2] for f in fields if "devices" in f[1].split(",")]:
            target = self.cgroup_root / "devices" / path.lstrip("/") / file
            try:
                target.write_text(f"c {NVIDIA_MAJOR}:{minor} rw\n")
            except OSError as e:
                raise CardAccessError(e.errno, f"{target}: {e.strerror}") from None


class _DirFd:
    """An open directory, closed when the ``with`` ends."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> _DirFd:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
