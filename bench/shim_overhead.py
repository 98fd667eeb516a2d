"""What libvgpu costs a program: kernel launches/s and allocations/s with and without the shim,
against the CUDA driver test double, measured side by side in one run (repetitions
interleaved, medians compared).

The shim runs as deployed without a cores limit: a memory limit, a container region and an
activity file, so every launch stamps the activity record and every allocation is checked and
counted. The double models what a real driver call costs the caller (a launch about 2 us, an
allocation about 5 us; both options below) so the ratio is about a realistic denominator; the
same comparison against the bare double (calls that cost nothing but the double's own
bookkeeping) and the absolute nanoseconds the shim adds are printed too.

    python bench/shim_overhead.py [--calls N] [--reps R] [--launch-ns 2000] [--alloc-ns 5000]

The last line is ``shim launch_ratio=<n> alloc_ratio=<n>``: time per call with the shim divided
by time per call without it (1.00 = free; the target is launch_ratio <= 1.05 with no cores
limit).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.libvgpu.harness import Node, build_all  # noqa: E402


def measure(node: Node, calls: int, reps: int) -> dict[str, dict[str, float]]:
    box = node.container("bench", "memory_mib=4096")
    runs: dict[str, dict[str, list[float]]] = {
        name: {"launch_ns": [], "alloc_ns": []} for name in ("without", "with")
    }
    for _ in range(reps):
        for name in ("without", "with"):  # interleaved: drift hits both alike
            r = box.run("init", "ctx", f"bench:{calls}", shim=(name == "with"))
            if r.returncode != 0 or int(r.one("bench")["rc"]) != 0:
                raise SystemExit(f"bench run failed ({name}): {r.stdout}{r.stderr}")
            for key in ("launch_ns", "alloc_ns"):
                runs[name][key].append(r.num("bench", key))
    return {
        name: {key: statistics.median(values) for key, values in series.items()}
        for name, series in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50_000, help="calls per run (default 50000)")
    parser.add_argument("--reps", type=int, default=7, help="interleaved runs per side (7)")
    parser.add_argument("--launch-ns", type=int, default=2000,
                        help="CPU time a launch costs in the modelled driver, ns (2000)")
    parser.add_argument("--alloc-ns", type=int, default=5000,
                        help="CPU time an allocation or a free costs in the modelled driver (5000)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.reps < 1:
        parser.error("--calls and --reps must be at least 1")

    with tempfile.TemporaryDirectory(prefix="shim-bench-") as tmp:
        build = build_all(Path(tmp) / "build")
        bare = measure(Node(build, Path(tmp) / "bare"), args.calls, args.reps)
        modelled = measure(
            Node(build, Path(tmp) / "modelled", CUDA_DOUBLE_LAUNCH_CPU_NS=args.launch_ns,
                 CUDA_DOUBLE_ALLOC_CPU_NS=args.alloc_ns),
            args.calls, args.reps,
        )

    def ratio(m: dict[str, dict[str, float]], key: str) -> float:
        return m["with"][key] / m["without"][key]

    print(f"calls per run: {args.calls}, interleaved runs per side: {args.reps} (medians)")
    for title, m in (("bare double", bare),
                     (f"modelled driver (launch {args.launch_ns} ns, alloc/free "
                      f"{args.alloc_ns} ns each)", modelled)):
        print(f"{title}:")
        for side in ("without", "with"):
            launch, alloc = m[side]["launch_ns"], m[side]["alloc_ns"]
            print(f"  {side:7} shim: {1e9 / launch:12,.0f} launches/s "
                  f"{1e9 / alloc:12,.0f} alloc+free pairs/s")
        print(f"  shim adds {m['with']['launch_ns'] - m['without']['launch_ns']:+.0f} ns per "
              f"launch, {m['with']['alloc_ns'] - m['without']['alloc_ns']:+.0f} ns per "
              f"alloc+free pair; ratios {ratio(m, 'launch_ns'):.3f} / {ratio(m, 'alloc_ns'):.3f}")
    print(f"shim launch_ratio={ratio(modelled, 'launch_ns'):.3f} "
          f"alloc_ratio={ratio(modelled, 'alloc_ns'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
