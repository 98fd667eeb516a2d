"""Test harness for the shim: builds the shim, the CUDA/NVML doubles and the C programs, and
runs them as containers on a simulated node.

A :class:`Node` is one machine: a state file for the simulated GPU(s) shared by every process
that runs on it, and a directory for node regions. A :class:`Container` is one limits file
plus its own container region; :meth:`Container.run` runs the probe program (see
``progs/probe.c``) under the shim with that container's limits and returns its parsed output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _load_build_module():
    """libvgpu/_build.py by path: the tests build from the sources, installed or not."""
    spec = importlib.util.spec_from_file_location("libvgpu_build", REPO / "libvgpu" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_build = _load_build_module()

CFLAGS = ["-g", "-Wall", "-Wextra", "-Werror", "-pthread"]


def cc(*args: str | os.PathLike[str]) -> None:
    cmd = ["gcc", *[str(a) for a in args]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(cmd)}\n{proc.stderr}")


@dataclass
class Build:
    """Everything the tests compile, in one directory."""

    root: Path
    shim_dir: Path  # libvgpu.so + proxies
    lib_dir: Path  # the doubles: libcuda.so.1, libnvidia-ml.so.1 (+ test libraries)
    bin_dir: Path
    asan: bool = False

    @property
    def shim(self) -> Path:
        return self.shim_dir / "libvgpu.so"

    @property
    def probe(self) -> Path:
        return self.bin_dir / "probe"

    def preload(self) -> str:
        if not self.asan:
            return str(self.shim)
        libasan = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True
        ).stdout.strip()
        return f"{libasan} {self.shim}"


def build_doubles(lib_dir: Path) -> Path:
    """The CUDA and NVML doubles alone (libcuda.so.1, libnvidia-ml.so.1) in ``lib_dir``: what a
    hub on the doubles needs, whose kernels preload the installed shim; returns ``lib_dir``."""
    lib_dir.mkdir(parents=True, exist_ok=True)
    for src, soname in (("cuda_double.c", "libcuda.so.1"), ("nvml_double.c", "libnvidia-ml.so.1")):
        cc(*CFLAGS, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-Bsymbolic-functions",
           f"-Wl,-soname,{soname}", "-o", lib_dir / soname, HERE / "double" / src)
    return lib_dir


def build_all(root: Path, *, asan: bool = False, defines: dict[str, str] | None = None) -> Build:
    b = Build(root, root / "shim", root / "lib", root / "bin", asan=asan)
    for d in (b.shim_dir, b.lib_dir, b.bin_dir):
        d.mkdir(parents=True, exist_ok=True)
    _build.build(b.shim_dir, asan=asan, defines=defines)
    build_doubles(b.lib_dir)
    dbl = HERE / "double"
    progs = HERE / "progs"
    san = ["-O1", "-fsanitize=address", "-fno-omit-frame-pointer"] if asan else ["-O2"]
    # a driver before 570: no checkpoint API (what suspend must refuse to half-do)
    (b.lib_dir / "old-driver").mkdir(exist_ok=True)
    cc(*CFLAGS, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-Bsymbolic-functions", "-DDBL_NO_CHECKPOINT",
       "-Wl,-soname,libcuda.so.1", "-o", b.lib_dir / "old-driver" / "libcuda.so.1", dbl / "cuda_double.c")
    cc(*CFLAGS, *san, "-o", b.probe, progs / "probe.c", "-Wl,--no-as-needed",
       b.lib_dir / "libcuda.so.1", b.lib_dir / "libnvidia-ml.so.1", "-ldl")
    if not asan:
        cc(*CFLAGS, "-O2", "-fPIC", "-shared", "-o", b.lib_dir / "libctor.so", progs / "ctorlib.c",
           "-ldl")
        cc(*CFLAGS, "-O2", "-o", b.bin_dir / "ctorprog", progs / "ctorprog.c", "-Wl,--no-as-needed",
           b.lib_dir / "libctor.so", "-ldl")
        cc(*CFLAGS, "-O2", "-o", b.bin_dir / "ctorprog-dl", progs / "ctorprog.c", "-ldl")
        # a library linked to libcuda that hands out its entry points (test_bypass.py)
        cc(*CFLAGS, "-O2", "-fPIC", "-shared", "-o", b.lib_dir / "libsneaky.so", progs / "sneaky.c",
           "-Wl,--no-as-needed", b.lib_dir / "libcuda.so.1", "-ldl")
        cc(*CFLAGS, "-O2", "-o", b.bin_dir / "sneakyprog", progs / "sneakyprog.c", "-Wl,--no-as-needed",
           b.lib_dir / "libsneaky.so", f"-Wl,-rpath-link,{b.lib_dir}", "-ldl")
        inner = root / "runpath" / "inner"
        inner.mkdir(parents=True, exist_ok=True)
        cc(*CFLAGS, "-fPIC", "-shared", "-o", inner / "libinner.so", progs / "inner.c")
        cc(*CFLAGS, "-fPIC", "-shared", "-o", root / "runpath" / "libouter.so", progs / "outer.c",
           "-Wl,--enable-new-dtags,-rpath,$ORIGIN/inner", "-ldl")
        cc(*CFLAGS, "-o", b.bin_dir / "runpath", progs / "runpath.c", root / "runpath" / "libouter.so",
           f"-Wl,-rpath,{root / 'runpath'}", "-ldl")
    return b


@dataclass
class Result:
    """The probe's output: one (step, {key: value}) per line."""

    returncode: int
    stdout: str
    stderr: str
    lines: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    @classmethod
    def parse(cls, returncode: int, stdout: str, stderr: str) -> Result:
        r = cls(returncode, stdout, stderr)
        for line in stdout.splitlines():
            words = line.split()
            if not words:
                continue
            r.lines.append(
                (words[0], dict(w.split("=", 1) for w in words[1:] if "=" in w))
            )
        return r

    def all(self, step: str) -> list[dict[str, str]]:
        return [kv for s, kv in self.lines if s == step]

    def one(self, step: str, index: int = -1) -> dict[str, str]:
        found = self.all(step)
        assert found, f"no '{step}' line in output:\n{self.stdout}\n{self.stderr}"
        return found[index]

    def rcs(self, step: str) -> list[int]:
        return [int(kv["rc"]) for kv in self.all(step)]

    def num(self, step: str, key: str, index: int = -1) -> float:
        return float(self.one(step, index)[key])


class Node:
    """A simulated machine: GPUs (the doubles' shared state) and node regions."""

    def __init__(self, build: Build, root: Path, **double_env: str | int) -> None:
        self.build = build
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.node_dir = root / "node"
        self.double_env = {
            "CUDA_DOUBLE_STATE": str(root / "gpu.state"),
            "CUDA_DOUBLE_MEMORY_MIB": "4096",
            "CUDA_DOUBLE_CONTEXT_MIB": "0",
        }
        self.double_env.update({k: str(v) for k, v in double_env.items()})
        self.processes: list[subprocess.Popen[str]] = []

    def container(self, name: str, limits: str = "", *, regions: bool = True,
                  node_regions: bool = False) -> Container:
        """A container whose limits file has ``limits`` (key=value lines) plus its region paths."""
        croot = self.root / name
        croot.mkdir(parents=True, exist_ok=True)
        text = limits.strip() + "\n" if limits.strip() else ""
        if regions:
            text += f"container_region={croot / 'container.region'}\n"
            text += f"activity_file={croot / 'activity'}\n"
        if node_regions:
            text += f"node_region_dir={self.node_dir}\n"
        limits_path = croot / "limits.conf"
        limits_path.write_text(text)
        limits_path.chmod(0o444)
        return Container(self, name, croot, limits_path)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LIBVGPU_", "CUDA_"))}
        env.pop("LD_PRELOAD", None)
        env["LD_LIBRARY_PATH"] = str(self.build.lib_dir)
        env.update(self.double_env)
        if self.build.asan:
            env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0:exitcode=99"
        env.update(extra or {})
        return env

    def cleanup(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()


class Container:
    def __init__(self, node: Node, name: str, root: Path, limits: Path) -> None:
        self.node, self.name, self.root, self.limits = node, name, root, limits

    @property
    def region(self) -> Path:
        return self.root / "container.region"

    @property
    def activity(self) -> Path:
        return self.root / "activity"

    def env(self, *, mode: str = "link", shim: bool = True,
            extra: dict[str, str] | None = None) -> dict[str, str]:
        env = self.node.env({"LIBVGPU_CONFIG": str(self.limits), "PROBE_MODE": mode})
        if shim:
            env["LD_PRELOAD"] = self.node.build.preload()
        env.update(extra or {})
        return env

    def _command(self, program: Path, steps: tuple[str, ...], pidns: bool,
                 env: dict[str, str], read_only_node: bool = False) -> list[str]:
        """The program's command line; with ``pidns`` it runs in a new pid namespace with its
        own /proc (``unshare -p -f --mount-proc``), as in a pod: getpid() is not the host pid.
        The host's /proc is bind-mounted first (private mount namespace) at a path only the
        double is told about (CUDA_DOUBLE_HOST_PROC), so the driver double, like the kernel
        driver, knows processes by their host pid."""
        if read_only_node:  # the node regions read-only, as a GPU pod mounts them
            assert not pidns
            ro = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
            return ["unshare", "-m", "--propagation", "private", "sh", "-c", ro, str(self.node.node_dir),
                    str(program), *steps]
        if not pidns:
            return [str(program), *steps]
        host_proc = self.node.root / "hostproc"
        host_proc.mkdir(exist_ok=True)
        env["CUDA_DOUBLE_HOST_PROC"] = str(host_proc)
        inner = 'mount --bind /proc "$0" && exec unshare -p -f --kill-child --mount-proc "$@"'
        user = [] if os.geteuid() == 0 else ["-U", "-r"]  # unprivileged: in a user namespace
        return ["unshare", *user, "-m", "--propagation", "private", "sh", "-c", inner,
                str(host_proc), str(program), *steps]

    def run(self, *steps: str, mode: str = "link", shim: bool = True, timeout: float = 60,
            env: dict[str, str] | None = None, program: Path | None = None,
            pidns: bool = False, read_only_node: bool = False) -> Result:
        full = self.env(mode=mode, shim=shim, extra=env)
        cmd = self._command(program or self.node.build.probe, steps, pidns, full, read_only_node)
        proc = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)
        return Result.parse(proc.returncode, proc.stdout, proc.stderr)

    def start(self, *steps: str, mode: str = "link", env: dict[str, str] | None = None,
              wait_for: str | None = "waiting", stderr_line: str | None = None,
              timeout: float = 30, pidns: bool = False, read_only_node: bool = False) -> subprocess.Popen[str]:
        """Starts the probe in the background; waits until it prints ``wait_for`` on stdout (or
        ``stderr_line`` on stderr). The node kills it at cleanup. ``read_only_node``: in a mount
        namespace of its own where the node regions are read-only (root only)."""
        full = self.env(mode=mode, extra=env)
        proc = subprocess.Popen(self._command(self.node.build.probe, steps, pidns, full, read_only_node),
                                env=full, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        self.node.processes.append(proc)
        stream = proc.stderr if stderr_line else proc.stdout
        needle = stderr_line or wait_for
        if needle:
            deadline = time.monotonic() + timeout
            seen = []
            while time.monotonic() < deadline:
                line = stream.readline()
                if not line:
                    break
                seen.append(line)
                if needle in line:
                    return proc
            proc.kill()
            raise AssertionError(f"{needle!r} not seen from {steps}: {''.join(seen)}")
        return proc


CARD0 = "GPU-d00b1e00-7369-6d2d-6770-750000000000"  # the double's first card


@contextlib.contextmanager
def relaying(node: Node, *containers: Container) -> Iterator[None]:
    """The node agent's relay (libvgpu.agent.relay) of these containers' entries into card 0's
    node region every 50 ms, in a thread, as on a Kubernetes node where the containers read the
    node regions only (their processes: ``read_only_node=True``). The node region and the
    containers' regions are made first, as the agent and the pods' init containers make them."""
    from libvgpu.agent.relay import Relay, open_in_root
    from libvgpu.regions import prepare_container_region, prepare_node_regions

    node.node_dir.mkdir(parents=True, exist_ok=True)
    prepare_node_regions(node.node_dir, [CARD0])
    relay = Relay(node.node_dir)
    for c in containers:  # (the agent finds them in the pods: tests/kubeemu/test_gpu_pod_mounts.py)
        prepare_container_region(c.region, c.activity)
        relay.pods[c.name] = open_in_root("/", str(c.region))

    def run(stop: threading.Event) -> None:
        while not stop.wait(0.05):
            relay.relay([CARD0])

    try:
        with running(run):
            yield
    finally:
        relay.close()


@contextlib.contextmanager
def running(work: Callable[[threading.Event], object]) -> Iterator[None]:
    """``work(stop)`` in a thread while the block runs; ``stop`` is set when it ends."""
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def pid_namespaces_unavailable() -> str | None:
    """Why this machine cannot run a program in a new pid namespace, or None if it can."""
    user = [] if os.geteuid() == 0 else ["-U", "-r"]
    try:
        proc = subprocess.run(["unshare", *user, "-m", "-p", "-f", "--mount-proc", "true"],
                              capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        return "unshare (util-linux) is not installed"
    if proc.returncode:
        return f"unshare cannot create a pid namespace here: {proc.stderr.strip()}"
    return None


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def limiter_rates(stderr: str, percent: int, kernel_us: int) -> list[tuple[float, float]]:
    """The rate each cost estimate of a limiter set (its LIBVGPU_DEBUG lines): (ms since its
    first window began, percent x kernel length / estimate, rounded to 0.1)."""
    windows = re.findall(r"over ([0-9.]+) ms, [0-9]+ launches: ([0-9.]+) us per launch", stderr)
    elapsed, rates = 0.0, []
    for ms, cost in windows:
        elapsed += float(ms)
        rates.append((elapsed, round(percent * kernel_us / float(cost), 1)))
    return rates
