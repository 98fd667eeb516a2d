"""Attack: keep a GPU slice forever by writing a far-future last launch into one's activity record.

The activity record lives in the slice's region directory, which the kernel's own processes
write (the shim does, from inside the user's process). Code in alice's kernel writes a record
whose last launch is a year ahead, once, then leaves the kernel idle. The culler must still
reclaim it: a record is believed no further than the moment the culler first saw it.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time

import pytest

from tests.culler import shimrecord
from tests.culler.stack import CullerProcess
from tests.hubrunner import REPO
from tests.libvgpu.harness import CFLAGS, HERE, cc
from tests.security.conftest import CULLER_TOKEN, SPEC
from tests.security.helpers import Session, broker_kernels, used_mib, wait_until

YEAR = 365 * 24 * 3600


def forge_code(last_launch: float) -> str:
    """Cell code that writes the shim's activity record of the kernel's own slice."""
    constants = "".join(
        f"{name} = {getattr(shimrecord, name)!r}\n" for name in ("MAGIC", "VERSION", "KIND_ACTIVITY", "SIZE")
    )
    return (
        "import os, struct, time\n"
        + constants
        + inspect.getsource(shimrecord.write_activity)
        + "\npath = os.path.join(os.path.dirname(os.environ['LIBVGPU_CONTAINER_REGION']), 'activity')\n"
        + f"write_activity(path, last_launch={last_launch!r}, used_mib=(512,), launches=1, in_place=True)\n"
        + "print(path)\n"
    )


@pytest.fixture
def culler(sec):
    procs: list[CullerProcess] = []
    yield lambda name, **traits: procs.append(CullerProcess(sec.hub, sec.work, CULLER_TOKEN, name, **traits).start())
    for proc in procs:
        proc.stop()


def test_a_far_future_last_launch_does_not_keep_an_idle_kernel(sec, culler):
    hub = sec.hub
    session = Session(sec.server("alice"), SPEC)
    try:
        path = session.run(forge_code(time.time() + YEAR)).strip()
        assert path == broker_kernels(hub)[session.kernel_id]["activity_file"], "wrote somewhere else"
        session.tab.close()
        session._tab = None
        culler("sec-activity", idle_timeout_seconds=3, warning_seconds=0, gpu_busy_window_seconds=2)
        wait_until(
            lambda: session.kernel_id not in broker_kernels(hub),
            30,
            "the culler to reclaim the idle kernel whose record claims a launch a year from now",
        )
        wait_until(lambda: used_mib(hub) == 0, 10, "the slice to be back in the pool")
    finally:
        session.close()


NVML_CHECK = """
import json, sys, time
from culler.app import GPUCuller
from culler.activity import GPUTimeCheck

library = sys.argv[1]
probe = GPUTimeCheck(library)
nv = probe._init()
uuid = nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(0))
uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
culler = GPUCuller(nvml_library=library, nvml_sample_seconds=0.2)

def records():  # both records say "a launch just now", every time: one is real work, one is a writer
    return [
        {"id": name, "user": "alice", "state": "running", "allocation_id": f"kernel-{name}",
         "allocation": {"id": f"kernel-{name}", "gpu_uuids": [uuid]},
         "activity": {"last_launch": time.time(), "memory_used_mib": 0}}
        for name in ("busy", "liar")
    ]

deadline = time.time() + 4
while time.time() < deadline:
    culler._parse(records())
    culler.sample_gpu_time()
    time.sleep(0.2)
print(json.dumps({k.id: k.gpu_last_launch for k in culler._parse(records())}))
"""


def test_a_record_rewritten_without_gpu_work_is_not_activity_where_nvml_can_tell(tmp_path):
    """The record is rewritten over and over ("a launch just now") by a process that does no GPU
    work; NVML (here the NVML test double, which measures the SM time of the kernels each process
    really ran) sees no SM time for that slice, so the culler does not believe the record. A slice
    whose process does launch kernels stays busy."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for src, soname in (("cuda_double.c", "libcuda.so.1"), ("nvml_double.c", "libnvidia-ml.so.1")):
        cc(
            *CFLAGS,
            "-O2",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            f"-Wl,-soname,{soname}",
            "-o",
            lib / soname,
            HERE / "double" / src,
        )
    probe = tmp_path / "probe"
    cc(
        *CFLAGS,
        "-O2",
        "-o",
        probe,
        HERE / "progs" / "probe.c",
        "-Wl,--no-as-needed",
        lib / "libcuda.so.1",
        lib / "libnvidia-ml.so.1",
        "-ldl",
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("LIBVGPU_", "CUDA_", "LD_PRELOAD"))},
        "LD_LIBRARY_PATH": str(lib),
        "CUDA_DOUBLE_STATE": str(tmp_path / "gpu.state"),
        "CUDA_DOUBLE_MEMORY_MIB": "4096",
        "CUDA_DOUBLE_CONTEXT_MIB": "0",
        "PROBE_MODE": "link",
    }
    busy = subprocess.Popen(
        [str(probe), "init", "ctx", "ready", "timeline:30:1000"],
        env={**env, "ELASTIC_GPU_ALLOCATION_ID": "kernel-busy"},
        stdout=subprocess.PIPE,
        text=True,
    )
    liar = subprocess.Popen(["sleep", "60"], env={**env, "ELASTIC_GPU_ALLOCATION_ID": "kernel-liar"})
    try:
        lines = [busy.stdout.readline() for _ in range(3)]  # init, ctx, ready
        assert "ready" in lines[-1], lines
        out = subprocess.run(
            [sys.executable, "-c", NVML_CHECK, str(lib / "libnvidia-ml.so.1")],
            env={**env, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        believed = json.loads(out.stdout.splitlines()[-1])
        now = time.time()
        assert believed["busy"] >= now - 2, f"the slice that launches kernels must stay busy: {believed}"
        # believed no later than NVML's first look (plus one sample period), seconds before the end
        assert believed["liar"] <= now - 3, f"a record rewritten without GPU work was believed: {believed}"
    finally:
        for proc in (busy, liar):
            proc.kill()
            proc.wait()
