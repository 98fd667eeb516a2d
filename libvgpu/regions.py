"""Read the shared-memory regions libvgpu writes: usage and activity for the culler and metrics.

Three kinds of file (layouts in ``libvgpu/src/vgpu.h``, version :data:`REGION_VERSION`):

* the **container region** (``container_region=`` in the limits file): one slot per process of
  the container with its memory in use per GPU and the time of its last kernel launch, the
  container's totals and limits, and the compute limiter's last measured utilisation;
* a **node region** per GPU (``<node_region_dir>/<GPU uuid>.region``): one entry per container
  using that GPU, with its priority, memory in use and last launch;
* the **activity file** (``activity_file=``): a container-wide summary (last launch, memory, and
  for an elastic slice the GPU time it ran above its compute request).

Reads are lock-free snapshots. Whether a process (or a container in a node region) is alive
comes from the OFD lock the shim holds for it while it lives, so it works from any pid
namespace (the node agent's) and survives pid reuse. Dead processes are left out of
``processes`` and of the totals, so a process killed with SIGKILL stops counting at once, even
before the shim clears its slot (which it does on the next allocation, query or lock recovery).

    from libvgpu.regions import read_container_region
    usage = read_container_region("/var/run/libvgpu/container.region")
    usage.memory_used_bytes[0], usage.last_launch_at, usage.idle_seconds()
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PREPARE_SOURCE",
    "REGION_VERSION",
    "Activity",
    "ContainerUsage",
    "NodeContainer",
    "NodeGPU",
    "ProcessUsage",
    "RegionError",
    "read_activity",
    "read_container_region",
    "read_node_region",
    "read_node_regions",
    "prepare_container_region",
    "prepare_node_regions",
]

REGION_VERSION = 1
MAGIC = b"LIBVGPU\0"
KIND_CONTAINER, KIND_NODE, KIND_ACTIVITY = 1, 2, 3
MAX_DEVICES = 16
MAX_PROCS = 1024
NODE_ENTRIES = 64
UNLIMITED = 2**64 - 1
LOCK_BASE = 1 << 30

# Byte offsets, mirrored from vgpu.h (tests/libvgpu/test_regions.py compiles a program that
# prints the C offsets and compares them with this table).
LAYOUT: dict[str, int] = {
    "head.version": 8,
    "head.kind": 12,
    "head.size": 16,
    "head.created_ns": 24,
    "container.container_id": 32,
    "container.max_devices": 40,
    "container.max_procs": 44,
    "container.slot_size": 48,
    "container.slots_offset": 52,
    "container.priority": 56,
    "container.hwm": 60,
    "container.last_launch_ns": 64,
    "container.used": 192,
    "container.limit": 320,
    "container.cores_percent": 448,
    "container.compute": 512,
    "container.name": 2560,
    "container.card": 2624,
    "card.uuid": 0,
    "card.last_launch_ns": 48,
    "card.held_since_ns": 56,
    "card.reclaim": 64,
    "card.size": 80,
    "container.size": 4096 + MAX_PROCS * 320,
    "compute.size": 128,
    "compute.cost_ns": 16,
    "compute.util_permille": 48,
    "slot.pid": 0,
    "slot.host_pid": 4,
    "slot.attached_ns": 16,
    "slot.last_launch_ns": 24,
    "slot.launches": 32,
    "slot.comm": 40,
    "slot.used": 64,
    "slot.overhead": 192,
    "slot.size": 320,
    "node.uuid": 32,
    "node.max_entries": 96,
    "node.entry_size": 100,
    "node.entries_offset": 104,
    "node.size": 256 + NODE_ENTRIES * 128,
    "entry.container_id": 0,
    "entry.priority": 8,
    "entry.cores_percent": 12,
    "entry.memory_limit": 16,
    "entry.memory_used": 24,
    "entry.last_launch_ns": 32,
    "entry.held_since_ns": 40,
    "entry.attached_ns": 48,
    "entry.reclaim": 56,
    "entry.name": 64,
    "entry.size": 128,
    "activity.container_id": 32,
    "activity.last_launch_ns": 40,
    "activity.launches": 48,
    "activity.updated_ns": 56,
    "activity.used": 64,
    "activity.compute_burst_ns": 192,
    "activity.size": 4096,
}

_FLOCK = "hh4xqqi4x"  # struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid


class RegionError(ValueError):
    """A file is not a region this reader understands; the message names the file and why."""


@dataclass(frozen=True)
class ProcessUsage:
    """One process of a container, as its shim recorded it."""

    slot: int
    pid: int  # in the container's pid namespace
    host_pid: int | None  # if the node agent filled it in
    name: str
    alive: bool | None  # None: the kernel could not tell (no OFD locks)
    attached_at: float  # unix seconds
    last_launch_at: float | None  # unix seconds of the last kernel/graph launch, None if never
    launches: int
    memory_bytes: tuple[int, ...]  # per GPU index: allocations + context/module memory
    overhead_bytes: tuple[int, ...]  # per GPU index: the context/module part


@dataclass(frozen=True)
class ContainerUsage:
    """A container region: what the container's processes use, per GPU index."""

    path: str
    container_id: int
    created_at: float
    priority: int
    memory_limit_bytes: tuple[int | None, ...]  # None: no limit
    cores_percent: tuple[int | None, ...]  # None: no limit
    memory_used_bytes: tuple[int, ...]  # sum over live processes
    utilisation_percent: tuple[float | None, ...]  # last measured by the limiter, if limited
    last_launch_at: float | None
    processes: tuple[ProcessUsage, ...]  # live processes (all of them with include_dead=True)

    def idle_seconds(self, now: float | None = None) -> float | None:
        """Seconds since any process of the container launched a kernel (None: never)."""
        if self.last_launch_at is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.last_launch_at)


@dataclass(frozen=True)
class NodeContainer:
    """One container's entry in a GPU's node region."""

    index: int
    container_id: int
    name: str
    priority: int
    cores_percent: int | None
    memory_limit_bytes: int | None
    memory_used_bytes: int
    last_launch_at: float | None
    held_since: float | None  # set while it holds launches for a higher priority
    attached_at: float
    alive: bool | None
    # elastic slices: MiB it waits for within its request while other containers' bursts hold
    # the card's memory (0: none), and since when (unix seconds); see libvgpu.elastic
    reclaim_mib: int = 0
    reclaim_since: float | None = None


@dataclass(frozen=True)
class NodeGPU:
    """A node region: the containers sharing one GPU."""

    uuid: str
    path: str
    containers: tuple[NodeContainer, ...]  # live ones (all with include_dead=True)


@dataclass(frozen=True)
class Activity:
    """An activity file: the container-wide summary for the culler."""

    path: str
    container_id: int
    last_launch_at: float | None
    launches: int
    updated_at: float | None
    memory_used_bytes: tuple[int, ...]
    #: GPU time the container ran above its compute request per GPU, so far (elastic slices;
    #: zeros for a fixed slice, or a file of a shim older than the field)
    compute_burst_ns: tuple[int, ...] = ()

    @property
    def compute_burst_seconds(self) -> float:
        """GPU-seconds run above the compute request, summed over the GPUs (card-seconds)."""
        return sum(self.compute_burst_ns) / 1e9

    def idle_seconds(self, now: float | None = None) -> float | None:
        """Seconds since the container's last kernel launch (None: never launched)."""
        if self.last_launch_at is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.last_launch_at)

    @property
    def last_launch(self) -> float | None:
        """Alias of last_launch_at (the culler's name for it)."""
        return self.last_launch_at

    @property
    def memory_used_mib(self) -> int:
        """Memory in use on all GPUs, MiB."""
        return sum(self.memory_used_bytes) // (1 << 20)


#: a time stamped further ahead than this was forged (or the clock jumped): not trusted
FUTURE_SLACK_SECONDS = 60.0


def _seconds(ns: int) -> float | None:
    """A CLOCK_REALTIME stamp in seconds; None for 0 (never) and for stamps in the future."""
    if not ns or ns / 1e9 > time.time() + FUTURE_SLACK_SECONDS:
        return None
    return ns / 1e9


def _u32(buf: bytes, off: int) -> int:
    return struct.unpack_from("<I", buf, off)[0]


def _i32(buf: bytes, off: int) -> int:
    return struct.unpack_from("<i", buf, off)[0]


def _u64(buf: bytes, off: int) -> int:
    return struct.unpack_from("<Q", buf, off)[0]


def _u64s(buf: bytes, off: int, n: int = MAX_DEVICES) -> tuple[int, ...]:
    return struct.unpack_from(f"<{n}Q", buf, off)


def _cstr(buf: bytes, off: int, n: int) -> str:
    return buf[off : off + n].split(b"\0", 1)[0].decode("utf-8", "replace")


def _load(path: str | os.PathLike[str], kind: int, size: int, what: str, fd: int | None = None) -> tuple[bytes, int]:
    """The file's bytes and an fd kept open for lock probes (the caller closes it); ``fd``: the
    file opened already (e.g. inside a pod's root: :func:`libvgpu.agent.relay.open_in_root`), which
    this takes over, ``path`` then only names it."""
    name = os.fspath(path)
    # never block (a FIFO planted where a region is expected would hang an event loop) and
    # never follow a symlink (any container can write the directories regions live in)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW
    try:
        fd = os.open(name, flags) if fd is None else fd
    except FileNotFoundError as exc:  # not created yet: no process of it initialised CUDA
        raise FileNotFoundError(exc.errno, f"no {what} yet", name) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RegionError(f"{name}: a symbolic link, not a {what}") from exc
        raise RegionError(f"{name}: cannot open the {what} ({exc.strerror})") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RegionError(f"{name}: not a regular file, so not a {what}")
        buf = os.pread(fd, size, 0)
    except RegionError:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise RegionError(f"{name}: cannot read the {what} ({exc.strerror})") from exc
    try:
        if len(buf) < 32 or buf[:8] != MAGIC:
            raise RegionError(f"{name}: not a libvgpu {what} (no LIBVGPU header)")
        version, got_kind = _u32(buf, 8), _u32(buf, 12)
        if version != REGION_VERSION:
            raise RegionError(
                f"{name}: {what} layout version {version}; this reader knows version "
                f"{REGION_VERSION} (update the package on this node)"
            )
        if got_kind != kind:
            names = {KIND_CONTAINER: "container region", KIND_NODE: "node region",
                     KIND_ACTIVITY: "activity file"}
            raise RegionError(f"{name}: is a {names.get(got_kind, 'unknown region')}, not a {what}")
        if st.st_size > size:
            raise RegionError(f"{name}: {st.st_size} bytes, larger than a {what} ({size})")
        if len(buf) < size or _u64(buf, 16) != size:
            raise RegionError(f"{name}: {what} is truncated ({len(buf)} of {size} bytes)")
    except RegionError:
        os.close(fd)
        raise
    return buf, fd


def _locked(fd: int, index: int) -> bool | None:
    """Whether some process holds the liveness lock of slot/entry ``index`` (None: unknown)."""
    probe = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, LOCK_BASE + index, 1, 0)
    try:
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe)
    except (OSError, AttributeError):
        return None
    return struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK


def read_container_region(
    path: str | os.PathLike[str], *, include_dead: bool = False
) -> ContainerUsage:
    """Snapshot of a container region.

    Raises FileNotFoundError when it does not exist yet (no process of the container has
    initialised CUDA), :class:`RegionError` naming what is wrong otherwise.
    """
    size = LAYOUT["container.size"]
    buf, fd = _load(path, KIND_CONTAINER, size, "container region")
    try:
        L = LAYOUT
        hwm = min(_u32(buf, L["container.hwm"]), MAX_PROCS)
        processes: list[ProcessUsage] = []
        totals = [0] * MAX_DEVICES
        for i in range(hwm):
            base = 4096 + i * L["slot.size"]
            pid = _i32(buf, base + L["slot.pid"])
            if not pid:
                continue
            alive = _locked(fd, i)
            if alive is None:
                alive = _pid_alive(pid)
            used = _u64s(buf, base + L["slot.used"])
            if alive is not False:
                totals = [a + b for a, b in zip(totals, used, strict=True)]
            elif not include_dead:
                continue
            host_pid = _i32(buf, base + L["slot.host_pid"])
            processes.append(
                ProcessUsage(
                    slot=i,
                    pid=pid,
                    host_pid=host_pid or None,
                    name=_cstr(buf, base + L["slot.comm"], 16),
                    alive=alive,
                    attached_at=_u64(buf, base + L["slot.attached_ns"]) / 1e9,
                    last_launch_at=_seconds(_u64(buf, base + L["slot.last_launch_ns"])),
                    launches=_u64(buf, base + L["slot.launches"]),
                    memory_bytes=used,
                    overhead_bytes=_u64s(buf, base + L["slot.overhead"]),
                )
            )
        cores = struct.unpack_from(f"<{MAX_DEVICES}I", buf, L["container.cores_percent"])
        util: list[float | None] = []
        for d in range(MAX_DEVICES):
            base = L["container.compute"] + d * L["compute.size"]
            measured = _u64(buf, base + L["compute.cost_ns"])
            permille = _u32(buf, base + L["compute.util_permille"])
            util.append(permille / 10 if cores[d] and measured else None)
        live_launches = [p.last_launch_at for p in processes if p.alive is not False]
        last = max([t for t in live_launches if t] or [0.0]) or None
        header_last = _seconds(_u64(buf, L["container.last_launch_ns"]))
        if header_last and (last is None or header_last > last):
            last = header_last  # launches of processes that have exited count too
        return ContainerUsage(
            path=os.fspath(path),
            container_id=_u64(buf, L["container.container_id"]),
            created_at=_u64(buf, L["head.created_ns"]) / 1e9,
            priority=_i32(buf, L["container.priority"]),
            memory_limit_bytes=tuple(
                None if v == UNLIMITED else v for v in _u64s(buf, L["container.limit"])
            ),
            cores_percent=tuple(c or None for c in cores),
            memory_used_bytes=tuple(totals),
            utilisation_percent=tuple(util),
            last_launch_at=last,
            processes=tuple(processes),
        )
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    return True


def read_node_region(path: str | os.PathLike[str], *, include_dead: bool = False) -> NodeGPU:
    """Snapshot of one GPU's node region (FileNotFoundError / :class:`RegionError` as above)."""
    size = LAYOUT["node.size"]
    buf, fd = _load(path, KIND_NODE, size, "node region")
    try:
        L = LAYOUT
        containers: list[NodeContainer] = []
        for i in range(NODE_ENTRIES):
            base = 256 + i * L["entry.size"]
            cid = _u64(buf, base + L["entry.container_id"])
            if not cid:
                continue
            alive = _locked(fd, i)
            if alive is False and not include_dead:
                continue
            cores = _u32(buf, base + L["entry.cores_percent"])
            limit = _u64(buf, base + L["entry.memory_limit"])
            reclaim = _u64(buf, base + L["entry.reclaim"])
            containers.append(
                NodeContainer(
                    index=i,
                    container_id=cid,
                    name=_cstr(buf, base + L["entry.name"], 64),
                    priority=_i32(buf, base + L["entry.priority"]),
                    cores_percent=cores or None,
                    memory_limit_bytes=None if limit == UNLIMITED else limit,
                    memory_used_bytes=_u64(buf, base + L["entry.memory_used"]),
                    last_launch_at=_seconds(_u64(buf, base + L["entry.last_launch_ns"])),
                    held_since=_seconds(_u64(buf, base + L["entry.held_since_ns"])),
                    attached_at=_u64(buf, base + L["entry.attached_ns"]) / 1e9,
                    alive=alive,
                    reclaim_mib=reclaim & 0xFFFFFFFF,
                    reclaim_since=float(reclaim >> 32) if reclaim & 0xFFFFFFFF else None,
                )
            )
        return NodeGPU(
            uuid=_cstr(buf, L["node.uuid"], 64), path=os.fspath(path), containers=tuple(containers)
        )
    finally:
        os.close(fd)


def read_node_regions(
    directory: str | os.PathLike[str], *, include_dead: bool = False
) -> dict[str, NodeGPU]:
    """Every GPU's node region in ``directory`` (``node_region_dir``), by GPU uuid.

    Files that are not node regions (or are mid-creation) are skipped; a missing directory
    reads as no GPUs.
    """
    found: dict[str, NodeGPU] = {}
    root = Path(directory)
    if not root.is_dir():
        return found
    for entry in sorted(root.glob("*.region")):
        try:
            gpu = read_node_region(entry, include_dead=include_dead)
        except (RegionError, FileNotFoundError):
            continue
        found[gpu.uuid] = gpu
    return found


def read_activity(path: str | os.PathLike[str], fd: int | None = None) -> Activity:
    """The activity file (FileNotFoundError while no process of the container initialised
    CUDA; :class:`RegionError` naming what is wrong otherwise); ``fd``: as :func:`_load`'s."""
    buf, fd = _load(path, KIND_ACTIVITY, LAYOUT["activity.size"], "activity file", fd)
    os.close(fd)
    L = LAYOUT
    return Activity(
        path=os.fspath(path),
        container_id=_u64(buf, L["activity.container_id"]),
        last_launch_at=_seconds(_u64(buf, L["activity.last_launch_ns"])),
        launches=_u64(buf, L["activity.launches"]),
        updated_at=_seconds(_u64(buf, L["activity.updated_ns"])),
        memory_used_bytes=_u64s(buf, L["activity.used"]),
        compute_burst_ns=_u64s(buf, L["activity.compute_burst_ns"]),
    )



#: The program that prepares a container region with the shim's own code: run it as
#: ``python3 -I -S -c PREPARE_SOURCE <region> <activity>`` with ``LD_PRELOAD`` naming libvgpu.so
#: (:func:`prepare_container_region` here; a 'native' GPU pod's init container on Kubernetes).
#: With ``--node <dir> <uuid>...`` it prepares node regions instead (:func:`prepare_node_regions`).
PREPARE_SOURCE = """import ctypes, sys
why = ctypes.create_string_buffer(1024)
shim = ctypes.CDLL(None)
if sys.argv[1:2] == ["--node"]:
    for uuid in sys.argv[3:]:
        if shim.libvgpu_prepare_node_region(sys.argv[2].encode(), uuid.encode(), why, len(why)):
            sys.exit(why.value.decode(errors="replace"))
    sys.exit(0)
rc = shim.libvgpu_prepare_region(*(a.encode() for a in sys.argv[1:]), why, len(why))
sys.exit(why.value.decode(errors="replace") if rc else 0)
"""


def _prepare(*args: str) -> None:
    """Run :data:`PREPARE_SOURCE` with ``args`` in a short Python with ``libvgpu.so`` preloaded
    (the shim's thread-local storage cannot be dlopened into a running process)."""
    import subprocess
    import sys

    from . import library_path

    proc = subprocess.run([sys.executable, "-I", "-S", "-c", PREPARE_SOURCE, *args],
                          env={"LD_PRELOAD": library_path()}, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RegionError((proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])


def prepare_container_region(region: str | os.PathLike[str], activity: str | os.PathLike[str] = "") -> None:
    """Create (or check) a container region and its activity file as the shim would on its first
    CUDA call, with the shim's own code (``libvgpu_prepare_region``), so that they can be placed
    in a directory the container cannot write: there it can neither unlink, rename nor replace
    them, and so never start a region of its own (a fresh limit). Raises :class:`RegionError`
    naming the file and the problem."""
    _prepare(os.fspath(region), os.fspath(activity))


def prepare_node_regions(directory: str | os.PathLike[str], uuids: Sequence[str]) -> None:
    """Create (or check) the node region of each card in ``uuids`` under ``directory`` as the
    shim would (``libvgpu_prepare_node_region``, mode 0666), so that the directory can stay the
    node agent's: GPU containers map their card's region but can neither unlink, rename nor
    replace it (which would split the node's containers into two that no longer see each
    other). Raises :class:`RegionError` naming the file and the problem."""
    if uuids:
        _prepare("--node", os.fspath(directory), *uuids)
