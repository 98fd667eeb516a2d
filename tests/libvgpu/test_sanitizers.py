"""The C side under AddressSanitizer (shim and probe built with -fsanitize=address) and under
valgrind's memcheck: the main scenarios run clean (no memory errors, no leaks)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from .harness import Build, Node, build_all

MiB = 1 << 20
SCENARIOS = {
    "memory": ("init", "ctx", "alloc:100M", "managed:1M", "async:1M", "pool:1M", "vmm:2M",
               "pitch:1100:100", "array:100:100", "array3d:16:16:16", "mipmap:64:64:3", "info",
               "nvml", "module", "unload", "ctxcreate", "alloc:1M", "ctxdestroy", "ctx",
               "alloc:2G", "freeall", "release"),
    "compute": ("init", "ctx", "util:0.2:0.3:500:kernel", "util:0.1:0.2:1000:graph",
                "launch:50:10", "sync"),
    "getproc": ("init", "ctx", "procaddr", "alloc:1M", "free", "launch:3:1", "fork:1M"),
    "threads": ("init", "ctx", "threads:8:200:1M", "info"),
    "escapes": ("init", "ctx", "keeppool", "async:1M", "free", "async:1M", "trim", "vmmmap:2M",
                "unmap", "graphmem:1M", "graphtrim", "nvmlprocs", "nvmlutil", "burst:20:10",
                "info", "nvml"),
}


def asan_available() -> str | None:
    probe = subprocess.run(["gcc", "-fsanitize=address", "-x", "c", "-", "-o", "/dev/null"],
                           input="int main(void){return 0;}", capture_output=True, text=True)
    return None if probe.returncode == 0 else probe.stderr.strip()[:200]


@pytest.fixture(scope="module")
def asan_build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    why = asan_available()
    if why:
        pytest.skip(f"gcc cannot build with -fsanitize=address here: {why}")
    built = build_all(tmp_path_factory.mktemp("libvgpu-asan"), asan=True,
                      defines={"VGPU_TEST_HOOKS": "1"})  # a test build: its hooks too
    needed = subprocess.run(["readelf", "-d", str(built.shim)], capture_output=True, text=True)
    assert "libasan" in needed.stdout  # really the instrumented shim
    return built


def assert_clean(result, tool: str) -> None:
    assert result.returncode == 0, f"{tool} failed:\n{result.stdout}\n{result.stderr}"
    for marker in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "Invalid read",
                   "Invalid write", "definitely lost in", "uninitialised"):
        assert marker not in result.stderr, result.stderr


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenarios_run_clean_under_asan(asan_build, tmp_path, scenario):
    node = Node(asan_build, tmp_path / "node")
    try:
        box = node.container("c", "memory_mib=1024\ncores_percent=50", node_regions=True)
        r = box.run(*SCENARIOS[scenario], mode="dlopen" if scenario == "memory" else "getproc")
        assert_clean(r, "ASan")
        assert "init rc=0" in r.stdout
    finally:
        node.cleanup()


def test_sigkill_recovery_runs_clean_under_asan(asan_build, tmp_path):
    node = Node(asan_build, tmp_path / "node")
    try:
        box = node.container("c", "memory_mib=1024")
        stuck = box.start("init", "ctx", "alloc:100M", wait_for=None,
                          env={"LIBVGPU_TEST_SLEEP_IN_LOCK_MS": "600000"},
                          stderr_line="holding the accounting lock")
        stuck.kill()
        stuck.wait(timeout=10)
        r = box.run("init", "ctx", "alloc:1G", "info")
        assert_clean(r, "ASan")
        assert r.rcs("alloc") == [0]
    finally:
        node.cleanup()


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_shim_runs_clean_under_valgrind(node: Node, build: Build):
    box = node.container("c", "memory_mib=1024\ncores_percent=50", node_regions=True)
    env = box.env(mode="dlopen")
    cmd = ["valgrind", "--error-exitcode=97", "--leak-check=full",
           "--errors-for-leak-kinds=definite", "--show-leak-kinds=definite", "-q",
           str(build.probe), "init", "ctx", "alloc:100M", "array:100:100", "vmm:2M", "info",
           "nvml", "launch:20:10", "freeall", "release"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "alloc rc=0" in proc.stdout and "freeall rc=0" in proc.stdout
    assert Path(build.shim).exists()
