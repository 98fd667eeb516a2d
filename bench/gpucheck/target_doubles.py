"""The claims' workloads against the CUDA/NVML doubles (tests/libvgpu/double), driven by the C
probe program (tests/libvgpu/progs/probe.c): what runs here without a GPU or PyTorch. Every
workload gets a simulated node (GPU state file) of its own, so workloads may run at once."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from libvgpu.elastic import pending_reclaims
from libvgpu.regions import read_container_region

from ..shim_overhead import measure as measure_overhead
from ..shim_overhead import syscalls_per_call
from .claims import (
    CHUNK_MIB,
    CORES_POINTS,
    ELASTIC_LIMIT,
    ELASTIC_MEMORY_MIB,
    ELASTIC_REQUEST,
    SLICE_MIB,
    Figures,
    NotModelled,
    Phase,
)
from .common import held_figures, host_used_mib, median

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.libvgpu.harness import Build, Container, Node, Result, build_all, pid_namespaces_unavailable  # noqa: E402

#: how each PyTorch allocator reaches the driver, as a probe step allocating one chunk
ALLOCATOR_STEP = {"caching": "alloc", "expandable": "vmm", "mallocasync": "async"}
#: the bypass rows that go through libsneaky.so (a library linked to libcuda): sneakyprog HOW
SNEAKY = ("handle", "next", "rawdlopen")
#: a context takes this much on the simulated GPU (a real one: a few hundred MiB)
CONTEXT_MIB = 300
MODULE_MIB = 64
#: the double copies nothing when it checkpoints: it models this bandwidth (figures are the
#: model's, the claim checks the path and its latency)
MODELLED_GIB_S = 25


class DoubleTarget:
    name = "doubles"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.build: Build = build_all(root / "build")
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "target=doubles (tests/libvgpu/double: simulated GPUs, the shim built from libvgpu/src)"

    def pidns_unavailable(self) -> str | None:
        return pid_namespaces_unavailable()

    def _node(self, what: str, **double_env: str | int) -> Node:
        with self._lock:
            n = next(self._ids)
        return Node(self.build, self.root / f"{n:02d}-{what}", **double_env)

    def _hold(self, box: Container, steps: list[str], pidns: bool, **kw: str) -> tuple[subprocess.Popen[str], Result]:
        """Runs the probe up to its final 'wait' step; returns it (alive) and its output so far."""
        env = box.env(**kw)
        proc = subprocess.Popen(box._command(self.build.probe, (*steps, "wait"), pidns, env), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        box.node.processes.append(proc)
        lines = []
        for line in proc.stdout:
            if line.startswith("waiting"):
                return proc, Result.parse(0, "".join(lines), "")
            lines.append(line)
        raise RuntimeError(f"the probe ended early: {''.join(lines)[-300:]} {proc.stderr.read()[-300:]}")

    def memory(self, slice_mib: int, allocator: str, pidns: bool) -> Figures:
        node = self._node(f"mem-{allocator}", CUDA_DOUBLE_CONTEXT_MIB=CONTEXT_MIB)
        try:
            box = node.container("c", f"memory_mib={slice_mib}")
            step = f"{ALLOCATOR_STEP[allocator]}:{CHUNK_MIB}M"
            chunks = slice_mib // CHUNK_MIB + 2
            _, r = self._hold(box, ["init", "ctx", "info", "nvml", *[step] * chunks], pidns)
            rcs = r.rcs(ALLOCATOR_STEP[allocator])
            ok = len(list(itertools.takewhile(lambda rc: rc == 0, rcs)))
            return {"total_mib": int(r.num("info", "total")) >> 20, "free_mib": int(r.num("info", "free")) >> 20,
                    "nvml_total_mib": int(r.num("nvml", "total")) >> 20, "allocated_mib": ok * CHUNK_MIB,
                    "oom": 2 in rcs[ok:], "used_mib": host_used_mib(node.env())}
        finally:
            node.cleanup()

    def driver_memory(self, pidns: bool) -> Figures:
        node = self._node("driver", CUDA_DOUBLE_CONTEXT_MIB=CONTEXT_MIB, CUDA_DOUBLE_MODULE_MIB=MODULE_MIB)
        try:
            box = node.container("c", "memory_mib=2048")
            self._hold(box, ["init", "ctx", "module", "module", "alloc:100M"], pidns)
            counted = read_container_region(box.region).memory_used_bytes[0] >> 20
            return {"counted_mib": counted, "nvml_mib": host_used_mib(node.env())}
        finally:
            node.cleanup()

    @staticmethod
    def _util_steps(phases: tuple[Phase, ...]) -> list[str]:
        steps = []
        for p in phases:
            if p.idle_s:
                steps.append(f"sleep:{int(p.idle_s * 1000)}")
            steps.append(f"util:{p.warm_s:g}:{p.measure_s:g}:{int(p.ms * 1000)}:{p.kind}")
        return steps

    def cores(self, limit: int, phases: tuple[Phase, ...], pidns: bool) -> list[float]:
        node = self._node(f"cores{limit}")
        try:
            box = node.container("c", f"cores_percent={limit}")
            timeout = sum(p.idle_s + p.warm_s + p.measure_s for p in phases) + 60
            r = box.run("init", "ctx", *self._util_steps(phases), pidns=pidns, timeout=timeout)
            if r.returncode:
                raise RuntimeError(f"probe: {r.stderr[-300:]}")
            return [float(kv["util"]) for kv in r.all("util")]
        finally:
            node.cleanup()

    def two_containers(self, limits: tuple[int, int], pidns: bool) -> list[float]:
        node = self._node("two")
        try:
            steps = ["init", "ctx", "ready", "util:3:3:2000:kernel"]
            a, b = (node.container(f"c{lim}", f"cores_percent={lim}") for lim in limits)
            first = b.start(*steps, wait_for="ready", pidns=pidns)
            r = a.run(*steps, pidns=pidns, timeout=60)
            out, _ = first.communicate(timeout=60)
            other = Result.parse(first.returncode, out, "")
            return [r.num("util", "util"), other.num("util", "util")]
        finally:
            node.cleanup()

    def beside_unlimited(self, limit: int, pidns: bool) -> list[float]:
        # the double runs the processes' kernels in one queue, in order (a real GPU time-slices
        # contexts), so the neighbour's queue is kept at 40 kernels (80 ms), not the 1024 a
        # driver allows: the limited container's launches wait behind it as behind bursting
        # neighbours (tests/libvgpu/test_limiter.py)
        node = self._node("beside")
        try:
            steps = ["init", "ctx", "ready", "util:3:3:2000:kernel"]
            neighbour = node.container("unlimited", "memory_mib=1024")
            hog = neighbour.start(*steps, wait_for="ready", pidns=pidns, env={"CUDA_DOUBLE_QUEUE": "40"})
            r = node.container("c", f"cores_percent={limit}").run(*steps, pidns=pidns, timeout=60)
            out, _ = hog.communicate(timeout=60)
            return [r.num("util", "util"), Result.parse(hog.returncode, out, "").num("util", "util")]
        finally:
            node.cleanup()

    def priority(self, pidns: bool) -> Figures:
        node = self._node("priority", CUDA_DOUBLE_QUEUE=2)
        try:
            common = f"node_region_dir={node.node_dir}\npriority_window_ms=200"
            low = node.container("low", f"priority=1\nname=low\n{common}")
            high = node.container("high", f"priority=100\nname=high\n{common}")
            low_proc = low.start("init", "ctx", "ready", "timeline:3:1000", wait_for="ready", pidns=pidns)
            time.sleep(1.0)  # the low one runs alone for a while first
            h = high.run("init", "ctx", "timeline:1:1000", "sleep:400", pidns=pidns)
            out, _ = low_proc.communicate(timeout=30)
            lo, hi = Result.parse(0, out, "").one("timeline"), h.one("timeline")
            gaps = [tuple(map(float, w[4:].split("-"))) for w in out.split() if w.startswith("gap=")]
            return held_figures(gaps, float(lo["end_ms"]), float(hi["start_ms"]), float(hi["end_ms"]))
        finally:
            node.cleanup()

    def bypass(self, how: str, slice_mib: int) -> Figures:
        node = self._node(f"bypass-{how}")
        try:
            box = node.container("c", f"memory_mib={slice_mib}")
            half = slice_mib // 2
            if how in SNEAKY:  # a library linked to libcuda leads the program to the driver
                r = box.run(how, str(half), program=self.build.bin_dir / "sneakyprog")
                rcs = [int(rc) for rc in r.one("sneaky")["allocs"].split(",")]
            elif how == "v1":
                rcs = box.run("init", "ctx", *[f"alloc1:{half}M"] * 3).rcs("alloc1")
            elif how == "region_unlink":
                rcs = self._region_unlinked(box, half)
            else:
                rcs = box.run("init", "ctx", *[f"alloc:{half}M"] * 3, mode=how).rcs("alloc")
            return {"allocated_mib": rcs.count(0) * half}
        finally:
            node.cleanup()

    def _region_unlinked(self, box: Container, half: int) -> list[int]:
        """The process holds half the slice; its region is unlinked (a fresh one would be a
        fresh limit); then it asks for two more halves."""
        flag = box.root / "unlinked"
        steps = ("init", "ctx", f"alloc:{half}M", "ready", f"waitfile:{flag}", "sleep:150",
                 f"alloc:{half}M", f"alloc:{half}M", "wait")
        env = box.env()
        proc = subprocess.Popen(box._command(self.build.probe, steps, False, env), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        box.node.processes.append(proc)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready"):
                box.region.unlink()
                flag.touch()
            if line.startswith("waiting"):
                return Result.parse(0, "".join(lines), "").rcs("alloc")
        raise RuntimeError(f"the probe ended early: {''.join(lines)[-300:]} {proc.stderr.read()[-300:]}")

    def capture_after_idle(self, limit: int) -> Figures | None:
        node = self._node("capture")
        try:
            box = node.container("c", f"cores_percent={limit}")
            r = box.run("init", "ctx", "util:0.3:0.3:500:kernel", "sleep:3500", "capture:8:1000",
                        "capturewhile:1000")
            cap, other = r.one("capture"), r.one("capturewhile")
            # (capturewhile: another thread's first launch while this one captures)
            return {"captured": cap["rc"] == cap["end"] == cap["run"] == "0" and other["end"] == "0",
                    "end_rc": cap["end"], "end_rc_other_thread_launching": other["end"]}
        finally:
            node.cleanup()

    def launch_overhead(self) -> Figures:
        if not shutil.which("strace"):
            raise NotModelled("strace is not installed: the system calls the shim adds are not counted")
        node = self._node("overhead", CUDA_DOUBLE_LAUNCH_CPU_NS=2000, CUDA_DOUBLE_ALLOC_CPU_NS=5000)
        m = measure_overhead(node, 3000, 31)  # medians of per-round ratios, strictly alternating
        return {**{f"{k[:-3]}_ratio": round(m["ratio"][k][0], 3) for k in ("launch_ns", "alloc_ns")},
                **{f"{k[:-3]}_ratio_ci95": f"{m['ratio'][k][1]:.3f}-{m['ratio'][k][2]:.3f}"
                   for k in ("launch_ns", "alloc_ns")},
                "syscalls_per_call": round(syscalls_per_call(self._node("syscalls"), 10000), 4),
                "cpu_model": True}

    def swap(self, gib: int) -> Figures:
        node = self._node("swap", CUDA_DOUBLE_MEMORY_MIB=gib * 1024 + 1024, CUDA_DOUBLE_CONTEXT_MIB=0,
                          CUDA_DOUBLE_CHECKPOINT_GIB_S=MODELLED_GIB_S)
        env = node.env({"PYTHONPATH": str(REPO)})
        cmd = [sys.executable, str(REPO / "bench" / "swap.py"), "--controller", str(gib), "2",
               str(self.build.lib_dir / "libcuda.so.1")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"bench/swap.py: {proc.stderr[-300:]}")
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        return {"suspend_gib_s": round(gib / median([r["suspend_s"] for r in rows]), 1),
                "resume_gib_s": round(gib / median([r["resume_s"] for r in rows]), 1),
                "resume_latency_s": round(median([r["latency_s"] for r in rows]), 3),
                "identical": "n/a", "modelled_gib_s": MODELLED_GIB_S}

    def elastic(self, pidns: bool) -> Figures:
        node = self._node("elastic")
        try:
            cores = f"cores_percent={ELASTIC_REQUEST}\ncores_limit_percent={ELASTIC_LIMIT}"
            memory = f"memory_mib={SLICE_MIB}\nmemory_limit_mib={ELASTIC_MEMORY_MIB}"
            alone = node.container("alone", f"name=alone\n{cores}\n{memory}", node_regions=True)
            chunks = ELASTIC_MEMORY_MIB // CHUNK_MIB + 2
            r = alone.run("init", "ctx", "info", "util:1:2:2000:kernel", *[f"alloc:{CHUNK_MIB}M"] * chunks,
                          pidns=pidns, timeout=60)
            burst_mib = len(list(itertools.takewhile(lambda rc: rc == 0, r.rcs("alloc")))) * CHUNK_MIB
            figures: Figures = {"burst_share": r.num("util", "util"), "burst_mib": burst_mib,
                                "total_mib": int(r.num("info", "total")) >> 20}
            burster = node.container("burster", f"name=burster\n{cores}", node_regions=True)
            burster.start("init", "ctx", "ready", "util:0:30:2000:kernel", wait_for="ready", pidns=pidns)
            time.sleep(1.0)  # it bursts: the card is its
            newcomer = node.container("newcomer", f"name=newcomer\n{cores}", node_regions=True)
            floor = ELASTIC_REQUEST - CORES_POINTS
            f = newcomer.run("init", "ctx", f"floorback:3:2000:{floor}", pidns=pidns, timeout=60)
            figures["floor_back_s"] = round(f.num("floorback", "back_ms") / 1000, 2)
            card = 4096  # the node's simulated GPU
            hog = node.container("hog", f"name=hog\nmemory_mib={SLICE_MIB}\nmemory_limit_mib={card}",
                                 node_regions=True)
            held, _ = self._hold(hog, ["init", "ctx", f"alloc:{card - 256}M"], pidns)
            owner = node.container("owner", f"name=owner\nmemory_mib={SLICE_MIB}", node_regions=True)
            asking = owner.start("init", "ctx", f"alloc:{SLICE_MIB // 2}M", "ready", wait_for=None, pidns=pidns)
            deadline = time.monotonic() + 20
            while not pending_reclaims(node.node_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
            held.kill()  # the hub's part: the burster is swapped out or stopped
            held.wait(timeout=10)
            out, _ = asking.communicate(timeout=60)
            figures["reclaimed"] = "alloc rc=0" in out
            return figures
        finally:
            node.cleanup()
