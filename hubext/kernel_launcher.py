"""Where GPU kernels run: the launcher contract and its local and Kubernetes implementations.

The broker (``hubext.broker``) decides *whether* a kernel may have a GPU slice; a launcher
only makes the kernel exist, with the slice it was given, and answers what became of it.
Callers see :class:`KernelLauncher` only.

- :class:`LocalKernelLauncher`: a local process (single-machine mode). The hub writes the
  connection file (0600, the kernel's key) and the shim's limits file into a per-kernel
  directory the user cannot write, and keeps a small JSON ledger of kernels (pid, ports,
  allocation) so that a restarted hub finds its kernels again.
- :class:`KubernetesKernelLauncher`: a kernel pod holding the slice (written by
  ``hubext.kube_spawner.apply_gpu_to_pod``), its connection key in a Secret mounted as a
  file, owned by the user's server pod (so Kubernetes garbage-collects it with the server),
  no service account token, and a per-kernel NetworkPolicy admitting only the user's server.
  The labelled pods are the ledger.

A kernel keeps its slice across restarts: a restart starts the replacement process or pod
first (new ports, same allocation), then stops the old one, so the allocation is held by a
live holder at every instant.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shlex
import signal
import socket
import sys
import time
from abc import ABCMeta, abstractmethod
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from traitlets import Bool, Dict, Float, Integer, List, Unicode, default
from traitlets.config import LoggingConfigurable

from quotas import Allocation

from . import labels as L

PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


STATES = ("pending", "running", "stopped", "failed")


class LaunchError(Exception):
    """A kernel could not be created; ``message`` is a sentence for the user, ``status`` the HTTP status."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class ServerRef:
    """The user's server a kernel belongs to (its lifetime bounds the kernel's)."""

    user: str
    name: str = ""
    #: what identifies this run of the server: a pid (local), or pod uid + restart count (Kubernetes)
    identity: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    namespace: str = ""
    pod_labels: dict[str, str] = field(default_factory=dict)
    #: local: the unix account to run the kernel as ('' = the hub's own account)
    unix_user: str = ""
    home: str = ""
    #: the spawner's GPU settings (backend, runtime class, ...) when it has them
    gpu_settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class KernelRecord:
    """What the broker knows about one GPU kernel (never its key)."""

    id: str
    user: str
    server_name: str
    size: str
    allocation_id: str
    section: dict[str, Any] = field(default_factory=dict)
    state: str = "pending"
    reason: str = ""
    ip: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    transport: str = "tcp"
    signature_scheme: str = "hmac-sha256"
    server_identity: str = ""
    holder: str = ""  # a pid (local) or a pod name (Kubernetes)
    namespace: str = ""
    generation: int = 0
    created_at: float = 0.0
    exit_code: int | None = None
    cwd: str = ""
    kernel_name: str = ""
    jupyter_kernel_id: str = ""  # the kernel's id on the user's server (what the culler shuts down)
    allocation: dict[str, Any] = field(default_factory=dict)  # where the slice is (node, GPUs, limits)
    activity_file: str = ""  # local: the shim's activity record of the slice (for the culler)
    #: Kubernetes: {last_launch, memory_used_mib} from the node agent's gpu-activity pod annotation
    activity: dict[str, Any] = field(default_factory=dict)
    run_as: str = ""  # local: the unix account the kernel runs as ('' = the hub's)
    home: str = ""  # local: the user's home (HOME, default working directory)

    def model(self) -> dict[str, Any]:
        """The REST model (``GET /hub/api/gpu/kernels/<id>``)."""
        return {
            "id": self.id,
            "user": self.user,
            "server_name": self.server_name,
            "size": self.size,
            "allocation_id": self.allocation_id,
            "gpu": self.section,
            "state": self.state,
            "reason": self.reason,
            "ip": self.ip,
            "transport": self.transport,
            "signature_scheme": self.signature_scheme,
            **{name: self.ports.get(name, 0) for name in PORT_NAMES},
            "generation": self.generation,
            "holder": self.holder,
            "created_at": self.created_at,
            "exit_code": self.exit_code,
            "kernel_name": self.kernel_name,
            "kernel_id": self.jupyter_kernel_id,
            "profile": self.size,
            "allocation": self.allocation,
            **{
                k: self.allocation[k] for k in ("memory_mib", "cores_percent", "priority_class") if k in self.allocation
            },
            "gpu_count": len(self.allocation.get("gpu_uuids", [])) or self.section.get("count", 1),
            "workspace": self.allocation.get("workspace", ""),
            **({"activity_file": self.activity_file} if self.activity_file else {}),
            **({"activity": self.activity} if self.activity else {}),
        }

    def set_allocation(self, allocation: Allocation) -> None:
        self.allocation_id = allocation.id
        self.allocation = {
            "id": allocation.id,
            "node": allocation.node,
            "gpu_uuids": list(allocation.gpu_uuids),
            "memory_mib": allocation.memory_mib,
            "cores_percent": allocation.cores_percent,
            "priority_class": allocation.priority_class,
            "workspace": allocation.owner.workspace,
            "namespace": allocation.owner.namespace,
            "borrowed": allocation.borrowed,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def free_local_ports(ip: str, count: int = 5) -> list[int]:
    """Ports free on ``ip`` right now (jupyter_client's approach: bind to 0, read, close)."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((ip, 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


class _LauncherMeta(ABCMeta, type(LoggingConfigurable)):  # type: ignore[misc]
    """ABCMeta combined with traitlets' metaclass."""


class KernelLauncher(LoggingConfigurable, metaclass=_LauncherMeta):
    """Makes GPU kernels exist and reports on them. Implementations do the I/O."""

    kernel_cmd = List(
        Unicode(),
        config=True,
        help="""The kernel's command line; '{connection_file}' is replaced by the path of the
        connection file. Default: the Python of the launcher ('python' in pods) running
        ipykernel_launcher.""",
    )

    @abstractmethod
    async def start(self) -> list[KernelRecord]:
        """Connect, and return the kernels that exist (the ledger), so a restarted hub keeps them."""

    @abstractmethod
    async def server_ref(self, spawner: Any) -> ServerRef:
        """Describe the user's running server (``spawner``) that will own a kernel."""

    @abstractmethod
    async def server_alive(self, record: KernelRecord, spawner: Any | None) -> bool:
        """Whether the server instance that owns ``record`` still exists (None: no spawner)."""

    @abstractmethod
    async def launch(self, record: KernelRecord, allocation: Allocation, key: str, server: ServerRef) -> None:
        """Create the kernel; fill ``record`` (ip, ports, holder, state). Leaves nothing behind on error."""

    @abstractmethod
    async def restart(self, record: KernelRecord, allocation: Allocation, server: ServerRef | None) -> None:
        """Start a new kernel process in the same allocation (new ports), then stop the old one."""

    @abstractmethod
    async def refresh(self, record: KernelRecord) -> None:
        """Update ``record.state``/``reason``/``ip`` from what really runs."""

    @abstractmethod
    async def delete(self, record: KernelRecord) -> None:
        """Stop the kernel and remove everything made for it. Idempotent."""

    async def interrupt(self, record: KernelRecord) -> bool:
        """Interrupt by signal where possible; False when this launcher cannot (use the control channel)."""
        return False

    @abstractmethod
    async def sweep(self, known: set[str]) -> list[str]:
        """Delete kernels (processes, pods and their objects) whose id is not in ``known``; return their ids."""

    async def stop(self) -> None:
        """Release connections."""

    def persist(self, records: Iterable[KernelRecord]) -> None:
        """Save the ledger where the launcher keeps one (local); no-op where the pods are the ledger."""


# ---------------------------------------------------------------------------------------------
# local processes
# ---------------------------------------------------------------------------------------------


def _proc_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _proc_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _library_path() -> str:
    """libvgpu.so when it is built, else ''."""
    try:
        import libvgpu

        path = libvgpu.library_path()
    except Exception:
        return ""
    return path if path and os.path.exists(path) else ""


class LocalKernelLauncher(KernelLauncher):
    """GPU kernels as local processes, with the shim preloaded and a hub-written limits file.

    Layout (``state_dir``, owned by the hub, mode 0711)::

        kernels.json              the ledger: one record per kernel (pid, ports, allocation)
        <kernel id>/              0711, hub-owned: the kernel cannot replace its limits
            connection.json       0600, owned by the kernel's account: the key
            limits.conf           0444: libvgpu's limits (LIBVGPU_CONFIG)
            region/               0700, the kernel's account: libvgpu's container region
            kernel.log            the kernel's stdout/stderr
    """

    state_dir = Unicode(
        "",
        config=True,
        help="""Directory for the kernels' ledger, connection files and limits files. It must
        not be writable by users. Default: '<LocalPool.data_dir>/kernels' when that is set,
        else './elastic-gpu-data/kernels' under the hub's working directory.""",
    )
    ip = Unicode("127.0.0.1", config=True, help="Address local kernels listen on. Default: 127.0.0.1.")
    preload_shim = Bool(
        True,
        config=True,
        help="Preload libvgpu.so (LD_PRELOAD) into kernels when it is built. Default: True.",
    )
    env_keep = List(
        Unicode(),
        ["PATH", "PYTHONPATH", "CONDA_ROOT", "CONDA_DEFAULT_ENV", "VIRTUAL_ENV", "LANG", "LC_ALL", "LD_LIBRARY_PATH"],
        config=True,
        help="Environment variables of the hub passed on to local kernels.",
    )
    environment = Dict(
        Unicode(),
        config=True,
        help="Extra environment variables for local kernels.",
    )
    stop_grace_seconds = Float(
        3.0, config=True, help="Seconds between SIGTERM and SIGKILL when a kernel is stopped. Default: 3."
    )

    @default("kernel_cmd")
    def _default_kernel_cmd(self) -> list[str]:
        return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._watchers: set[asyncio.Task] = set()
        self._warned_no_shim = False

    # ---- paths -------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir)
        pool_dir = ""
        try:
            pool_dir = self.config.LocalPool.data_dir if "data_dir" in self.config.LocalPool else ""
        except AttributeError:
            pool_dir = ""
        base = Path(pool_dir) if pool_dir else Path.cwd() / "elastic-gpu-data"
        return base / "kernels"

    @property
    def ledger_path(self) -> Path:
        return self.root / "kernels.json"

    def kernel_dir(self, kernel_id: str) -> Path:
        return self.root / kernel_id

    # ---- ledger ------------------------------------------------------------------------

    def persist(self, records: Iterable[KernelRecord]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        data = {"version": 1, "kernels": [r.to_json() for r in records]}
        tmp = self.ledger_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.ledger_path)

    def _load_ledger(self) -> list[KernelRecord]:
        try:
            data = json.loads(self.ledger_path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            self.log.error("GPU kernel ledger %s is unreadable (%s); starting with no kernels", self.ledger_path, e)
            return []
        records = []
        for item in data.get("kernels", []):
            try:
                records.append(KernelRecord.from_json(item))
            except TypeError as e:
                self.log.error("Skipping a damaged GPU kernel record in %s: %s", self.ledger_path, e)
        return records

    def _is_our_process(self, record: KernelRecord) -> bool:
        try:
            pid = int(record.holder)
        except ValueError:
            return False
        if not _proc_alive(pid):
            return False
        cmdline = _proc_cmdline(pid)
        conn = str(self.kernel_dir(record.id) / "connection.json")
        return not cmdline or any(conn in part for part in cmdline)

    async def start(self) -> list[KernelRecord]:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        records = []
        for record in self._load_ledger():
            if record.state in ("pending", "running") and not self._is_our_process(record):
                record.state, record.reason = "stopped", "the kernel process ended while the hub was down"
            records.append(record)
        alive = sum(1 for r in records if r.state in ("pending", "running"))
        self.log.info("Local GPU kernels: %d in the ledger, %d running", len(records), alive)
        return records

    # ---- the user's server ---------------------------------------------------------------

    async def server_ref(self, spawner: Any) -> ServerRef:
        from jupyterhub.spawner import LocalProcessSpawner

        unix_user = ""
        if os.geteuid() == 0:
            if hasattr(spawner, "gpu_user_ids"):  # hubext.local_spawner: (None, None) = the hub's account
                uid, _gid = spawner.gpu_user_ids()
                unix_user = spawner.user.name if uid not in (None, 0) else ""
            elif (
                isinstance(spawner, LocalProcessSpawner)
                and type(spawner).make_preexec_fn is LocalProcessSpawner.make_preexec_fn
            ):
                unix_user = spawner.user.name
        home = getattr(spawner, "home_dir", "") or ""
        if not home and unix_user:
            import pwd

            home = pwd.getpwnam(unix_user).pw_dir
        pid = getattr(spawner, "pid", 0) or 0
        return ServerRef(
            user=spawner.user.name,
            name=spawner.name or "",
            identity=str(pid) if pid else "",
            unix_user=unix_user,
            home=home,
        )

    async def server_alive(self, record: KernelRecord, spawner: Any | None) -> bool:
        if spawner is None or not spawner.active:
            return False
        if spawner.pending:  # starting or stopping: judge on the next round
            return True
        pid = getattr(spawner, "pid", 0) or 0
        if record.server_identity and pid and str(pid) != record.server_identity:
            return False  # the server was restarted: this kernel belonged to the old one
        if pid:
            return _proc_alive(pid)
        return await spawner.poll() is None

    # ---- launch --------------------------------------------------------------------------

    def _ids(self, record: KernelRecord) -> tuple[int, int]:
        if not record.run_as:
            return -1, -1
        import pwd

        pw = pwd.getpwnam(record.run_as)
        return pw.pw_uid, pw.pw_gid

    def _gpu_env(self, record: KernelRecord, allocation: Allocation) -> dict[str, str]:
        """The shim's files and environment: the pool's (same as notebooks') when it writes them."""
        from .allocator import GPUAllocator

        allocator = GPUAllocator.instance()
        priority = allocator.priority_value(allocation.priority_class) if allocator.config_data else 0
        uid, gid = self._ids(record)
        backend = allocator.backend if allocator.config_data else None
        if backend is not None and hasattr(backend, "holder_env"):  # hubext.local_pool.LocalPool
            return backend.holder_env(allocation, priority, None if uid < 0 else uid, None if gid < 0 else gid)
        kdir = self.kernel_dir(record.id)
        region = kdir / "region"
        region.mkdir(exist_ok=True)
        os.chmod(region, 0o700)
        if uid >= 0:
            os.chown(region, uid, gid)
        text = L.limits_file_text(allocation, priority, container_region=str(region / "container.region"))
        tmp = kdir / "limits.conf.tmp"
        tmp.write_text(text)
        os.chmod(tmp, 0o444)
        os.replace(tmp, kdir / "limits.conf")
        env = {
            "LIBVGPU_CONFIG": str(kdir / "limits.conf"),
            "LIBVGPU_CONTAINER_REGION": str(region / "container.region"),
            "CUDA_VISIBLE_DEVICES": ",".join(allocation.gpu_uuids),
            "ELASTIC_GPU_ALLOCATION_ID": allocation.id,
        }
        lib = _library_path() if self.preload_shim else ""
        if lib:
            env["LD_PRELOAD"] = lib
        return env

    def _env(self, record: KernelRecord, allocation: Allocation) -> dict[str, str]:
        env = {k: os.environ[k] for k in self.env_keep if k in os.environ}
        env.update(self._gpu_env(record, allocation))
        try:
            for line in Path(env["LIBVGPU_CONFIG"]).read_text().splitlines():
                if line.startswith("activity_file="):
                    record.activity_file = line.split("=", 1)[1].strip()
        except (KeyError, OSError):
            pass
        if not self.preload_shim:
            env.pop("LD_PRELOAD", None)
        env["JUPYTERHUB_USER"] = record.user
        env["ELASTIC_GPU_KERNEL_ID"] = record.id
        if record.home:
            env["HOME"] = record.home
        env.update(self.environment)
        return env

    def _write_connection_file(self, record: KernelRecord, key: str | None) -> None:
        """The kernel's connection file: 0600, owned by the kernel's account, in a hub-owned directory."""
        kdir = self.kernel_dir(record.id)
        kdir.mkdir(parents=True, exist_ok=True)
        os.chmod(kdir, 0o711)
        conn = kdir / "connection.json"
        if key is None:  # restart: keep the key, new ports
            key = json.loads(conn.read_text())["key"]
        info = {
            "ip": record.ip,
            "transport": record.transport,
            "signature_scheme": record.signature_scheme,
            "key": key,
            "kernel_name": record.kernel_name,
            **record.ports,
        }
        tmp = str(conn) + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        uid, gid = self._ids(record)
        if uid >= 0:
            os.chown(tmp, uid, gid)
        os.replace(tmp, conn)

    def _cmd(self, record: KernelRecord) -> list[str]:
        conn = str(self.kernel_dir(record.id) / "connection.json")
        return [part.replace("{connection_file}", conn) for part in self.kernel_cmd]

    async def _spawn(self, record: KernelRecord, allocation: Allocation) -> int:
        kdir = self.kernel_dir(record.id)
        cmd = self._cmd(record)
        cwd = next((d for d in (record.cwd, record.home) if d and os.path.isdir(d)), str(kdir))
        preexec = None
        if record.run_as:
            from jupyterhub.spawner import set_user_setuid

            preexec = set_user_setuid(record.run_as, chdir=False)
        log = open(kdir / "kernel.log", "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=self._env(record, allocation),
                cwd=cwd,
                start_new_session=True,  # survives a hub restart; its own process group for signals
                preexec_fn=preexec,
            )
        except OSError as e:
            raise LaunchError(
                f"The GPU kernel could not be started: {shlex.join(cmd[:3])}... failed ({e.strerror or e})."
            ) from None
        finally:
            log.close()
        self._procs[record.id] = proc
        task = asyncio.ensure_future(self._watch(record, proc))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        return proc.pid

    async def _watch(self, record: KernelRecord, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._procs.get(record.id) is proc and record.holder == str(proc.pid):
            self._procs.pop(record.id, None)
            record.exit_code = code
            if record.state in ("pending", "running"):
                if code == 0:
                    record.state, record.reason = "stopped", "the kernel process exited"
                else:
                    record.state = "failed"
                    record.reason = f"the kernel process exited with code {code}" + self._log_hint(record)
                self.log.info("GPU kernel %s of %s: %s", record.id, record.user, record.reason)

    def _log_hint(self, record: KernelRecord) -> str:
        try:
            tail = (self.kernel_dir(record.id) / "kernel.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f": {tail[-1][:300]}" if tail else ""

    async def launch(self, record: KernelRecord, allocation: Allocation, key: str, server: ServerRef) -> None:
        record.ip = self.ip
        record.ports = dict(zip(PORT_NAMES, free_local_ports(self.ip), strict=True))
        record.namespace = ""
        record.run_as, record.home = server.unix_user, server.home
        try:
            self._write_connection_file(record, key)
            pid = await self._spawn(record, allocation)
        except LaunchError:
            await self._remove_files(record)
            raise
        except OSError as e:
            await self._remove_files(record)
            raise LaunchError(f"The GPU kernel's files could not be written: {e}") from None
        record.holder = str(pid)
        record.state, record.reason = "running", ""
        self.log.info(
            "GPU kernel %s of %s started: pid %d on %s:%d",
            record.id,
            record.user,
            pid,
            record.ip,
            record.ports["shell_port"],
        )

    async def restart(self, record: KernelRecord, allocation: Allocation, server: ServerRef | None) -> None:
        old_pid = int(record.holder) if record.holder.isdigit() else 0
        record.ports = dict(zip(PORT_NAMES, free_local_ports(self.ip), strict=True))
        record.generation += 1
        record.exit_code = None
        self._write_connection_file(record, None)
        pid = await self._spawn(record, allocation)
        record.holder = str(pid)
        record.state, record.reason = "running", ""
        if old_pid:
            task = asyncio.ensure_future(self._terminate(old_pid))
            self._watchers.add(task)
            task.add_done_callback(self._watchers.discard)
        self.log.info("GPU kernel %s of %s restarted: pid %d (was %d)", record.id, record.user, pid, old_pid)

    async def _terminate(self, pid: int) -> None:
        for sig, wait in ((signal.SIGTERM, self.stop_grace_seconds), (signal.SIGKILL, 5.0)):
            if not _proc_alive(pid):
                return
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            except PermissionError:
                os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not _proc_alive(pid):
                    return
                await asyncio.sleep(0.05)

    async def refresh(self, record: KernelRecord) -> None:
        if record.state not in ("pending", "running") or record.id in self._procs:
            return  # our own children report through _watch
        if not self._is_our_process(record):
            record.state, record.reason = "stopped", "the kernel process is gone"

    async def interrupt(self, record: KernelRecord) -> bool:
        if record.state != "running" or not record.holder.isdigit():
            return False
        try:
            os.killpg(int(record.holder), signal.SIGINT)
        except ProcessLookupError:
            return False
        return True

    async def delete(self, record: KernelRecord) -> None:
        proc = self._procs.pop(record.id, None)
        pid = int(record.holder) if record.holder.isdigit() else 0
        if pid and (proc is not None or self._is_our_process(record)):
            await self._terminate(pid)
            if proc is not None:
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except asyncio.TimeoutError:
                    self.log.warning("GPU kernel %s: pid %d did not exit", record.id, pid)
        await self._remove_files(record)

    async def _remove_files(self, record: KernelRecord) -> None:
        kdir = self.kernel_dir(record.id)
        for name in ("connection.json", "connection.json.tmp", "limits.conf", "limits.conf.tmp", "kernel.log"):
            try:
                (kdir / name).unlink()
            except FileNotFoundError:
                pass
        for path in sorted((kdir / "region").glob("*"), reverse=True) if (kdir / "region").exists() else []:
            try:
                path.unlink()
            except OSError:
                pass
        for d in (kdir / "region", kdir):
            try:
                d.rmdir()
            except OSError:
                pass

    async def sweep(self, known: set[str]) -> list[str]:
        if not self.root.is_dir():
            return []
        strays = [d for d in self.root.iterdir() if d.is_dir() and d.name not in known]
        if not strays:
            return []
        swept = []
        for kdir in strays:
            conn = str(kdir / "connection.json")
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and any(conn in part for part in _proc_cmdline(int(entry.name))):
                    self.log.warning("Stopping stray GPU kernel process %s (kernel %s)", entry.name, kdir.name)
                    await self._terminate(int(entry.name))
            await self._remove_files(KernelRecord(id=kdir.name, user="", server_name="", size="", allocation_id=""))
            swept.append(kdir.name)
        return swept

    async def stop(self) -> None:
        for task in list(self._watchers):
            task.cancel()


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------

#: Runs in the kernel pod before the kernel: builds the kernel's connection file from the
#: mounted Secret (key) and the pod's own address (downward API), in a private directory,
#: then becomes the kernel. Passed with ``python -c`` so kernel images need nothing of ours.
BOOTSTRAP = r"""
import json, os, sys, tempfile
secret_file, ports = sys.argv[1], json.loads(sys.argv[2])
with open(secret_file) as f:
    info = json.load(f)
info.update(ports)
info["ip"] = os.environ.get("POD_IP") or "0.0.0.0"
info.setdefault("transport", "tcp")
d = tempfile.mkdtemp(prefix="kernel-")
path = os.path.join(d, "connection.json")
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
with os.fdopen(fd, "w") as f:
    json.dump(info, f)
cmd = [a.replace("{connection_file}", path) for a in sys.argv[3:]]
os.execvp(cmd[0], cmd)
""".strip()

SECRET_MOUNT = "/var/run/elastic-gpu/kernel"
SECRET_FILE = "connection.json"

#: container waiting reasons that will not resolve by waiting
_FATAL_WAITING = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
}


def _slug(value: str, limit: int = 24) -> str:
    out = "".join(c if c.isalnum() else "-" for c in value.lower()).strip("-")
    return (out[:limit].strip("-")) or "x"


class KubernetesKernelLauncher(KernelLauncher):
    """GPU kernels as pods. The hub's service account needs pods, secrets and networkpolicies rights
    in the users' namespace (the Helm chart grants them); kernel pods need none."""

    namespace = Unicode(
        "",
        config=True,
        help="Namespace of kernel pods. Default: the user's server pod's namespace, else $POD_NAMESPACE or 'default'.",
    )
    image = Unicode(
        "quay.io/jupyter/pytorch-notebook:cuda12-latest",
        config=True,
        help="Container image of kernel pods (must have python and ipykernel).",
    )
    image_pull_policy = Unicode("IfNotPresent", config=True, help="imagePullPolicy of kernel pods.")
    service_account = Unicode(
        "",
        config=True,
        help="serviceAccountName of kernel pods (its token is never mounted). Empty: the namespace default.",
    )
    cpu_request = Unicode("", config=True, help="CPU request of the kernel container, e.g. '500m' (empty: none).")
    memory_request = Unicode("", config=True, help="Memory request of the kernel container, e.g. '1Gi' (empty: none).")
    memory_limit = Unicode("", config=True, help="Memory limit of the kernel container, e.g. '8Gi' (empty: none).")
    extra_pod_labels = Dict(Unicode(), config=True, help="Extra labels for kernel pods.")
    environment = Dict(Unicode(), config=True, help="Extra environment variables of kernel containers.")
    network_policy = Bool(
        True,
        config=True,
        help="""Create a NetworkPolicy per kernel that admits ingress only from the user's server
        pod (the chart's default-deny policy for kernel pods admits the hub). Default: True.""",
    )
    server_selector_labels = List(
        Unicode(),
        ["hub.jupyter.org/username", "hub.jupyter.org/servername", "component"],
        config=True,
        help="""Labels of the user's server pod that the per-kernel NetworkPolicy matches
        (those present on the pod; when none is present, all its labels).""",
    )
    gpu_backend = Unicode(
        "native",
        config=True,
        help="GPU backend of kernel pods when the user's spawner does not say ('native', 'hami', 'mig', 'whole').",
    )
    gpu_runtime_class = Unicode(
        "nvidia", config=True, help="runtimeClassName for the 'native' backend when the spawner does not say."
    )
    gpu_priority_class_prefix = Unicode(
        "elastic-gpu-", config=True, help="Prefix of the Kubernetes PriorityClass names when the spawner does not say."
    )
    gpu_host_dir = Unicode(
        "/var/lib/elastic-gpu",
        config=True,
        help="Host directory of libvgpu on GPU nodes when the spawner does not say.",
    )
    unschedulable_grace_seconds = Float(
        0.0,
        config=True,
        help="""Seconds a kernel pod may stay Unschedulable before the kernel fails with the
        scheduler's message. 0 (default): fail at once — admission already placed it, so an
        unschedulable kernel pod means a node problem, not a wait.""",
    )
    kernel_port_base = Integer(
        50001,
        config=True,
        help="""First of the kernel pods' ZMQ ports. Each pod has its own address, so the ports are
        fixed: base..base+4, and base+10..base+14 after a restart (alternating, so that
        jupyter-server and JupyterLab see the ports change and reconnect). Default: 50001.""",
    )
    delete_grace_seconds = Integer(2, config=True, help="gracePeriodSeconds when deleting kernel pods. Default: 2.")
    k8s_api_request_timeout = Float(10.0, config=True, help="Seconds to wait for one Kubernetes API call.")

    @default("kernel_cmd")
    def _default_kernel_cmd(self) -> list[str]:
        return ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._unschedulable_since: dict[str, float] = {}

    def pod_ports(self, generation: int) -> dict[str, int]:
        """The ZMQ ports of a kernel pod of this generation (two alternating sets)."""
        base = self.kernel_port_base + 10 * (generation % 2)
        return {name: base + i for i, name in enumerate(PORT_NAMES)}

    # ---- clients -----------------------------------------------------------------------

    @property
    def core(self):
        from kubespawner.clients import shared_client

        return shared_client("CoreV1Api")

    @property
    def networking(self):
        from kubespawner.clients import shared_client

        return shared_client("NetworkingV1Api")

    def _ns(self, server_namespace: str = "") -> str:
        if self.namespace or server_namespace:
            return self.namespace or server_namespace
        from .allocator import GPUAllocator

        pool_ns = getattr(GPUAllocator.instance().backend, "namespace", "") if GPUAllocator.initialized() else ""
        return pool_ns or os.environ.get("POD_NAMESPACE", "default")

    async def _call(self, coro: Any) -> Any:
        return await asyncio.wait_for(coro, self.k8s_api_request_timeout)

    # ---- ledger ------------------------------------------------------------------------

    async def start(self) -> list[KernelRecord]:
        from kubespawner.clients import load_config

        load_config()
        selector = f"{L.KIND}=kernel,{L.MANAGED}=true"
        ns = self._ns()
        result = await self._call(self.core.list_namespaced_pod(ns, label_selector=selector))
        newest: dict[str, Any] = {}
        stale = []
        for pod in result.items:
            ann = pod.metadata.annotations or {}
            kid = ann.get(L.A_KERNEL_ID)
            if not kid:
                continue
            gen = int(ann.get(L.A_GENERATION, "0"))
            other = newest.get(kid)
            if other is None or gen > int(other.metadata.annotations.get(L.A_GENERATION, "0")):
                if other is not None:
                    stale.append(other)
                newest[kid] = pod
            else:
                stale.append(pod)
        for pod in stale:  # an interrupted restart left an older generation behind
            await self._delete_pod(pod.metadata.name, pod.metadata.namespace)
        records = []
        for kid, pod in newest.items():
            record = self._record_from_pod(kid, pod)
            if record is not None:
                records.append(record)
        self.log.info("Kubernetes GPU kernels: %d kernel pods found in %s", len(records), ns)
        return records

    def _record_from_pod(self, kid: str, pod: Any) -> KernelRecord | None:
        meta = pod.metadata
        ann = meta.annotations or {}
        allocation = L.allocation_from_metadata(meta.labels, ann)
        if allocation is None:
            return None
        try:
            ports = json.loads(ann.get(L.A_PORTS, "{}"))
            section = json.loads(ann.get(L.A_SECTION, "{}"))
        except ValueError:
            ports, section = {}, {}
        record = KernelRecord(
            id=kid,
            user=allocation.owner.user,
            server_name=ann.get(L.A_SERVER_NAME, ""),
            size=ann.get(L.A_SIZE, ""),
            allocation_id=allocation.id,
            section=section,
            ports={k: int(v) for k, v in ports.items() if k in PORT_NAMES},
            signature_scheme=ann.get(L.A_SIGNATURE_SCHEME, "hmac-sha256"),
            server_identity=ann.get(L.A_SERVER_IDENTITY, ""),
            holder=meta.name,
            namespace=meta.namespace,
            generation=int(ann.get(L.A_GENERATION, "0")),
            created_at=float(ann.get(L.A_KERNEL_CREATED_AT, "0") or 0),
            jupyter_kernel_id=ann.get(L.A_JUPYTER_KERNEL_ID, ""),
        )
        record.set_allocation(allocation)
        self._apply_pod_status(record, pod)
        return record

    # ---- the user's server ---------------------------------------------------------------

    async def server_ref(self, spawner: Any) -> ServerRef:
        from kubernetes_asyncio.client.rest import ApiException

        pod_name = getattr(spawner, "pod_name", "")
        namespace = getattr(spawner, "namespace", "") or self._ns()
        ref = ServerRef(user=spawner.user.name, name=spawner.name or "", pod_name=pod_name, namespace=namespace)
        for trait in ("gpu_backend", "gpu_runtime_class", "gpu_priority_class_prefix", "gpu_host_dir"):
            if hasattr(spawner, trait):
                ref.gpu_settings[trait] = getattr(spawner, trait)
        if pod_name:
            try:
                pod = await self._call(self.core.read_namespaced_pod(pod_name, namespace))
            except ApiException as e:
                if e.status == 404:
                    raise LaunchError(
                        f"The server pod {pod_name} of {spawner.user.name} does not exist; start the server again.", 409
                    ) from None
                raise
            ref.identity = _server_identity(pod)
            ref.pod_uid = pod.metadata.uid or ""
            ref.pod_labels = dict(pod.metadata.labels or {})
        return ref

    async def server_alive(self, record: KernelRecord, spawner: Any | None) -> bool:
        from kubernetes_asyncio.client.rest import ApiException

        if spawner is None or not spawner.active:
            return False
        if spawner.pending:
            return True
        pod_name = getattr(spawner, "pod_name", "")
        if not pod_name:
            return await spawner.poll() is None
        try:
            pod = await self._call(
                self.core.read_namespaced_pod(pod_name, getattr(spawner, "namespace", "") or record.namespace)
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        if record.server_identity and _server_identity(pod) != record.server_identity:
            return False
        if pod.metadata.deletion_timestamp is not None:
            return False
        if (pod.status.phase if pod.status else "") in ("Succeeded", "Failed"):
            return False
        notebook = _notebook_status(pod)
        # a server container that is not running (exited, restarting) has lost its kernels
        return notebook is None or notebook.state is None or notebook.state.running is not None

    # ---- objects -------------------------------------------------------------------------

    def _base_name(self, record: KernelRecord) -> str:
        return f"kernel-{_slug(record.user)}-{record.id[:8]}"

    def _pod_name(self, record: KernelRecord) -> str:
        return f"{self._base_name(record)}-{record.generation}"

    def _owner_refs(self, server: ServerRef | None) -> list | None:
        from kubernetes_asyncio.client import models as k8s

        if server is None or not server.pod_uid or not server.pod_name:
            return None
        return [
            k8s.V1OwnerReference(
                api_version="v1", kind="Pod", name=server.pod_name, uid=server.pod_uid, block_owner_deletion=False
            )
        ]

    def _secret(self, record: KernelRecord, key: str, server: ServerRef) -> Any:
        from kubernetes_asyncio.client import models as k8s

        payload = json.dumps({"key": key, "signature_scheme": record.signature_scheme, "transport": record.transport})
        return k8s.V1Secret(
            api_version="v1",
            kind="Secret",
            metadata=k8s.V1ObjectMeta(
                name=self._base_name(record) + "-key",
                namespace=record.namespace,
                labels={L.KERNEL_ID: record.id, L.MANAGED: "true", L.USER: L.label_value(record.user)},
                owner_references=self._owner_refs(server),
            ),
            type="Opaque",
            data={SECRET_FILE: base64.b64encode(payload.encode()).decode()},
        )

    def _network_policy(self, record: KernelRecord, server: ServerRef) -> Any:
        from kubernetes_asyncio.client import models as k8s

        chosen = {k: v for k, v in server.pod_labels.items() if k in self.server_selector_labels}
        match = chosen or dict(server.pod_labels)
        return k8s.V1NetworkPolicy(
            api_version="networking.k8s.io/v1",
            kind="NetworkPolicy",
            metadata=k8s.V1ObjectMeta(
                name=self._base_name(record) + "-ingress",
                namespace=record.namespace,
                labels={L.KERNEL_ID: record.id, L.MANAGED: "true", L.USER: L.label_value(record.user)},
                owner_references=self._owner_refs(server),
            ),
            spec=k8s.V1NetworkPolicySpec(
                pod_selector=k8s.V1LabelSelector(match_labels={L.KERNEL_ID: record.id}),
                policy_types=["Ingress"],
                ingress=[
                    k8s.V1NetworkPolicyIngressRule(
                        _from=[k8s.V1NetworkPolicyPeer(pod_selector=k8s.V1LabelSelector(match_labels=match))],
                        # both port sets: the policy outlives restarts, which alternate between them
                        ports=[
                            k8s.V1NetworkPolicyPort(protocol="TCP", port=p)
                            for g in (0, 1)
                            for p in self.pod_ports(g).values()
                        ],
                    )
                ],
            ),
        )

    def _pod(self, record: KernelRecord, allocation: Allocation, server: ServerRef | None) -> Any:
        from kubernetes_asyncio.client import models as k8s

        from .allocator import GPUAllocator
        from .kube_spawner import apply_gpu_to_pod

        settings = dict(server.gpu_settings) if server else {}
        env = [
            k8s.V1EnvVar(
                name="POD_IP",
                value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="status.podIP")),
            ),
            k8s.V1EnvVar(name="JUPYTERHUB_USER", value=record.user),
            k8s.V1EnvVar(name="ELASTIC_GPU_KERNEL_ID", value=record.id),
        ] + [k8s.V1EnvVar(name=k, value=v) for k, v in sorted(self.environment.items())]
        requests = {k: v for k, v in (("cpu", self.cpu_request), ("memory", self.memory_request)) if v}
        limits = {"memory": self.memory_limit} if self.memory_limit else {}
        ports_arg = json.dumps(record.ports, sort_keys=True)
        container = k8s.V1Container(
            name="kernel",
            image=self.image,
            image_pull_policy=self.image_pull_policy,
            command=[self.kernel_cmd[0], "-c", BOOTSTRAP, f"{SECRET_MOUNT}/{SECRET_FILE}", ports_arg, *self.kernel_cmd],
            env=env,
            ports=[k8s.V1ContainerPort(container_port=p, name=n.split("_")[0][:15]) for n, p in record.ports.items()],
            resources=k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None),
            volume_mounts=[k8s.V1VolumeMount(name="connection", mount_path=SECRET_MOUNT, read_only=True)],
            security_context=k8s.V1SecurityContext(allow_privilege_escalation=False),
        )
        labels = {L.KERNEL_ID: record.id, **self.extra_pod_labels}
        annotations = {
            L.A_KERNEL_ID: record.id,
            L.A_SERVER_NAME: record.server_name,
            L.A_SERVER_IDENTITY: record.server_identity,
            L.A_GENERATION: str(record.generation),
            L.A_PORTS: json.dumps(record.ports, sort_keys=True),
            L.A_SIZE: record.size,
            L.A_SIGNATURE_SCHEME: record.signature_scheme,
            L.A_KERNEL_CREATED_AT: repr(record.created_at),
            L.A_JUPYTER_KERNEL_ID: record.jupyter_kernel_id,
        }
        pod = k8s.V1Pod(
            api_version="v1",
            kind="Pod",
            metadata=k8s.V1ObjectMeta(
                name=self._pod_name(record),
                namespace=record.namespace,
                labels=labels,
                annotations=annotations,
                owner_references=self._owner_refs(server),
            ),
            spec=k8s.V1PodSpec(
                restart_policy="Never",
                automount_service_account_token=False,
                enable_service_links=False,
                service_account_name=self.service_account or None,
                containers=[container],
                volumes=[
                    k8s.V1Volume(
                        name="connection",
                        secret=k8s.V1SecretVolumeSource(
                            secret_name=self._base_name(record) + "-key", default_mode=0o400
                        ),
                    )
                ],
            ),
        )
        allocator = GPUAllocator.instance()
        apply_gpu_to_pod(
            pod,
            allocation,
            backend=settings.get("gpu_backend", self.gpu_backend),
            section=record.section,
            priority_value=allocator.priority_value(allocation.priority_class) if allocator.config_data else 0,
            priority_class_name=settings.get("gpu_priority_class_prefix", self.gpu_priority_class_prefix)
            + allocation.priority_class,
            runtime_class=settings.get("gpu_runtime_class", self.gpu_runtime_class),
            host_dir=settings.get("gpu_host_dir", self.gpu_host_dir),
            server=record.server_name,
        )
        return pod

    # ---- lifecycle -------------------------------------------------------------------------

    async def launch(self, record: KernelRecord, allocation: Allocation, key: str, server: ServerRef) -> None:
        from kubernetes_asyncio.client.rest import ApiException

        record.namespace = self._ns(server.namespace)
        record.ports = self.pod_ports(record.generation)
        record.server_identity = server.identity
        created: list[tuple[str, str]] = []
        try:
            await self._call(self.core.create_namespaced_secret(record.namespace, self._secret(record, key, server)))
            created.append(("secret", self._base_name(record) + "-key"))
            if self.network_policy and server.pod_labels:
                try:
                    await self._call(
                        self.networking.create_namespaced_network_policy(
                            record.namespace, self._network_policy(record, server)
                        )
                    )
                except ApiException as e:
                    if e.status == 404:
                        raise LaunchError(
                            "This cluster does not serve NetworkPolicies (networking.k8s.io/v1), so the "
                            "GPU kernel could not be isolated. An admin can set "
                            "KubernetesKernelLauncher.network_policy = False to run kernels without one.",
                            500,
                        ) from None
                    raise
                created.append(("networkpolicy", self._base_name(record) + "-ingress"))
            pod = self._pod(record, allocation, server)
            await self._call(self.core.create_namespaced_pod(record.namespace, pod))
        except ApiException as e:
            await self._cleanup(record.namespace, created)
            raise LaunchError(f"The GPU kernel pod could not be created: {_api_message(e)}", 500) from None
        except LaunchError:
            await self._cleanup(record.namespace, created)
            raise
        except asyncio.TimeoutError:
            await self._cleanup(record.namespace, created)
            raise LaunchError(
                "The Kubernetes API did not answer in time; the GPU kernel was not created.", 503
            ) from None
        except BaseException:
            await self._cleanup(record.namespace, created)
            raise
        record.holder = self._pod_name(record)
        record.state, record.reason = "pending", "waiting for the kernel pod to start"
        self.log.info("GPU kernel %s of %s: pod %s/%s created", record.id, record.user, record.namespace, record.holder)

    async def _cleanup(self, namespace: str, created: list[tuple[str, str]]) -> None:
        from kubernetes_asyncio.client.rest import ApiException

        for kind, name in reversed(created):
            try:
                if kind == "secret":
                    await self._call(self.core.delete_namespaced_secret(name, namespace))
                elif kind == "networkpolicy":
                    await self._call(self.networking.delete_namespaced_network_policy(name, namespace))
                else:
                    await self._delete_pod(name, namespace)
            except (ApiException, asyncio.TimeoutError) as e:
                if getattr(e, "status", None) != 404:
                    self.log.warning("Could not delete %s %s/%s: %s", kind, namespace, name, e)

    async def _delete_pod(self, name: str, namespace: str) -> None:
        from kubernetes_asyncio.client.rest import ApiException

        try:
            await self._call(
                self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=self.delete_grace_seconds)
            )
        except ApiException as e:
            if e.status != 404:
                raise

    async def restart(self, record: KernelRecord, allocation: Allocation, server: ServerRef | None) -> None:
        from kubernetes_asyncio.client.rest import ApiException

        old = record.holder
        record.generation += 1
        record.ports = self.pod_ports(record.generation)
        record.ip, record.exit_code = "", None
        pod = self._pod(record, allocation, server)
        if server is None and old:  # keep the owner (the server pod) of the previous generation
            try:
                prev = await self._call(self.core.read_namespaced_pod(old, record.namespace))
                pod.metadata.owner_references = prev.metadata.owner_references
            except ApiException as e:
                if e.status != 404:
                    raise
        try:
            await self._call(self.core.create_namespaced_pod(record.namespace, pod))
        except ApiException as e:
            record.generation -= 1
            raise LaunchError(f"The GPU kernel pod could not be re-created: {_api_message(e)}", 500) from None
        record.holder = self._pod_name(record)
        record.state, record.reason = "pending", "waiting for the restarted kernel pod to start"
        if old and old != record.holder:  # only now: the allocation always has a live holder
            await self._delete_pod(old, record.namespace)
        self.log.info("GPU kernel %s of %s restarted: pod %s (was %s)", record.id, record.user, record.holder, old)

    def _apply_pod_status(self, record: KernelRecord, pod: Any) -> None:
        record.activity = gpu_activity((pod.metadata.annotations or {}).get(L.A_GPU_ACTIVITY))
        status = pod.status
        phase = status.phase if status else "Pending"
        record.ip = (status.pod_ip if status else "") or ""
        if pod.metadata.deletion_timestamp is not None:
            record.state, record.reason = "stopped", "the kernel pod is being deleted"
            return
        if phase == "Running":
            record.state, record.reason = "running", ""
            self._unschedulable_since.pop(record.id, None)
            return
        term = None
        for cs in (status.container_statuses or []) if status else []:
            state = cs.state
            if state and state.waiting and state.waiting.reason in _FATAL_WAITING:
                record.state = "failed"
                record.reason = (
                    f"the kernel container cannot start: {state.waiting.reason}: {state.waiting.message or ''}".strip(
                        ": "
                    )
                )
                return
            if state and state.terminated:
                term = state.terminated
        if phase in ("Succeeded", "Failed"):
            code = term.exit_code if term else (0 if phase == "Succeeded" else 1)
            record.exit_code = code
            if phase == "Succeeded":
                record.state, record.reason = "stopped", "the kernel process exited"
            else:
                detail = (term.message or term.reason) if term else (status.message or status.reason or "")
                record.state = "failed"
                record.reason = f"the kernel pod failed (exit code {code}){': ' + detail if detail else ''}"
            return
        for cond in (status.conditions or []) if status else []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                since = self._unschedulable_since.setdefault(record.id, time.monotonic())
                if time.monotonic() - since >= self.unschedulable_grace_seconds:
                    record.state = "failed"
                    record.reason = f"the kernel pod cannot be scheduled: {cond.message or 'Unschedulable'}"
                    return
        record.state = "pending"
        record.reason = (status.reason or status.message or "waiting for the kernel pod to start") if status else ""

    async def refresh(self, record: KernelRecord) -> None:
        from kubernetes_asyncio.client.rest import ApiException

        if record.state not in ("pending", "running") or not record.holder:
            return
        try:
            pod = await self._call(self.core.read_namespaced_pod(record.holder, record.namespace))
        except ApiException as e:
            if e.status == 404:
                record.state, record.reason = "stopped", "the kernel pod is gone"
                return
            raise
        self._apply_pod_status(record, pod)

    async def delete(self, record: KernelRecord) -> None:
        from kubernetes_asyncio.client.rest import ApiException

        ns = record.namespace or self._ns()
        if record.holder:
            await self._delete_pod(record.holder, ns)
        # older generations left by an interrupted restart, and the per-kernel objects
        try:
            pods = await self._call(self.core.list_namespaced_pod(ns, label_selector=f"{L.KERNEL_ID}={record.id}"))
            for pod in pods.items:
                if pod.metadata.name != record.holder:
                    await self._delete_pod(pod.metadata.name, ns)
        except ApiException as e:
            self.log.warning("Could not list pods of GPU kernel %s: %s", record.id, _api_message(e))
        await self._cleanup(
            ns,
            [("secret", self._base_name(record) + "-key")]
            + ([("networkpolicy", self._base_name(record) + "-ingress")] if self.network_policy else []),
        )

    async def sweep(self, known: set[str]) -> list[str]:
        from kubernetes_asyncio.client.rest import ApiException

        ns = self._ns()
        swept: set[str] = set()
        pods = await self._call(self.core.list_namespaced_pod(ns, label_selector=f"{L.KIND}=kernel,{L.MANAGED}=true"))
        for pod in pods.items:
            kid = (pod.metadata.annotations or {}).get(L.A_KERNEL_ID, "")
            if kid and kid not in known and pod.metadata.deletion_timestamp is None:
                self.log.warning("Deleting stray GPU kernel pod %s/%s (kernel %s)", ns, pod.metadata.name, kid)
                await self._delete_pod(pod.metadata.name, ns)
                swept.add(kid)
        selector = f"{L.KERNEL_ID},{L.MANAGED}=true"
        try:
            secrets = await self._call(self.core.list_namespaced_secret(ns, label_selector=selector))
            for obj in secrets.items:
                if obj.metadata.labels.get(L.KERNEL_ID) not in known:
                    await self._cleanup(ns, [("secret", obj.metadata.name)])
                    swept.add(obj.metadata.labels.get(L.KERNEL_ID))
            if self.network_policy:
                policies = await self._call(self.networking.list_namespaced_network_policy(ns, label_selector=selector))
                for obj in policies.items:
                    if obj.metadata.labels.get(L.KERNEL_ID) not in known:
                        await self._cleanup(ns, [("networkpolicy", obj.metadata.name)])
                        swept.add(obj.metadata.labels.get(L.KERNEL_ID))
        except ApiException as e:
            self.log.warning("Could not sweep GPU kernel secrets/policies in %s: %s", ns, _api_message(e))
        return sorted(swept)


def gpu_activity(value: str | None) -> dict[str, Any]:
    """{last_launch, memory_used_mib} from the node agent's gpu-activity annotation; {} (unknown to
    the culler) when the pod has none or it is not what the agent writes."""
    if not value:
        return {}
    try:
        data = json.loads(value)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    last, used = data.get("last_launch"), data.get("memory_used_mib")
    number = (int, float)
    if last is not None and (isinstance(last, bool) or not isinstance(last, number) or last < 0):
        return {}
    if isinstance(used, bool) or not isinstance(used, int) or used < 0:
        return {}
    return {"last_launch": last, "memory_used_mib": used}


def _notebook_status(pod: Any) -> Any | None:
    """The container status of a server pod's notebook container (KubeSpawner names it 'notebook')."""
    statuses = (pod.status.container_statuses if pod.status else None) or []
    return next((c for c in statuses if c.name == "notebook"), statuses[0] if statuses else None)


def _server_identity(pod: Any) -> str:
    """A server pod's uid and its notebook container's restart count: a kernel belongs to one run
    of the server process (a restarted container has lost its kernels)."""
    notebook = _notebook_status(pod)
    restarts = notebook.restart_count if notebook is not None else 0
    return f"{pod.metadata.uid}/{restarts or 0}"


def _api_message(e: Exception) -> str:
    body = getattr(e, "body", None)
    if body:
        try:
            return json.loads(body).get("message") or str(body)
        except (ValueError, AttributeError, TypeError):
            return str(body)[:300]
    return str(getattr(e, "reason", "") or e)
