"""The enforcement backstop: the host's view of GPU memory checked against each pod's slice.

The shim limits a container from the inside, and a container can get around it: a statically
linked program, a process the preload missed, a tampered region. The node agent therefore looks
every ``interval_seconds`` at what the driver itself reports per process on each shared card
(``nvmlDeviceGetComputeRunningProcesses``, host pids), finds each process's pod from its cgroup,
and compares with the allocation that pod holds:

* ``over-limit`` — the processes of one allocation use more memory on a card than its slice
  plus ``tolerance_mib``;
* ``unregistered`` — a process on a shared card that holds no slice of that card (no pod, or a
  pod without an allocation on it) and uses more than ``tolerance_mib``;
* ``no-shim`` — an allocation's processes use a card but its shim never registered there (no
  entry in the card's node region; native backend only): the shim was bypassed. On one
  machine the hub sees it per process (a process of the allocation that holds no slot of the
  allocation's container region: ``LD_PRELOAD`` unset, ``LIBVGPU_CONFIG`` repointed, a static
  binary), and such a finding (``per_process``) is stopped like the others.

A finding must persist for ``confirm_checks`` consecutive checks (a process between its first
allocation and the shim's registration is not a finding). Each confirmed finding is counted in
``elastic_gpu_enforcement_violations_total{reason}``, recorded as a Kubernetes Event (on the
pod, or on the Node for a process of no known pod) and logged, naming the user and the
allocation. ``action = 'kill'`` (the default) kills the offending processes with SIGKILL: for
``over-limit`` the largest users first until the rest fits, for ``unregistered`` and a
per-process ``no-shim`` the process;
with the default interval (2 s) and confirmation (2 checks) that is within 10 s of the
violation, and every time it happens: after a kill the episode starts over, so a hog restarted
under the same allocation is confirmed and killed again. ``no-shim`` is reported only (once per
episode, as is everything in ``report`` mode): its memory is still bounded by the
``over-limit`` check.

The node agent runs it on Kubernetes (:mod:`libvgpu.agent.app`), the hub's local pool on one
machine (:mod:`hubext.local.backstop`): the same policy, findings and log lines in both modes.

:func:`evaluate` is pure (plain data in, findings out); :class:`Backstop` keeps the episode state
and acts through :class:`Actions`, which the agent implements with NVML/Kubernetes/os.kill.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from traitlets import Bool, Enum, Float, Integer
from traitlets.config import LoggingConfigurable

from quotas.messages import mib

MIB = 1 << 20

OVER_LIMIT = "over-limit"
UNREGISTERED = "unregistered"
NO_SHIM = "no-shim"
REASONS = (OVER_LIMIT, UNREGISTERED, NO_SHIM)

#: Kubernetes Event reasons
EVENT_REASONS = {
    OVER_LIMIT: "GPUMemoryOverSlice",
    UNREGISTERED: "GPUProcessWithoutSlice",
    NO_SHIM: "GPUShimBypassed",
}


@dataclass(frozen=True)
class Proc:
    """A process on a card as the driver reports it, with the pod it was traced to."""

    pid: int
    used_bytes: int
    name: str = ""  # comm
    pod: str = ""  # "namespace/name", "" when no pod
    pod_uid: str = ""
    allocation_id: str = ""  # "" when the pod holds no allocation
    other_pod: str = ""  # "namespace/name" (or "uid ...") of a pod that is not one of the hub's GPU pods
    claimed: bool = False  # linked to its allocation only by what it says (an id in its environment)


@dataclass(frozen=True)
class Slice:
    """What an allocation may use on one card."""

    allocation_id: str
    gpu_uuid: str
    limit_bytes: int | None  # None: whole card (no memory limit)
    pod: str  # "namespace/name"
    pod_uid: str
    user: str = ""
    registered: bool = True  # its shim is in the card's node region (or that is not checked)


@dataclass(frozen=True)
class Finding:
    reason: str
    gpu_uuid: str
    gpu_index: int
    processes: tuple[Proc, ...]
    used_bytes: int
    limit_bytes: int | None
    pod: str  # "namespace/name", "" for a process of no known pod (the Event goes on the Node)
    pod_uid: str
    allocation_id: str
    user: str = ""
    per_process: bool = False  # about processes[0] alone (one machine's no-shim)

    @property
    def key(self) -> tuple[str, str, str]:
        """What makes an episode: the same reason on the same card for the same allocation/pid."""
        if self.reason == UNREGISTERED or self.per_process:
            return (self.reason, self.gpu_uuid, f"pid:{self.processes[0].pid}")
        return (self.reason, self.gpu_uuid, self.allocation_id)


def _mib(n: int | None) -> str:
    return "no limit" if n is None else mib(round(n / MIB))


def evaluate(
    gpu_uuid: str,
    gpu_index: int,
    processes: Sequence[Proc],
    slices: Mapping[str, Slice],
    *,
    tolerance_bytes: int,
    check_unregistered: bool = True,
    check_shim: bool = True,
) -> list[Finding]:
    """The findings on one shared card. ``slices``: allocation id -> its slice of this card."""
    findings: list[Finding] = []
    by_alloc: dict[str, list[Proc]] = defaultdict(list)
    for p in processes:
        if p.allocation_id and p.allocation_id in slices:
            by_alloc[p.allocation_id].append(p)
        elif check_unregistered and p.used_bytes > tolerance_bytes:
            findings.append(
                Finding(UNREGISTERED, gpu_uuid, gpu_index, (p,), p.used_bytes, 0, p.pod, p.pod_uid,
                        p.allocation_id)
            )
    for alloc_id, procs in sorted(by_alloc.items()):
        s = slices[alloc_id]
        used = sum(p.used_bytes for p in procs)
        # what a process only claims never costs a process traced to the slice its place: the
        # claimed ones come first (largest first), see to_kill
        ordered = tuple(sorted(procs, key=lambda p: (not p.claimed, -p.used_bytes, p.pid)))
        if s.limit_bytes is not None and used > s.limit_bytes + tolerance_bytes:
            findings.append(
                Finding(OVER_LIMIT, gpu_uuid, gpu_index, ordered, used, s.limit_bytes, s.pod, s.pod_uid,
                        alloc_id, s.user)
            )
        if check_shim and not s.registered and used > 0:
            findings.append(
                Finding(NO_SHIM, gpu_uuid, gpu_index, ordered, used, s.limit_bytes, s.pod, s.pod_uid,
                        alloc_id, s.user)
            )
    return findings


def to_kill(finding: Finding, tolerance_bytes: int) -> list[Proc]:
    """The processes the kill policy ends for a finding (none for ``no-shim``). Over a limit: the
    largest first, those that only claim the allocation (``Proc.claimed``) before any other, and a
    process traced to the slice only while those traced to it use more than the slice alone."""
    if finding.reason == UNREGISTERED or finding.per_process:
        return list(finding.processes)
    if finding.reason != OVER_LIMIT or finding.limit_bytes is None:
        return []
    allowed = finding.limit_bytes + tolerance_bytes
    used = finding.used_bytes
    traced = sum(p.used_bytes for p in finding.processes if not p.claimed)
    victims: list[Proc] = []
    for p in finding.processes:  # claimed first, each group largest first
        if used <= allowed or (not p.claimed and traced <= allowed):
            break
        victims.append(p)
        used -= p.used_bytes
        traced -= 0 if p.claimed else p.used_bytes
    return victims


def describe(finding: Finding, tolerance_bytes: int, outcome: str) -> str:
    """The Event message: what was seen, against what, and what was done."""
    where = f"GPU {finding.gpu_index} ({finding.gpu_uuid})"
    procs = ", ".join(f"{p.pid}" + (f" ({p.name})" if p.name else "") for p in finding.processes)
    who = f" of user {finding.user}" if finding.user else ""
    if finding.reason == OVER_LIMIT:
        text = (f"Processes {procs} of allocation {finding.allocation_id}{who} use {_mib(finding.used_bytes)} of "
                f"GPU memory on {where}; the slice is {_mib(finding.limit_bytes)} "
                f"(tolerance {_mib(tolerance_bytes)}).")
    elif finding.reason == UNREGISTERED:
        if finding.pod:
            owner = f"pod {finding.pod}, which holds no slice of this card"
        elif finding.allocation_id:
            owner = f"allocation {finding.allocation_id}{who}, which holds no slice of this card"
        elif finding.user:  # one machine: a process of a server account, linked to no slice
            owner = (f"account {finding.user}, which the hub runs servers as, but to no live slice (it left its "
                     "slice: a detached session without the slice's allocation id)")
        elif finding.processes and finding.processes[0].other_pod:
            owner = (f"pod {finding.processes[0].other_pod}, which is not one of the hub's GPU pods "
                     "(another workload on a managed card)")
        else:
            owner = "no pod of this node"
        text = (f"Process {procs} uses {_mib(finding.used_bytes)} of GPU memory on shared {where} but belongs "
                f"to {owner}: no shim registered it.")
    elif finding.per_process:
        text = (f"Process {procs} of allocation {finding.allocation_id}{who} uses {_mib(finding.used_bytes)} on "
                f"{where} without libvgpu: it holds no slot of the allocation's region (LD_PRELOAD unset, "
                "LIBVGPU_CONFIG repointed or a static binary): the shim was bypassed.")
    else:
        text = (f"Processes {procs} of allocation {finding.allocation_id}{who} use {_mib(finding.used_bytes)} on "
                f"{where}, but libvgpu never registered the container in the card's node region: the shim was "
                "bypassed (a static binary, a missing preload or a tampered region).")
    return f"{text} {outcome}"


class Actions(Protocol):
    """What the backstop does about a confirmed finding (the agent implements it)."""

    def count(self, finding: Finding) -> None: ...
    def killed(self, finding: Finding, proc: Proc) -> None: ...
    async def record(self, finding: Finding, message: str) -> None: ...


def kill_process(pid: int) -> str:
    """SIGKILL ``pid``; "" on success, else why not."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "it had already exited"
    except PermissionError:
        return "permission denied (the agent needs CAP_KILL and hostPID)"
    return ""


@dataclass
class _Episode:
    seen: int = 0
    acted: bool = False


class Backstop(LoggingConfigurable):
    """Policy and episode state of the enforcement backstop (configured as ``Backstop.*``)."""

    tolerance_mib = Integer(
        256,
        min=0,
        config=True,
        help="""GPU memory (MiB) a slice may be exceeded by, and an unregistered process may use,
        before it is a violation: room for the driver's own per-process memory that the shim
        cannot see. Default: 256.""",
    )
    action = Enum(
        ["report", "kill"],
        default_value="kill",
        config=True,
        help="""What to do about a violation: 'kill' (SIGKILL the offending processes, every time
        the violation is confirmed, with an Event, a metric and a log line naming the user and
        the allocation; needs hostPID and the KILL capability) or 'report' (the Event, metric and
        log line only, once per episode). Default: 'kill'.""",
    )
    interval_seconds = Float(
        2.0,
        min=0.1,
        config=True,
        help="""Seconds between two checks of every shared card. With confirm_checks, how soon a
        violation is acted on: within (confirm_checks + 1) x interval_seconds. Default: 2.""",
    )
    confirm_checks = Integer(
        2,
        min=1,
        config=True,
        help="""Consecutive checks a violation must be seen in before it is acted on (1: at
        once). Default: 2.""",
    )
    check_unregistered = Bool(
        True,
        config=True,
        help="Flag processes on shared cards that hold no slice of them. Default: True.",
    )
    check_shim = Bool(
        True,
        config=True,
        help="""Flag allocations whose processes use a card where their shim never registered
        (native backend only; needs the node regions). Default: True.""",
    )

    #: seconds a killed pid is not looked at again (the driver may list it until it is reaped)
    killed_grace_seconds = 60.0

    def __init__(self, kill: Callable[[int], str] = kill_process, clock: Callable[[], float] = time.monotonic,
                 **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._kill = kill
        self._clock = clock
        self._episodes: dict[tuple[str, str, str], _Episode] = {}
        self._killed: dict[int, float] = {}

    def recently_killed(self, pid: int) -> bool:
        """Whether the backstop killed ``pid`` lately (leave it out of the next checks)."""
        at = self._killed.get(pid)
        if at is None:
            return False
        if self._clock() - at > self.killed_grace_seconds:
            del self._killed[pid]
            return False
        return True

    @property
    def tolerance_bytes(self) -> int:
        return int(self.tolerance_mib) * MIB

    async def act(self, findings: Sequence[Finding], actions: Actions) -> list[Finding]:
        """Advance the episodes with this check's findings; act on newly confirmed ones.

        Returns the findings acted on in this call.
        """
        current = {f.key: f for f in findings}
        for key in list(self._episodes):
            if key not in current:  # the episode ended (process gone, usage back under)
                del self._episodes[key]
        acted: list[Finding] = []
        for key, finding in current.items():
            ep = self._episodes.setdefault(key, _Episode())
            ep.seen += 1
            if ep.acted or ep.seen < self.confirm_checks:
                continue
            ep.acted = True
            if self.action == "kill" and to_kill(finding, self.tolerance_bytes) and all(
                    self.recently_killed(p.pid) for p in to_kill(finding, self.tolerance_bytes)):
                del self._episodes[key]  # another finding of this check killed them already
                continue
            if self.action == "kill" and to_kill(finding, self.tolerance_bytes):
                # killed: whatever stays over the slice afterwards (a respawned hog, a process
                # that survived) is a new violation, confirmed and acted on again
                del self._episodes[key]
            actions.count(finding)
            outcome = "Reported only (Backstop.action is 'report')."
            if self.action == "kill":
                victims = [p for p in to_kill(finding, self.tolerance_bytes) if not self.recently_killed(p.pid)]
                done, failed = [], []
                for proc in victims:
                    why = self._kill(proc.pid)
                    if why:
                        failed.append(f"{proc.pid}: {why}")
                    else:
                        done.append(str(proc.pid))
                        self._killed[proc.pid] = self._clock()
                        actions.killed(finding, proc)
                parts = []
                if done:
                    parts.append(f"Killed process {', '.join(done)}.")
                if failed:
                    parts.append(f"Could not kill {'; '.join(failed)}.")
                if not victims:
                    parts.append("Reported only (nothing to kill for this kind of finding).")
                outcome = " ".join(parts)
            message = describe(finding, self.tolerance_bytes, outcome)
            who = f"user {finding.user}, " if finding.user else ""
            what = f"allocation {finding.allocation_id}" if finding.allocation_id else "no allocation"
            self.log.warning("Backstop %s on %s (%s%s): %s", finding.reason, finding.pod or "node",
                             who, what, message)
            await actions.record(finding, message)
            acted.append(finding)
        return acted

