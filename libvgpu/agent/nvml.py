"""The node's GPUs through NVML (``pynvml`` from nvidia-ml-py): inventory, samples, processes, Xid,
and the looks burst metering makes at a card (the hub's on one machine and the agent's).

Everything here is a thin, typed layer over pynvml so the rest of the agent never sees its
handles or exceptions. Calls that a driver may not support (temperature on some boards, SM count
on full GPUs, per-process listing on old drivers) degrade to ``None`` / an empty answer instead of
failing the agent.
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from libvgpu.burst import Sample
from libvgpu.contract import model_name
from quotas.config import KNOWN_MODELS

MIB = 1 << 20

# NVML_TEMPERATURE_GPU, nvmlEventTypeXidCriticalError
_TEMPERATURE_GPU = 0
_EVENT_XID = 0x8


class NVMLUnavailable(RuntimeError):
    """NVML cannot be used on this machine; the message says why and what to do, in one line."""


@dataclass(frozen=True)
class MigInstance:
    """One MIG device of a GPU in MIG mode."""

    uuid: str
    profile: str  # e.g. "3g.40gb"
    memory_mib: int
    sm_count: int


@dataclass(frozen=True)
class GPUInfo:
    """What the inventory says about one physical GPU."""

    index: int
    uuid: str
    name: str  # NVML's product name, e.g. "NVIDIA H100 80GB HBM3"
    model: str  # normalised, e.g. "H100-80GB" (what profiles filter on)
    memory_mib: int
    sm_count: int  # 0 when unknown
    mig_enabled: bool = False
    mig_instances: tuple[MigInstance, ...] = ()
    #: its device node's minor (/dev/nvidia<minor>); None: NVML did not say (the index is used)
    minor: int | None = None


@dataclass(frozen=True)
class GPUSample:
    """A GPU's state at one moment."""

    uuid: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilisation_ratio: float | None  # 0..1, None: not supported
    temperature_celsius: float | None


@dataclass(frozen=True)
class GPUProcess:
    """A process with a context on a GPU, as the driver sees it (host pid)."""

    pid: int
    gpu_uuid: str
    used_bytes: int  # None from NVML (not available) reads as 0


# ---- model names and SM counts ------------------------------------------------------------


def sm_count_for(model: str) -> int:
    """Streaming multiprocessors of a model from the table in ``quotas`` (0 if unknown)."""
    base = model.rsplit("-", 1)[0].upper() if model.upper().endswith("GB") else model.upper()
    known = KNOWN_MODELS.get(base)
    return int(known[1]) if known else 0


def mig_profile_of(name: str) -> str:
    """``"NVIDIA A100-SXM4-40GB MIG 3g.20gb"`` -> ``"3g.20gb"``."""
    match = re.search(r"\bMIG\s+(\S+)\s*$", name)
    return match.group(1) if match else name.rsplit(" ", 1)[-1]


# ---- NVML ---------------------------------------------------------------------------------


class NVML:
    """pynvml, initialised once. ``library``: a path to load instead of the loader's search."""

    def __init__(self, library: str = "") -> None:
        self.library = library
        self._nv: Any = None
        self._handles: dict[str, Any] = {}

    def init(self) -> None:
        """Load and initialise NVML; :class:`NVMLUnavailable` (one line) when it cannot be used."""
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise NVMLUnavailable(f"the nvidia-ml-py package is not installed ({exc})") from exc
        if self.library:
            try:
                pynvml.nvmlLib = ctypes.CDLL(self.library)
            except OSError as exc:
                raise NVMLUnavailable(
                    f"NVML library {self.library} cannot be loaded ({exc}); fix "
                    "NodeAgent.nvml_library or leave it empty to use libnvidia-ml.so.1 from the "
                    "driver"
                ) from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as exc:
            raise NVMLUnavailable(
                "NVML (libnvidia-ml.so.1) was not found: run the agent on a GPU node with the "
                "NVIDIA container runtime (NVIDIA_VISIBLE_DEVICES=all, "
                "NVIDIA_DRIVER_CAPABILITIES=utility) or set nodeAgent.runtimeClassName"
            ) from exc
        except pynvml.NVMLError as exc:
            raise NVMLUnavailable(
                f"NVML could not be initialised ({exc}): is the NVIDIA driver loaded on this node?"
            ) from exc
        self._nv = pynvml

    @property
    def nv(self) -> Any:
        if self._nv is None:
            raise RuntimeError("NVML.init() was not called")
        return self._nv

    def shutdown(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError:
                pass
            self._nv = None

    def driver_version(self) -> str:
        try:
            return str(self.nv.nvmlSystemGetDriverVersion())
        except (self.nv.NVMLError, AttributeError):
            return ""

    # -- inventory

    def discover(self) -> list[GPUInfo]:
        """Every GPU of the node, by NVML index."""
        nv = self.nv
        gpus: list[GPUInfo] = []
        handles: dict[str, Any] = {}
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid = str(nv.nvmlDeviceGetUUID(h))
            name = str(nv.nvmlDeviceGetName(h))
            memory_mib = int(nv.nvmlDeviceGetMemoryInfo(h).total) // MIB
            model = model_name(name, memory_mib)
            sm = self._sm_count(h) or sm_count_for(model)
            mig_enabled, instances = self._mig(h)
            try:
                minor: int | None = int(nv.nvmlDeviceGetMinorNumber(h))
            except nv.NVMLError:
                minor = None
            handles[uuid] = h
            gpus.append(
                GPUInfo(
                    index=i,
                    uuid=uuid,
                    name=name,
                    model=model,
                    memory_mib=memory_mib,
                    sm_count=sm,
                    mig_enabled=mig_enabled,
                    mig_instances=instances,
                    minor=minor,
                )
            )
        self._handles = handles
        return gpus

    def _sm_count(self, handle: Any) -> int:
        """nvmlDeviceGetAttributes (real drivers answer it for MIG handles only)."""
        try:
            return int(self.nv.nvmlDeviceGetAttributes(handle).multiprocessorCount)
        except (self.nv.NVMLError, AttributeError):
            return 0

    def _mig(self, handle: Any) -> tuple[bool, tuple[MigInstance, ...]]:
        nv = self.nv
        try:
            current, _pending = nv.nvmlDeviceGetMigMode(handle)
        except nv.NVMLError:  # not MIG capable
            return False, ()
        if not current:
            return False, ()
        instances: list[MigInstance] = []
        try:
            count = nv.nvmlDeviceGetMaxMigDeviceCount(handle)
        except nv.NVMLError:
            return True, ()
        for j in range(count):
            try:
                mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
            except nv.NVMLError:  # NOT_FOUND: no instance in this slot
                continue
            try:
                instances.append(
                    MigInstance(
                        uuid=str(nv.nvmlDeviceGetUUID(mh)),
                        profile=mig_profile_of(str(nv.nvmlDeviceGetName(mh))),
                        memory_mib=int(nv.nvmlDeviceGetMemoryInfo(mh).total) // MIB,
                        sm_count=self._sm_count(mh),
                    )
                )
            except nv.NVMLError:
                continue
        return True, tuple(instances)

    def handle(self, uuid: str) -> Any:
        h = self._handles.get(uuid)
        if h is None:
            h = self.nv.nvmlDeviceGetHandleByUUID(uuid)
            self._handles[uuid] = h
        return h

    def answers(self, uuid: str) -> bool:
        """Whether the card answers NVML: a fresh handle by its UUID and a memory query succeed
        (a card that fell off the bus answers NVML_ERROR_GPU_IS_LOST until it is reset)."""
        nv = self.nv
        try:
            h = nv.nvmlDeviceGetHandleByUUID(uuid)
            nv.nvmlDeviceGetMemoryInfo(h)
        except nv.NVMLError:
            return False
        self._handles[uuid] = h
        return True

    # -- samples

    def sample(self, uuid: str) -> GPUSample:
        nv = self.nv
        h = self.handle(uuid)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        try:
            util: float | None = nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
        except nv.NVMLError:
            util = None
        try:
            temp: float | None = float(nv.nvmlDeviceGetTemperature(h, _TEMPERATURE_GPU))
        except nv.NVMLError:
            temp = None
        return GPUSample(
            uuid=uuid,
            memory_used_bytes=int(mem.used),
            memory_total_bytes=int(mem.total),
            utilisation_ratio=util,
            temperature_celsius=temp,
        )

    def processes(self, uuid: str) -> list[GPUProcess]:
        """Compute processes on a GPU with the memory the driver charges each (host pids)."""
        nv = self.nv
        h = self.handle(uuid)
        infos: list[Any] = []
        for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"):
            fn = getattr(nv, fn_name, None)
            if fn is None:
                continue
            try:
                infos = fn(h)
                break
            except nv.NVMLError_FunctionNotFound:  # older driver: _v3 missing, try _v2
                continue
        return [GPUProcess(pid=int(p.pid), gpu_uuid=uuid, used_bytes=int(p.usedGpuMemory or 0)) for p in infos]

    def process_utilization(self, uuid: str, since_us: int) -> list[Sample]:
        """The driver's per-process SM samples on a GPU newer than ``since_us`` (host pids; [] when
        no process had one); NVMLError when the driver keeps none (NOT_SUPPORTED)."""
        nv = self.nv
        try:
            raw = process_utilization(nv, self.handle(uuid), since_us)
        except nv.NVMLError_NotFound:
            return []
        return [Sample(int(s.pid), int(s.timeStamp), int(s.smUtil)) for s in raw]


class BurstLooks:
    """What burst metering (:mod:`libvgpu.burst`) reads of a card at each look, for the hub on one
    machine (:mod:`hubext.local.burst`) and the node agent alike: NVML's per-process SM samples
    newer than ``since_us`` and the memory the driver charges each process. A card whose driver
    keeps no per-process samples (NOT_SUPPORTED) is warned about once and not asked again; any
    other error skips this look only (logged at debug)."""

    def __init__(self, nvml: NVML, log: Any) -> None:
        self.nvml = nvml
        self.log = log
        self.unsupported: set[str] = set()

    def look(self, uuid: str, since_us: int) -> tuple[list[Sample], dict[int, int]] | None:
        """(samples, pid -> bytes held) of card ``uuid``; None when it gave none this time."""
        if uuid in self.unsupported:
            return None
        nv = self.nvml.nv
        try:
            samples = self.nvml.process_utilization(uuid, since_us)
            memory = {p.pid: p.used_bytes for p in self.nvml.processes(uuid)}
        except nv.NVMLError as e:
            if isinstance(e, nv.NVMLError_NotSupported):
                self.unsupported.add(uuid)
                self.log.warning("GPU %s keeps no per-process samples (%s): its slices' burst is not metered", uuid, e)
            else:
                self.log.debug("GPU %s: no burst sample (%s)", uuid, e)
            return None
        return samples, memory


def process_utilization(nv: Any, handle: Any, since_us: int) -> list[Any]:
    """``nvmlDeviceGetProcessUtilization`` into a buffer sized up front (as the shim calls it), so
    the answer does not hang on how a driver answers a first call without a buffer. ``nv``: pynvml."""
    fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
    size = 128
    while True:
        buf = (nv.c_nvmlProcessUtilizationSample_t * size)()
        count = ctypes.c_uint(size)
        ret = fn(handle, buf, ctypes.byref(count), ctypes.c_ulonglong(since_us))
        if ret == nv.NVML_ERROR_INSUFFICIENT_SIZE and count.value > size:
            size = count.value
            continue
        if ret != nv.NVML_SUCCESS:
            raise nv.NVMLError(ret)
        return list(buf[: count.value])


@dataclass
class XidWatcher:
    """Counts Xid critical errors with an NVML event set, in a thread (the wait blocks).

    ``on_xid(gpu_uuid, xid)`` is called from that thread. ``supported`` is False when the driver
    offers no event set (the Xid counters then stay at 0).
    """

    nvml: NVML
    uuids: list[str]
    on_xid: Callable[[str, int], None]
    timeout_ms: int = 500
    supported: bool = False
    reason: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _set: Any = None

    def start(self) -> None:
        nv = self.nvml.nv
        try:
            self._set = nv.nvmlEventSetCreate()
            registered = 0
            for uuid in self.uuids:
                try:
                    nv.nvmlDeviceRegisterEvents(self.nvml.handle(uuid), _EVENT_XID, self._set)
                    registered += 1
                except nv.NVMLError as exc:
                    self.reason = f"{uuid}: {exc}"
            if not registered:
                self.reason = self.reason or "no GPU"
                return
        except (nv.NVMLError, AttributeError) as exc:
            self.reason = str(exc)
            return
        self.supported = True
        self._thread = threading.Thread(target=self._run, name="xid-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nv = self.nvml.nv
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait(self._set, self.timeout_ms)
            except nv.NVMLError_Timeout:
                continue
            except nv.NVMLError:
                if self._stop.wait(1.0):
                    break
                continue
            if data.eventType & _EVENT_XID:
                try:
                    uuid = str(nv.nvmlDeviceGetUUID(data.device))
                except nv.NVMLError:
                    uuid = ""
                self.on_xid(uuid, int(data.eventData))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_ms / 1000 + 2)
        if self._set is not None:
            try:
                self.nvml.nv.nvmlEventSetFree(self._set)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._set = None
