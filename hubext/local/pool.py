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
import os
import shutil
import signal
import threading
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from traitlets import Bool, Float, Instance, Unicode

from libvgpu import contract as C
from libvgpu.agent.relay import Relay
from libvgpu.backstop import Backstop
from libvgpu.elastic import pending_reclaims
from libvgpu.priorities import read_priority_table, write_priority_table
from libvgpu.regions import RegionError, prepare_container_region, read_activity
from quotas import Allocation, ConfigError, Node, Pool, parse_simulated

from ..backends import GoneCallback, PoolBackend, ReleaseCause
from .backstop import LocalBackstop
from .burst import LocalBurst, start_burst
from .inventory import detect_nvml_gpus, machine_resources, nvml_activity, shim_library
from .launcher import LocalKernelLauncher
from .ledger import LEDGER_FILE, Ledger
from .noderegions import prepare_node_dir
from .processes import process_alive, process_start_time, process_uid, signal_all, slice_processes, stop_slice


class LocalPool(PoolBackend):
    """The GPUs of this machine (NVML or simulated) with a SQLite ledger of local processes."""

    mode = "local"
    launcher_class = LocalKernelLauncher

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

    backstop = Bool(
        True,
        config=True,
        help="""Run the enforcement backstop on this machine's real GPUs (never on simulated
        ones): what the driver reports per process is checked against each slice every
        Backstop.interval_seconds, and an over-slice process, or one that bypasses the shim
        (LD_PRELOAD unset, LIBVGPU_CONFIG repointed, a card its slice does not hold), or a GPU
        process of an account servers run as that belongs to no slice (detached and its
        environment cleared), is killed (Backstop.action = 'kill', the default) or reported, with a log line naming the
        user and the allocation. Configure it with c.Backstop.*. Default: True.""",
    )
    nvml_library = Unicode(
        "",
        config=True,
        help="""Path of the NVML library to load for the inventory and the backstop instead of
        the driver's libnvidia-ml.so.1. Default: '' (the driver's).""",
    )
    relay_interval_seconds = Float(
        0.05,
        config=True,
        help="""Seconds between two copies of each slice's own entry (priority, memory in use,
        launches, bursts, reclaims: written by its shim into its container region) into the
        card's node region, which only the hub writes (a user's code can neither rewrite another
        slice's entry nor replace the file). The shims see the other slices at most this late.
        Not done on simulated GPUs (no shim uses them). 0 turns the copy off: then only holders
        of the hub's own account, which write their entries themselves, see each other.
        Default: 0.05.""",
    )
    burst_sample_seconds = Float(
        0.5,
        config=True,
        help="""Seconds between two looks at the real GPUs' per-process samples (NVML) that measure
        what elastic slices use above their request, the burst metering bills (hubext/local/burst.py;
        never the slice's own activity file). A driver keeps its samples about a second: keep it
        under that. Looks are made only while an elastic slice is held. 0: burst is not metered.
        Default: 0.5.""",
    )
    backstop_policy = Instance(Backstop, allow_none=True, help="The backstop's policy (set at start).")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.simulated = False
        self.ledger: Ledger | None = None
        self._pool: Pool | None = None
        self._on_gone: GoneCallback | None = None
        self._task: asyncio.Task | None = None
        self._evicted: set[str] = set()
        self._kill_tasks: dict[str, asyncio.Task] = {}  # allocation id -> the stop of its processes
        self._backstop_task: asyncio.Task | None = None
        self._relay_task: asyncio.Task | None = None
        self._server_accounts: dict[int, set[str]] = {}  # uid -> hub users whose servers ran as it
        self._aliases: dict[str, str] = {}  # a swapped-out allocation id -> the one its kernel resumed in
        self._elastic: set[str] = set()  # held elastic allocations (the burst meter looks while any is)
        self._burst: LocalBurst | None = None
        self._burst_stop: threading.Event | None = None

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

    def region_dir(self, allocation_id: str) -> Path:
        return self.regions_dir / _safe_name(allocation_id)

    def activity_path(self, allocation_id: str) -> str:
        """The shim's activity record of an allocation (the culler reads it)."""
        return str(self.region_dir(allocation_id) / "activity")

    # ---- PoolBackend ------------------------------------------------------------------------

    async def start(self, on_gone: GoneCallback) -> None:
        self._on_gone = on_gone
        self.root.mkdir(parents=True, exist_ok=True)
        for directory, mode in ((self.limits_dir, 0o755), (self.regions_dir, 0o755)):
            directory.mkdir(exist_ok=True)
            os.chmod(directory, mode)
        node_regions = self.regions_dir / "node"
        self.ledger = Ledger(self.ledger_path)
        self._pool = self._detect()
        cards = [g.uuid for n in self._pool.nodes for g in n.gpus]
        shim = bool(self.preload_shim and shim_library()) and not self.simulated  # no shim sees a simulated card
        prepare_node_dir(node_regions, cards, self.log, shim)  # the hub's, read-only to users
        self.ledger.save_inventory(self._pool, self.simulated)
        self._drop_stale()
        held = set(self.ledger.holders())
        for allocation in self.ledger.allocations():  # servers and kernels that outlived the last hub
            holder = self.ledger.holders().get(allocation.id)
            if holder and holder.isdigit() and process_alive(int(holder)):
                self.server_running(int(holder), allocation.owner.user)
        self._set_priorities({k: v for k, v in read_priority_table(node_regions).items() if k in held})
        self._task = asyncio.ensure_future(self._watch())
        if shim and cards and self.relay_interval_seconds > 0:
            self._relay_task = asyncio.ensure_future(
                Relay(node_regions).run(
                    lambda: cards, self.relay_interval_seconds, self.log, containers=self._container_regions
                )
            )
        if self.backstop and not self.simulated and any(n.gpus for n in self._pool.nodes):
            self._start_backstop()
        self._elastic = {a.id for a in self.ledger.allocations() if a.elastic}
        if self.burst_sample_seconds > 0 and not self.simulated and cards:
            self._start_burst()

    def _detect(self) -> Pool:
        if self.simulate_gpus:
            try:
                pool = parse_simulated(self.simulate_gpus, node=self.node_name)
            except ConfigError as e:
                raise ConfigError(f"LocalPool.simulate_gpus: {e}") from None
            self.simulated = True
            return self._with_machine(pool)
        gpus = detect_nvml_gpus(self.nvml_library)
        if not gpus:
            self.log.warning(
                "No NVIDIA GPU found through NVML and LocalPool.simulate_gpus is not set: "
                "the pool is empty (set simulate_gpus, e.g. '2xH100-80GB', to try the flow without a GPU)."
            )
        self.simulated = False
        return self._with_machine(Pool(nodes=(Node(self.node_name, tuple(gpus)),)))

    def _with_machine(self, pool: Pool) -> Pool:
        """The machine's CPUs and memory on its one node (simulated GPUs or not): admission never
        grants servers more than the machine has in all."""
        cpu, memory = machine_resources()
        return Pool(nodes=tuple(replace(n, cpu_millicores=cpu, host_memory_mib=memory) for n in pool.nodes))

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
                self._stop_slice(row["id"], 0, 0.0)  # a child that outlived its holder while the hub was down

    async def inventory(self) -> Pool:
        if self._pool is None:
            self._pool = self._detect()
        return self._pool

    async def allocations(self) -> list[Allocation]:
        return self.ledger.allocations() if self.ledger else []

    async def record(self, allocation: Allocation) -> None:
        self.ledger.insert(allocation)
        if allocation.elastic:
            self._elastic.add(allocation.id)

    async def bind(self, allocation_id: str, holder: str) -> None:
        """Tie an allocation to a process id (the holder's process-group leader), as a decimal string."""
        holder = str(holder)
        started = process_start_time(int(holder)) if holder.isdigit() else None
        if not holder.isdigit():
            self.log.warning(
                "GPU ledger: holder %r of %s is not a process id; it is never checked", holder, allocation_id
            )
        if self.ledger.set_holder(allocation_id, holder, started):
            if holder.isdigit():  # a GPU server or kernel: the account it runs as is a server account
                owner = next((a.owner.user for a in self.ledger.allocations() if a.id == allocation_id), "")
                self.server_running(int(holder), owner)
        else:
            if allocation_id in self._evicted and holder.isdigit():
                self.log.warning(
                    "GPU ledger: %s was preempted before process %s started; stopping it", allocation_id, holder
                )
                self._stop_slice(allocation_id, int(holder), self.evict_grace_seconds)
            else:
                self.log.warning("GPU ledger: bind of unknown allocation %s to %s ignored", allocation_id, holder)

    def server_running(self, pid: int, user: str) -> None:
        uid = process_uid(pid)
        if uid is None or uid == 0:  # gone already, or root: never a server's account (spawners refuse it)
            return
        users = self._server_accounts.setdefault(uid, set())
        if user and user not in users:
            users.add(user)
            self.log.debug("GPU backstop: uid %d runs servers (%s)", uid, ", ".join(sorted(users)))

    def server_accounts(self) -> dict[int, str]:
        """uid -> account name of every account the hub ran a server or GPU kernel as (the backstop
        stops their GPU processes that belong to no slice)."""
        import pwd

        out = {}
        for uid in self._server_accounts:
            try:
                out[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                out[uid] = f"uid {uid}"
        return out

    async def forget(self, allocation_id: str, cause: ReleaseCause = ReleaseCause.STOPPED) -> None:
        """The slice is gone: no process of it may run on (a holder's ``setsid`` child included),
        unless it was swapped out: its kernel lives on and keeps its files for the resume."""
        holder = self.ledger.holders().get(allocation_id) if self.ledger is not None else None
        if self._burst is not None and allocation_id in self._elastic:  # bill its burst up to now
            await asyncio.to_thread(self._burst.look, *self._burst_state())
        if self.ledger is not None:
            self.ledger.delete(allocation_id)
        self._elastic.discard(allocation_id)
        if cause is ReleaseCause.SWAPPED:
            return
        self._remove_files(allocation_id)
        leader = int(holder) if holder and holder.isdigit() else 0
        if allocation_id not in self._kill_tasks and slice_processes(allocation_id, ()):
            # its holder was stopped (or died) but something of the slice still runs
            self._stop_slice(allocation_id, leader, self.evict_grace_seconds)

    async def evict(self, allocation: Allocation, reason: str) -> None:
        self._evicted.add(allocation.id)
        holder = self.ledger.holders().get(allocation.id) if self.ledger else None
        self.log.warning(
            "GPU preemption: stopping %s of %s (holder %s): %s", allocation.id, allocation.owner.user, holder, reason
        )
        if self.ledger is not None:
            self.ledger.add_event(allocation, "preempted", reason)
        self._stop_slice(allocation.id, int(holder) if holder and holder.isdigit() else 0, self.evict_grace_seconds)

    async def stop(self) -> None:
        if self._burst_stop is not None:
            self._burst_stop.set()
        if self._backstop_task is not None:
            self._backstop_task.cancel()
            self._backstop_task = None
        for task in (self._relay_task, self._task):  # the relay closes its files as it ends
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self._relay_task = self._task = None
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
        processes run under their own uid cannot change their limits. When the hub runs as root
        and the holder as ``uid``/``gid``, the container region and activity file are made here
        (by the shim's own code) and given to the holder, mode 0600, in a directory that stays
        the hub's (0711): the holder's processes use them but can neither unlink, rename nor
        replace them, so none of them ever starts a region of its own (a fresh limit).
        """
        limits = self.limits_path(allocation.id)
        region_dir = self.region_dir(allocation.id)
        region_dir.mkdir(exist_ok=True)
        if uid is not None and os.geteuid() == 0 and self.preload_shim and shim_library():
            os.chown(region_dir, 0, 0)  # the hub's, also where an earlier start gave it to the holder
            os.chmod(region_dir, 0o711)
            files = (region_dir / "container.region", Path(self.activity_path(allocation.id)))
            prepare_container_region(*files)  # O_NOFOLLOW: a link planted earlier is refused
            for path in files:
                os.chown(path, uid, gid if gid is not None else -1)
                os.chmod(path, 0o600)
        else:
            os.chmod(region_dir, 0o700)
        text = C.limits_file_text(
            allocation,
            priority_value,
            container_region=str(region_dir / "container.region"),
            node_region_dir=str(self.regions_dir / "node"),
            activity_file=self.activity_path(allocation.id),
        )
        self._set_priorities(
            {**read_priority_table(self.regions_dir / "node"), allocation.id: priority_value}, allocation
        )
        tmp = limits.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o444)
        os.replace(tmp, limits)
        env = {
            C.ENV_CONFIG: str(limits),
            C.ENV_CONTAINER_REGION: str(region_dir / "container.region"),
            C.ENV_NODE_REGION_DIR: str(self.regions_dir / "node"),
            "CUDA_VISIBLE_DEVICES": ",".join(allocation.gpu_uuids),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            C.ENV_ALLOCATION_ID: allocation.id,
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

    def pending_reclaims(self) -> list[Any]:
        """The node regions' waits for burst memory (``libvgpu.elastic.pending_reclaims``), with a
        resumed kernel's region named by the allocation it resumed in."""
        node = self.regions_dir / "node"
        if self.simulated or not node.is_dir():
            return []
        return [
            replace(r, owner=self._aliases.get(r.owner, r.owner), burster=self._aliases.get(r.burster, r.burster))
            for r in pending_reclaims(node)
        ]

    def slice_activity(self, allocation_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The shim's activity file of each allocation (``activity_path``: last launch, memory, for
        the busy time), and the burst the hub measured of each elastic one (``burst_gpu_seconds``,
        NVML's samples as of the burst thread's last look: hubext/local/burst.py), which no file
        of the slice changes."""
        wanted = list(allocation_ids)
        burst = self._burst.totals(wanted, self._elastic) if self._burst is not None else {}
        found: dict[str, dict[str, Any]] = {a: {"burst_gpu_seconds": burst[a]} for a in wanted if a in burst}
        for allocation_id in wanted:
            try:
                a = read_activity(self.activity_path(allocation_id))
            except (OSError, RegionError):  # none yet (no CUDA), or not a record the shim wrote
                continue
            found.setdefault(allocation_id, {}).update(
                last_launch=a.last_launch_at, memory_used_mib=a.memory_used_mib, launches=a.launches
            )
        return found

    def events(self, limit: int = 20) -> list[dict[str, Any]]:
        """Recent preemptions, newest first."""
        return self.ledger.events(limit) if self.ledger else []

    # ---- internals ---------------------------------------------------------------------------

    def _container_regions(self) -> dict[str, Path]:
        """Each held slice's container region, whose entries the relay copies into the node regions."""
        return {a: self.region_dir(a) / "container.region" for a in self.ledger.holders()}

    def _set_priorities(self, priorities: dict[str, int], new: Allocation | None = None) -> None:
        """The node regions' priority table (the shim believes a priority only if it is here, on
        the cards listed with it)."""
        held = [*(self.ledger.allocations() if self.ledger is not None else []), *([new] if new else [])]
        write_priority_table(self.regions_dir / "node", priorities, {a.id: a.gpu_uuids for a in held})

    def carry_files(self, old_id: str, new_id: str) -> None:
        """A resumed kernel's new allocation takes over the limits file and region of the one it
        was swapped out of (its shim keeps them open: renaming leaves them as they are)."""
        for old, new in (
            (self.limits_path(old_id), self.limits_path(new_id)),
            (self.region_dir(old_id), self.region_dir(new_id)),
        ):
            if old.exists():
                os.replace(old, new)
        self._aliases[old_id] = new_id  # what its processes' environment names is the new slice now
        for old, new in list(self._aliases.items()):
            if new == old_id:
                self._aliases[old] = new_id

    def _remove_files(self, allocation_id: str) -> None:
        table = read_priority_table(self.regions_dir / "node")
        if table.pop(allocation_id, None) is not None:
            self._set_priorities(table)
        self.limits_path(allocation_id).unlink(missing_ok=True)
        shutil.rmtree(self.region_dir(allocation_id), ignore_errors=True)

    def _stop_slice(self, allocation_id: str, leader: int, grace_seconds: float) -> None:
        """Stop every process of a slice (the holder's session and descendants, and whatever carries
        the slice's allocation id): SIGTERM now, SIGKILL after the grace, in the background."""
        if allocation_id in self._kill_tasks:
            return
        leaders = (leader,) if leader else ()
        if grace_seconds > 0:  # the first SIGTERM now, as the caller returns; the rest in the background
            signal_all(slice_processes(allocation_id, leaders), signal.SIGTERM)
        task = asyncio.ensure_future(stop_slice(allocation_id, leaders, grace_seconds))
        self._kill_tasks[allocation_id] = task

        def done(t: asyncio.Task) -> None:
            self._kill_tasks.pop(allocation_id, None)
            if not t.cancelled() and t.exception() is None and not t.result():
                self.log.warning("GPU slice %s: some of its processes did not stop", allocation_id)

        task.add_done_callback(done)

    async def _watch(self) -> None:
        """Notice holders that died and tell the allocator (which releases their slices)."""
        while True:
            await asyncio.sleep(self.check_interval_seconds)
            try:
                await self.check_holders()
            except Exception:
                self.log.exception("GPU ledger: checking holders failed")

    # ---- the backstop --------------------------------------------------------------------------

    def _nvml(self, off: str) -> Any:
        """This machine's NVML, started (None, logged with ``off``, when it cannot be)."""
        from libvgpu.agent.nvml import NVML, NVMLUnavailable

        nvml = NVML(self.nvml_library)
        try:
            nvml.init()
        except NVMLUnavailable as e:
            self.log.warning("%s: %s", off, e)
            return None
        return nvml

    def _holder_pids(self) -> dict[str, int]:
        """allocation id -> its holder's pid (the slices bound to a process)."""
        return {r["id"]: int(r["holder"]) for r in self.ledger.rows() if r["holder"] and r["holder"].isdigit()}

    def _start_backstop(self) -> None:
        policy = self.backstop_policy = Backstop(parent=self)
        nvml = self._nvml("GPU backstop off")
        if nvml is None:
            return
        gpus = [(g.uuid, g.index) for n in self._pool.nodes for g in n.gpus]
        region = lambda a: self.region_dir(a) / "container.region"  # noqa: E731
        record = lambda a, user, message: self.ledger.add_event_for(a, user, "backstop", message)  # noqa: E731
        checker = LocalBackstop(policy, nvml.processes, region, record, self.log)
        on = "GPU backstop on: %d GPU(s) checked every %.1f s, action '%s'"
        self.log.info(on, len(gpus), policy.interval_seconds, policy.action)

        async def run() -> None:
            while True:
                await asyncio.sleep(policy.interval_seconds)
                try:
                    await checker.check(
                        gpus,
                        self.ledger.allocations(),
                        self._holder_pids(),
                        accounts=self.server_accounts(),
                        aliases=self._aliases,
                        stopping=set(self._kill_tasks),
                    )
                except Exception:
                    self.log.exception("GPU backstop: the check failed")

        self._backstop_task = asyncio.ensure_future(run())

    def _start_burst(self) -> None:
        nvml = self._nvml("GPU burst of elastic slices not metered")
        if nvml is None:
            return
        cards = [(g.uuid, g.memory_mib) for n in self._pool.nodes for g in n.gpus]
        self._burst, self._burst_stop = start_burst(nvml, cards, self.burst_sample_seconds, self._burst_state, self.log)

    def _burst_state(self) -> tuple[list[Allocation], dict[str, int], dict[str, str]]:
        """(held allocations, their holders' pids, aliases) for the burst meter; nothing while no
        elastic slice is held (no look at the cards then)."""
        if not self._elastic or self.ledger is None:
            return [], {}, {}
        return self.ledger.allocations(), self._holder_pids(), dict(self._aliases)

    async def check_holders(self) -> list[str]:
        """Report allocations whose bound process has exited (``on_gone``); return their ids."""
        gone = []
        for row in self.ledger.rows():
            holder, started = row["holder"], row["holder_started"]
            if holder and holder.isdigit() and not process_alive(int(holder), started):
                if self.ledger.holders().get(row["id"]) != holder:
                    continue  # re-bound (a restarted kernel) or released while an earlier report was handled
                gone.append(row["id"])
                why = f"process {holder} exited"
                if self._on_gone is not None:
                    await self._on_gone(row["id"], why)
                else:
                    await self.forget(row["id"])
        return gone


def _safe_name(allocation_id: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in allocation_id)
