"""Local processes that hold slices: liveness, identity and stopping (single-machine mode).

Holders (single-user servers, GPU kernels) start their own session, so the holder's pid is
also its process group's id; the pid's start time is kept with it so a recycled pid is never
mistaken for the holder.

A slice's processes are more than the holder's group: a child may call ``setsid()`` (its own
session and group) and even be re-parented to init (``setsid -f``, a double fork). So a slice
is stopped by :func:`stop_slice`, which finds every process of it in /proc: the holder's
session, group and descendants, and every process whose environment carries the slice's
allocation id (``ELASTIC_GPU_ALLOCATION_ID``, which the pool sets for every holder and which
every child inherits, however it detaches).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from libvgpu.contract import ENV_ALLOCATION_ID


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name; None when the process does not exist, [] when unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return []
    return stat[stat.rfind(")") + 2 :].split()


def process_start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), or None if unknown."""
    fields = _stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead) and, when ``started`` is given, is the same process."""
    if pid <= 0:
        return False
    fields = _stat_fields(pid)
    if fields is None:
        return False
    if fields:
        if fields[0] in ("Z", "X"):
            return False
        return not (started is not None and len(fields) > 19 and fields[19] != started)
    try:  # /proc unreadable: ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_uid(pid: int) -> int | None:
    """The real uid ``pid`` runs as (None when it is gone or unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` ([] when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def signal_group(pid: int, sig: int) -> None:
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


async def stop_group(pid: int, grace_seconds: float, kill_wait_seconds: float = 5.0) -> bool:
    """SIGTERM the group of ``pid``, SIGKILL it after ``grace_seconds``; True once ``pid`` is gone."""
    for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, kill_wait_seconds)):
        if not process_alive(pid):
            return True
        signal_group(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not process_alive(pid):
                return True
            await asyncio.sleep(0.05)
    return not process_alive(pid)


def _ancestors(pid: int) -> set[int]:
    """``pid`` and its ancestors (never to be stopped as part of a slice: the hub and its parents)."""
    out = set()
    while pid > 0 and pid not in out:
        out.add(pid)
        fields = _stat_fields(pid)
        if not fields or len(fields) < 2:
            break
        pid = int(fields[1])
    return out


def slice_processes(allocation_id: str = "", leaders: Iterable[int] = ()) -> set[int]:
    """Live processes of a slice: the session, group and descendants of each of ``leaders``, and
    (when ``allocation_id`` is given) every process whose environment names that allocation."""
    leaders = {p for p in leaders if p > 0}
    needle = f"{ENV_ALLOCATION_ID}={allocation_id}".encode() if allocation_id else b""
    spare = _ancestors(os.getpid()) | {1}
    parents: dict[int, int] = {}
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        fields = _stat_fields(pid)
        if not fields or len(fields) < 4 or fields[0] in ("Z", "X"):
            continue
        ppid, pgrp, session = int(fields[1]), int(fields[2]), int(fields[3])
        parents[pid] = ppid
        if pid in leaders or pgrp in leaders or session in leaders:
            found.add(pid)
        elif needle:
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                found.add(pid)
    grew = True
    while grew:  # descendants of what was found (a child that cleared its environment, say)
        grew = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found - spare


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids`` (gone ones are skipped)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


async def stop_slice(
    allocation_id: str = "", leaders: Iterable[int] = (), grace_seconds: float = 0.0, kill_wait_seconds: float = 5.0
) -> bool:
    """Stop every process of a slice (see :func:`slice_processes`): SIGTERM, then SIGKILL after
    ``grace_seconds`` (at once when 0). Looks again each round, so a child forked meanwhile is
    stopped too. True once none is left."""
    leaders = tuple(leaders)
    deadline = time.monotonic() + grace_seconds
    pids = slice_processes(allocation_id, leaders)
    if grace_seconds > 0 and pids:
        signal_all(pids, signal.SIGTERM)
        while pids and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            pids = slice_processes(allocation_id, leaders)
            signal_all(pids, signal.SIGTERM)  # a child forked after the first round
    deadline = time.monotonic() + kill_wait_seconds
    while pids:
        signal_all(pids, signal.SIGKILL)
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
        pids = slice_processes(allocation_id, leaders)
    return True


def _environ_value(pid: int, name: str) -> str | None:
    """The value of ``name`` in the environment ``pid`` started with (None: unset or unreadable)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{name}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def trace_allocations(pids: Iterable[int], leaders: dict[int, str]) -> dict[int, tuple[str, bool]]:
    """The slice each of ``pids`` belongs to (the same rule as :func:`slice_processes`, for a few
    pids rather than the whole of /proc), and how it was found: ``(allocation id, True)`` for a
    holder's session, group or descendant (the kernel's word), else ``(id, False)`` for the
    allocation id its environment carries (the process's own word: any process can set it). Pids
    of no slice are left out. ``leaders``: holder pid -> allocation id."""
    found: dict[int, tuple[str, bool]] = {}
    for pid in pids:
        seen: set[int] = set()
        at = pid
        while at > 1 and at not in seen:
            seen.add(at)
            fields = _stat_fields(at)
            if not fields or len(fields) < 4:
                break
            ppid, pgrp, session = int(fields[1]), int(fields[2]), int(fields[3])
            holder = next((leaders[p] for p in (at, pgrp, session) if p in leaders), None)
            if holder is not None:
                found[pid] = (holder, True)
                break
            at = ppid
        if pid not in found:
            carried = _environ_value(pid, ENV_ALLOCATION_ID)
            if carried:
                found[pid] = (carried, False)
    return found


def allocations_of(pids: Iterable[int], leaders: dict[int, str]) -> dict[int, str]:
    """The allocation id of each of ``pids`` that belongs to a slice, however it was found (see
    :func:`trace_allocations`)."""
    return {pid: a for pid, (a, _) in trace_allocations(pids, leaders).items()}
