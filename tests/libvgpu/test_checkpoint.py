"""The driver double's checkpoint API (cuCheckpointProcess*), driven from another process
through libvgpu.checkpoint as the hub drives it: states and their errors, device memory moving
to host memory (NVML no longer lists the process), a locked process's calls blocked until it is
unlocked, a restore onto another GPU, the old driver without the API, and a failed checkpoint
undone rather than left half-done."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from .harness import Node

MIB = 1 << 20
UUID = "GPU-d00b1e00-7369-6d2d-6770-7500000000{:02x}"

#: a CUDA process: allocates argv[1] MiB on device 0, then one more MiB per line read (printing
#: the result and the time it came back)
TARGET = textwrap.dedent(
    """
    import ctypes, sys, time
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cuda.cuCtxSetCurrent(ctx) == 0
    print("allocated", cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[1]) << 20)), flush=True)
    for line in sys.stdin:
        rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
        print("alloc", rc, repr(time.time()), flush=True)
    """
)

#: the controller: runs `code` with `cp` (a CudaCheckpoint), `cuda` (the driver) and `pid`; prints `out` as JSON
CONTROLLER = """
import ctypes, json, sys, time
from libvgpu.checkpoint import CudaCheckpoint, CheckpointError, CheckpointUnavailable, ProcessState
cp = CudaCheckpoint(sys.argv[1])
cuda = ctypes.CDLL(sys.argv[1]); cuda.cuDoubleDeviceUsed.restype = ctypes.c_ulonglong
pid = int(sys.argv[2])
cuda.cuInit(0)
out = {}
def used(dev): return cuda.cuDoubleDeviceUsed(dev) >> 20
def call(step, args=None): return getattr(cuda, "cuCheckpointProcess" + step)(pid, args)
"""


def control(node: Node, pid: int, code: str, library: str = "") -> dict:
    lib = library or str(node.build.lib_dir / "libcuda.so.1")
    proc = subprocess.run(
        [sys.executable, "-c", CONTROLLER + textwrap.dedent(code) + "\nprint(json.dumps(out))", lib, str(pid)],
        env=node.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_target(node: Node, mib: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(mib)],
        env=node.env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    node.processes.append(proc)
    assert proc.stdout.readline().split() == ["allocated", "0"]
    return proc


def test_checkpoint_moves_device_memory_to_host_and_blocks_the_process_until_unlocked(node: Node) -> None:
    target = start_target(node, 512)
    out = control(
        node,
        target.pid,
        """
        out["before"] = used(0)
        cp.suspend([pid])
        out["state"] = cp.state(pid).name
        out["after"] = used(0)
        cuda.cuDoubleCheckpointHostBytes.restype = ctypes.c_ulonglong
        out["host"] = cuda.cuDoubleCheckpointHostBytes(pid) >> 20
        """,
    )
    assert out == {"before": 512, "state": "CHECKPOINTED", "after": 0, "host": 512}
    target.stdin.write("alloc\n")  # its next call blocks while it is checkpointed
    target.stdin.flush()
    out = control(node, target.pid, 'out["unlocked_at"] = time.time(); cp.resume([pid]); out["used"] = used(0)')
    answer = target.stdout.readline().split()
    assert answer[:2] == ["alloc", "0"]
    assert float(answer[2]) >= out["unlocked_at"], "the call came back before the process was restored"
    assert out["used"] >= 512
    assert control(node, target.pid, 'out["used"] = used(0); out["state"] = cp.state(pid).name') == {
        "used": 513,
        "state": "RUNNING",
    }


def test_calls_in_the_wrong_state_are_refused_and_change_nothing(node: Node) -> None:
    target = start_target(node, 64)
    out = control(
        node,
        target.pid,
        """
        out["checkpoint_running"] = call("Checkpoint")
        out["unlock_running"] = call("Unlock")
        out["restore_running"] = call("Restore")
        out["lock"] = call("Lock")
        out["lock_again"] = call("Lock")
        out["restore_locked"] = call("Restore")
        out["state"] = cp.state(pid).name
        out["unlock"] = call("Unlock")
        out["not_cuda"] = cp.state(1) is None
        """,
    )
    assert out == {
        "checkpoint_running": 401,  # CUDA_ERROR_ILLEGAL_STATE
        "unlock_running": 401,
        "restore_running": 401,
        "lock": 0,
        "lock_again": 401,
        "restore_locked": 401,
        "state": "LOCKED",
        "unlock": 0,
        "not_cuda": True,
    }


def test_restore_onto_another_gpu_needs_every_checkpointed_gpu_named(make_node) -> None:
    node = make_node(CUDA_DOUBLE_DEVICES=2, CUDA_DOUBLE_NAME="NVIDIA H100 80GB HBM3")  # two cards of one model
    target = start_target(node, 256)
    out = control(
        node,
        target.pid,
        f"""
        cp.suspend([pid])
        try:
            cp.resume([pid], {{{UUID.format(1)!r}: {UUID.format(0)!r}}})  # it was never on GPU 1
        except CheckpointError as e:
            out["wrong_pair"] = e.code
        out["state"] = cp.state(pid).name
        cp.resume([pid], {{{UUID.format(0)!r}: {UUID.format(1)!r}}})
        out["used"] = [used(0), used(1)]
        """,
    )
    assert out == {"wrong_pair": 1, "state": "CHECKPOINTED", "used": [0, 256]}
    target.stdin.write("alloc\n")  # its device 0 lives on GPU 1 now: so does what it allocates
    target.stdin.flush()
    assert target.stdout.readline().split()[:2] == ["alloc", "0"]
    assert control(node, target.pid, 'out["used"] = [used(0), used(1)]') == {"used": [0, 257]}


def test_restore_onto_a_gpu_of_another_model_is_refused_and_leaves_the_process_checkpointed(make_node) -> None:
    # the driver restores onto another GPU only of the same chip type (cuCheckpointProcessRestore)
    node = make_node(CUDA_DOUBLE_DEVICES=2, CUDA_DOUBLE_NAME="NVIDIA H100 80GB HBM3;NVIDIA A100-SXM4-40GB")
    target = start_target(node, 256)
    out = control(
        node,
        target.pid,
        f"""
        import pynvml
        pynvml.nvmlInit()
        out["names"] = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)]
        name = ctypes.create_string_buffer(64)
        out["cuda_name"] = cuda.cuDeviceGetName(name, 64, 1) == 0 and name.value.decode()
        cp.suspend([pid])
        try:
            cp.resume([pid], {{{UUID.format(0)!r}: {UUID.format(1)!r}}})
        except CheckpointError as e:
            out["other_model"] = [e.code, e.stuck]  # not stuck: it is swapped out as before
        out["state"] = cp.state(pid).name
        out["used"] = [used(0), used(1)]
        cp.resume([pid])  # back onto its own GPU
        out["after"] = [cp.state(pid).name, used(0), used(1)]
        """,
    )
    assert out == {
        "names": ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"],
        "cuda_name": "NVIDIA A100-SXM4-40GB",
        "other_model": [101, False],  # CUDA_ERROR_INVALID_DEVICE
        "state": "CHECKPOINTED",
        "used": [0, 0],
        "after": ["RUNNING", 256, 0],
    }


def test_a_driver_before_580_restores_only_onto_the_gpus_a_process_was_checkpointed_on(make_node) -> None:
    name = "NVIDIA H100 80GB HBM3"
    node = make_node(CUDA_DOUBLE_DEVICES=2, CUDA_DOUBLE_NAME=name, CUDA_DOUBLE_DRIVER_VERSION=12080)
    target = start_target(node, 64)
    out = control(
        node,
        target.pid,
        f"""
        out["why"] = cp.remap_unavailable()
        cp.suspend([pid])
        try:
            cp.resume([pid], {{{UUID.format(0)!r}: {UUID.format(1)!r}}})
        except CheckpointError as e:
            out["remap"] = [e.code, e.stuck]
        cp.resume([pid])
        out["after"] = [cp.state(pid).name, used(0), used(1)]
        """,
    )
    assert "needs driver 580 or newer (CUDA 13.0)" in out.pop("why")
    assert out == {"remap": [1, False], "after": ["RUNNING", 64, 0]}  # CUDA_ERROR_INVALID_VALUE
    current = make_node(CUDA_DOUBLE_NAME=name)  # driver 580: it can
    assert control(current, 1, 'out["why"] = cp.remap_unavailable()') == {"why": ""}


def test_a_driver_without_the_checkpoint_api_or_not_supporting_it_is_unavailable(make_node) -> None:
    code = """
    try:
        cp.check()
    except CheckpointUnavailable as e:
        out["why"] = e.message
    """
    node = make_node()
    old = str(node.build.lib_dir / "old-driver" / "libcuda.so.1")
    why = control(node, 1, code, library=old)["why"]
    assert "no checkpoint API" in why and "570" in why, why
    unsupported = make_node(CUDA_DOUBLE_CHECKPOINT="unsupported")
    assert "NOT_SUPPORTED" in control(unsupported, 1, code)["why"]


def test_a_failed_checkpoint_is_undone_not_left_half_done(make_node) -> None:
    node = make_node(CUDA_DOUBLE_CHECKPOINT_FAIL="checkpoint")
    target = start_target(node, 128)
    out = control(
        node,
        target.pid,
        """
        try:
            cp.suspend([pid])
        except CheckpointError as e:
            out["error"] = [e.step, e.code, e.stuck]
        out["state"] = cp.state(pid).name
        out["used"] = used(0)
        """,
    )
    assert out == {"error": ["checkpoint", 2, False], "state": "RUNNING", "used": 128}
    target.stdin.write("alloc\n")
    target.stdin.flush()
    assert target.stdout.readline().split()[:2] == ["alloc", "0"]


def test_a_checkpointed_process_is_not_listed_by_nvml(node: Node) -> None:
    target = start_target(node, 32)
    code = """
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    def listed(): return [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
    out["before"] = pid in listed()
    cp.suspend([pid])
    out["suspended"] = pid in listed()
    cp.resume([pid])
    out["after"] = pid in listed()
    """
    assert control(node, target.pid, code) == {"before": True, "suspended": False, "after": True}
