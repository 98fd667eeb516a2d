"""Bypasses a hostile user could try from inside the container, with the double: the driver
loaded under another file name, a pre-created or corrupted container region (so that each
process would fall back to a limit of its own), and zeroed usage counters in the writable
region. None of them raises what the container may use."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import subprocess
import sys

import pytest

from libvgpu.regions import LAYOUT

MiB = 1 << 20
OOM = 2


@pytest.mark.parametrize("how", ["path", "bare-name"])
def test_the_driver_dlopened_under_another_name_is_still_limited(node, tmp_path, how):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    shutil.copy(node.build.lib_dir / "libcuda.so.1", hidden / "libtotallynotcuda.so")
    box = node.container("c", "memory_mib=1024")
    env = {"PROBE_CUDA_LIB": str(hidden / "libtotallynotcuda.so")}
    if how == "bare-name":  # found through the library path, like any other library
        env = {"PROBE_CUDA_LIB": "libtotallynotcuda.so",
               "LD_LIBRARY_PATH": f"{hidden}:{node.build.lib_dir}"}
    r = box.run("init", "ctx", "alloc:600M", "alloc:600M", "info", mode="dlopen", env=env)
    assert r.returncode == 0, r.stderr
    assert r.rcs("alloc") == [0, OOM]
    assert int(r.one("info")["total"]) == 1024 * MiB


def _junk(path):
    path.write_bytes(os.urandom(LAYOUT["container.size"]))


def _short(path):
    path.write_bytes(b"LIBVGPU\0" + b"\0" * 100)


def _fifo(path):
    os.mkfifo(path)


def _symlink(path):
    target = path.parent / "elsewhere"
    target.write_bytes(b"\0" * LAYOUT["container.size"])
    path.symlink_to(target)


@pytest.mark.parametrize("plant", [_junk, _short, _fifo, _symlink],
                         ids=["junk", "short", "fifo", "symlink"])
def test_a_planted_container_region_disables_cuda_instead_of_splitting_the_limit(node, plant):
    box = node.container("c", "memory_mib=1024")
    plant(box.region)
    runs = [box.run("init", "ctx", "alloc:600M", timeout=20) for _ in range(2)]
    for r in runs:  # not one limit per process: no CUDA at all, and one line that says why
        assert r.rcs("init") != [0]
        assert r.rcs("alloc") in ([], [3])  # never allocated
        assert str(box.region) in r.stderr and "CUDA is disabled" in r.stderr


def test_a_region_corrupted_while_a_process_runs_stops_new_processes(node):
    box = node.container("c", "memory_mib=1024")
    box.start("init", "ctx", "alloc:600M", "wait")
    with open(box.region, "r+b") as f:
        f.write(b"XXXXXXXX")
    r = box.run("init", "ctx", "alloc:600M", timeout=20)
    assert r.rcs("init") != [0] and "CUDA is disabled" in r.stderr


def _zero_usage(region):
    """What a hostile process in the container can do: zero every usage counter."""
    with open(region, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        zeros = struct.pack("<16Q", *[0] * 16)
        m[LAYOUT["container.used"]:LAYOUT["container.used"] + 128] = zeros
        for i in range(4):
            base = LAYOUT["container.size"] - (1024 - i) * LAYOUT["slot.size"]
            for field in ("slot.used", "slot.overhead"):
                m[base + LAYOUT[field]:base + LAYOUT[field] + 128] = zeros


def test_zeroed_usage_counters_do_not_raise_the_limit(node):
    box = node.container("c", "memory_mib=1024")
    box.start("init", "ctx", "alloc:700M", "wait")
    _zero_usage(box.region)
    r = box.run("init", "ctx", "alloc:700M", "alloc:300M", "info")
    assert r.returncode == 0, r.stderr
    assert r.rcs("alloc") == [OOM, 0]
    assert int(r.one("info")["free"]) == 24 * MiB


def test_the_driver_dlmopened_into_a_namespace_of_its_own_is_still_limited(node):
    box = node.container("c", "memory_mib=1024")
    r = box.run("init", "ctx", "alloc:600M", "alloc:600M", mode="dlopen",
                env={"PROBE_DLMOPEN": "1"})
    assert r.returncode == 0, r.stderr
    assert r.rcs("alloc") == [0, OOM]


def _wipe_slots(region):
    """What a hostile process in the container can also do: make the other processes vanish
    from the region (pid, host pid and every counter of their slots zeroed)."""
    _zero_usage(region)
    with open(region, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        for i in range(4):
            base = 4096 + i * LAYOUT["slot.size"]
            m[base + LAYOUT["slot.pid"]:base + LAYOUT["slot.host_pid"] + 4] = b"\0" * 8


@pytest.mark.parametrize("pidns_on", [False, True], ids=["host", "pid-namespace"])
def test_wiped_slots_of_other_processes_do_not_raise_the_limit(node, request, pidns_on):
    if pidns_on:
        request.getfixturevalue("pidns")
    box = node.container("c", "memory_mib=1024")
    box.start("init", "ctx", "alloc:700M", "wait", pidns=pidns_on)
    _wipe_slots(box.region)
    r = box.run("init", "ctx", "alloc:700M", "alloc:300M", pidns=pidns_on)
    assert r.returncode == 0, r.stderr
    assert r.rcs("alloc") == [OOM, 0]



@pytest.mark.parametrize("how", ["handle", "getproc", "next", "rawdlopen"])
def test_a_library_linked_to_the_driver_hands_out_only_the_hooks(node, how):
    """What a library that links libcuda (triton's cuda_utils, a torch extension) leads code in
    the process to: dlsym on its own handle, its cuGetProcAddress_v2, dlsym(RTLD_NEXT) from
    inside it, dlsym on a handle from glibc's own dlopen. Every entry point is the shim's."""
    box = node.container("c", "memory_mib=1024")
    r = box.run(how, program=node.build.bin_dir / "sneakyprog")
    assert r.returncode == 0, r.stdout + r.stderr
    kv = r.one("sneaky")
    assert kv["allocs"] == f"0,{OOM},{OOM}", kv  # 1,800 MiB on a 1,024 MiB slice before
    assert int(kv["total"]) == 1024 * MiB, kv  # the whole card before



def test_dlvsym_on_a_library_linked_to_the_driver_finds_no_entry_point(node):
    """dlvsym is left to glibc: by no version does it find an unversioned driver symbol."""
    box = node.container("c", "memory_mib=1024")
    r = box.run("vsym", program=node.build.bin_dir / "sneakyprog")
    assert r.one("sneaky") == {"missing": "1"}


CTYPES_SNEAKY = """
import ctypes, json, sys
lib = ctypes.CDLL("libsneaky.so")  # links libcuda.so.1; the script never names libcuda
ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
if sys.argv[1] == "handle":  # dlsym on the library's handle: its dependency libcuda answers
    alloc = ALLOC(ctypes.cast(lib.cuMemAlloc_v2, ctypes.c_void_p).value)
else:  # the library's cuGetProcAddress_v2
    fn, st = ctypes.c_void_p(), ctypes.c_int()
    lib.cuGetProcAddress_v2(b"cuMemAlloc", ctypes.byref(fn), 12040, ctypes.c_uint64(0), ctypes.byref(st))
    alloc = ALLOC(fn.value)
assert lib.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and lib.cuCtxSetCurrent(ctx) == 0
ptr = ctypes.c_uint64()
print(json.dumps([alloc(ctypes.byref(ptr), 600 << 20) for _ in range(3)]))
"""


@pytest.mark.parametrize("how", ["handle", "getproc"])
def test_python_reaching_the_driver_through_a_library_that_links_it_is_limited(node, tmp_path, how):
    """The same without a compiler: ctypes on a library that links libcuda."""
    script = tmp_path / "sneaky.py"
    script.write_text(CTYPES_SNEAKY)
    box = node.container("c", "memory_mib=1024")
    proc = subprocess.run([sys.executable, str(script), how], env=box.env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [0, OOM, OOM]


@pytest.mark.parametrize("how", ["unlink", "rename"])
def test_a_process_whose_region_is_removed_under_it_allocates_no_more(node, how):
    """A region removed or replaced while a process uses it: the next process would start a
    region of its own (where the directory lets it), so the one that lost it fails closed."""
    box = node.container("c", "memory_mib=1024")
    flag = node.root / "removed"
    proc = box.start("init", "ctx", "alloc:100M", "ready", f"waitfile:{flag}", "sleep:150", "alloc:100M",
                     "wait", wait_for="ready")
    if how == "unlink":
        box.region.unlink()
    else:
        box.region.rename(box.region.with_name("elsewhere.region"))
    flag.touch()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "waiting" in line:
            break
    assert [ln for ln in lines if ln.startswith("alloc")] == ["alloc rc=2\n"], lines
    proc.kill()
    assert "removed or replaced" in proc.stderr.read()


def test_a_region_whose_directory_is_moved_as_a_whole_stays_in_use(node):
    """What the hub does when a swapped-out kernel resumes in a new allocation: it moves the
    slice's directory (limits, region) over to the new allocation's name. The kernel's
    processes keep their region and their limit, and go on allocating."""
    box = node.container("c", "memory_mib=1024")
    flag = node.root / "moved"
    proc = box.start("init", "ctx", "alloc:100M", "ready", f"waitfile:{flag}", "sleep:150", "alloc:100M",
                     "alloc:900M", "wait", wait_for="ready")
    box.root.rename(box.root.with_name("resumed"))
    flag.touch()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "waiting" in line:
            break
    assert [ln for ln in lines if ln.startswith("alloc")] == ["alloc rc=0\n", "alloc rc=2\n"], lines
