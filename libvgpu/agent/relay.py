"""The node regions' writer on Kubernetes: GPU pods mount ``regions/`` read-only, and the agent
copies each pod's entries into them.

A card's node region (``regions/<uuid>.region``) has one entry per container using the card:
its requests (priority, cores, memory), its memory in use, its last launch, whether it is held
for a higher priority and what it waits for of other slices' bursts. Every shim on the card
reads the others' entries (priority, elastic bursts and reclaims), the agent and the culler
read them too. Were the file writable by the pods, a hostile pod could rewrite the others'
entries (zero their memory in use, fake their launches). So the pods only read it, and each
container writes its own entry's fields into its own container region (``card[]`` of
``libvgpu/src/vgpu.h``, in the pod's private emptyDir). Every :attr:`NodeAgent.relay_interval_seconds`
(50 ms by default) the agent reads each GPU pod's container region and writes the card's
entries: the shims see the others at most one period late.

The agent reaches a pod's container region through ``/proc/<pid>/root`` of one of the pod's
processes, a filesystem the pod controls: the path is resolved with ``openat2`` and
``RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`` (a symlink the pod plants resolves inside the pod's
root, never the host's), opened read-only, without blocking (a FIFO) and without following a
final symlink, and accepted only as a regular file of a container region's size with a valid
header. The agent reads it with ``pread`` (never a mapping: the pod may truncate its file).

In single-machine mode the hub's local pool (:class:`hubext.local.pool.LocalPool`) runs the same
relay over the node regions it owns (``regions/node``, 0755 and 0644, written by the hub only):
it knows each slice's container region (a file in a directory of the hub's), so it names them
(:meth:`Relay.follow`) instead of looking for pods.

An entry lives while some process of its container does (the container region's per-process
OFD locks); the agent holds an OFD read lock on the entry's liveness byte meanwhile, so that
the shims and :func:`libvgpu.regions.read_node_region` see it alive exactly as an entry a shim
wrote itself, and clears the entry when the container has no live process left.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from libvgpu.regions import (
    _FLOCK,
    KIND_CONTAINER,
    KIND_NODE,
    LAYOUT,
    LOCK_BASE,
    MAGIC,
    MAX_DEVICES,
    MAX_PROCS,
    NODE_ENTRIES,
    REGION_VERSION,
)

from .pods import process_cgroup

#: the container region's path inside a 'native' GPU pod (hubext.kubernetes.objects writes it
#: into the limits file: ``container_region=``)
POD_CONTAINER_REGION = "/var/run/libvgpu/container.region"

_ENTRIES = 256  # the node region's entries[] (vgpu.h)
_HEADER = 4096  # the container region's header: totals, limits, card[]; the slots follow
_SYS_OPENAT2 = 437  # the same number on x86_64 and aarch64
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


@dataclass(frozen=True)
class Entry:
    """One container's entry on one card, as its container region says."""

    container_id: int
    name: str
    priority: int
    cores_percent: int
    memory_limit: int
    memory_used: int
    last_launch_ns: int
    held_since_ns: int
    reclaim: int


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def open_in_root(root: str | os.PathLike[str], path: str, size: int = LAYOUT["container.size"]) -> int:
    """A read-only fd of ``path`` resolved inside the directory ``root`` (a pod's
    ``/proc/<pid>/root``) as if it were ``/``: OSError if it cannot be, or is not a regular file
    of ``size`` bytes (a container region's by default)."""
    dirfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0,
                       _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(_SYS_OPENAT2, dirfd, path.lstrip("/").encode(), ctypes.byref(how),
                           ctypes.sizeof(how))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
    finally:
        os.close(dirfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        raise OSError(errno.EINVAL, f"not a regular file of {size} bytes", path)
    return fd


def _probe(fd: int, byte: int) -> bool:
    """Whether another open file description holds a lock on ``byte`` (unknown: True)."""
    got = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
    try:
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, got)
    except OSError:
        return True
    return struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK


def read_entries(fd: int) -> dict[str, Entry]:
    """The entries (card uuid -> entry) a container region's header holds; none while no process
    of the container lives, or when the file is not a container region."""
    L = LAYOUT
    try:
        buf = os.pread(fd, _HEADER, 0)
    except OSError:
        return {}
    if len(buf) < _HEADER or buf[:8] != MAGIC:
        return {}
    version, kind, size = struct.unpack_from("<IIQ", buf, 8)
    if version != REGION_VERSION or kind != KIND_CONTAINER or size != L["container.size"]:
        return {}
    hwm = min(struct.unpack_from("<I", buf, L["container.hwm"])[0], MAX_PROCS)
    if not any(_probe(fd, LOCK_BASE + i) for i in range(hwm)):
        return {}
    cid = struct.unpack_from("<Q", buf, L["container.container_id"])[0]
    name = buf[L["container.name"] : L["container.name"] + 64].split(b"\0", 1)[0].decode("utf-8", "replace")
    priority = struct.unpack_from("<i", buf, L["container.priority"])[0]
    used = struct.unpack_from(f"<{MAX_DEVICES}Q", buf, L["container.used"])
    limit = struct.unpack_from(f"<{MAX_DEVICES}Q", buf, L["container.limit"])
    cores = struct.unpack_from(f"<{MAX_DEVICES}I", buf, L["container.cores_percent"])
    out = {}
    for d in range(MAX_DEVICES):
        base = L["container.card"] + d * L["card.size"]
        uuid = buf[base : base + 48].split(b"\0", 1)[0].decode("ascii", "replace")
        if not uuid or not cid or "/" in uuid:
            continue
        launch, held, reclaim = struct.unpack_from("<QQQ", buf, base + L["card.last_launch_ns"])
        out[uuid] = Entry(cid, name, priority, cores[d], limit[d], used[d], launch, held, reclaim)
    return out


class CardRegion:
    """One card's node region, written by the agent (the only writer where pods mount it
    read-only)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != LAYOUT["node.size"]:
            os.close(self.fd)
            raise OSError(errno.EINVAL, "not a node region", self.path)
        self.map = mmap.mmap(self.fd, LAYOUT["node.size"])
        if self.map[:8] != MAGIC or struct.unpack_from("<I", self.map, 12)[0] != KIND_NODE:
            self.close()
            raise OSError(errno.EINVAL, "not a node region", self.path)
        self.q = memoryview(self.map).cast("Q")  # aligned 8-byte stores: no torn values
        self.held: dict[int, int] = {}  # container id -> entry index whose lock we hold

    def close(self) -> None:
        if getattr(self, "q", None) is not None:
            self.q.release()
        self.map.close()
        os.close(self.fd)

    def _lock(self, index: int, kind: int) -> None:
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, LOCK_BASE + index, 1, 0))

    def write(self, entries: Iterable[Entry]) -> None:
        """Make the relayed entries these: update each, add new ones in free entries, clear the
        ones relayed before whose container has gone. Entries a shim holds itself (a node region
        it can write: pods from before the read-only mount) are left alone."""
        L, q = LAYOUT, self.q
        size = L["entry.size"]
        base = _ENTRIES
        ids = [q[(base + i * size) // 8] for i in range(NODE_ENTRIES)]
        wanted = {e.container_id: e for e in entries}
        for cid, index in list(self.held.items()):
            if cid not in wanted or ids[index] != cid:
                q[(base + index * size) // 8] = 0
                self._lock(index, fcntl.F_UNLCK)
                del self.held[cid]
                ids[index] = 0
        for cid, e in wanted.items():
            index = self.held.get(cid)
            fresh = index is None
            if fresh:
                # its entry from before (an agent restart), else one no process holds: free, or
                # left by a container that ended (of an earlier agent, or of a shim that wrote
                # its own); ours are held through our own fd, which the probe does not see
                ours = set(self.held.values())
                free = [i for i in range(NODE_ENTRIES) if ids[i] == cid and i not in ours] or [
                    i for i in range(NODE_ENTRIES)
                    if i not in ours and (ids[i] == 0 or not _probe(self.fd, LOCK_BASE + i))]
                if not free:
                    continue
                index = free[0]
            at = base + index * size
            if fresh:
                q[at // 8] = 0
                struct.pack_into("<iI", self.map, at + L["entry.priority"], e.priority, e.cores_percent)
                self.map[at + L["entry.name"] : at + L["entry.name"] + 64] = e.name.encode()[:63].ljust(64, b"\0")
                q[(at + L["entry.attached_ns"]) // 8] = time.time_ns()
            q[(at + L["entry.memory_limit"]) // 8] = e.memory_limit
            q[(at + L["entry.memory_used"]) // 8] = e.memory_used
            q[(at + L["entry.last_launch_ns"]) // 8] = e.last_launch_ns
            q[(at + L["entry.held_since_ns"]) // 8] = e.held_since_ns
            q[(at + L["entry.reclaim"]) // 8] = e.reclaim
            if fresh:
                self._lock(index, fcntl.F_RDLCK)
                q[at // 8] = cid  # last: a reader that sees the id sees the rest
                self.held[cid] = index
                ids[index] = cid


class Relay:
    """Every GPU pod's container region, relayed into the node regions of ``region_dir``."""

    def __init__(self, region_dir: str | os.PathLike[str], proc_root: str | os.PathLike[str] = "/proc",
                 pod_path: str = POD_CONTAINER_REGION) -> None:
        self.region_dir = Path(region_dir)
        self.proc_root = Path(proc_root)
        self.pod_path = pod_path
        self.pods: dict[str, int] = {}  # pod uid -> fd of its container region
        self.roots: dict[str, int] = {}  # pod uid -> the host pid through whose root it was opened
        self.known: dict[int, str | None] = {}  # host pid -> its pod's uid (None: no pod's)
        self.cards: dict[str, CardRegion] = {}
        self.problems: dict[str, str] = {}  # card uuid -> why its region is not written

    def close(self) -> None:
        for fd in self.pods.values():
            os.close(fd)
        for card in self.cards.values():
            card.close()
        self.pods, self.cards = {}, {}

    def discover(self) -> None:
        """Open the container region of each pod of this node not opened yet (one of its
        processes' root holds it), and close those of pods that have no process left."""
        seen: dict[str, list[int]] = {}
        pids = {int(e.name) for e in self.proc_root.iterdir() if e.name.isdigit()}
        self.known = {pid: uid for pid, uid in self.known.items() if pid in pids}
        for pid in sorted(pids):
            if pid not in self.known:  # a process keeps its pod: its cgroup is read once
                cgroup = process_cgroup(pid, self.proc_root)
                self.known[pid] = cgroup.pod_uid if cgroup is not None else None
            uid = self.known[pid]
            if uid is not None:
                seen.setdefault(uid, []).append(pid)
        for uid in [u for u in self.pods if u not in seen]:
            os.close(self.pods.pop(uid))
            self.roots.pop(uid, None)
        for uid, pids in seen.items():
            if uid in self.pods:
                continue
            for pid in pids:
                try:
                    self.pods[uid] = open_in_root(self.proc_root / str(pid) / "root", self.pod_path)
                    self.roots[uid] = pid
                    break
                except OSError:
                    continue

    def follow(self, regions: Mapping[str, str | os.PathLike[str]]) -> None:
        """Relay exactly these container regions (a key per container -> its path on this host),
        for a relay that knows its containers (the single-machine pool) instead of discovering
        pods: opens the new ones (one not made yet is tried again next time), closes the others."""
        for key in [k for k in self.pods if k not in regions]:
            os.close(self.pods.pop(key))
        for key, path in regions.items():
            if key not in self.pods:
                try:
                    self.pods[key] = open_in_root("/", os.fspath(path))
                except OSError:
                    continue

    def _card(self, uuid: str) -> CardRegion | None:
        card = self.cards.get(uuid)
        if card is None:
            try:
                card = self.cards[uuid] = CardRegion(self.region_dir / f"{uuid}.region")
                self.problems.pop(uuid, None)
            except OSError as e:
                self.problems[uuid] = f"{self.region_dir / f'{uuid}.region'}: {e.strerror or e}"
                return None
        return card

    def relay(self, cards: Iterable[str]) -> Mapping[str, list[Entry]]:
        """One period: read every opened pod's entries and write each card's (``cards``: the
        node's card uuids). Returns what was written, by card."""
        by_card: dict[str, list[Entry]] = {uuid: [] for uuid in cards}
        for fd in self.pods.values():
            for uuid, e in read_entries(fd).items():
                if uuid in by_card:
                    by_card[uuid].append(e)
        for uuid, entries in by_card.items():
            card = self._card(uuid)
            if card is not None:
                card.write(entries)
        return by_card

    async def run(self, cards: Callable[[], Iterable[str]], interval_seconds: float, log: logging.Logger,
                  discover_seconds: float = 0.25,
                  containers: Callable[[], Mapping[str, str | os.PathLike[str]]] | None = None) -> None:
        """Relay every ``interval_seconds``, looking for new pods every ``discover_seconds`` (or,
        with ``containers``, following the container regions it names: :meth:`follow`), until
        cancelled."""
        next_discovery = 0.0
        warned: dict[str, str] = {}
        try:
            while True:
                try:
                    if time.monotonic() >= next_discovery:
                        if containers is None:
                            await asyncio.to_thread(self.discover)
                        else:
                            await asyncio.to_thread(self.follow, dict(containers()))
                        next_discovery = time.monotonic() + discover_seconds
                    await asyncio.to_thread(self.relay, list(cards()))
                except OSError as e:
                    log.warning("Node regions not relayed this period: %s", e)
                for uuid, why in self.problems.items():
                    if warned.get(uuid) != why:
                        log.warning("Node region of GPU %s not written (its GPU pods see no other slice): %s",
                                    uuid, why)
                warned = dict(self.problems)
                await asyncio.sleep(interval_seconds)
        finally:
            self.close()
