"""What `elastic-gpu up` stops after the hub exited on Ctrl-C (``stop_leftover_holders``): every GPU
process the hub started. A swapped-out GPU kernel holds no slice (its allocation was released,
its GPU state sits in host memory, its process waits), so the allocations alone do not name it:
before, it outlived `up` for ever, holding its host memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hubext.cli.offline import stop_leftover_holders
from hubext.kernels import KernelRecord
from hubext.local.ledger import LEDGER_FILE, Ledger

SLEEPER = "import time; time.sleep(600)"


def kernel_process(conn: Path | None) -> subprocess.Popen:
    """A process as the local launcher starts a kernel (its own session, ``-f <its connection file>``)."""
    argv = [sys.executable, "-c", SLEEPER] + (["-f", str(conn)] if conn else [])
    return subprocess.Popen(argv, start_new_session=True)


def test_stopping_up_stops_swapped_out_kernels_too_and_only_the_hubs(tmp_path: Path) -> None:
    data = tmp_path / "data"
    swapped_id, reused_id = "a" * 32, "b" * 32
    conn = data / "kernels" / swapped_id / "connection.json"
    conn.parent.mkdir(parents=True)
    conn.write_text("{}")
    swapped = kernel_process(conn)
    stranger = kernel_process(None)  # a pid the ledger names, now another program's: left alone
    try:
        ledger = Ledger(data / LEDGER_FILE)
        try:
            swap = {"state": "swapped", "since": 1.0, "host_mib": 1024, "gpu_uuids": ["GPU-1"]}
            ledger.save_kernels(
                [
                    KernelRecord(id=kid, user="alice", server_name="", size="gpu-10g", allocation_id="",
                                 state="running", holder=str(p.pid), swap=swap).to_json()
                    for kid, p in ((swapped_id, swapped), (reused_id, stranger))
                ]
            )  # fmt: skip
        finally:
            ledger.close()
        assert stop_leftover_holders(data, grace_seconds=1.0) == 1
        assert swapped.wait(timeout=15) is not None
        assert stranger.poll() is None
    finally:
        for p in (swapped, stranger):
            p.kill()
            p.wait()
