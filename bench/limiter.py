"""The cores limiter against the NVML double that samples as a driver does (one integer percent
per process per 167 ms period): limit x launch length -> the container's measured share, from a
cold start and after idle, one process per limit (the limits run at once, each on a simulated
GPU of its own). The same phases as ``./dev gpu-check`` (bench/gpucheck/claims.py).

    python bench/limiter.py [--limits 20,30,50,80] [--pidns]

Prints one row per limit: the share (percent) in each phase; ``*`` marks a share more than
5 points from the limit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpucheck.claims import CORES_POINTS, WORK, phases_for  # noqa: E402
from bench.gpucheck.target_doubles import DoubleTarget  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", default="20,30,50,80", help="cores limits, percent (20,30,50,80)")
    parser.add_argument("--pidns", action="store_true", help="every process in a pid namespace of its own")
    args = parser.parse_args(argv)
    limits = [int(x) for x in args.limits.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-limiter-") as tmp:
        target = DoubleTarget(Path(tmp))
        with ThreadPoolExecutor(len(limits)) as pool:
            runs = pool.map(lambda lim: target.cores(lim, phases_for(lim), args.pidns), limits)
            shares = dict(zip(limits, runs, strict=True))
    labels = [f"{kind} {ms:g} ms" for kind, ms in WORK]
    print(f"share of the GPU (%), NVML sampled every 167 ms{', in pid namespaces' if args.pidns else ''}; "
          "(c) = from a cold start, else after 3.2 s idle")
    print(f"{'limit':>6} | " + " | ".join(f"{label:>13}" for label in labels))
    for limit in limits:
        by_work = {(p.kind, p.ms): (s, p.idle_s == 0) for p, s in zip(phases_for(limit), shares[limit], strict=True)}
        cells = []
        for work in WORK:
            share, cold = by_work[work]
            mark = "*" if abs(share - limit) > CORES_POINTS else " "
            cells.append(f"{share:8.1f}{' (c)' if cold else '    '}{mark}")
        print(f"{limit:>5}% | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
