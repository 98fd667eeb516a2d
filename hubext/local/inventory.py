"""This machine's GPUs (NVML, through ``pynvml`` from nvidia-ml-py) and the shim's library.

Model names come from :func:`libvgpu.contract.model_name`, the same function the node agent
uses, so a profile's ``model`` means the same card on one machine and on Kubernetes.
"""

from __future__ import annotations

import os

from libvgpu.contract import model_name
from quotas import GPU

MIB = 1024 * 1024


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def machine_resources() -> tuple[int | None, int | None]:
    """(CPU millicores, memory MiB) this machine gives its processes: the CPUs this process may
    run on and the physical memory; None for what cannot be read."""
    try:
        cpus: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    try:
        memory: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB
    except (ValueError, OSError, AttributeError):
        memory = None
    return (cpus * 1000 if cpus else None), (memory or None)


def detect_nvml_gpus(library: str = "") -> list[GPU]:
    """The GPUs NVML reports, in index order; [] when there is no driver or no GPU.
    ``library``: the NVML library to load instead of the driver's libnvidia-ml.so.1."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        if library:
            import ctypes

            pynvml.nvmlLib = ctypes.CDLL(library)  # OSError: not loadable
        pynvml.nvmlInit()
    except Exception:  # OSError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return []
    gpus = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            name = _text(pynvml.nvmlDeviceGetName(handle))
            memory_mib = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total // MIB)
            try:
                sm_count = int(pynvml.nvmlDeviceGetAttributes_v2(handle).multiprocessorCount)
            except Exception:
                sm_count = 0
            gpus.append(
                GPU(
                    uuid=uuid, model=model_name(name, memory_mib), memory_mib=memory_mib, sm_count=sm_count, index=index
                )
            )
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return gpus


def nvml_activity() -> dict[str, dict[str, int]]:
    """Per GPU uuid: utilization_percent and memory_used_mib from NVML ({} without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    out: dict[str, dict[str, int]] = {}
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            entry: dict[str, int] = {}
            try:
                entry["utilization_percent"] = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                pass
            try:
                entry["memory_used_mib"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used // MIB)
            except Exception:
                pass
            out[_text(pynvml.nvmlDeviceGetUUID(handle))] = entry
    except Exception:
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def nvml_process_memory_mib(pids: list[int]) -> int:
    """GPU memory NVML says ``pids`` use, on every GPU together, in MiB (0 without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    wanted, used = set(pids), 0
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in wanted and proc.usedGpuMemory:
                    used += int(proc.usedGpuMemory)
    except Exception:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return (used + MIB - 1) // MIB


def shim_library() -> str:
    """Path of the built libvgpu.so, or '' when the shim is not built/installed."""
    try:
        from libvgpu import library_path
    except ImportError:
        return ""
    try:
        path = library_path()
    except Exception:  # not built
        return ""
    return path if path and os.path.exists(path) else ""
