"""The claims' workloads on this machine's GPU: PyTorch programs (torch_work.py) run by the
machine's own python3 under the shim, built here with the machine's compiler. One workload at a
time (they share the GPU)."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from libvgpu.elastic import pending_reclaims
from libvgpu.regions import read_container_region

from .claims import (
    CHUNK_MIB,
    CORES_POINTS,
    ELASTIC_LIMIT,
    ELASTIC_MEMORY_MIB,
    ELASTIC_REQUEST,
    SLICE_MIB,
    Figures,
    Phase,
)
from .common import clean_env, held_figures, host_used_mib, median

REPO = Path(__file__).resolve().parents[2]
WORK = Path(__file__).resolve().parent / "torch_work.py"
PIDNS = ("unshare", *(() if os.geteuid() == 0 else ("-U", "-r")), "-p", "-f", "--kill-child",
         "--mount-proc")
#: the memory-only profile of the neighbour without a cores limit (beside_unlimited), MiB
UNLIMITED_NEIGHBOUR_MIB = 4096
ALLOC_CONF = {"caching": "", "expandable": "expandable_segments:True",
              "mallocasync": "backend:cudaMallocAsync"}


def _build_module():
    spec = importlib.util.spec_from_file_location("libvgpu_build", REPO / "libvgpu" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_line(*cmd: str) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({exc})"
    return out.splitlines()[0] if out else "?"


class Child:
    """A torch_work.py process; reads its JSON lines."""

    def __init__(self, argv: list[str], env: dict[str, str], pidns: bool) -> None:
        cmd = [*(PIDNS if pidns else ()), sys.executable, str(WORK), *argv]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.proc.wait(timeout=30)
        raise RuntimeError(f"torch_work.py exited {self.proc.returncode}: {self.proc.stderr.read()[-400:]}")

    def tell(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def close(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                self.tell()
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


class GpuTarget:
    name = "gpu"

    def __init__(self, root: Path) -> None:
        self.root = root
        build = _build_module()
        how = "ok"
        try:
            build.build(root / "shim")
        except build.BuildError as exc:  # this machine's gcc warns where ours does not
            build.CFLAGS = tuple(f for f in build.CFLAGS if f != "-Werror")
            build.build(root / "shim")
            how = f"without-Werror({str(exc).strip().splitlines()[-1][:160]})"
        self.shim = str(root / "shim" / "libvgpu.so")
        import torch  # noqa: F401 - here only to fail early, with its own message, if missing

        gpu = _first_line("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
        self.about = (f"gpu={gpu!r} torch={torch.__version__} cuda={torch.version.cuda} "
                      f"gcc={_first_line('gcc', '-dumpfullversion')} shim_build={how}")
        self._cycles_per_ms: float | None = None

    def describe(self) -> str:
        return self.about

    def pidns_unavailable(self) -> str | None:
        proc = subprocess.run([*PIDNS, "true"], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            return None
        return proc.stderr.strip() or f"unshare exited {proc.returncode}"

    def _container(self, limits: str) -> tuple[dict[str, str], Path]:
        d = Path(tempfile.mkdtemp(prefix="c-", dir=self.root))
        conf = d / "limits.conf"
        conf.write_text(f"{limits}\ncontainer_region={d / 'container.region'}\n")
        conf.chmod(0o444)
        env = clean_env(LD_PRELOAD=self.shim, LIBVGPU_CONFIG=str(conf), CUDA_DEVICE_ORDER="PCI_BUS_ID",
                        PYTHONUNBUFFERED="1")
        return env, d / "container.region"

    def _run(self, argv: list[str], env: dict[str, str], pidns: bool = False, timeout: float = 180) -> dict:
        child = Child(argv, env, pidns)
        try:
            return child.read()
        finally:
            child.close(timeout)

    def memory(self, slice_mib: int, allocator: str, pidns: bool) -> Figures:
        env, _ = self._container(f"memory_mib={slice_mib}")
        if ALLOC_CONF[allocator]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF[allocator]
        child = Child(["memory", str(CHUNK_MIB), str(4 * slice_mib)], env, pidns)
        try:
            f = child.read()
            smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 env=env, capture_output=True, text=True, timeout=60)
            f["nvml_total_mib"] = int(smi.stdout.split()[0]) if smi.returncode == 0 else smi.stderr.strip()[-100:]
            f["used_mib"] = host_used_mib(env)
            return f
        finally:
            child.close()

    def driver_memory(self, pidns: bool) -> Figures:
        env, region = self._container("memory_mib=65536")
        child = Child(["driver"], env, pidns)
        try:
            child.read()
            counted = read_container_region(region).memory_used_bytes[0] >> 20
            return {"counted_mib": counted, "nvml_mib": host_used_mib(env)}
        finally:
            child.close()

    def cycles_per_ms(self) -> float:
        if self._cycles_per_ms is None:
            self._cycles_per_ms = self._run(["calibrate"], clean_env())["cycles_per_ms"]
        return self._cycles_per_ms

    def _phases_arg(self, phases: tuple[Phase, ...]) -> str:
        return json.dumps([dataclasses.asdict(p) for p in phases])

    def cores(self, limit: int, phases: tuple[Phase, ...], pidns: bool) -> list[float]:
        env, _ = self._container(f"cores_percent={limit}")
        return self._run(["cores", str(self.cycles_per_ms()), self._phases_arg(phases)], env, pidns)["shares"]

    def two_containers(self, limits: tuple[int, int], pidns: bool) -> list[float]:
        phases = self._phases_arg((Phase("kernel", 2, warm_s=3.0, measure_s=3.0),))
        children = [Child(["cores", str(self.cycles_per_ms()), phases], self._container(f"cores_percent={lim}")[0],
                          pidns) for lim in limits]
        try:
            return [c.read()["shares"][0] for c in children]
        finally:
            for c in children:
                c.close()

    def beside_unlimited(self, limit: int, pidns: bool) -> list[float]:
        phases = self._phases_arg((Phase("kernel", 2, warm_s=3.0, measure_s=3.0),))
        cpm = str(self.cycles_per_ms())
        children = [Child(["cores", cpm, phases], self._container(limits)[0], pidns)
                    for limits in (f"cores_percent={limit}", f"memory_mib={UNLIMITED_NEIGHBOUR_MIB}")]
        try:
            return [c.read()["shares"][0] for c in children]
        finally:
            for c in children:
                c.close()

    def priority(self, pidns: bool) -> Figures:
        node = Path(tempfile.mkdtemp(prefix="node-", dir=self.root))
        common = f"node_region_dir={node}\npriority_window_ms=200"
        cpm = str(self.cycles_per_ms())
        low = Child(["timeline", "6", cpm], self._container(f"priority=1\nname=low\n{common}")[0], pidns)
        high = Child(["timeline", "1", cpm], self._container(f"priority=100\nname=high\n{common}")[0], pidns)
        try:
            low.read(), high.read()  # both started: CUDA up, a kernel run
            low.tell()
            time.sleep(1.5)  # the low one runs alone first
            high.tell()
            hi, lo = high.read(), low.read()
            return held_figures(lo["gaps"], lo["end_ms"], hi["start_ms"], hi["end_ms"])
        finally:
            low.close()
            high.close()

    def bypass(self, how: str, slice_mib: int) -> Figures:
        env, region = self._container(f"memory_mib={slice_mib}")
        path = {"region_unlink": str(region)}.get(how, "")
        if how in ("handle", "next", "rawdlopen"):
            path = self._sneaky()
        return self._run(["bypass", how, str(slice_mib // 2), *([path] if path else [])], env)

    def _sneaky(self) -> str:
        """tests/libvgpu/progs/sneaky.c built here, linked to this machine's libcuda.so.1 (a
        library like triton's cuda_utils: the bypass rows reach the driver through it)."""
        out = self.root / "libsneaky.so"
        if not out.exists():
            ctypes.CDLL("libcuda.so.1")  # here, without the shim: where the driver lives
            with open("/proc/self/maps") as maps:
                driver = next(ln.split()[-1] for ln in maps if "/libcuda.so" in ln)
            subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-o", str(out),
                            str(REPO / "tests" / "libvgpu" / "progs" / "sneaky.c"),
                            "-Wl,--no-as-needed", driver, "-ldl"], check=True, timeout=120)
        return str(out)

    def capture_after_idle(self, limit: int) -> Figures | None:
        env, _ = self._container(f"cores_percent={limit}")
        return self._run(["capture", "4"], env)

    def launch_overhead(self) -> Figures:
        runs: dict[str, list[dict]] = {"without": [], "with": []}
        for _ in range(3):  # interleaved: drift hits both alike
            runs["without"].append(self._run(["overhead", "300"], clean_env()))
            runs["with"].append(self._run(["overhead", "300"], self._container("memory_mib=65536")[0]))
        m = {side: {k: median([r[k] for r in rs]) for k in ("step_us", "alloc_ns")} for side, rs in runs.items()}
        return {"step_us": round(m["without"]["step_us"], 1),
                "launch_ratio": round(m["with"]["step_us"] / m["without"]["step_us"], 3),
                "alloc_ratio": round(m["with"]["alloc_ns"] / m["without"]["alloc_ns"], 3)}

    def swap(self, gib: int) -> Figures:
        sys.path.insert(0, str(REPO / "bench"))
        from swap import GPU_TARGET, run

        rows = run(GPU_TARGET, gib, 2, clean_env(), "libcuda.so.1")
        return {"suspend_gib_s": round(gib / median([r["suspend_s"] for r in rows]), 1),
                "resume_gib_s": round(gib / median([r["resume_s"] for r in rows]), 1),
                "resume_latency_s": round(median([r["latency_s"] for r in rows]), 3),
                "identical": all(r["identical"] is True for r in rows)}

    def elastic(self, pidns: bool) -> Figures:
        node = Path(tempfile.mkdtemp(prefix="node-", dir=self.root))
        cpm = str(self.cycles_per_ms())
        cores = f"cores_percent={ELASTIC_REQUEST}\ncores_limit_percent={ELASTIC_LIMIT}\nnode_region_dir={node}"
        memory = f"memory_mib={SLICE_MIB}\nmemory_limit_mib={ELASTIC_MEMORY_MIB}"
        env, _ = self._container(f"name=alone\n{cores}\n{memory}")
        f = self._run(["elastic", cpm, str(CHUNK_MIB), str(2 * ELASTIC_MEMORY_MIB)], env, pidns)
        figures: Figures = {"burst_share": round(f["burst_share"], 1), "burst_mib": f["burst_mib"],
                            "total_mib": f["total_mib"]}
        phase = self._phases_arg((Phase("kernel", 2, warm_s=0.0, measure_s=6.0),))
        burster = Child(["cores", cpm, phase], self._container(f"name=burster\n{cores}")[0], pidns)
        try:
            time.sleep(2.0)  # CUDA up, and it bursts: the card is its
            env, _ = self._container(f"name=newcomer\n{cores}")
            figures["floor_back_s"] = round(self._run(["floorback", "3", cpm, str(ELASTIC_REQUEST - CORES_POINTS)], env,
                                                      pidns)["back_s"], 2)
        finally:
            burster.close()
        card = int(_first_line("nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"))
        # the hog leaves room for the owner's context, not for what the owner then asks
        hog = Child(["memory", "1024", str(card)], self._container(
            f"name=hog\nmemory_mib={SLICE_MIB}\nmemory_limit_mib={card - 2048}\nnode_region_dir={node}")[0], pidns)
        owner = None
        try:
            hog.read()  # it holds what it could take of the card
            owner = Child(["owner", "4096"], self._container(
                f"name=owner\nmemory_mib=8192\nnode_region_dir={node}")[0], pidns)
            deadline = time.monotonic() + 20
            while not pending_reclaims(node) and time.monotonic() < deadline:
                time.sleep(0.05)
            figures["reclaim_seen"] = bool(pending_reclaims(node))
            hog.proc.kill()  # the hub's part: the burster is swapped out or stopped
            hog.proc.wait(timeout=30)
            figures["reclaimed"] = owner.read().get("ok") is True
        finally:
            hog.close()
            if owner:
                owner.close()
        return figures
