"""The enforcement backstop on one machine: the node agent's (:mod:`libvgpu.backstop`), run by
the hub's local pool.

On one machine the shim's limits bind only while a user keeps the hub's environment: a process
that unsets ``LD_PRELOAD``, repoints ``LIBVGPU_CONFIG`` or uses another GPU index gets past it.
So, as the node agent does on Kubernetes, the local pool looks every
``Backstop.interval_seconds`` at what the driver reports per process (NVML, real pids) and
judges it with the same :func:`~libvgpu.backstop.evaluate` and :class:`~libvgpu.backstop.Backstop`
(configured as ``c.Backstop.*``; kill mode by default):

* a process belongs to the slice whose holder's session, group or descendant it is, or whose
  allocation id its environment carries (:func:`hubext.local.processes.trace_allocations`). The
  environment is the process's own word and allocation ids are listable, so it is believed only
  from a process that runs as the account the allocation's holder runs as (whole-card allocations
  included; no live holder, no belief), and such a process (``Proc.claimed``) never gets another
  one killed: over a limit, claimed processes go first, and a process traced to the slice only
  while the traced ones alone use more than the slice. A process of another account that carries
  the id is of no slice (below);
* ``over-limit``: a slice's processes use more of a card than the slice plus the tolerance;
* ``unregistered``: a process of a slice uses a card that slice does not hold (another GPU
  index);
* ``no-shim``, per process: a process of a (not whole-card) slice uses a card but holds no slot
  of its allocation's container region, so no libvgpu accounts for it.

* ``unregistered``, per process: a GPU process of an account the hub runs servers or GPU kernels
  as (:meth:`LocalPool.server_running`: the shared ``elastic-gpu`` account, a user's own account
  under PAM, the hub's own when servers run as it) that belongs to no live slice. A user's code
  can leave its slice: double-fork with ``setsid`` (a session and group of its own, re-parented to
  init) and clear its environment (no allocation id, no ``LD_PRELOAD``); nothing links it to a
  slice, so it would use the card outside every limit and quota. Whatever its memory (compute
  alone is worth stopping), it is stopped like the others. A kernel as it starts is linked from
  its first GPU call (its environment carries the allocation id from exec, and the allocation is
  in the ledger before it is launched); a slice being stopped is left to its stop (its grace);
  a resumed kernel's processes, whose environment names the allocation it was swapped out of,
  belong to the one it resumed in.

GPU processes of other accounts (root, the hub's own when no server runs as it, an admin's own
jobs) are not the hub's: they are left alone. Each confirmed finding is logged
(naming the user or account and the allocation), recorded in the ledger's events (the admin page and
``elastic-gpu status`` show them) and, in kill mode, its processes get SIGKILL, every time it
happens (a respawned hog too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from libvgpu.backstop import NO_SHIM, UNREGISTERED, Backstop, Finding, Proc, Slice, evaluate
from libvgpu.regions import RegionError, read_container_region
from quotas import Allocation

from .processes import process_uid, trace_allocations

MIB = 1 << 20


class LocalBackstop:
    """One check of this machine's cards (the pool calls :meth:`check` every interval)."""

    def __init__(
        self,
        backstop: Backstop,
        processes: Callable[[str], list[Any]],
        region_of: Callable[[str], Path],
        record: Callable[[str, str, str], None],
        log: Any,
    ) -> None:
        """``processes(uuid)``: NVML's processes on a card (``.pid``, ``.used_bytes``);
        ``region_of(allocation_id)``: its container region; ``record(allocation_id, user, message)``:
        the ledger's event (allocation id '' and the account for a process of no slice)."""
        self.backstop = backstop
        self._processes = processes
        self._region_of = region_of
        self._record = record
        self.log = log

    def _shimmed(self, allocation_id: str) -> set[int]:
        """Pids of the live processes that hold a slot of the allocation's container region."""
        try:
            usage = read_container_region(self._region_of(allocation_id))
        except (FileNotFoundError, RegionError, OSError):
            return set()
        return {pid for p in usage.processes if p.alive is not False for pid in (p.pid, p.host_pid or 0) if pid}

    async def check(self, gpus: Sequence[tuple[str, int]], allocations: Sequence[Allocation],
                    holders: dict[str, int], *, accounts: Mapping[int, str] | None = None,
                    aliases: Mapping[str, str] | None = None, stopping: set[str] | None = None) -> list[Finding]:
        """Judge every card once and act on confirmed findings; returns those acted on.
        ``gpus``: (uuid, NVML index) of each card; ``holders``: allocation id -> holder pid;
        ``accounts``: uid -> name of the accounts servers run as (their processes must belong to a
        live slice); ``aliases``: allocation id a process may carry -> the live one it stands for;
        ``stopping``: allocation ids whose processes the pool is stopping (left to that)."""
        accounts, aliases, stopping = accounts or {}, aliases or {}, stopping or set()
        gpu_uuids = [uuid for uuid, _ in gpus]
        by_id = {a.id: a for a in allocations}
        on_card = {}
        for uuid in gpu_uuids:
            try:
                on_card[uuid] = [p for p in self._processes(uuid) if not self.backstop.recently_killed(p.pid)]
            except Exception as e:  # an NVML error on one card: the others are still checked
                self.log.debug("Backstop: no process list for GPU %s: %s", uuid, e)
        pids = {p.pid for procs in on_card.values() for p in procs}
        linked, claimed = link_pids(pids, holders, aliases)
        owner = {pid: a for pid, a in linked.items() if a in by_id}
        shimmed = {a: self._shimmed(a) for a in set(owner.values())}
        findings: list[Finding] = []
        for uuid, index in gpus:
            procs = on_card.get(uuid, [])
            findings += self._sliceless(uuid, index, [p for p in procs if p.pid not in owner and linked.get(p.pid)
                                                      not in stopping], accounts)
            views = [Proc(pid=p.pid, used_bytes=p.used_bytes, name=_comm(p.pid), allocation_id=owner[p.pid],
                          claimed=p.pid in claimed) for p in procs if p.pid in owner]
            if not views:
                continue
            slices = {
                a.id: Slice(a.id, uuid, None if a.whole else a.memory_ceiling_mib * MIB, "", "", user=a.owner.user)
                for a in allocations if uuid in a.gpu_uuids
            }
            findings += evaluate(uuid, index, views, slices, tolerance_bytes=self.backstop.tolerance_bytes,
                                 check_unregistered=self.backstop.check_unregistered, check_shim=False)
            if self.backstop.check_shim:
                for p in views:
                    a = by_id[p.allocation_id]
                    if a.whole or p.allocation_id not in slices or p.pid in shimmed[p.allocation_id]:
                        continue
                    findings.append(Finding(NO_SHIM, uuid, index, (p,), p.used_bytes, slices[a.id].limit_bytes,
                                            "", "", a.id, a.owner.user, per_process=True))
        # the user of a process on a card its slice does not hold (evaluate() knows no user there)
        findings = [replace(f, user=by_id[f.allocation_id].owner.user) if not f.user and f.allocation_id in by_id
                    else f for f in findings]
        return await self.backstop.act(findings, _Actions(self, by_id))

    @staticmethod
    def _sliceless(uuid: str, index: int, procs: Sequence[Any], accounts: Mapping[int, str]) -> list[Finding]:
        """One finding per process of a server account that belongs to no live slice."""
        out = []
        for p in procs:
            uid = process_uid(p.pid)
            if uid is not None and uid in accounts:
                view = Proc(pid=p.pid, used_bytes=p.used_bytes, name=_comm(p.pid))
                out.append(Finding(UNREGISTERED, uuid, index, (view,), p.used_bytes, 0, "", "", "",
                                   accounts[uid]))
        return out


def link_pids(pids: set[int], holders: Mapping[str, int],
              aliases: Mapping[str, str]) -> tuple[dict[int, str], set[int]]:
    """pid -> the live allocation it belongs to, and the pids linked only by the id their
    environment carries (believed only from the account the allocation's holder runs as).
    ``holders``: allocation id -> holder pid. The backstop and the burst meter (burst.py) ask it."""
    traced = trace_allocations(pids, {pid: a for a, pid in holders.items()})
    holder_uid: dict[str, int | None] = {}
    linked: dict[int, str] = {}
    claimed: set[int] = set()
    for pid, (carried, by_ancestry) in traced.items():
        a = aliases.get(carried, carried)
        if not by_ancestry:
            if a not in holder_uid:
                holder_uid[a] = process_uid(holders[a]) if a in holders else None
            uid = process_uid(pid)
            if uid is None or holder_uid[a] is None or uid != holder_uid[a]:
                continue
            claimed.add(pid)
        linked[pid] = a
    return linked, claimed


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class _Actions:
    """The backstop's effects on one machine: the ledger's events (the log line is the backstop's)."""

    def __init__(self, owner: LocalBackstop, allocations: dict[str, Allocation]) -> None:
        self.owner = owner
        self.allocations = allocations

    def count(self, finding: Finding) -> None:
        pass

    def killed(self, finding: Finding, proc: Proc) -> None:
        pass

    async def record(self, finding: Finding, message: str) -> None:
        allocation = self.allocations.get(finding.allocation_id)
        if allocation is None and finding.allocation_id:
            return  # an allocation released meanwhile
        user = allocation.owner.user if allocation is not None else finding.user
        try:
            self.owner._record(finding.allocation_id, user, f"backstop {finding.reason}: {message}")
        except Exception as e:  # the ledger is busy or gone: the log line stays
            self.owner.log.warning("Backstop event for %s not recorded: %s", finding.allocation_id or user, e)
