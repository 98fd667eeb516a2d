"""Reading what a hub left in its config dir when it is not running: the GPU ledger.

``status`` and ``quota`` fall back to it; ``up`` uses it to find GPU processes (servers,
kernels) that outlived their hub, to stop them on Ctrl-C or to say that the next hub adopts them.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from quotas import Allocation

from ..local.ledger import LEDGER_FILE, Ledger
from ..local.processes import process_alive, process_cmdline, stop_slice
from .base import ADMISSION_FILE, CLIError


def offline_view(config_dir: Path, what: str) -> dict[str, Any]:
    """The pool ('pool') or quota ('quota') view, in the API's format, from the ledger."""
    from quotas import AdmissionState, ConfigError, Pool, load_config, load_pool

    from ..admin import pool_view, quota_view

    path = config_dir / "data" / LEDGER_FILE
    if not path.exists():
        raise CLIError(
            f"no hub has run with the config dir {config_dir} yet (no {path}); start one with `elastic-gpu up`"
        )
    if not os.access(path, os.R_OK):
        raise CLIError(f"{path} is readable by the hub's account only; run this as that account, or start the hub")
    ledger = Ledger(path)
    try:
        inventory = ledger.inventory()
        nodes, simulated = inventory if inventory else ([], False)
        allocations = []
        for row in ledger.rows():
            holder, started = row["holder"], row["holder_started"]
            if holder and holder.isdigit() and not process_alive(int(holder), started):
                continue  # its process has exited: the hub drops it when it starts
            allocations.append(Allocation.from_dict(json.loads(row["data"])))
        if what == "pool":
            return pool_view(
                nodes,
                [a.to_dict() for a in allocations],
                simulated=simulated,
                events=ledger.events(),
                source="ledger",
            )
        import yaml

        try:
            config = load_config(yaml.safe_load((config_dir / ADMISSION_FILE).read_text()) or {})
            state = AdmissionState(config, load_pool({"nodes": nodes}) if nodes else Pool(nodes=()))
        except (OSError, ConfigError, yaml.YAMLError) as e:
            raise CLIError(f"cannot read {config_dir / ADMISSION_FILE}: {e}") from None
        for a in allocations:
            state.add(a)
        return quota_view(state, source="ledger")
    finally:
        ledger.close()


def live_holders(data: Path) -> dict[str, int]:
    """Allocation id -> pid of the GPU holders (servers, kernels) in the ledger whose process still runs."""
    path = data / LEDGER_FILE
    if not path.exists() or not os.access(path, os.R_OK):
        return {}
    ledger = Ledger(path)
    try:
        rows = ledger.rows()
    finally:
        ledger.close()
    return {
        r["id"]: int(r["holder"])
        for r in rows
        if r["holder"] and r["holder"].isdigit() and process_alive(int(r["holder"]), r["holder_started"])
    }


def swapped_kernels(data: Path) -> dict[str, int]:
    """Kernel id -> pid of the swapped-out GPU kernels in the ledger whose process still runs (its
    command line names its connection file): they hold no slice, so :func:`live_holders` does not
    list them, and their GPU state waits in host memory."""
    path = data / LEDGER_FILE
    if not path.exists() or not os.access(path, os.R_OK):
        return {}
    ledger = Ledger(path)
    try:
        kernels = ledger.kernels()
    finally:
        ledger.close()
    out = {}
    for k in kernels:
        holder, kernel_id = str(k.get("holder") or ""), str(k.get("id") or "")
        if not (k.get("swap") and holder.isdigit() and kernel_id and process_alive(int(holder))):
            continue
        if any(f"{kernel_id}/connection.json" in part for part in process_cmdline(int(holder))):
            out[kernel_id] = int(holder)
    return out


def stop_leftover_holders(data: Path, grace_seconds: float = 5.0) -> int:
    """Stop the GPU holders (servers, kernels) still alive after the hub exited, with every process of
    their slice (``setsid`` children included), as the pool stops a slice.

    ``up`` promises that Ctrl-C stops everything the hub started; JupyterHub stops its servers,
    and this catches what outlives them (a GPU kernel whose server could not reach the broker, a
    swapped-out kernel: :func:`swapped_kernels`).
    """
    alive = live_holders(data)
    swapped = swapped_kernels(data)

    async def stop_all() -> None:
        await asyncio.gather(
            *(stop_slice(aid, (pid,), grace_seconds) for aid, pid in alive.items()),
            *(stop_slice("", (pid,), grace_seconds) for pid in swapped.values() if pid not in alive.values()),
        )

    if alive or swapped:
        asyncio.run(stop_all())
    return len(alive) + sum(pid not in alive.values() for pid in swapped.values())
