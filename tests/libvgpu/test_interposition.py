"""How calls reach the shim: linked programs, dlopen + dlsym (PyTorch, ctypes), and
cuGetProcAddress (the CUDA 12 runtime); with no global dlsym override, so libraries that use
dlopen/dlsym from their constructors and callers that rely on their RUNPATH keep working."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MiB = 1 << 20
OOM = 2


@pytest.mark.parametrize("mode", ["link", "dlopen", "getproc"])
def test_get_proc_address_answers_with_the_hooks(node, mode):
    box = node.container("c", "memory_mib=64")
    r = box.run("init", "procaddr", mode=mode)
    p = r.one("procaddr")
    assert int(p["rc"]) == 0
    assert (p["memalloc_lib"], p["memalloc_sym"]) == ("libvgpu.so", "cuMemAlloc_v2")
    assert p["launch_lib"] == "libvgpu.so"
    assert p["ptsz_sym"] == "cuLaunchKernel_ptsz"  # per-thread default stream variant
    if mode != "link":
        assert p["same_as_dlsym"] == "1"  # dlsym on the libcuda handle gives the hook too


def test_hooks_are_found_by_name_when_the_driver_hands_out_internal_pointers(make_node):
    node = make_node(CUDA_DOUBLE_PROC_ALIASES=1)
    box = node.container("c", "memory_mib=64")
    r = box.run("init", "ctx", "procaddr", "alloc:65M", "alloc:64M", mode="getproc")
    assert r.one("procaddr")["memalloc_lib"] == "libvgpu.so"
    assert r.rcs("alloc") == [OOM, 0]


def test_unhooked_functions_reach_the_real_driver_through_the_proxy(node):
    box = node.container("c", "memory_mib=64")
    r = box.run("init", "errstr", mode="dlopen")
    assert r.one("errstr") == {"rc": "0", "text": "out"}  # "out of memory", from the double


@pytest.mark.parametrize("how", ["linked", "dlopen"])
def test_a_library_using_dlopen_and_dlsym_in_its_constructor_works(node, build, how):
    box = node.container("c", "memory_mib=64")
    program = build.bin_dir / ("ctorprog" if how == "linked" else "ctorprog-dl")
    r = box.run(*(["dlopen"] if how == "dlopen" else []), program=program, timeout=20)
    assert r.returncode == 0, r.stderr
    ctor = r.one("ctor")
    assert ctor == {"alloc_lib": "libvgpu.so", "init_lib": "libvgpu.so", "malloc": "1",
                    "cuinit_rc": "0"}
    assert r.one("after") == {"alloc_rc": "0"}


def test_dlopen_keeps_the_callers_runpath(node, build):
    box = node.container("c", "memory_mib=64")
    r = box.run(program=build.bin_dir / "runpath")
    assert r.returncode == 0, r.stderr
    # found through libouter's RUNPATH; the control (no RUNPATH in the program) is not found
    assert r.one("runpath") == {"outer_rc": "0", "direct_found": "0"}


CTYPES_SCRIPT = textwrap.dedent(
    """
    import ctypes, json
    cuda = ctypes.CDLL("libcuda.so.1")
    out = {"init": cuda.cuInit(0)}
    ctx = ctypes.c_void_p()
    cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cuda.cuCtxSetCurrent(ctx)
    ptr = ctypes.c_uint64()
    out["allocs"] = [cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n))
                     for n in (200 << 20, 100 << 20)]
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    out["free"], out["total"] = free.value, total.value
    fn, status = ctypes.c_void_p(), ctypes.c_int()
    cuda.cuGetProcAddress_v2(b"cuMemAlloc", ctypes.byref(fn), 12040, ctypes.c_uint64(0),
                             ctypes.byref(status))
    alloc = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)(
        fn.value)
    out["via_proc"] = alloc(ctypes.byref(ptr), 200 << 20)
    import pynvml
    pynvml.nvmlInit()
    mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    out["nvml"] = [mem.total, mem.used, mem.free]
    print(json.dumps(out))
    """
)


def test_python_ctypes_and_pynvml_see_the_slice(node, tmp_path):
    box = node.container("c", "memory_mib=256")
    script = tmp_path / "drive.py"
    script.write_text(CTYPES_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=box.env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["init"] == 0
    assert out["allocs"] == [0, OOM]
    assert (out["free"], out["total"]) == (56 * MiB, 256 * MiB)
    assert out["via_proc"] == OOM
    assert out["nvml"] == [256 * MiB, 200 * MiB, 56 * MiB]


def test_without_any_configuration_the_shim_passes_through(node):
    box = node.container("c", "", regions=False)
    # no limits file, no LIBVGPU_* variables
    r = box.run("init", "ctx", "alloc:3G", "info", "launch:3:10", env={"LIBVGPU_CONFIG": ""})
    assert r.returncode == 0 and r.stderr == ""
    assert r.rcs("alloc") == [0]
    assert int(r.one("info")["total"]) == 4096 * MiB
    assert not list(node.root.rglob("*.region"))
