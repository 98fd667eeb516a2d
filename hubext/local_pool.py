"""LocalPool: the GPUs of this one machine, and a small SQLite ledger of who holds which slice.

Inventory comes from NVML (``pynvml``, from the ``nvidia-ml-py`` package) when a driver is
present, or from a simulated inventory (``LocalPool.simulate_gpus = "2xH100-80GB"``) so the
whole flow runs on a machine without a GPU; pages and the spawn form then say so.

Holders are local processes: a single-user server or a GPU kernel, identified by the process
id of its process-group leader (``bind(allocation_id, str(pid))``). The ledger survives a hub
restart: allocations whose process is still running are kept, those whose process died (or
that were never bound to one, because the hub stopped mid-spawn) are dropped.

The pool also writes what a holder needs for the shim: a read-only limits file per
allocation (``LIBVGPU_CONFIG``) in a directory only the hub can write, and a region
directory (see :meth:`LocalPool.holder_env`), so the local spawner and the broker's local
kernels prepare holders the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from traitlets import Bool, Float, Unicode

from quotas import GPU, Allocation, ConfigError, Node, Owner, Pool, parse_simulated

from . import labels as L
from .pool import GoneCallback, PoolBackend

LEDGER_FILE = "elastic-gpu-ledger.sqlite"
MIB = 1024 * 1024

_metadata = sa.MetaData()
ALLOCATIONS = sa.Table(
    "allocations",
    _metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("holder", sa.String, nullable=True),
    sa.Column("holder_started", sa.String, nullable=True),
    sa.Column("recorded_at", sa.Float, nullable=False),
    sa.Column("bound_at", sa.Float, nullable=True),
)
INVENTORY = sa.Table(
    "inventory",
    _metadata,
    sa.Column("key", sa.String, primary_key=True),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("simulated", sa.Boolean, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
EVENTS = sa.Table(
    "events",
    _metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("allocation_id", sa.String, nullable=False),
    sa.Column("user", sa.String, nullable=False),
    sa.Column("kind", sa.String, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
)


# ---- plain-data helpers (also used by the CLI and the admin page) ------------------------------


def allocation_to_dict(allocation: Allocation) -> dict[str, Any]:
    """A JSON-ready dict of an allocation (the ledger's and the API's format)."""
    return {
        "id": allocation.id,
        "user": allocation.owner.user,
        "namespace": allocation.owner.namespace,
        "workspace": allocation.owner.workspace,
        "node": allocation.node,
        "gpu_uuids": list(allocation.gpu_uuids),
        "memory_mib": allocation.memory_mib,
        "cores_percent": allocation.cores_percent,
        "priority_class": allocation.priority_class,
        "whole": allocation.whole,
        "borrowed": allocation.borrowed,
        "kind": allocation.kind,
        "created_at": allocation.created_at,
    }


def allocation_from_dict(data: dict[str, Any]) -> Allocation:
    """The inverse of :func:`allocation_to_dict`."""
    return Allocation(
        id=data["id"],
        owner=Owner(user=data["user"], namespace=data["namespace"], workspace=data["workspace"]),
        node=data["node"],
        gpu_uuids=tuple(data["gpu_uuids"]),
        memory_mib=int(data["memory_mib"]),
        cores_percent=int(data["cores_percent"]),
        priority_class=data["priority_class"],
        whole=bool(data.get("whole", False)),
        borrowed=bool(data.get("borrowed", False)),
        kind=data.get("kind", "notebook"),
        created_at=float(data.get("created_at", 0.0)),
    )


def gpu_to_dict(gpu: GPU) -> dict[str, Any]:
    """A GPU in load_pool's format."""
    return {
        "uuid": gpu.uuid,
        "model": gpu.model,
        "memory_mib": gpu.memory_mib,
        "sm_count": gpu.sm_count,
        "mode": getattr(gpu.mode, "value", str(gpu.mode)),
        "mig_profiles": list(gpu.mig_profiles),
        "index": gpu.index,
        "memory_oversub": gpu.memory_oversub,
        "cores_oversub": gpu.cores_oversub,
    }


def pool_to_dict(pool: Pool) -> list[dict[str, Any]]:
    return [{"name": node.name, "gpus": [gpu_to_dict(g) for g in node.gpus]} for node in pool.nodes]


def model_name(nvml_name: str) -> str:
    """A compact GPU model name from NVML's: 'NVIDIA H100 80GB HBM3' -> 'H100-80GB-HBM3'."""
    name = nvml_name.strip()
    for prefix in ("NVIDIA ", "Tesla "):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return "-".join(name.split()) or "GPU"


def detect_nvml_gpus() -> list[GPU]:
    """The GPUs NVML reports, in index order; [] when there is no driver or no GPU."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return []
    gpus = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
            if isinstance(name, bytes):
                name = name.decode()
            memory_mib = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total // MIB)
            try:
                sm_count = int(pynvml.nvmlDeviceGetAttributes_v2(handle).multiprocessorCount)
            except Exception:
                sm_count = 0
            gpus.append(GPU(uuid=uuid, model=model_name(name), memory_mib=memory_mib, sm_count=sm_count, index=index))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return gpus


def nvml_activity() -> dict[str, dict[str, int]]:
    """Per GPU uuid: utilization_percent and memory_used_mib from NVML ({} without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    out: dict[str, dict[str, int]] = {}
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
            entry: dict[str, int] = {}
            try:
                entry["utilization_percent"] = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                pass
            try:
                entry["memory_used_mib"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used // MIB)
            except Exception:
                pass
            out[uuid] = entry
    except Exception:
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def process_start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), or None if unknown.

    Stored with the holder so that a recycled pid is not mistaken for the original process.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, when ``started`` is given, is the same process."""
    if pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        stat = ""
    if stat:
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields and fields[0] in ("Z", "X"):
            return False
        if started is not None and len(fields) > 19 and fields[19] != started:
            return False
        return True
    try:  # no /proc: ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shim_library() -> str:
    """Path of the built libvgpu.so, or '' when the shim is not built/installed."""
    try:
        from libvgpu import library_path
    except ImportError:
        return ""
    try:
        path = library_path()
    except Exception:  # not built
        return ""
    return path if path and os.path.exists(path) else ""


class Ledger:
    """The SQLite ledger, usable without a hub (``elastic-gpu status`` when the hub is down)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.engine = sa.create_engine(f"sqlite:///{self.path}", future=True)
        _metadata.create_all(self.engine)

    def rows(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            result = conn.execute(sa.select(ALLOCATIONS).order_by(ALLOCATIONS.c.recorded_at))
            return [dict(r._mapping) for r in result]

    def allocations(self) -> list[Allocation]:
        return [allocation_from_dict(json.loads(r["data"])) for r in self.rows()]

    def holders(self) -> dict[str, str | None]:
        return {r["id"]: r["holder"] for r in self.rows()}

    def insert(self, allocation: Allocation) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.delete(ALLOCATIONS).where(ALLOCATIONS.c.id == allocation.id))
            conn.execute(
                sa.insert(ALLOCATIONS).values(
                    id=allocation.id,
                    data=json.dumps(allocation_to_dict(allocation)),
                    holder=None,
                    recorded_at=time.time(),
                )
            )

    def set_holder(self, allocation_id: str, holder: str, started: str | None) -> bool:
        with self.engine.begin() as conn:
            result = conn.execute(
                sa.update(ALLOCATIONS)
                .where(ALLOCATIONS.c.id == allocation_id)
                .values(holder=holder, holder_started=started, bound_at=time.time())
            )
            return result.rowcount > 0

    def delete(self, allocation_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.delete(ALLOCATIONS).where(ALLOCATIONS.c.id == allocation_id))

    def save_inventory(self, pool: Pool, simulated: bool) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.delete(INVENTORY).where(INVENTORY.c.key == "pool"))
            conn.execute(
                sa.insert(INVENTORY).values(
                    key="pool", data=json.dumps(pool_to_dict(pool)), simulated=simulated, updated_at=time.time()
                )
            )

    def inventory(self) -> tuple[list[dict[str, Any]], bool] | None:
        """The last inventory a hub saw (nodes as dicts, simulated), or None if never recorded."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(INVENTORY).where(INVENTORY.c.key == "pool")).first()
        if row is None:
            return None
        return json.loads(row.data), bool(row.simulated)

    def add_event(self, allocation: Allocation, kind: str, reason: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                sa.insert(EVENTS).values(
                    at=time.time(), allocation_id=allocation.id, user=allocation.owner.user, kind=kind, reason=reason
                )
            )

    def events(self, limit: int = 20) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            result = conn.execute(sa.select(EVENTS).order_by(EVENTS.c.seq.desc()).limit(limit))
            return [{k: v for k, v in dict(r._mapping).items() if k != "seq"} for r in result]

    def close(self) -> None:
        self.engine.dispose()


class LocalPool(PoolBackend):
    """The GPUs of this machine (NVML or simulated) with a SQLite ledger of local processes."""

    simulate_gpus = Unicode(
        "",
        config=True,
        help="""Simulated GPU inventory, e.g. '2xH100-80GB' or '2xH100-80GB,1xA100-40GB'.
        Set it to run the whole flow without a GPU (nothing runs on a real card then, and the
        spawn form and admin page say the GPUs are simulated). When set, it is used even if
        NVML finds real GPUs. Default: '' (use the GPUs NVML finds).""",
    )
    data_dir = Unicode(
        "",
        config=True,
        help="""Directory of the ledger (elastic-gpu-ledger.sqlite), the limits files
        (limits/, written by the hub, read-only for users) and the shim's regions (regions/).
        Default: '' (the hub's working directory).""",
    )
    node_name = Unicode(
        "localhost",
        config=True,
        help="Name of this machine's node in the pool and in allocations. Default: 'localhost'.",
    )
    check_interval_seconds = Float(
        5.0,
        config=True,
        help="Seconds between checks for holders (servers, kernels) whose process has exited. Default: 5.",
    )
    evict_grace_seconds = Float(
        10.0,
        config=True,
        help="""Seconds a preempted holder's process group gets between SIGTERM and SIGKILL.
        Default: 10.""",
    )
    preload_shim = Bool(
        True,
        config=True,
        help="""Preload libvgpu.so (LD_PRELOAD) into GPU notebooks and kernels when the shim is
        built. Without it the limits file is still written but nothing enforces it. Default: True.""",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.simulated = False
        self.ledger: Ledger | None = None
        self._pool: Pool | None = None
        self._on_gone: GoneCallback | None = None
        self._task: asyncio.Task | None = None
        self._evicted: set[str] = set()
        self._kill_tasks: set[asyncio.Task] = set()

    # ---- paths ------------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        return Path(self.data_dir or os.getcwd()).resolve()

    @property
    def ledger_path(self) -> Path:
        return self.root / LEDGER_FILE

    @property
    def limits_dir(self) -> Path:
        return self.root / "limits"

    @property
    def regions_dir(self) -> Path:
        return self.root / "regions"

    def limits_path(self, allocation_id: str) -> Path:
        return self.limits_dir / f"{_safe_name(allocation_id)}.conf"

    # ---- PoolBackend ------------------------------------------------------------------------

    async def start(self, on_gone: GoneCallback) -> None:
        self._on_gone = on_gone
        self.root.mkdir(parents=True, exist_ok=True)
        for directory, mode in ((self.limits_dir, 0o755), (self.regions_dir, 0o755)):
            directory.mkdir(exist_ok=True)
            os.chmod(directory, mode)
        node_regions = self.regions_dir / "node"
        node_regions.mkdir(exist_ok=True)
        os.chmod(node_regions, 0o1777)  # shared by every holder on the node, like /tmp
        self.ledger = Ledger(self.ledger_path)
        self._pool = self._detect()
        self.ledger.save_inventory(self._pool, self.simulated)
        self._drop_stale()
        self._task = asyncio.ensure_future(self._watch())

    def _detect(self) -> Pool:
        if self.simulate_gpus:
            try:
                pool = parse_simulated(self.simulate_gpus, node=self.node_name)
            except ConfigError as e:
                raise ConfigError(f"LocalPool.simulate_gpus: {e}") from None
            self.simulated = True
            return pool
        gpus = detect_nvml_gpus()
        if not gpus:
            self.log.warning(
                "No NVIDIA GPU found through NVML and LocalPool.simulate_gpus is not set: "
                "the pool is empty (set simulate_gpus, e.g. '2xH100-80GB', to try the flow without a GPU)."
            )
        self.simulated = False
        return Pool(nodes=(Node(self.node_name, tuple(gpus)),))

    def _drop_stale(self) -> None:
        """Drop allocations whose process is gone or that never got one (hub stopped mid-spawn)."""
        for row in self.ledger.rows():
            holder, started = row["holder"], row["holder_started"]
            why = ""
            if holder is None:
                why = "never bound to a process (the hub stopped while it started)"
            elif holder.isdigit() and not process_alive(int(holder), started):
                why = f"its process {holder} is no longer running"
            if why:
                self.log.info("GPU ledger: dropping %s: %s", row["id"], why)
                self.ledger.delete(row["id"])
                self._remove_files(row["id"])

    async def inventory(self) -> Pool:
        if self._pool is None:
            self._pool = self._detect()
        return self._pool

    async def allocations(self) -> list[Allocation]:
        return self.ledger.allocations() if self.ledger else []

    async def record(self, allocation: Allocation) -> None:
        self.ledger.insert(allocation)

    async def bind(self, allocation_id: str, holder: str) -> None:
        """Tie an allocation to a process id (the holder's process-group leader), as a decimal string."""
        holder = str(holder)
        started = process_start_time(int(holder)) if holder.isdigit() else None
        if not holder.isdigit():
            self.log.warning(
                "GPU ledger: holder %r of %s is not a process id; it is never checked", holder, allocation_id
            )
        if not self.ledger.set_holder(allocation_id, holder, started):
            if allocation_id in self._evicted and holder.isdigit():
                self.log.warning(
                    "GPU ledger: %s was preempted before process %s started; stopping it", allocation_id, holder
                )
                self._kill_group(int(holder))
            else:
                self.log.warning("GPU ledger: bind of unknown allocation %s to %s ignored", allocation_id, holder)

    async def forget(self, allocation_id: str) -> None:
        if self.ledger is not None:
            self.ledger.delete(allocation_id)
        self._remove_files(allocation_id)

    async def evict(self, allocation: Allocation, reason: str) -> None:
        self._evicted.add(allocation.id)
        holder = self.ledger.holders().get(allocation.id) if self.ledger else None
        self.log.warning(
            "GPU preemption: stopping %s of %s (holder %s): %s", allocation.id, allocation.owner.user, holder, reason
        )
        if self.ledger is not None:
            self.ledger.add_event(allocation, "preempted", reason)
        if holder and holder.isdigit():
            self._kill_group(int(holder))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if self.ledger is not None:
            self.ledger.close()

    # ---- what holders need -------------------------------------------------------------------

    def holder_env(
        self,
        allocation: Allocation,
        priority_value: int,
        uid: int | None = None,
        gid: int | None = None,
    ) -> dict[str, str]:
        """Write the allocation's limits file and region directory; return the holder's environment.

        The limits file is mode 0444 in a 0755 directory owned by the hub's user, so a user whose
        processes run under their own uid cannot change their limits. The region directory is
        given to ``uid``/``gid`` (the holder's user) when the hub runs as root.
        """
        limits = self.limits_path(allocation.id)
        region_dir = self.regions_dir / _safe_name(allocation.id)
        region_dir.mkdir(exist_ok=True)
        if uid is not None and os.geteuid() == 0:
            os.chown(region_dir, uid, gid if gid is not None else -1)
        os.chmod(region_dir, 0o700)
        text = L.limits_file_text(
            allocation,
            priority_value,
            container_region=str(region_dir / "container.region"),
            node_region_dir=str(self.regions_dir / "node"),
            activity_file=str(region_dir / "activity"),
        )
        tmp = limits.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o444)
        os.replace(tmp, limits)
        env = {
            "LIBVGPU_CONFIG": str(limits),
            "LIBVGPU_CONTAINER_REGION": str(region_dir / "container.region"),
            "LIBVGPU_NODE_REGION_DIR": str(self.regions_dir / "node"),
            "CUDA_VISIBLE_DEVICES": ",".join(allocation.gpu_uuids),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "ELASTIC_GPU_ALLOCATION_ID": allocation.id,
        }
        library = shim_library() if self.preload_shim else ""
        if library:
            env["LD_PRELOAD"] = library
        elif self.preload_shim and not self.simulated:
            self.log.warning("libvgpu.so is not built: GPU limits of %s are not enforced", allocation.id)
        return env

    def activity(self) -> dict[str, dict[str, int]]:
        """Per GPU uuid: utilization_percent and memory_used_mib (real GPUs only; {} if simulated)."""
        return {} if self.simulated else nvml_activity()

    def events(self, limit: int = 20) -> list[dict[str, Any]]:
        """Recent preemptions, newest first."""
        return self.ledger.events(limit) if self.ledger else []

    # ---- internals ---------------------------------------------------------------------------

    def _remove_files(self, allocation_id: str) -> None:
        self.limits_path(allocation_id).unlink(missing_ok=True)
        shutil.rmtree(self.regions_dir / _safe_name(allocation_id), ignore_errors=True)

    def _kill_group(self, pid: int) -> None:
        _signal_group(pid, signal.SIGTERM)
        task = asyncio.ensure_future(self._kill_later(pid))
        self._kill_tasks.add(task)
        task.add_done_callback(self._kill_tasks.discard)

    async def _kill_later(self, pid: int) -> None:
        deadline = time.monotonic() + self.evict_grace_seconds
        while time.monotonic() < deadline:
            if not process_alive(pid):
                return
            await asyncio.sleep(0.2)
        self.log.warning(
            "GPU preemption: process group %d did not stop in %s s; killing it", pid, self.evict_grace_seconds
        )
        _signal_group(pid, signal.SIGKILL)

    async def _watch(self) -> None:
        """Notice holders that died and tell the allocator (which releases their slices)."""
        while True:
            await asyncio.sleep(self.check_interval_seconds)
            try:
                await self.check_holders()
            except Exception:
                self.log.exception("GPU ledger: checking holders failed")

    async def check_holders(self) -> list[str]:
        """Report allocations whose bound process has exited (``on_gone``); return their ids."""
        gone = []
        for row in self.ledger.rows():
            holder, started = row["holder"], row["holder_started"]
            if holder and holder.isdigit() and not process_alive(int(holder), started):
                gone.append(row["id"])
                why = f"process {holder} exited"
                if self._on_gone is not None:
                    await self._on_gone(row["id"], why)
                else:
                    await self.forget(row["id"])
        return gone


def _signal_group(pid: int, sig: int) -> None:
    """Signal the process group led by ``pid`` (holders start their own session), else ``pid`` alone."""
    try:
        os.killpg(pid, sig)
        return
    except OSError:
        pass
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _safe_name(allocation_id: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in allocation_id)
