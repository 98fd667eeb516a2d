"""The GPU claims' workloads in PyTorch (run by target_gpu.py, one process each, under the shim
or not): ``python3 torch_work.py <command> [args]``. Each prints its figures as one JSON line;
``hold`` commands then wait for a line on stdin (the checker looks at the process meanwhile).

Kernels of a given length are ``torch.cuda._sleep`` (a kernel that spins for N cycles); the
cycles per millisecond come from ``calibrate`` (run without a limit).

    memory CHUNK_MIB MAX_MIB       allocate CHUNK_MIB tensors until out of memory; hold
    driver                         a context, cuBLAS and cuDNN loaded (their modules); hold
    calibrate                      cycles of torch.cuda._sleep per millisecond
    cores CYCLES_PER_MS PHASES     each phase (JSON list) after its idle time; shares
    timeline SECONDS               wait for a line, then 1 ms kernels one at a time; pauses
    capture IDLE_S                 capture a graph (global mode) after IDLE_S idle
    bypass HOW HALF_MIB [PATH]     3 x HALF_MIB through one path to the driver (claims.BYPASSES;
                                   PATH: libsneaky.so for handle/next/rawdlopen, the container's
                                   region for region_unlink)
    overhead STEPS                 a small training step and cuMemAlloc/cuMemFree: times
    elastic CYCLES_PER_MS CHUNK MAX  mem_get_info, the share of 2 ms kernels, then CHUNK MiB
                                   tensors until out of memory (an elastic slice alone)
    floorback SECS CYCLES_PER_MS PCT  2 ms kernels for SECS: since when the share held at PCT
    owner MIB                      one tensor of MIB (waits while a reclaim is pending)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import torch


def say(**figures: object) -> None:
    print(json.dumps(figures), flush=True)


def hold() -> None:
    sys.stdin.readline()


def memory(chunk_mib: int, max_mib: int) -> None:
    free, total = torch.cuda.mem_get_info()
    kept, oom = [], False
    try:
        while len(kept) * chunk_mib < max_mib:
            kept.append(torch.empty(chunk_mib << 20, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        oom = True
    torch.cuda.synchronize()
    say(total_mib=total >> 20, free_mib=free >> 20, allocated_mib=len(kept) * chunk_mib, oom=oom)
    hold()


def driver() -> None:
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    b = a @ a  # cuBLAS
    x = torch.randn(8, 32, 64, 64, device="cuda")
    y = torch.nn.functional.conv2d(x, torch.randn(32, 32, 3, 3, device="cuda"), padding=1)  # cuDNN
    torch.softmax(y, dim=1).sum().item()
    del b
    torch.cuda.synchronize()
    say(reserved_mib=torch.cuda.memory_reserved() >> 20)
    hold()


def calibrate() -> None:
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    rates = []
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(20_000_000)
        e.record()
        e.synchronize()
        rates.append(20_000_000 / s.elapsed_time(e))
    say(cycles_per_ms=sorted(rates)[1])


def launcher(kind: str, ms: float, cycles_per_ms: float):
    if kind == "kernel":
        cycles = max(1, int(ms * cycles_per_ms))
        return lambda: torch.cuda._sleep(cycles)
    cycles = max(1, int(ms / 4 * cycles_per_ms))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):
            torch.cuda._sleep(cycles)
    return graph.replay


def share(kind: str, ms: float, warm_s: float, measure_s: float, cycles_per_ms: float) -> float:
    """Percent of the GPU's time this process's launches took, over whole launch periods: from
    the start of the first launch after warm_s to the start of the last one, the launches
    between counted at their calibrated length (time-slicing with other contexts stretches a
    kernel's own span, not its work)."""
    launch = launcher(kind, ms, cycles_per_ms)
    end_warm = time.monotonic() + warm_s
    while time.monotonic() < end_warm:
        launch()
    starts = []
    end = time.monotonic() + measure_s
    while time.monotonic() < end or len(starts) < 2:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        starts.append(start)
    torch.cuda.synchronize()
    span_ms = starts[0].elapsed_time(starts[-1])
    return 100.0 * (len(starts) - 1) * ms / span_ms


def cores(cycles_per_ms: float, phases: list[dict]) -> None:
    torch.zeros(1, device="cuda")  # the context: not part of the first phase
    torch.cuda.synchronize()
    shares = []
    for p in phases:
        torch.cuda.synchronize()
        time.sleep(p["idle_s"])
        shares.append(share(p["kind"], p["ms"], p["warm_s"], p["measure_s"], cycles_per_ms))
    say(shares=shares)


def timeline(seconds: float, cycles_per_ms: float) -> None:
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    say(ready=True)
    hold()
    cycles = int(cycles_per_ms)
    t0 = last = time.time()
    gaps = []
    while last - t0 < seconds:
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        now = time.time()
        if now - last > 0.05:
            gaps.append((last * 1000, now * 1000))
        last = now
    say(start_ms=t0 * 1000, end_ms=last * 1000, gaps=gaps)
    time.sleep(0.4)  # alive past the priority window: a dead container's entry holds nobody


def capture(idle_s: float) -> None:
    a = torch.randn(1024, 1024, device="cuda")
    for _ in range(10):
        b = a @ a
    torch.cuda.synchronize()
    time.sleep(idle_s)  # the limiter forgets the cost of a launch and measures afresh
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # capture_error_mode "global", PyTorch's default
            for _ in range(10):
                b = b @ a
        graph.replay()
        torch.cuda.synchronize()
        say(captured=True)
    except RuntimeError as exc:
        say(captured=False, error=str(exc)[:160])


def overhead(steps: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 512, device="cuda"), torch.randint(0, 10, (64,), device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(50):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / steps)
    cuda = ctypes.CDLL("libcuda.so.1")
    ptr, pairs = ctypes.c_uint64(), 2000
    t = time.perf_counter()
    for _ in range(pairs):
        if cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(2 << 20)) or cuda.cuMemFree_v2(ptr):
            raise SystemExit("cuMemAlloc_v2/cuMemFree_v2 failed")
    say(step_us=best * 1e6, alloc_ns=(time.perf_counter() - t) / pairs * 1e9)


def bypass(how: str, half_mib: int, path: str = "") -> None:
    """Three allocations of half the slice through one path to the driver, after PyTorch made
    its context; prints how many the driver (through the shim or not) granted."""
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    alloc_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
    if how in ("dlopen", "region_unlink"):
        alloc = cuda.cuMemAlloc_v2
    elif how == "getproc":
        fn, status = ctypes.c_void_p(), ctypes.c_int()
        rc = cuda.cuGetProcAddress_v2(b"cuMemAlloc", ctypes.byref(fn), 12000, ctypes.c_uint64(0),
                                      ctypes.byref(status))
        if rc or not fn.value:
            raise SystemExit(f"cuGetProcAddress_v2: {rc}")
        alloc = alloc_t(fn.value)
    elif how in ("handle", "next", "rawdlopen"):  # libsneaky.so links libcuda.so.1
        lib = ctypes.CDLL(path)
        if how == "handle":
            fn = ctypes.cast(lib.cuMemAlloc_v2, ctypes.c_void_p).value
        else:
            getter = getattr(lib, f"sneaky_{how}")
            getter.restype, getter.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
            fn = getter(b"cuMemAlloc_v2")
        if not fn:
            raise SystemExit(f"libsneaky.so {how}: no cuMemAlloc_v2")
        alloc = alloc_t(fn)
    elif how == "v1":  # 32-bit sizes and pointers
        v1 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.c_uint)(
            ctypes.cast(cuda.cuMemAlloc, ctypes.c_void_p).value)
        ptrs32 = [ctypes.c_uint() for _ in range(3)]
        granted = sum(1 for p in ptrs32 if v1(ctypes.byref(p), ctypes.c_uint(half_mib << 20)) == 0)
        say(allocated_mib=granted * half_mib)
        return
    else:
        raise SystemExit(f"no bypass {how} here")
    ptrs = [ctypes.c_uint64() for _ in range(3)]
    granted = int(alloc(ctypes.byref(ptrs[0]), ctypes.c_size_t(half_mib << 20)) == 0)
    if how == "region_unlink":  # a fresh region would be a fresh limit: this process stops
        os.unlink(path)
        time.sleep(0.15)  # the shim looks at its region at most every 100 ms
    granted += sum(1 for p in ptrs[1:] if alloc(ctypes.byref(p), ctypes.c_size_t(half_mib << 20)) == 0)
    say(allocated_mib=granted * half_mib)


def elastic(cycles_per_ms: float, chunk_mib: int, max_mib: int) -> None:
    free, total = torch.cuda.mem_get_info()
    burst_share = share("kernel", 2, 1.0, 2.0, cycles_per_ms)
    kept = []
    try:
        while len(kept) * chunk_mib < max_mib:
            kept.append(torch.empty(chunk_mib << 20, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        pass
    say(total_mib=total >> 20, free_mib=free >> 20, burst_share=burst_share, burst_mib=len(kept) * chunk_mib)


def floorback(seconds: float, cycles_per_ms: float, pct: float) -> None:
    """Each 2 ms kernel counts at its calibrated length where it starts; windows of 250 ms."""
    launch = launcher("kernel", 2, cycles_per_ms)
    first = torch.cuda.Event(enable_timing=True)
    first.record()
    starts = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        launch()
        starts.append(e)
    torch.cuda.synchronize()
    at = [first.elapsed_time(e) for e in starts]  # ms since the first launch
    back, w = 250.0, 250.0
    s = 0.0
    while s + w <= at[-1]:
        work = 2.0 * sum(1 for t in at if s <= t < s + w)
        if 100.0 * work / w < pct:
            back = s + w
        s += 10.0
    say(back_s=back / 1000)


def owner(mib: int) -> None:
    t = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    say(ok=t.numel() == mib << 20)


def main(argv: list[str]) -> None:
    cmd, args = argv[0], argv[1:]
    if cmd == "memory":
        memory(int(args[0]), int(args[1]))
    elif cmd == "driver":
        driver()
    elif cmd == "calibrate":
        calibrate()
    elif cmd == "cores":
        cores(float(args[0]), json.loads(args[1]))
    elif cmd == "timeline":
        timeline(float(args[0]), float(args[1]))
    elif cmd == "capture":
        capture(float(args[0]))
    elif cmd == "bypass":
        bypass(args[0], int(args[1]), *args[2:])
    elif cmd == "overhead":
        overhead(int(args[0]))
    elif cmd == "elastic":
        elastic(float(args[0]), int(args[1]), int(args[2]))
    elif cmd == "floorback":
        floorback(float(args[0]), float(args[1]), float(args[2]))
    elif cmd == "owner":
        owner(int(args[0]))
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv[1:])
