"""What both targets share: the host's NVML view of the GPU, medians, the priority verdict's
figures."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence

from .claims import Figures

#: run outside the shim: NVML's compute processes of GPU 0 as the host sees them (pid -> MiB)
HOST_NVML = """
import ctypes, json
lib = ctypes.CDLL("libnvidia-ml.so.1")
class P(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong),
                ("gpu_instance", ctypes.c_uint), ("compute_instance", ctypes.c_uint)]
assert lib.nvmlInit_v2() == 0, "nvmlInit_v2 failed"
h = ctypes.c_void_p()
assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0, "no GPU 0"
n, arr = ctypes.c_uint(256), (P * 256)()
rc = lib.nvmlDeviceGetComputeRunningProcesses_v2(h, ctypes.byref(n), arr)
assert rc == 0, f"nvmlDeviceGetComputeRunningProcesses_v2: {rc}"
print(json.dumps({arr[i].pid: arr[i].used >> 20 for i in range(n.value)}))
"""


def host_processes(env: Mapping[str, str]) -> dict[int, int]:
    """pid -> MiB of every compute process NVML lists on GPU 0 (no shim in the way)."""
    clean = {k: v for k, v in env.items() if k != "LD_PRELOAD" and not k.startswith("LIBVGPU_")}
    proc = subprocess.run([sys.executable, "-c", HOST_NVML], env=clean, capture_output=True,
                          text=True, timeout=60)
    if proc.returncode:
        raise RuntimeError(f"NVML from the host: {proc.stderr.strip()[-300:]}")
    return {int(k): v for k, v in json.loads(proc.stdout).items()}


def host_used_mib(env: Mapping[str, str], ignore: Sequence[int] = ()) -> int:
    """MiB every compute process on GPU 0 uses, as the host's NVML reports (the check runs
    one workload at a time on a GPU, one per simulated GPU on the doubles)."""
    return sum(mib for pid, mib in host_processes(env).items() if pid not in ignore)


def held_figures(low_gaps: Sequence[tuple[float, float]], low_end_ms: float, high_start_ms: float,
                 high_end_ms: float) -> Figures:
    """The priority claim's figures from the low container's pauses and the high one's run
    (wall-clock milliseconds)."""
    held = max((min(b, high_end_ms) - max(a, high_start_ms) for a, b in low_gaps), default=0.0)
    return {"high_ms": round(high_end_ms - high_start_ms), "held_ms": round(max(held, 0.0)),
            "resumed": low_end_ms > high_end_ms}


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any shim settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBVGPU_")}
    env.pop("LD_PRELOAD", None)
    env.update(extra)
    return env
