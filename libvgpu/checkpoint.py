"""The CUDA driver's checkpoint API, called from outside the target processes (as
``cuda-checkpoint --toggle --pid`` does): move a process's GPU state to host memory and give the
GPU up (suspend), and bring it back, onto the same GPUs or others of the same model (resume:
driver 580+, CUDA 13.0, takes a device map; :meth:`CudaCheckpoint.remap_unavailable` says whether).

Driver 570+ (CUDA 12.8) has it: ``cuCheckpointProcessLock / Checkpoint / Restore / Unlock /
GetState`` with the target's pid. Whoever knows a kernel's processes calls it: the hub in
single-machine mode. A driver without the symbols, or one that answers
``CUDA_ERROR_NOT_SUPPORTED``, raises :class:`CheckpointUnavailable`.

:meth:`CudaCheckpoint.suspend` is all or nothing: every CUDA process of the kernel is locked,
then each is checkpointed; when a step fails, what was done is undone (restored, unlocked) and
:class:`CheckpointError` says which process and step failed, and whether the undo worked
(``stuck``: a process left locked or failed, which only stopping it clears).

The calls block for as long as the copy takes; callers in an event loop run them in a thread.
"""

from __future__ import annotations

import ctypes
import enum
import os
from collections.abc import Iterable, Mapping

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_SUPPORTED = 801
#: cuda.h's names of the codes the checkpoint calls answer (the rest are shown as numbers)
ERROR_NAMES = {
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    101: "CUDA_ERROR_INVALID_DEVICE",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    500: "CUDA_ERROR_NOT_FOUND",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    909: "CUDA_ERROR_TIMEOUT",
    999: "CUDA_ERROR_UNKNOWN",
}
#: cuDriverGetVersion of driver 580 (CUDA 13.0), the first whose restore takes a device map
REMAP_DRIVER_VERSION = 13000
FUNCTIONS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)


class ProcessState(enum.IntEnum):
    """``CUprocessState``."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class CheckpointUnavailable(Exception):
    """This machine's driver cannot checkpoint; ``message`` says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class CheckpointError(Exception):
    """A step failed for one process; ``stuck``: the undo failed too (the process is not running)."""

    def __init__(self, message: str, pid: int, step: str, code: int, stuck: bool = False) -> None:
        super().__init__(message)
        self.message, self.pid, self.step, self.code, self.stuck = message, pid, step, code, stuck


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(_GpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


def error_name(code: int) -> str:
    return ERROR_NAMES.get(code, f"CUDA error {code}")


def uuid_bytes(uuid: str) -> bytes:
    """NVML's 'GPU-xxxxxxxx-xxxx-...' as the 16 bytes of a ``CUuuid``; ValueError for MIG and others."""
    if not uuid.startswith("GPU-"):
        raise ValueError(f"{uuid!r} is not a GPU uuid (GPU-...); a restore can be remapped onto whole GPUs only")
    raw = bytes.fromhex(uuid[4:].replace("-", ""))
    if len(raw) != 16:
        raise ValueError(f"{uuid!r} is not a GPU uuid of 16 bytes")
    return raw


class CudaCheckpoint:
    """The checkpoint API of the driver library ``library`` (loaded on first use)."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self.library = library
        self._lib: ctypes.CDLL | None = None
        self._why = ""

    def _load(self) -> ctypes.CDLL:
        if self._lib is not None:
            return self._lib
        if self._why:
            raise CheckpointUnavailable(self._why)
        try:
            lib = ctypes.CDLL(self.library)
        except OSError as e:
            self._why = f"the CUDA driver library {self.library} cannot be loaded ({e})"
            raise CheckpointUnavailable(self._why) from None
        missing = [name for name in FUNCTIONS if not hasattr(lib, name)]
        if missing:
            version = ctypes.c_int(0)
            lib.cuDriverGetVersion(ctypes.byref(version))
            self._why = (
                f"the CUDA driver (CUDA {version.value // 1000}.{version.value % 1000 // 10}) has no checkpoint API "
                f"({missing[0]} is missing); it needs driver 570 or newer (CUDA 12.8)"
            )
            raise CheckpointUnavailable(self._why)
        for name in FUNCTIONS:
            getattr(lib, name).restype = ctypes.c_int
        rc = lib.cuInit(0)  # a restore needs cuInit in the calling process
        if rc != CUDA_SUCCESS:
            self._why = f"the CUDA driver did not initialise ({error_name(rc)})"
            raise CheckpointUnavailable(self._why)
        self._lib = lib
        return lib

    def check(self) -> None:
        """Raise :class:`CheckpointUnavailable` when this driver cannot checkpoint."""
        lib = self._load()
        state = ctypes.c_int(0)
        rc = lib.cuCheckpointProcessGetState(os.getpid(), ctypes.byref(state))
        if rc == CUDA_ERROR_NOT_SUPPORTED:
            raise CheckpointUnavailable("the CUDA driver does not support checkpoints here (CUDA_ERROR_NOT_SUPPORTED)")

    def remap_unavailable(self) -> str:
        """'' when this driver restores a process onto other GPUs (of the same model as the ones
        it was checkpointed on), else why not (:class:`CheckpointUnavailable` without the API)."""
        lib = self._load()
        version = ctypes.c_int(0)
        lib.cuDriverGetVersion(ctypes.byref(version))
        if version.value >= REMAP_DRIVER_VERSION:
            return ""
        return (
            f"the CUDA driver (CUDA {version.value // 1000}.{version.value % 1000 // 10}) restores a process only "
            "onto the GPUs it was checkpointed on; onto another GPU needs driver 580 or newer (CUDA 13.0)"
        )

    def state(self, pid: int) -> ProcessState | None:
        """The process's checkpoint state; None when it is not a CUDA process (or is gone)."""
        lib = self._load()
        state = ctypes.c_int(0)
        rc = lib.cuCheckpointProcessGetState(pid, ctypes.byref(state))
        if rc == CUDA_ERROR_NOT_SUPPORTED:
            raise CheckpointUnavailable("the CUDA driver does not support checkpoints here (CUDA_ERROR_NOT_SUPPORTED)")
        return ProcessState(state.value) if rc == CUDA_SUCCESS else None

    def cuda_processes(self, pids: Iterable[int]) -> list[int]:
        """Those of ``pids`` that hold CUDA state (in any checkpoint state)."""
        return [pid for pid in sorted(set(pids)) if self.state(pid) is not None]

    def _call(self, step: str, pid: int, args: object = None) -> int:
        fn = getattr(self._load(), f"cuCheckpointProcess{step}")
        return fn(pid, ctypes.byref(args) if args is not None else None)

    def suspend(self, pids: Iterable[int], lock_timeout_ms: int = 10000) -> None:
        """Lock every process, then checkpoint each: all of them end CHECKPOINTED, or none does."""
        pids = list(pids)
        locked: list[int] = []
        done: list[int] = []
        for step, todo, into in (("Lock", pids, locked), ("Checkpoint", pids, done)):
            for pid in todo:
                args = _LockArgs(timeoutMs=lock_timeout_ms) if step == "Lock" else None
                rc = self._call(step, pid, args)
                if rc != CUDA_SUCCESS:
                    stuck = self._undo(done, locked)
                    raise CheckpointError(
                        f"{step.lower()} of process {pid} failed ({error_name(rc)})"
                        + ("; undoing it failed too, the process cannot run on" if stuck else ""),
                        pid,
                        step.lower(),
                        rc,
                        stuck,
                    )
                into.append(pid)

    def _undo(self, checkpointed: list[int], locked: list[int]) -> bool:
        stuck = False
        for pid in checkpointed:
            stuck |= self._call("Restore", pid, _RestoreArgs()) != CUDA_SUCCESS
        for pid in locked:
            stuck |= self._call("Unlock", pid) != CUDA_SUCCESS
        return stuck

    def resume(self, pids: Iterable[int], remap: Mapping[str, str] | None = None) -> None:
        """Restore every process (onto ``remap``'s GPUs: old uuid -> new uuid, every GPU they were
        on named), then unlock each. Raises :class:`CheckpointError` at the first failure; not
        ``stuck`` when a refused restore left every process checkpointed, as before the call."""
        pairs = [(uuid_bytes(old), uuid_bytes(new)) for old, new in (remap or {}).items()]
        array = (_GpuPair * max(1, len(pairs)))()
        for pair, (old, new) in zip(array, pairs, strict=False):
            ctypes.memmove(pair.oldUuid, old, 16)
            ctypes.memmove(pair.newUuid, new, 16)
        args = _RestoreArgs()
        if pairs:
            args.gpuPairs = array
            args.gpuPairsCount = len(pairs)
        pids = list(pids)
        restored: list[int] = []
        for step in ("Restore", "Unlock"):
            for pid in pids:
                rc = self._call(step, pid, args if step == "Restore" else None)
                if rc != CUDA_SUCCESS:
                    # a refused restore leaves its process checkpointed: checkpoint the ones restored
                    # before it again, and the kernel is swapped out as it was (not stuck)
                    stuck = step == "Unlock" or self.state(pid) is not ProcessState.CHECKPOINTED
                    for done in restored:
                        stuck |= self._call("Checkpoint", done) != CUDA_SUCCESS
                    raise CheckpointError(
                        f"{step.lower()} of process {pid} failed ({error_name(rc)})", pid, step.lower(), rc, stuck
                    )
                if step == "Restore":
                    restored.append(pid)
