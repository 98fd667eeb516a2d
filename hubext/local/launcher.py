"""GPU kernels as local processes (single-machine mode).

The hub writes the connection file (0600, the kernel's key) into a per-kernel directory the
user cannot write; the shim's limits file and region come from the pool, as for notebooks.
The kernel records are kept in the pool's ledger, so a restarted hub finds its kernels again.
A restart starts the replacement process first (new ports, same allocation), then stops the
old one. The old one may have exited already (jupyter_client sends it ``shutdown_request``
before it asks for the restart): the broker restarts inside ``GPUAllocator.handover``, so the
pool's report that the old holder is gone does not take the slice from the new process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Container, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_client.connect import port_names
from traitlets import Bool, Float, List, Unicode, default

from libvgpu import contract as C
from quotas import Allocation

from ..backends import KernelLauncher, LaunchError, ServerRef
from ..gpu_spawner import GPUSpawnerMixin
from ..kernels import KernelRecord
from .processes import process_alive, process_cmdline, stop_slice
from .swap import CELL_FILE, MOVED_FILE, SWAP_FILE, LocalSwapMixin

if TYPE_CHECKING:
    from .ledger import Ledger
    from .pool import LocalPool


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


class LocalKernelLauncher(LocalSwapMixin, KernelLauncher):
    """GPU kernels as local processes, with the shim preloaded and a hub-written limits file.

    The kernel records live in the pool's ledger (``hubext.local.ledger``, one database with
    the allocations); the limits file and region directory are the pool's
    (:meth:`hubext.local.pool.LocalPool.holder_env`, the same as notebooks'). Per kernel, in
    ``state_dir`` (owned by the hub, mode 0711)::

        <kernel id>/              0711, hub-owned
            connection.json       0600, owned by the kernel's account: the key
            kernel.log            the kernel's stdout/stderr
    """

    state_dir = Unicode(
        "",
        config=True,
        help="""Directory for the kernels' connection files and logs. It must not be writable by
        users. Default: 'kernels' in the pool's data directory (LocalPool.data_dir).""",
    )
    ip = Unicode("127.0.0.1", config=True, help="Address local kernels listen on. Default: 127.0.0.1.")
    env_keep = List(
        Unicode(),
        ["PATH", "PYTHONPATH", "CONDA_ROOT", "CONDA_DEFAULT_ENV", "VIRTUAL_ENV", "LANG", "LC_ALL", "LD_LIBRARY_PATH"],
        config=True,
        help="Environment variables of the hub passed on to local kernels.",
    )
    stop_grace_seconds = Float(
        3.0, config=True, help="Seconds between SIGTERM and SIGKILL when a kernel is stopped. Default: 3."
    )
    kernel_binds_ports = Bool(
        True,
        config=True,
        help="""Let the kernel bind its own ports: the connection file says port 0 and the kernel
        writes the ports it bound back into it (as ipykernel does); the broker answers once they
        are there. False: the hub picks free ports and the kernel binds them later, which races
        with any other process binding ports meanwhile (a kernel then dies with 'Address already
        in use'). Default: True.""",
    )
    ready_timeout_seconds = Float(
        60.0,
        config=True,
        help="""With kernel_binds_ports: seconds a new kernel process has to write its ports back
        before its start fails. Default: 60.""",
    )

    @default("kernel_cmd")
    def _default_kernel_cmd(self) -> list[str]:
        return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext=kernelprovider.resume"]

    pool: LocalPool | None

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
        base = self.pool.root if self.pool is not None else Path.cwd() / "elastic-gpu-data"
        return base / "kernels"

    def kernel_dir(self, kernel_id: str) -> Path:
        return self.root / kernel_id

    # ---- ledger ------------------------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        if self.pool is None or self.pool.ledger is None:
            raise LaunchError("The local GPU pool is not started; local GPU kernels need it.", 503)
        return self.pool.ledger

    def persist(self, records: Iterable[KernelRecord]) -> None:
        self.ledger.save_kernels([r.to_json() for r in records])

    def _load_ledger(self) -> list[KernelRecord]:
        records = []
        for item in self.ledger.kernels():
            try:
                records.append(KernelRecord.from_json(item))
            except TypeError as e:
                self.log.error("Skipping a damaged GPU kernel record in the ledger: %s", e)
        return records

    def _is_our_process(self, record: KernelRecord) -> bool:
        try:
            pid = int(record.holder)
        except ValueError:
            return False
        if not process_alive(pid):
            return False
        cmdline = process_cmdline(pid)
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
            if isinstance(spawner, GPUSpawnerMixin):  # ours: the account its server runs as, (None, None) = the hub's
                import pwd

                uid, _gid = spawner.gpu_user_ids()
                unix_user = pwd.getpwuid(uid).pw_name if uid not in (None, 0) else ""
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
            return process_alive(pid)
        return await spawner.poll() is None

    # ---- launch --------------------------------------------------------------------------

    def _ids(self, record: KernelRecord) -> tuple[int, int]:
        if not record.run_as:
            return -1, -1
        import pwd

        pw = pwd.getpwnam(record.run_as)
        return pw.pw_uid, pw.pw_gid

    def _gpu_env(self, record: KernelRecord, allocation: Allocation) -> dict[str, str]:
        """The shim's files and environment, written by the pool exactly as for notebooks."""
        if self.pool is None:
            raise LaunchError("The local GPU pool is not started; local GPU kernels need it.", 503)
        uid, gid = self._ids(record)
        return self.pool.holder_env(
            allocation,
            self.priority_value(allocation.priority_class),
            None if uid < 0 else uid,
            None if gid < 0 else gid,
        )

    def _env(self, record: KernelRecord, allocation: Allocation) -> dict[str, str]:
        env = {k: os.environ[k] for k in self.env_keep if k in os.environ}
        env.update(self._gpu_env(record, allocation))
        record.activity_file = self.pool.activity_path(allocation.id) if self.pool is not None else ""
        env["JUPYTERHUB_USER"] = record.user
        env[C.ENV_KERNEL_ID] = record.id
        if record.resume_url:  # swapped out, the kernel asks for its GPU back before a cell runs
            env["ELASTIC_GPU_RESUME_URL"] = record.resume_url
            env["ELASTIC_GPU_SWAP_FILE"] = str(self.kernel_dir(record.id) / SWAP_FILE)
            env["ELASTIC_GPU_CELL_FILE"] = str(self.kernel_dir(record.id) / CELL_FILE)
        if record.home:
            env["HOME"] = record.home
        env.update(self.environment)
        return env

    def _write_connection_file(
        self, record: KernelRecord, key: str | None, ports: dict[str, int] | None = None
    ) -> None:
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
            **(record.ports if ports is None else ports),
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
        if record.resume_url:
            self.prepare_cell_file(record, *self._ids(record))
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

    def _initial_ports(self) -> dict[str, int]:
        if self.kernel_binds_ports:
            return dict.fromkeys(port_names, 0)
        return dict(zip(port_names, free_local_ports(self.ip), strict=True))

    def _bound_ports(self, record: KernelRecord) -> dict[str, int] | None:
        """The ports the kernel wrote back into its connection file, or None while it has not."""
        try:
            fd = os.open(self.kernel_dir(record.id) / "connection.json", os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                info = json.loads(f.read(65536))
        except (OSError, ValueError):
            return None  # not there, or being written
        if not isinstance(info, dict):
            return None
        ports = {name: info.get(name) for name in port_names}
        if all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports.values()):
            return ports  # type: ignore[return-value]
        return None

    async def _await_ports(self, record: KernelRecord, pid: int, ports: dict[str, int]) -> dict[str, int]:
        """The kernel's ports: ``ports`` as written, or with kernel_binds_ports those it bound and
        wrote back (waiting until it has)."""
        if not self.kernel_binds_ports:
            return ports
        deadline = time.monotonic() + self.ready_timeout_seconds
        while True:
            bound = self._bound_ports(record)
            if bound is not None:
                return bound
            proc = self._procs.get(record.id)
            if (proc is not None and proc.returncode is not None) or not process_alive(pid):
                raise LaunchError("The GPU kernel process exited before it was ready" + (self._log_hint(record) or "."))
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"The GPU kernel did not bind its ports within {self.ready_timeout_seconds:g} s"
                    + (self._log_hint(record) or "."),
                    504,
                )
            await asyncio.sleep(0.05)

    async def launch(self, record: KernelRecord, allocation: Allocation, key: str, server: ServerRef) -> None:
        record.ip = self.ip
        record.ports = self._initial_ports()
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
        record.ports = await self._await_ports(record, pid, record.ports)  # on failure the broker deletes it
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
        """A new process in the same slice; the record changes (ports, holder, generation) only once
        it holds its ports, so a reader never sees a half-restarted kernel."""
        old_pid = int(record.holder) if record.holder.isdigit() else 0
        old_proc = self._procs.get(record.id)
        ports = self._initial_ports()
        self._write_connection_file(record, None, ports)
        pid = await self._spawn(record, allocation)
        try:
            ports = await self._await_ports(record, pid, ports)
        except LaunchError:
            await self._terminate(pid)
            if old_proc is not None:
                self._procs[record.id] = old_proc
            raise
        record.ports, record.holder = ports, str(pid)
        record.generation += 1
        record.exit_code = None
        record.state, record.reason = "running", ""
        if old_pid:
            task = asyncio.ensure_future(self._terminate(old_pid))
            self._watchers.add(task)
            task.add_done_callback(self._watchers.discard)
        self.log.info("GPU kernel %s of %s restarted: pid %d (was %d)", record.id, record.user, pid, old_pid)

    async def _terminate(self, pid: int, allocation_id: str = "") -> None:
        """Stop a kernel process with its session and descendants; with ``allocation_id`` (the slice
        ends with it) also every other process of the slice, ``setsid`` children included."""
        await stop_slice(allocation_id, (pid,) if pid else (), self.stop_grace_seconds)

    async def refresh(self, record: KernelRecord) -> None:
        if record.state not in ("pending", "running") or record.id in self._procs:
            return  # our own children report through _watch
        if not self._is_our_process(record):
            record.state, record.reason = "stopped", "the kernel process is gone"

    def resumed(self, record: KernelRecord, previous_allocation_id: str, allocation: Allocation) -> None:
        if self.pool is not None:
            self.pool.carry_files(previous_allocation_id, allocation.id)
            record.activity_file = self.pool.activity_path(allocation.id)

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
            await self._terminate(pid, record.allocation_id)
        elif record.allocation_id:
            await self._terminate(0, record.allocation_id)  # the kernel is gone; its children may not be
            if proc is not None:
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except asyncio.TimeoutError:
                    self.log.warning("GPU kernel %s: pid %d did not exit", record.id, pid)
        await self._remove_files(record)

    async def _remove_files(self, record: KernelRecord) -> None:
        kdir = self.kernel_dir(record.id)
        for name in ("connection.json", "connection.json.tmp", "kernel.log", SWAP_FILE, CELL_FILE, MOVED_FILE):
            try:
                (kdir / name).unlink()
            except FileNotFoundError:
                pass
        try:
            kdir.rmdir()
        except OSError:
            pass

    async def sweep(self, known: Container[str]) -> list[str]:
        if not self.root.is_dir():
            return []
        strays = [d for d in self.root.iterdir() if d.is_dir() and d.name not in known]
        if not strays:
            return []
        swept = []
        for kdir in strays:
            conn = str(kdir / "connection.json")
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and any(conn in part for part in process_cmdline(int(entry.name))):
                    self.log.warning("Stopping stray GPU kernel process %s (kernel %s)", entry.name, kdir.name)
                    await self._terminate(int(entry.name))
            await self._remove_files(KernelRecord(id=kdir.name, user="", server_name="", size="", allocation_id=""))
            swept.append(kdir.name)
        return swept

    async def stop(self) -> None:
        for task in list(self._watchers):
            task.cancel()
