"""Attack: lower one's own burst bill by rewriting the counters the shim keeps in the slice's
activity file.

An elastic slice (request 25 % of the card and 1 GiB, limit the whole card and 2 GiB) runs alone
on a card of the NVML double under the shim, so it runs far above its compute request. The
activity file is the slice's own (its processes write it: the shim does, from inside them); code
of the slice rewinds the shim's burst counters to zero every few milliseconds meanwhile. What the
hub bills (the usage record's ``burst_gpu_seconds``, through the real GPUAllocator, LocalPool and
UsageMeter) must still be the GPU time the driver saw the slice run above its request.

Memory held above the request, as the driver charges it per process, is billed the same way."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time

import pytest

from hubext.metering.report import usage_report
from libvgpu.regions import LAYOUT
from quotas import GPURequest, Owner
from tests.metering.test_meter import make

#: code in the slice: zero the shim's burst counters (every card) of its own activity file, again and again
REWIND = f"""
import os, time
path = os.path.join(os.path.dirname(os.environ["LIBVGPU_CONTAINER_REGION"]), "activity")
while not os.path.exists(path):
    time.sleep(0.01)
with open(path, "r+b") as f:
    print("rewinding", flush=True)
    while True:
        f.seek({LAYOUT["activity.compute_burst_ns"]})
        f.write(bytes(8 * 16))
        f.flush()
        time.sleep(0.005)
"""


@pytest.fixture
async def hub(build, make_node, tmp_path, monkeypatch):
    """The hub's allocator (a LocalPool on one 4 GiB card of the NVML double) and usage meter, and
    start(allocation, *steps): the probe under the shim as the slice's holder."""
    node = make_node()
    for key, value in node.double_env.items():  # the pool's NVML reads the same simulated card
        monkeypatch.setenv(key, value)
    nvml = tmp_path / "nvml" / "libnvidia-ml.so.1"  # a load of its own (see test_backstop_local)
    nvml.parent.mkdir()
    shutil.copy(build.lib_dir / "libnvidia-ml.so.1", nvml)
    allocator, meter = make(tmp_path, simulate_gpus="", nvml_library=str(nvml))
    procs: list[subprocess.Popen] = []

    async def start(allocation, *steps: str) -> tuple[subprocess.Popen, dict[str, str]]:
        env = node.env(allocator.backend.holder_env(allocation, priority_value=0))
        env["LD_PRELOAD"] = build.preload()
        proc = subprocess.Popen(
            [str(build.probe), *steps], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        procs.append(proc)
        await allocator.backend.bind(allocation.id, str(proc.pid))  # the holder, as the broker binds it
        assert "ready" in await asyncio.to_thread(_line, proc, "ready")
        return proc, env

    yield allocator, meter, start, procs
    for proc in procs:
        proc.kill()
        proc.wait()
    meter.close()
    await allocator.backend.stop()
    import pynvml

    pynvml.nvmlShutdown()  # the next test's NVML is its own
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()


def elastic(user: str, rid: str, **limits: int) -> GPURequest:
    return GPURequest(
        owner=Owner(user=user, workspace="vision"), memory_mib=1024, cores_percent=25, request_id=rid, **limits
    )


async def test_a_slice_that_rewinds_its_activity_files_burst_counters_is_billed_the_burst_nvml_saw(hub):
    allocator, meter, start, procs = hub
    a = await allocator.allocate(elastic("mallory", "b", memory_limit_mib=2048, cores_limit_percent=100))
    measure = 4.0
    slice_, env = await start(a, "init", "ctx", "alloc:512M", "ready", f"util:0.5:{measure}:2000:kernel", "wait")
    rewinder = subprocess.Popen(
        [sys.executable, "-c", REWIND], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    procs.append(rewinder)
    assert "rewinding" in await asyncio.to_thread(rewinder.stdout.readline)
    await meter.sample()  # the slice's first sample, before it launches anything
    util = await asyncio.to_thread(_line, slice_, "util")  # the hub's loop runs meanwhile
    share = float(util.split("util=")[1].split()[0]) / 100
    assert share >= 0.7, util  # alone on the card it ran far above its 25 % (the shim let it burst)
    await meter.sample()
    await allocator.release(a.id, "kernel stopped")
    assert meter.recorder.flush()
    (record,) = meter.store.records()
    # it ran `share` of the card for the measured seconds (and its warm-up): what is above its
    # 25 % is burst, whatever its activity file says; at most the rest of the card throughout
    assert record.burst_gpu_seconds >= 0.75 * (share - 0.25) * measure, (record.burst_gpu_seconds, util)
    assert record.burst_gpu_seconds <= 0.75 * (measure + 0.5) * 1.5, (record.burst_gpu_seconds, util)


async def test_memory_held_above_the_request_is_billed_as_burst_apart_from_the_guaranteed_hours(hub):
    """An elastic slice holds 1.5 GiB of its 1 GiB request (limit 2 GiB) and launches nothing: half
    a GiB of a 4 GiB card, an eighth of a card, is burst for as long as it holds it, as NVML's
    per-process memory says. A fixed slice within its request on the same card bursts nothing."""
    allocator, meter, start, _ = hub
    a = await allocator.allocate(elastic("alice", "m", memory_limit_mib=2048))
    fixed = await allocator.allocate(elastic("bob", "f"))
    began = time.time()
    await start(a, "init", "ctx", "alloc:1536M", "ready", "wait")
    await start(fixed, "init", "ctx", "alloc:512M", "ready", "wait")
    await meter.sample()
    for _ in range(200):  # until the hub measured half a card-second of burst (4 s at 1/8 card)
        if allocator.backend.slice_activity([a.id])[a.id]["burst_gpu_seconds"] >= 0.5:
            break
        await asyncio.sleep(0.1)
    await meter.sample()
    ended = time.time()
    for allocation in (a, fixed):
        await allocator.release(allocation.id, "server stopped")
    assert meter.recorder.flush()
    records = {r.id: r for r in meter.store.records()}
    burst = records[a.id].burst_gpu_seconds
    assert 0.5 <= burst <= (ended - began) / 8 * 1.05, burst
    assert records[fixed.id].burst_gpu_seconds == 0.0
    report = usage_report(meter.store.records(), began - 60, time.time() + 60, by=("user",))
    rows = {row["user"]: row for row in report.rows}
    assert rows["alice"]["burst_gpu_hours"] == pytest.approx(burst / 3600)
    held = records[a.id].released_at - records[a.id].granted_at
    assert rows["alice"]["gpu_hours"] == pytest.approx(held / 3600 * 0.25)  # the guarantee: 1 GiB of 4
    assert rows["bob"]["burst_gpu_hours"] == 0.0


def _line(proc: subprocess.Popen, word: str) -> str:
    """The probe's first line from now on that starts with ``word`` ('' if it exited first)."""
    for line in proc.stdout:
        if line.startswith(word):
            return line
    return ""


async def test_a_burst_released_before_the_meters_next_sample_is_billed(hub):
    """A slice holds memory above its request and is released before the meter samples again (a
    short cell, then the kernel stops): the burst the pool measured up to the release is billed,
    not lost with the slice. Request 1 GiB, 3 GiB held: half of the 4 GiB card is burst."""
    allocator, meter, start, _ = hub
    a = await allocator.allocate(elastic("carol", "r", memory_limit_mib=4096))
    began = time.time()
    await start(a, "init", "ctx", "alloc:3072M", "ready", "wait")
    await meter.sample()  # the meter's last sample: before the burst was measured
    measured = 0.0
    for _ in range(200):  # until the pool measured a quarter card-second of burst
        measured = allocator.backend.slice_activity([a.id]).get(a.id, {}).get("burst_gpu_seconds", 0.0)
        if measured >= 0.25:
            break
        await asyncio.sleep(0.05)
    await allocator.release(a.id, "kernel stopped")
    ended = time.time()
    assert meter.recorder.flush()
    (record,) = meter.store.records()
    assert measured <= record.burst_gpu_seconds <= (ended - began) / 2 * 1.05, (record.burst_gpu_seconds, measured)
