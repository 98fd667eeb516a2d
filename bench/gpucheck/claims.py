"""The claim table: what ``./dev gpu-check`` checks, and when a claim holds.

A claim runs a workload on a target (the GPU machine or the doubles: :class:`Target`) and judges
the figures it measured; the judgement is the same on both targets. Adding a claim is one row of
:data:`CLAIMS`; a shim escape that is closed is one row of :data:`BYPASSES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

Figures = dict[str, Any]

#: the slice the memory claims give a container, MiB
SLICE_MIB = 1024
#: allocations are made in chunks of this size until the driver (the shim) refuses, MiB
CHUNK_MIB = 64
#: what NVML may show a slice's processes use beyond the slice (the driver's page rounding), MiB
OVER_SLICE_TOLERANCE_MIB = 32
#: the driver memory the shim counts may differ from NVML's by this much (page rounding), MiB
DRIVER_TOLERANCE_MIB = 16
#: a cores limit holds when the measured share is within this many points of it
CORES_POINTS = 5
#: the shim's cost on a launch or an alloc+free pair, as a ratio to no shim
OVERHEAD_RATIO = 1.02
#: on the doubles the driver's cost is modelled with CPU time on a machine others share, where
#: the ratio moves with the load (per-round medians 1.016-1.017 at load 8-11, 1.022-1.026 beside
#: two busy loops, bench/shim_overhead.py): the ratios are held to this looser bound, and the
#: cause of a real overhead is judged instead: the
#: shim adds no system call to a launch or an alloc+free pair (at most this many per call, which
#: leaves room for its 100 ms floor refresh)
DOUBLES_OVERHEAD_RATIO = 1.10
SYSCALLS_PER_CALL = 0.01
#: the limit of the container that runs beside a neighbour without a cores limit
BESIDE_LIMIT = 25
#: swap: GiB moved and the goals of docs/kernels.md (GiB/s each way, seconds to the first call)
SWAP_GIB = 16
SWAP_GIB_S = 10.0
#: elastic slices: a request of ELASTIC_REQUEST percent that may burst to ELASTIC_LIMIT, and a
#: memory request of SLICE_MIB that may burst to ELASTIC_MEMORY_MIB; a newcomer's floor is back
#: within FLOOR_BACK_S (docs/libvgpu.md, Elastic slices)
ELASTIC_REQUEST = 25
ELASTIC_LIMIT = 80
ELASTIC_MEMORY_MIB = 3 * SLICE_MIB
FLOOR_BACK_S = 1.0


@dataclass(frozen=True)
class Phase:
    """Launches of one kind for a while: ``kind`` 'kernel' (one kernel of ``ms``) or 'graph'
    (four kernels of ``ms``/4 in a CUDA graph), after ``idle_s`` seconds without launches
    (0: the process's first launches, a cold start). The share is measured over whole launch
    periods from ``warm_s`` after the phase starts, for ``measure_s`` seconds."""

    kind: str
    ms: float
    idle_s: float = 0.0
    warm_s: float = 1.0
    measure_s: float = 2.0

    @property
    def label(self) -> str:
        when = "cold" if self.idle_s == 0 else "idle"
        return f"{self.kind}{self.ms:g}ms_{when}"


#: after this long without launches the limiter measures the work afresh (compute.c STALE_NS)
IDLE_S = 3.2
#: (kind, ms) of the phases every cores limit runs
WORK = (("kernel", 0.1), ("kernel", 2), ("kernel", 20), ("kernel", 200), ("graph", 2), ("graph", 200))
#: which of them runs first, from a cold start (the others after IDLE_S idle): each limit starts
#: cold with another, so one process per limit covers cold starts of every length
COLD = {20: ("kernel", 0.1), 30: ("graph", 200), 50: ("kernel", 20), 80: ("graph", 2)}


def phases_for(limit: int) -> tuple[Phase, ...]:
    cold = COLD.get(limit, WORK[0])
    return (Phase(*cold), *(Phase(kind, ms, IDLE_S) for kind, ms in WORK if (kind, ms) != cold))


class Target(Protocol):
    """Where the workloads run. Every method returns the figures it measured."""

    name: str

    def pidns_unavailable(self) -> str | None:
        """Why workloads cannot run in a pid namespace here, or None."""

    def memory(self, slice_mib: int, allocator: str, pidns: bool) -> Figures:
        """A container with a ``slice_mib`` slice allocates ``CHUNK_MIB`` chunks with
        ``allocator`` ('caching', 'expandable', 'mallocasync') until refused. Figures:
        total_mib, free_mib (CUDA's view in the slice), nvml_total_mib (NVML's/nvidia-smi's
        view in the slice), allocated_mib, oom (bool), used_mib (NVML's view from the host of
        what the container's process uses, driver memory included)."""

    def driver_memory(self, pidns: bool) -> Figures:
        """A process creates its context and loads code (modules, libraries); figures:
        counted_mib (what the shim charges the container), nvml_mib (the host's NVML)."""

    def cores(self, limit: int, phases: tuple[Phase, ...], pidns: bool) -> list[float]:
        """One process with ``cores_percent=limit`` runs the phases; its share of the GPU
        (percent) in each."""

    def two_containers(self, limits: tuple[int, int], pidns: bool) -> list[float]:
        """Two containers with these cores limits launch at once; each one's share (percent)."""

    def beside_unlimited(self, limit: int, pidns: bool) -> list[float]:
        """A container with ``cores_percent=limit`` launches 2 ms kernels beside one with no
        cores limit (a memory-only profile) that launches them as fast as it can, its queue
        full; the limited one's share and the neighbour's (percent)."""

    def priority(self, pidns: bool) -> Figures:
        """A low-priority container launches; a high-priority one launches for a while in the
        middle. Figures: high_ms (how long the high one ran), held_ms (the low one's longest
        pause overlapping it), resumed (the low one launched again after)."""

    def bypass(self, how: str, slice_mib: int) -> Figures:
        """Allocate 3 × slice/2 through the path ``how`` (a row of BYPASSES); allocated_mib."""

    def capture_after_idle(self, limit: int) -> Figures | None:
        """A CUDA graph captured (PyTorch's default global capture mode) after idle under a
        cores limit; figures: captured (bool). None where the target does not model capture."""

    def launch_overhead(self) -> Figures:
        """launch_ratio (and alloc_ratio where measured): time with the shim / without."""

    def swap(self, gib: int) -> Figures:
        """A process holding ``gib`` GiB suspended and resumed: suspend_gib_s, resume_gib_s,
        resume_latency_s (resume's start to the first CUDA call's return), identical."""

    def elastic(self, pidns: bool) -> Figures:
        """Elastic slices (request ELASTIC_REQUEST %, limit ELASTIC_LIMIT %; memory request
        SLICE_MIB, limit ELASTIC_MEMORY_MIB): burst_share (alone on the card, 2 ms kernels),
        floor_back_s (another slice bursting on the card, a newcomer of the same request starts
        launching: until its share stays within CORES_POINTS of its request), burst_mib (allocated in
        CHUNK_MIB chunks alone, past the request, until refused), total_mib (mem_get_info's
        total then), reclaimed (a slice bursting over the whole card, then an owner asks for
        memory within its request: its allocation succeeds once the burster exits)."""


Verdict = tuple[bool, Figures]


def _memory(allocator: str) -> Callable[[Target, bool], Verdict]:
    def claim(target: Target, pidns: bool) -> Verdict:
        f = target.memory(SLICE_MIB, allocator, pidns)
        ok = (f["oom"] and f["used_mib"] <= SLICE_MIB + OVER_SLICE_TOLERANCE_MIB
              and f["used_mib"] >= SLICE_MIB - 2 * CHUNK_MIB)
        return bool(ok), {"slice_mib": SLICE_MIB, **f}

    return claim


def _slice_visible(target: Target, pidns: bool) -> Verdict:
    f = target.memory(SLICE_MIB, "caching", pidns)
    ok = f["total_mib"] == SLICE_MIB and f["nvml_total_mib"] == SLICE_MIB
    return ok, {"slice_mib": SLICE_MIB, "total_mib": f["total_mib"], "free_mib": f["free_mib"],
                "nvml_total_mib": f["nvml_total_mib"]}


def _driver_memory(target: Target, pidns: bool) -> Verdict:
    f = target.driver_memory(pidns)
    return abs(f["nvml_mib"] - f["counted_mib"]) <= DRIVER_TOLERANCE_MIB, f


def _within(share: float, limit: int) -> bool:
    return abs(share - limit) <= CORES_POINTS


def _cores(limit: int) -> Callable[[Target, bool], Verdict]:
    def claim(target: Target, pidns: bool) -> Verdict:
        figures: Figures = {"limit": limit}
        phases = phases_for(limit)
        shares = target.cores(limit, phases, pidns)
        for phase, share in zip(phases, shares, strict=True):
            figures[phase.label] = round(share, 1)
        return all(_within(share, limit) for share in shares), figures

    return claim


def _two_containers(target: Target, pidns: bool) -> Verdict:
    small, big = target.two_containers((20, 60), pidns)
    return _within(small, 20) and _within(big, 60), {"share_20": round(small, 1),
                                                     "share_60": round(big, 1)}


def _beside_unlimited(target: Target, pidns: bool) -> Verdict:
    share, neighbour = target.beside_unlimited(BESIDE_LIMIT, pidns)
    return _within(share, BESIDE_LIMIT), {"limit": BESIDE_LIMIT, "share": round(share, 1),
                                          "neighbour_share": round(neighbour, 1)}


def _priority(target: Target, pidns: bool) -> Verdict:
    f = target.priority(pidns)
    return bool(f["held_ms"] >= 0.8 * f["high_ms"] and f["resumed"]), f


def _bypass(how: str) -> Callable[[Target, bool], Verdict]:
    def claim(target: Target, pidns: bool) -> Verdict:
        f = target.bypass(how, SLICE_MIB)
        return f["allocated_mib"] <= SLICE_MIB, {"slice_mib": SLICE_MIB, **f}

    return claim


def _capture_after_idle(target: Target, pidns: bool) -> Verdict:
    f = target.capture_after_idle(30)
    if f is None:
        raise NotModelled("this target does not model stream capture")
    return bool(f["captured"]), f


def _launch_overhead(target: Target, pidns: bool) -> Verdict:
    f = target.launch_overhead()
    ratios = [v for k, v in f.items() if k.endswith("_ratio")]
    if f.pop("cpu_model", False):
        return (all(r <= DOUBLES_OVERHEAD_RATIO for r in ratios)
                and f["syscalls_per_call"] <= SYSCALLS_PER_CALL), {
                    **f, "judged": f"ratios<={DOUBLES_OVERHEAD_RATIO:g} on a shared CPU, "
                                   f"syscalls_per_call<={SYSCALLS_PER_CALL:g}; {OVERHEAD_RATIO:g} is judged on a GPU"}
    return all(r <= OVERHEAD_RATIO for r in ratios), f


def _swap(target: Target, pidns: bool) -> Verdict:
    f = target.swap(SWAP_GIB)
    ok = (f["suspend_gib_s"] >= SWAP_GIB_S and f["resume_gib_s"] >= SWAP_GIB_S
          and f["resume_latency_s"] <= 2 + SWAP_GIB / 10 and f["identical"] in (True, "n/a"))
    return ok, {"gib": SWAP_GIB, **f}


def _elastic(target: Target, pidns: bool) -> Verdict:
    f = target.elastic(pidns)
    ok = (f["burst_share"] >= ELASTIC_LIMIT - CORES_POINTS and f["floor_back_s"] <= FLOOR_BACK_S
          and ELASTIC_MEMORY_MIB - CHUNK_MIB <= f["burst_mib"] <= ELASTIC_MEMORY_MIB
          and f["total_mib"] == ELASTIC_MEMORY_MIB and f["reclaimed"] is True)
    return bool(ok), {"request": ELASTIC_REQUEST, "limit": ELASTIC_LIMIT, **f}


class NotModelled(Exception):
    """The target cannot run this claim's workload, or its figures are no verdict there (said
    on the claim's line, with the figures measured)."""

    def __init__(self, why: str, figures: Figures | None = None) -> None:
        super().__init__(why)
        self.figures = figures or {}


@dataclass(frozen=True)
class Claim:
    """A row: ``name`` as printed, the check, and whether it runs again in a pid namespace
    (as every process of a pod does)."""

    name: str
    check: Callable[[Target, bool], Verdict]
    pidns: bool = True


#: Paths to the driver that must end in the shim: one row per path (the escapes that are
#: closed add theirs). 'dlopen': ctypes/PyTorch's dlopen("libcuda.so.1") + dlsym;
#: 'getproc': every entry point through cuGetProcAddress (the CUDA 12 runtime's way); through a
#: library that links libcuda (tests/libvgpu/progs/sneaky.c, as triton's cuda_utils does):
#: 'handle' dlsym on its handle, 'next' dlsym(RTLD_NEXT) from inside it, 'rawdlopen' dlsym on
#: a handle from glibc's own dlopen; 'v1': cuMemAlloc without _v2 (32-bit, before CUDA 3.2);
#: 'region_unlink': the container's region unlinked while the process holds half the slice (a
#: fresh region would be a fresh limit): the process allocates no more.
BYPASSES = ("dlopen", "getproc", "handle", "next", "rawdlopen", "v1", "region_unlink")

CLAIMS: tuple[Claim, ...] = (
    Claim("slice_visible", _slice_visible),
    Claim("oom_caching", _memory("caching")),
    Claim("oom_expandable", _memory("expandable"), pidns=False),  # in-process paths: once is enough
    Claim("oom_mallocasync", _memory("mallocasync"), pidns=False),
    Claim("driver_memory", _driver_memory),
    *(Claim(f"bypass_{how}", _bypass(how), pidns=False) for how in BYPASSES),
    *(Claim(f"cores_{limit}", _cores(limit), pidns=limit == 30) for limit in (20, 30, 50, 80)),
    Claim("cores_two_20_60", _two_containers),
    Claim("cores_beside_unlimited", _beside_unlimited, pidns=False),
    Claim("priority", _priority),
    Claim("capture_after_idle", _capture_after_idle, pidns=False),
    Claim("launch_overhead", _launch_overhead, pidns=False),
    Claim("swap", _swap, pidns=False),
    Claim("elastic_burst_reclaim", _elastic, pidns=False),
)
