"""Local processes that hold slices: liveness, identity and stopping (single-machine mode).

Holders (single-user servers, GPU kernels) start their own session, so the holder's pid is
also its process group's id. Stopping a holder stops its whole group; the pid's start time is
kept with it so a recycled pid is never mistaken for the holder.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path


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
