"""Kernel start: from "start kernel" to the first executed cell, remote GPU kernel vs local kernel.

    python bench/kernel_start.py [--mode emulator|local] [--rounds 9]

Both kernels are started the way JupyterLab starts them, through the user's real jupyter-server
(started by a real JupyterHub): ``POST /api/sessions``, a websocket on the kernel's channels,
``execute_request`` of ``1 + 1``; the clock stops at the ``execute_reply``. The local kernel is
the server's own ``python3`` ipykernel; the remote one is a GPU kernelspec ("Python 3 (GPU 10
GiB)"), which goes through the provisioner, the hub's broker (admission), and:

- ``emulator`` (default): a kernel pod created through the Kubernetes API emulator, whose kubelet
  runs the pod's ipykernel as a local process (no image pull, no real scheduler or CNI);
- ``local``: a local kernel process with the shim's environment (single-machine mode).

Rounds alternate the order of the two kinds after one warm-up round that is not counted; each
kernel is shut down (and its slice freed) before the next starts. Medians are reported.

The last line is ``kernel_start local_s=<n> remote_s=<n> added_s=<n>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.kernelprovider.helpers import Server, kube_stack, local_stack  # noqa: E402

REMOTE_SPEC = "elastic-gpu-gpu-10g"
LOCAL_SPEC = "python3"


def time_first_cell(server: Server, spec: str) -> float:
    """Seconds from POST /api/sessions to the execute_reply of the first cell; the kernel is then stopped."""
    started = time.perf_counter()
    status, session = server.start_session(spec)
    if status != 201:
        raise SystemExit(f"starting a {spec} kernel failed: HTTP {status}: {session}")
    conn = server.connect(session["kernel"]["id"])
    try:
        result = conn.execute("1 + 1", timeout=120)
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    if result["status"] != "ok" or result["text"] != "2":
        raise SystemExit(f"the first cell of a {spec} kernel did not run: {result}")
    status, body = server.api("DELETE", f"/sessions/{session['id']}")
    if status != 204:
        raise SystemExit(f"stopping the {spec} kernel failed: HTTP {status}: {body}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("emulator", "local"), default="emulator")
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds (after one warm-up), default 9")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    with tempfile.TemporaryDirectory(prefix="bench-kernel-start-") as tmp:
        stack = kube_stack if args.mode == "emulator" else local_stack
        print(f"starting a hub ({args.mode} mode) and alice's server ...", flush=True)
        with stack(Path(tmp)) as st:
            server: Server = st["alice"]
            time_first_cell(server, LOCAL_SPEC)  # warm-up (imports, caches), not counted
            time_first_cell(server, REMOTE_SPEC)
            local, remote = [], []
            for i in range(args.rounds):
                order = [(LOCAL_SPEC, local), (REMOTE_SPEC, remote)]
                for spec, out in order if i % 2 == 0 else reversed(order):
                    out.append(time_first_cell(server, spec))
                print(f"round {i + 1}: local {local[-1]:.3f} s, remote GPU {remote[-1]:.3f} s", flush=True)
    local_s, remote_s = statistics.median(local), statistics.median(remote)
    print(f"mode={args.mode} rounds={args.rounds} (medians)")
    print(f"kernel_start local_s={local_s:.3f} remote_s={remote_s:.3f} added_s={remote_s - local_s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
