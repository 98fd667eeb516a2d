"""On a real NVIDIA GPU with PyTorch (``pytest -m gpu``; skipped without one): the installed
shim limits real CUDA 12 programs, which reach the driver through the runtime's dlopen and
cuGetProcAddress."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import libvgpu

pytestmark = pytest.mark.gpu
GiB = 1 << 30


@pytest.fixture(scope="module")
def shim() -> str:
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU is visible")
    try:
        return libvgpu.library_path()
    except libvgpu.ShimNotBuilt as exc:
        pytest.skip(str(exc))


def container(tmp_path: Path, name: str, limits: str) -> dict[str, str]:
    root = tmp_path / name
    root.mkdir()
    conf = root / "limits.conf"
    conf.write_text(f"{limits}\ncontainer_region={root / 'container.region'}\n")
    conf.chmod(0o444)
    return {"LIBVGPU_CONFIG": str(conf)}


#: ``./dev gpu-check`` runs the suite a second time with every program in a pid namespace of its
#: own (``unshare -p -f --mount-proc``), as in a pod: getpid() there is not the pid NVML reports
PIDNS = os.environ.get("ELASTIC_GPU_TESTS_PIDNS") == "1"


def python(shim: str, env: dict[str, str], code: str, *, pidns: bool = PIDNS) -> subprocess.Popen[str]:
    """``python -c code`` under the shim (in a pid namespace of its own with ``pidns``)."""
    full = {**os.environ, **env, "LD_PRELOAD": shim, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    command = [sys.executable, "-c", textwrap.dedent(code)]
    if pidns:
        from .harness import pid_namespaces_unavailable

        why = pid_namespaces_unavailable()
        if why:
            pytest.skip(why)
        user = [] if os.geteuid() == 0 else ["-U", "-r"]
        command = ["unshare", *user, "-p", "-f", "--kill-child", "--mount-proc", *command]
    return subprocess.Popen(command, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def host_pid(proc: subprocess.Popen[str]) -> int:
    """The program's pid as NVML reports it: in a pid namespace, the child unshare forked."""
    if not PIDNS:
        return proc.pid
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = children.read_text().split()
        if found:
            return int(found[0])
        time.sleep(0.05)
    raise AssertionError(f"unshare ({proc.pid}) started no program")


def result(proc: subprocess.Popen[str], timeout: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_torch_sees_the_slice(shim, tmp_path):
    env = container(tmp_path, "c", "memory_mib=4096")
    out = result(python(shim, env, """
        import json, torch
        free, total = torch.cuda.mem_get_info()
        print(json.dumps({"free": free, "total": total}))
    """))
    assert out["total"] == 4 * GiB
    assert 0 < out["free"] < out["total"]  # the context's own memory is already counted


def test_allocating_past_a_shared_slice_raises_oom(shim, tmp_path):
    env = container(tmp_path, "c", "memory_mib=6144")  # 2 + 3.5 GiB + two contexts > 6 GiB
    holder = python(shim, env, """
        import sys, time, torch
        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        print("ready", flush=True)
        time.sleep(60)
    """)
    try:
        assert holder.stdout.readline().strip() == "ready"
        out = result(python(shim, env, """
            import json, torch
            try:
                torch.empty(int(3.5 * (1 << 30)), dtype=torch.uint8, device="cuda")
                big = "allocated"
            except torch.cuda.OutOfMemoryError:
                big = "oom"
            torch.cuda.empty_cache()
            small = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            print(json.dumps({"big": big, "small": small.numel()}))
        """))
        assert out == {"big": "oom", "small": 1 << 30}
    finally:
        holder.kill()
        holder.communicate()


def device_utilisation(seconds: float) -> float:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        time.sleep(0.2)
    return sum(samples) / len(samples)


MATMULS = """
    import time, torch
    a = torch.randn(4096, 4096, device="cuda")
    print("ready", flush=True)
    end = time.monotonic() + {seconds}
    while time.monotonic() < end:
        for _ in range(8):
            b = a @ a
        torch.cuda.synchronize()
    print('{{"done": 1}}')
"""


def test_cores_limit_of_30_percent_measures_25_to_35(shim, tmp_path):
    env = container(tmp_path, "c", "cores_percent=30")
    proc = python(shim, env, MATMULS.format(seconds=14))
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(3)  # let the limiter measure the kernels
    measured = device_utilisation(8)
    result(proc)
    assert 25 <= measured <= 35, measured


def test_low_priority_stalls_while_high_priority_runs(shim, tmp_path):
    nodes = tmp_path / "node"
    low_env = container(tmp_path, "low", f"priority=1\nnode_region_dir={nodes}")
    high_env = container(tmp_path, "high", f"priority=100\nnode_region_dir={nodes}")
    low = python(shim, low_env, """
        import json, time, torch
        a = torch.randn(2048, 2048, device="cuda")
        print("ready", flush=True)
        stamps, end = [], time.monotonic() + 9
        while time.monotonic() < end:
            b = a @ a
            torch.cuda.synchronize()
            stamps.append(time.monotonic())
        print(json.dumps({"stamps": stamps}))
    """)
    assert low.stdout.readline().strip() == "ready"
    time.sleep(2)
    t0 = time.monotonic()
    high = python(shim, high_env, MATMULS.format(seconds=3))
    assert high.stdout.readline().strip() == "ready"
    t1 = time.monotonic()
    result(high)
    t2 = time.monotonic()
    stamps = result(low)["stamps"]
    during = [s for s in stamps if t1 + 0.5 <= s <= t2 - 0.2]
    before = [s for s in stamps if t0 - 1.5 <= s <= t0 - 0.5]
    after = [s for s in stamps if t2 + 1.0 <= s <= t2 + 2.0]
    assert len(before) > 20 and len(after) > 20
    assert len(during) <= len(before) / 20  # stalled while the high-priority one ran


# ---- added for issue 13 (written without a GPU: first run them with ./dev gpu-check) --------


OVER_THE_SLICE = """
    import json, torch
    held, oom = [], False
    try:
        for _ in range(64):
            held.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        oom = True
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({"got": len(held) * (256 << 20), "oom": oom, "total": total}))
"""


def _over_the_slice(shim: str, env: dict[str, str], alloc_conf: str) -> dict:
    """Allocates 256 MiB tensors until PyTorch raises OOM; returns what it got."""
    full = {**env, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf}
    return result(python(shim, full, OVER_THE_SLICE))


@pytest.mark.parametrize("alloc_conf", ["expandable_segments:True", "backend:cudaMallocAsync"])
def test_pytorch_allocator_backends_are_held_to_the_slice(shim, tmp_path, alloc_conf):
    env = container(tmp_path, "c", "memory_mib=4096")
    out = _over_the_slice(shim, env, alloc_conf)
    assert out["oom"] and out["total"] == 4 * GiB
    assert 2 * GiB <= out["got"] <= 4 * GiB  # the context (~0.5 GiB) counts too


def test_a_cudamallocasync_pool_counts_what_it_keeps_until_emptied(shim, tmp_path):
    env = container(tmp_path, "c", "memory_mib=4096")
    env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    out = result(python(shim, env, """
        import ctypes, json, torch
        cuda = ctypes.CDLL("libcuda.so.1")
        x = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        del x  # back into PyTorch's pool: the release threshold is UINT64_MAX, it stays reserved
        torch.cuda.synchronize()
        ptr = ctypes.c_uint64()
        kept = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(2 << 30))
        torch.cuda.empty_cache()  # cudaMemPoolTrimTo(pool, 0)
        emptied = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(2 << 30))
        print(json.dumps({"kept": kept, "emptied": emptied}))
    """))
    assert out == {"kept": 2, "emptied": 0}  # CUDA_ERROR_OUT_OF_MEMORY while the pool kept it


def test_mem_get_info_and_nvidia_smi_show_the_slice(shim, tmp_path):
    import shutil

    if not shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is not installed")
    env = container(tmp_path, "c", "memory_mib=4096")
    full = {**os.environ, **env, "LD_PRELOAD": shim}
    smi = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=memory.total",
                          "--format=csv,noheader,nounits"], env=full, capture_output=True,
                         text=True, timeout=60)
    assert smi.returncode == 0, smi.stderr
    assert int(smi.stdout.strip()) == 4096


def test_context_memory_is_counted_as_the_driver_reports_it(shim, tmp_path):
    import pynvml

    from libvgpu.regions import read_container_region

    env = container(tmp_path, "c", "memory_mib=8192")
    proc = python(shim, env, """
        import sys, time, torch
        x = torch.ones(1, device="cuda") + 1  # a context, and a module loaded lazily
        torch.cuda.synchronize()
        print("ready", flush=True)
        time.sleep(60)
    """)
    try:
        assert proc.stdout.readline().strip() == "ready"
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        driver = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        counted = read_container_region(tmp_path / "c" / "container.region")
        (p,) = counted.processes
        assert p.host_pid == host_pid(proc)
        # what the shim counts for the process is what the driver says it uses (2 MiB pages)
        assert abs(p.memory_bytes[0] - driver[host_pid(proc)]) <= 64 << 20
    finally:
        proc.kill()
        proc.communicate()


GRAPHS = """
    import time, torch
    a = torch.randn(8192, 8192, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            b = a @ a
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range({matmuls}):
            b = a @ a
    torch.cuda.synchronize()
    for line in ("ready", "again"):  # a first cell, a pause, a second cell
        print(line, flush=True)
        end = time.monotonic() + {seconds}
        while time.monotonic() < end:
            g.replay()
            torch.cuda.synchronize()
        time.sleep(4)
    print('{{"done": 1}}')
"""


@pytest.mark.parametrize("when", ["ready", "again"], ids=["from-a-cold-start", "after-idle"])
def test_graphs_are_held_to_the_cores_limit(shim, tmp_path, when):
    env = container(tmp_path, "c", "cores_percent=30")
    proc = python(shim, env, GRAPHS.format(matmuls=40, seconds=4))  # graphs of ~0.1-0.3 s
    while proc.stdout.readline().strip() != when:
        assert proc.poll() is None, proc.stderr.read()
    time.sleep(1)  # within 1 s of the first replay (after the pause)
    measured = device_utilisation(2.5)
    result(proc)
    assert 25 <= measured <= 35, measured


def test_the_cores_limit_holds_inside_a_pid_namespace(shim, tmp_path):
    env = container(tmp_path, "c", "cores_percent=30")
    proc = python(shim, env, MATMULS.format(seconds=12), pidns=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(3)
    measured = device_utilisation(6)
    result(proc)
    assert 25 <= measured <= 35, measured


def test_tiny_kernels_of_a_cell_after_a_pause_are_not_throttled(shim, tmp_path):
    env = container(tmp_path, "c", "cores_percent=30")
    out = result(python(shim, env, """
        import json, time, torch
        x = torch.ones(16, device="cuda")
        for _ in range(100):
            x = x + 1
        torch.cuda.synchronize()
        cells = []
        for _ in range(3):
            time.sleep(3)  # the user reads, then runs the next cell
            t = time.monotonic()
            for _ in range(100):
                x = x + 1
            torch.cuda.synchronize()
            cells.append(time.monotonic() - t)
        print(json.dumps({"cells": cells}))
    """))
    assert max(out["cells"]) < 0.1, out  # 100 tiny kernels: no start-up throttling


def process_utilisation(seconds: float) -> dict[int, float]:
    """Mean SM utilisation per host pid over ``seconds`` (NVML's per-process samples)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    samples: dict[int, list[int]] = {}
    since = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.5)
        try:
            got = pynvml.nvmlDeviceGetProcessUtilization(handle, since)
        except pynvml.NVMLError_NotFound:  # no sample since
            continue
        for s in got:
            samples.setdefault(s.pid, []).append(s.smUtil)
            since = max(since, s.timeStamp)
    return {pid: sum(v) / len(v) for pid, v in samples.items()}


def test_two_containers_at_20_and_60_percent_each_get_their_share(shim, tmp_path):
    small = python(shim, container(tmp_path, "small", "cores_percent=20"), MATMULS.format(seconds=14))
    large = python(shim, container(tmp_path, "large", "cores_percent=60"), MATMULS.format(seconds=14))
    assert small.stdout.readline().strip() == "ready"
    assert large.stdout.readline().strip() == "ready"
    pids = host_pid(small), host_pid(large)
    time.sleep(3)
    measured = process_utilisation(8)
    result(small)
    result(large)
    assert 15 <= measured.get(pids[0], 0) <= 25, measured
    assert 55 <= measured.get(pids[1], 0) <= 65, measured


def test_several_processes_share_one_cores_limit(shim, tmp_path):
    env = container(tmp_path, "c", "cores_percent=30")
    procs = [python(shim, env, MATMULS.format(seconds=14)) for _ in range(3)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    time.sleep(3)
    measured = device_utilisation(8)
    for proc in procs:
        result(proc)
    assert 25 <= measured <= 35, measured  # the three together, not 3 x 30


def test_the_memory_limit_holds_inside_a_pid_namespace(shim, tmp_path):
    env = container(tmp_path, "c", "memory_mib=4096")
    out = result(python(shim, env, OVER_THE_SLICE, pidns=True))
    # the context's driver memory (~0.5 GiB) is found through the host pid and counted
    assert out["oom"] and 2 * GiB <= out["got"] <= int(3.75 * GiB), out
