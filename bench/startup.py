"""How long 100 processes starting at once on one (simulated) card take to initialise CUDA and
allocate, with the shim (memory limit, container region) and without it, side by side in one
run (repetitions interleaved, medians compared).

    python bench/startup.py [--processes 100] [--reps 3]

The last line is ``startup processes=<n> with_s=<s> without_s=<s> ratio=<r>``: wall time from
the first start to the last process's allocation, with the shim over without it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.libvgpu.harness import Node, build_all  # noqa: E402


def once(node: Node, processes: int, shim: bool) -> float:
    box = node.container("bench", "memory_mib=1024")
    env = box.env(shim=shim)
    started = time.time_ns()
    procs = [subprocess.Popen([str(node.build.probe), "init", "ctx", "alloc:1M"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(processes)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        if p.returncode or "alloc rc=0" not in out:
            raise SystemExit(f"a process failed: {out}{err}")
        done.append(int(out.split("done_ns=")[1].split()[0]))
    return (max(done) - started) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        node = Node(build_all(Path(tmp) / "build"), Path(tmp) / "node")
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.reps):
            for shim in (False, True):  # interleaved: drift hits both alike
                runs[shim].append(once(node, args.processes, shim))
    with_s, without_s = statistics.median(runs[True]), statistics.median(runs[False])
    print(f"{args.processes} processes at once, {args.reps} interleaved runs per side (medians): "
          f"with the shim {runs[True]}, without {runs[False]}")
    print(f"startup processes={args.processes} with_s={with_s:.3f} without_s={without_s:.3f} "
          f"ratio={with_s / without_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
