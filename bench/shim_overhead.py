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
    python bench/shim_overhead.py --gpu [--calls N] [--reps R]

``--gpu`` measures on the real driver instead (an NVIDIA GPU and PyTorch needed; ``./dev
gpu-check`` runs it): tiny PyTorch kernels (one cuLaunchKernel each, as a notebook issues them)
and the driver's own cuMemAlloc/cuMemFree of 2 MiB through ctypes, with and without the shim
(memory limit, container region), interleaved; the last line is then
``gpu launch_ratio=<n> alloc_ratio=<n>`` (target launch_ratio <= 1.02).

The last line is ``shim launch_ratio=<n> alloc_ratio=<n>``: time per call with the shim divided
by time per call without it (1.00 = free; the targets are launch_ratio <= 1.02 and
alloc_ratio <= 1.02 with no cores limit). Times are the calling thread's CPU time (the modelled
driver burns CPU time too), so other load on the machine does not skew the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
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
    parser.add_argument("--calls", type=int, default=50_000, help="calls per run (default 50000)")
    parser.add_argument("--reps", type=int, default=7, help="interleaved runs per side (7)")
    parser.add_argument("--launch-ns", type=int, default=2000,
                        help="CPU time a launch costs in the modelled driver, ns (2000)")
    parser.add_argument("--alloc-ns", type=int, default=5000,
                        help="CPU time an allocation or a free costs in the modelled driver (5000)")
    parser.add_argument("--gpu", action="store_true",
                        help="measure on the real driver with PyTorch instead of the double")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.reps < 1:
        parser.error("--calls and --reps must be at least 1")
    if args.gpu:
        m = measure_gpu(args.calls, args.reps)
        print(f"real driver, calls per run: {args.calls} launches, {max(1, args.calls // 10)} "
              f"alloc+free pairs; interleaved runs per side: {args.reps} (medians)")
        for side in ("without", "with"):
            print(f"  {side:7} shim: {m[side]['launch_ns']:10.0f} ns per launch "
                  f"{m[side]['alloc_ns']:10.0f} ns per alloc+free pair")
        print(f"gpu launch_ratio={m['with']['launch_ns'] / m['without']['launch_ns']:.3f} "
              f"alloc_ratio={m['with']['alloc_ns'] / m['without']['alloc_ns']:.3f}")
        return 0

    with tempfile.TemporaryDirectory(prefix="shim-bench-") as tmp:
        build = build_all(Path(tmp) / "build")
        bare = measure(Node(build, Path(tmp) / "bare"), args.calls, args.reps)
        modelled = measure(
            Node(build, Path(tmp) / "modelled", CUDA_DOUBLE_LAUNCH_CPU_NS=args.launch_ns,
                 CUDA_DOUBLE_ALLOC_CPU_NS=args.alloc_ns),
            args.calls, args.reps,
        )
        per_call = syscalls_per_call(Node(build, Path(tmp) / "syscalls"), 10000) if shutil.which("strace") else None

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
    print("system calls the shim adds per launch + alloc+free pair (strace): "
          + ("strace is not installed" if per_call is None else f"{per_call:.4f}"))
    print(f"shim launch_ratio={ratio(modelled, 'launch_ns'):.3f} "
          f"alloc_ratio={ratio(modelled, 'alloc_ns'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
