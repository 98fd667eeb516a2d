"""What libvgpu costs a program: kernel launches/s and allocations/s with and without the shim,
against the CUDA driver test double, measured side by side in one run (rounds strictly
alternating on one core, per-round ratios, their median with a 95 % confidence interval).

The shim runs as deployed without a cores limit: a memory limit, a container region and an
activity file, so every launch stamps the activity record and every allocation is checked and
counted. The double models what a real driver call costs the caller (a launch about 2 us, an
allocation about 5 us; both options below) so the ratio is about a realistic denominator; the
same comparison against the bare double (calls that cost nothing but the double's own
bookkeeping) and the absolute nanoseconds the shim adds are printed too.

How it measures: two probe processes, one without the shim and one with it, each on a
simulated node of its own, are pinned to the same core (os.sched_setaffinity) and take turns:
round 1 without, round 1 with, round 2 without, ... (a round: --calls launches, then --calls
alloc+free pairs, timed by the calling thread's CPU time). Both sides so run on the same core,
with the same caches and clock, moments apart, and each round follows one of the other side.
The first WARMUP rounds of each side (first touches of pages and tables) are not counted; every
other round is. Each round gives a ratio with / without; the bench prints their median and a
distribution-free 95 % confidence interval of that median (order statistics). Work the shim
does per wall-clock time (its 100 ms floor refresh) comes about twice as often per call as in
a process running alone, since each side runs half of the time: that errs against the shim.

    python bench/shim_overhead.py [--calls N] [--rounds R] [--launch-ns 2000] [--alloc-ns 5000]
    python bench/shim_overhead.py --gpu [--calls N] [--rounds R]

``--gpu`` measures on the real driver instead (an NVIDIA GPU and PyTorch needed; ``./dev
gpu-check`` runs it): tiny PyTorch kernels (one cuLaunchKernel each, as a notebook issues them)
and the driver's own cuMemAlloc/cuMemFree of 2 MiB through ctypes, with and without the shim
(memory limit, container region), in R interleaved runs of a process each (medians); the last
line is then ``gpu launch_ratio=<n> alloc_ratio=<n>`` (target launch_ratio <= 1.02).

The last line is ``shim launch_ratio=<n> alloc_ratio=<n>``: the medians of the per-round ratios
(1.00 = free; the targets are launch_ratio <= 1.02 and alloc_ratio <= 1.02 with no cores
limit). Times are the calling thread's CPU time (the modelled driver burns CPU time too), so
time the process waits for a core does not count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.libvgpu.harness import Node, Result, build_all  # noqa: E402

#: rounds each side runs first that are not counted: the probe's first touches of its pages,
#: tables and the double's state (always the first WARMUP rounds, whatever they measured)
WARMUP = 3


@contextlib.contextmanager
def one_core() -> Iterator[int]:
    """This process, and the processes it starts meanwhile, on one core (the last it may use):
    both sides run on the same core, with its caches and its clock, never migrating."""
    allowed = os.sched_getaffinity(0)
    core = max(allowed)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, allowed)


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median and a distribution-free confidence interval for it: the order statistics
    x(k) and x(n+1-k), k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2."""
    xs, n = sorted(values), len(values)
    tail, below, k = (1 - level) / 2, 0.0, 0
    while k < n and below + math.comb(n, k) / 2 ** n <= tail:
        below += math.comb(n, k) / 2 ** n
        k += 1
    lo, hi = (xs[k - 1], xs[n - k]) if k else (xs[0], xs[-1])
    return statistics.median(xs), lo, hi


def measure(node: Node, calls: int, rounds: int) -> dict[str, dict[str, float]]:
    """Both sides at once, each a probe process (init, ctx, then rounds of ``calls`` launches and
    ``calls`` alloc+free pairs) pinned to the same core, driven in strict alternation: round i
    without the shim, round i with it, round i+1 without, ... Each round's ratio is with / without;
    returned: the sides' median ns and, under "ratio", (median, 95 % CI low, high) of the
    ``rounds`` per-round ratios (after WARMUP rounds each, all rounds counted)."""
    sides = ("without", "with")
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    with contextlib.ExitStack() as stack, one_core():
        procs = {}
        for name in sides:
            # each side alone on a simulated node of its own, as each would be on a machine: the
            # double looks up its caller among the node's processes (the later-registered one
            # would pay to pass over the other)
            own = Node(node.build, node.root / name,
                       **{k: v for k, v in node.double_env.items() if k != "CUDA_DOUBLE_STATE"})
            stack.callback(own.cleanup)
            box = own.container("bench", "memory_mib=4096")
            err = stack.enter_context(tempfile.TemporaryFile("w+"))
            proc = subprocess.Popen([str(node.build.probe), "init", "ctx", f"benchrounds:{calls}"],
                                    env=box.env(shim=(name == "with")), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, text=True)
            own.processes.append(proc)
            procs[name] = (proc, err)

        def line(name: str, prefix: str) -> str:
            proc, err = procs[name]
            while out := proc.stdout.readline():
                if out.startswith(prefix):
                    return out
                if " rc=" in out and " rc=0" not in out:
                    break
            proc.kill()
            err.seek(0)
            raise SystemExit(f"bench run failed ({name}): {out}{err.read()[-2000:]}")

        for name in sides:
            line(name, "benchready")
        for i in range(WARMUP + rounds):
            for name in sides:  # strictly alternating, one round at a time, on one core
                procs[name][0].stdin.write("\n")
                procs[name][0].stdin.flush()
                r = Result.parse(0, line(name, "round "), "").one("round")
                if int(r["rc"]) != 0:
                    raise SystemExit(f"bench round failed ({name}): {r}")
                if i >= WARMUP:
                    rows[name].append({k: float(r[k]) for k in ("launch_ns", "alloc_ns")})
        for name in sides:
            procs[name][0].stdin.close()
            line(name, "benchrounds rc=0")
            procs[name][0].wait(timeout=60)
    keys = ("launch_ns", "alloc_ns")
    m: dict[str, dict] = {name: {k: statistics.median(row[k] for row in rows[name]) for k in keys}
                          for name in sides}
    m["ratio"] = {k: median_ci([w[k] / wo[k] for wo, w in zip(rows["without"], rows["with"], strict=True)])
                  for k in keys}
    return m


def _syscalls(box, steps: tuple[str, ...], shim: bool) -> int:
    """System calls the probe makes running ``steps`` (strace -f -c, its 'total' row)."""
    with tempfile.TemporaryDirectory(prefix="shim-strace-") as tmp:
        out = Path(tmp) / "summary"
        env = box.env(shim=shim)
        proc = subprocess.run(["strace", "-f", "-c", "-o", str(out), str(box.node.build.probe), *steps],
                              env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise SystemExit(f"strace of the probe failed: {proc.stdout}{proc.stderr}")
        total = [line.split() for line in out.read_text().splitlines() if line.split()[-1:] == ["total"]]
        return int(total[-1][3])


def syscalls_per_call(node: Node, calls: int) -> float:
    """System calls the shim adds per launch + alloc+free pair in steady state: the probe's
    system calls for 2N and for N of each, with the shim minus without (what starting, the
    context and the double make cancels out), over N. The shim's 100 ms floor refresh is the
    only time-driven part; a per-call system call would read about 1.0 here. (The CUDA double,
like a real driver, makes none per call.)"""
    box = node.container("syscalls", "memory_mib=4096")
    _syscalls(box, ("init", "ctx", "bench:1"), True)  # the container region made once, as in a pod
    added = {}
    for shim in (False, True):
        n1 = _syscalls(box, ("init", "ctx", f"bench:{calls}"), shim)
        n2 = _syscalls(box, ("init", "ctx", f"bench:{2 * calls}"), shim)
        added[shim] = n2 - n1
    return max(0.0, (added[True] - added[False]) / calls)


GPU_SCRIPT = """
import ctypes, json, sys, time
import torch
cuda = ctypes.CDLL("libcuda.so.1")
n = int(sys.argv[1])
x = torch.zeros(16, device="cuda")
for _ in range(1000):  # warm up: modules loaded, allocator primed
    x.add_(1)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(n):
    x.add_(1)
torch.cuda.synchronize()
launch = (time.perf_counter() - t0) / n * 1e9
ptr = ctypes.c_uint64()
m = max(1, n // 10)
t0 = time.perf_counter()
for _ in range(m):
    if cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(2 << 20)) or cuda.cuMemFree_v2(ptr):
        raise SystemExit("cuMemAlloc_v2/cuMemFree_v2 failed")
alloc = (time.perf_counter() - t0) / m * 1e9
print(json.dumps({"launch_ns": launch, "alloc_ns": alloc}))
"""


def measure_gpu(calls: int, reps: int) -> dict[str, dict[str, float]]:
    """Medians on the real driver, with and without the shim (memory limit + region)."""
    import libvgpu

    shim = libvgpu.library_path()
    runs: dict[str, dict[str, list[float]]] = {
        name: {"launch_ns": [], "alloc_ns": []} for name in ("without", "with")
    }
    with tempfile.TemporaryDirectory(prefix="shim-gpu-bench-") as tmp:
        conf = Path(tmp) / "limits.conf"
        conf.write_text(f"memory_mib=65536\ncontainer_region={tmp}/container.region\n")
        base = {k: v for k, v in os.environ.items() if not k.startswith("LIBVGPU_")}
        base.pop("LD_PRELOAD", None)
        for _ in range(reps):
            for name in ("without", "with"):
                env = dict(base)
                if name == "with":
                    env.update(LD_PRELOAD=shim, LIBVGPU_CONFIG=str(conf))
                proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT, str(calls)], env=env,
                                      capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    raise SystemExit(f"GPU bench run failed ({name}): {proc.stderr[-2000:]}")
                out = json.loads(proc.stdout.strip().splitlines()[-1])
                for key in ("launch_ns", "alloc_ns"):
                    runs[name][key].append(out[key])
    return {
        name: {key: statistics.median(values) for key, values in series.items()}
        for name, series in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=None,
                        help="calls per round (default 5000; --gpu: calls per run, 50000)")
    parser.add_argument("--rounds", "--reps", type=int, default=None,
                        help="rounds per side, strictly alternating (default 101; --gpu: runs, 7)")
    parser.add_argument("--launch-ns", type=int, default=2000,
                        help="CPU time a launch costs in the modelled driver, ns (2000)")
    parser.add_argument("--alloc-ns", type=int, default=5000,
                        help="CPU time an allocation or a free costs in the modelled driver (5000)")
    parser.add_argument("--gpu", action="store_true",
                        help="measure on the real driver with PyTorch instead of the double")
    args = parser.parse_args(argv)
    calls = args.calls or (50_000 if args.gpu else 5000)
    rounds = args.rounds or (7 if args.gpu else 101)
    if calls < 1 or rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    if args.gpu:
        m = measure_gpu(calls, rounds)
        print(f"real driver, calls per run: {calls} launches, {max(1, calls // 10)} "
              f"alloc+free pairs; interleaved runs per side: {rounds} (medians)")
        for side in ("without", "with"):
            print(f"  {side:7} shim: {m[side]['launch_ns']:10.0f} ns per launch "
                  f"{m[side]['alloc_ns']:10.0f} ns per alloc+free pair")
        print(f"gpu launch_ratio={m['with']['launch_ns'] / m['without']['launch_ns']:.3f} "
              f"alloc_ratio={m['with']['alloc_ns'] / m['without']['alloc_ns']:.3f}")
        return 0

    with tempfile.TemporaryDirectory(prefix="shim-bench-") as tmp:
        build = build_all(Path(tmp) / "build")
        bare = measure(Node(build, Path(tmp) / "bare"), calls, rounds)
        modelled = measure(
            Node(build, Path(tmp) / "modelled", CUDA_DOUBLE_LAUNCH_CPU_NS=args.launch_ns,
                 CUDA_DOUBLE_ALLOC_CPU_NS=args.alloc_ns),
            calls, rounds,
        )
        per_call = syscalls_per_call(Node(build, Path(tmp) / "syscalls"), 10000) if shutil.which("strace") else None

    def ratio(m: dict[str, dict], key: str) -> str:
        med, lo, hi = m["ratio"][key]
        return f"{med:.3f} (95% CI {lo:.3f}-{hi:.3f})"

    print(f"calls per round: {calls}, rounds per side: {rounds} after {WARMUP} not counted, strictly "
          f"alternating on one core; per-round ratios with/without, their median and its 95% CI")
    for title, m in (("bare double", bare),
                     (f"modelled driver (launch {args.launch_ns} ns, alloc/free "
                      f"{args.alloc_ns} ns each)", modelled)):
        print(f"{title}:")
        for side in ("without", "with"):
            launch, alloc = m[side]["launch_ns"], m[side]["alloc_ns"]
            print(f"  {side:7} shim: {1e9 / launch:12,.0f} launches/s "
                  f"{1e9 / alloc:12,.0f} alloc+free pairs/s (medians)")
        print(f"  shim adds {m['with']['launch_ns'] - m['without']['launch_ns']:+.0f} ns per "
              f"launch, {m['with']['alloc_ns'] - m['without']['alloc_ns']:+.0f} ns per alloc+free pair")
        print(f"  launch ratio {ratio(m, 'launch_ns')}, alloc ratio {ratio(m, 'alloc_ns')}")
    print("system calls the shim adds per launch + alloc+free pair (strace): "
          + ("strace is not installed" if per_call is None else f"{per_call:.4f}"))
    print(f"shim launch_ratio={modelled['ratio']['launch_ns'][0]:.3f} "
          f"alloc_ratio={modelled['ratio']['alloc_ns'][0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
