"""How fast a GPU kernel's memory swaps out and back in: the driver's checkpoint API driven from
another process (``libvgpu.checkpoint``, as the hub drives it), on a process holding N GiB.

    python bench/swap.py [--gib N] [--reps R]           the CUDA driver double
    python bench/swap.py --gpu [--gib N] [--reps R]     the real driver (NVIDIA GPU, driver 570+,
                                                        PyTorch; ``./dev gpu-check`` runs it)

Per repetition: suspend (lock + checkpoint: device memory to host memory), then the target makes
a CUDA call (it blocks), then resume (restore + unlock); ``resume_latency_s`` is from the resume's
start to that call's return: what the first cell after a resume waits for the GPU, the hub's
admission aside. With ``--gpu`` the target is PyTorch holding N GiB of random int64 tensors,
compared bit for bit with a host copy after every resume (``identical=yes|no``).

The last line is ``swap suspend_gib_s=<n> resume_gib_s=<n> resume_latency_s=<n>`` (medians).
Goals on a GPU: >= 10 GiB/s each way, resume_latency_s <= 2 + N / 10. On the double nothing is
copied: the figures are the path's own cost, not a bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: the process whose memory moves: allocates, says "ready", then per line makes one CUDA call
#: and answers with the time it came back (and, on a GPU, whether its tensors are as they were)
DOUBLE_TARGET = """
import ctypes, json, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(float(sys.argv[1]) * (1 << 30)))) == 0
print("ready", flush=True)
small = ctypes.c_uint64()
for line in sys.stdin:
    assert cuda.cuMemAlloc_v2(ctypes.byref(small), ctypes.c_size_t(1 << 20)) == 0
    cuda.cuMemFree_v2(small)
    print(json.dumps({"back": time.time()}), flush=True)
"""

GPU_TARGET = """
import json, sys, time, torch
n = int(float(sys.argv[1]) * (1 << 30)) // 8
gen = torch.Generator(device="cuda").manual_seed(18)
held = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, device="cuda", generator=gen)
saved = held.cpu()
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    (held[:1] + 1).item()  # the first CUDA work after the resume
    back = time.time()
    print(json.dumps({"back": back, "identical": bool(torch.equal(held.cpu(), saved))}), flush=True)
"""


def run(target_code: str, gib: float, reps: int, env: dict[str, str], library: str) -> list[dict]:
    from libvgpu.checkpoint import CudaCheckpoint

    target = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(target_code), str(gib)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert target.stdout.readline().strip() == "ready", "the target did not start"
        cp = CudaCheckpoint(library)
        cp.check()
        rows = []
        for _ in range(reps):
            t0 = time.perf_counter()
            cp.suspend([target.pid])
            suspend_s = time.perf_counter() - t0
            target.stdin.write("go\n")  # its call blocks: it is checkpointed
            target.stdin.flush()
            start = time.time()
            t0 = time.perf_counter()
            cp.resume([target.pid])
            resume_s = time.perf_counter() - t0
            answer = json.loads(target.stdout.readline())
            rows.append(
                {
                    "suspend_s": suspend_s,
                    "resume_s": resume_s,
                    "latency_s": answer["back"] - start,
                    "identical": answer.get("identical", "n/a"),
                }
            )
        return rows
    finally:
        target.kill()
        target.wait()


def on_double(gib: float, reps: int) -> list[dict]:
    """The controller runs in a child process: the double reads its state file's name once per process."""
    from tests.libvgpu.harness import build_all

    root = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    build = build_all(root / "build")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIBVGPU_", "CUDA_"))}
    env.pop("LD_PRELOAD", None)
    env.update(
        LD_LIBRARY_PATH=str(build.lib_dir),
        CUDA_DOUBLE_STATE=str(root / "gpu.state"),
        CUDA_DOUBLE_MEMORY_MIB=str(int(gib * 1024) + 1024),
        CUDA_DOUBLE_CONTEXT_MIB="0",
        PYTHONPATH=str(REPO),
    )
    child = subprocess.run(
        [sys.executable, __file__, "--controller", str(gib), str(reps), str(build.lib_dir / "libcuda.so.1")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if child.returncode:
        sys.exit(f"bench/swap.py: the controller failed:\n{child.stderr}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="GiB the target holds (default 4)")
    parser.add_argument("--reps", type=int, default=5, help="suspend/resume cycles (default 5)")
    parser.add_argument("--gpu", action="store_true", help="the real driver and PyTorch instead of the double")
    parser.add_argument("--controller", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.controller:
        gib, reps, library = float(args.controller[0]), int(args.controller[1]), args.controller[2]
        print(json.dumps(run(DOUBLE_TARGET, gib, reps, dict(os.environ), library)))
        return
    if args.gpu:
        rows = run(GPU_TARGET, args.gib, args.reps, dict(os.environ), "libcuda.so.1")
        where = "GPU (real driver)"
    else:
        rows = on_double(args.gib, args.reps)
        where = "CUDA driver double (copies nothing: the API path's cost)"
    for i, r in enumerate(rows):
        print(
            f"rep {i}: suspend {r['suspend_s']:.3f} s, resume {r['resume_s']:.3f} s, "
            f"first call after resume {r['latency_s']:.3f} s, identical={r['identical']}"
        )
    suspend = statistics.median(r["suspend_s"] for r in rows)
    resume = statistics.median(r["resume_s"] for r in rows)
    latency = statistics.median(r["latency_s"] for r in rows)
    print(
        f"{where}: {args.gib:g} GiB, {args.reps} cycles; goal on a GPU: >= 10 GiB/s, latency <= {2 + args.gib / 10:g} s"
    )
    if args.gpu and not all(r["identical"] is True for r in rows):
        print("swap: FAILED: the tensors were not bit-identical after a resume")
        sys.exit(1)
    print(
        f"swap suspend_gib_s={args.gib / suspend:.1f} resume_gib_s={args.gib / resume:.1f} "
        f"resume_latency_s={latency:.3f}"
    )


if __name__ == "__main__":
    main()
