"""The node regions' priority table: which priority each allocation holds, as the hub (one
machine) or the node agent (Kubernetes) says, beside the node regions in a file containers cannot
write (the shim believes a container's stated priority only when this table confirms it)."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PRIORITY_TABLE", "read_priority_table", "write_priority_table"]


PRIORITY_TABLE = "priorities"
_TABLE_MAX_BYTES = 65536


def write_priority_table(
    directory: str | os.PathLike[str], priorities: dict[str, int], gpus: dict[str, Sequence[str]] | None = None
) -> bool:
    """Write ``<node_region_dir>/priorities``: one ``<allocation name> <priority> [<GPU uuid>,...]``
    line each (``gpus``: the cards each allocation holds; none listed: any card).

    A container states its own entry's priority (in its container region, relayed, or in the
    node region where it may write it), so the shim does not believe the priority it states: it
    holds launches only for an entry whose name and priority this table confirms, on a card the
    allocation holds. Written by the hub (single machine) or the node agent (Kubernetes), mode
    0644 in the node-region directory (the hub's or the agent's), replaced atomically, so a
    container can neither change nor remove it. Returns whether the file changed.
    """
    root = Path(directory)
    gpus = gpus or {}
    lines = [
        f"{name} {int(prio)} {','.join(gpus.get(name, ()))}".rstrip()
        for name, prio in sorted(priorities.items())
        if name and name.isprintable() and " " not in name and len(name) < 64
    ]
    text = "".join(line + "\n" for line in lines)
    path = root / PRIORITY_TABLE
    try:
        if path.read_text() == text and not path.is_symlink():
            return False
    except (OSError, UnicodeDecodeError):
        pass
    tmp = root / f".{PRIORITY_TABLE}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text[:_TABLE_MAX_BYTES])
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return True


def read_priority_table(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The priority table of a node-region directory ({} when there is none)."""
    out: dict[str, int] = {}
    try:
        fd = os.open(Path(directory) / PRIORITY_TABLE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return out
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return out
        text = f.read(_TABLE_MAX_BYTES).decode(errors="replace")
    for line in text.splitlines():
        parts = line.split()
        if len(parts) in (2, 3) and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out
