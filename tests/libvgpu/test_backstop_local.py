"""The backstop on one machine: the hub's local pool runs the node agent's backstop over what the
driver (here the NVML double) reports per process. As a user would try it: a hog that unsets
LD_PRELOAD and fills the card, the same hog restarted, a process that repoints LIBVGPU_CONFIG to
limits of its own, and one that uses a card its slice does not hold. Each is killed within 10 s,
every time, with a log line and a ledger event naming the user and the allocation; a process
that keeps to its slice runs on."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest
from traitlets.config import Config

from hubext.local.pool import LocalPool
from quotas import Allocation, Owner

INTERVAL = 0.5  # the default is 2 s; (confirm_checks + 1) x interval is the bound either way


@pytest.fixture
async def machine(build, make_node, tmp_path, monkeypatch):
    """A local pool over two cards of the NVML double, and one 1 GiB slice of card 0 for alice."""
    node = make_node(CUDA_DOUBLE_DEVICES=2)
    for key, value in node.double_env.items():  # the pool's NVML reads the same simulated cards
        monkeypatch.setenv(key, value)
    pool = LocalPool(
        config=Config({"Backstop": {"interval_seconds": INTERVAL}}),
        data_dir=str(tmp_path / "hub"),
        nvml_library=str(build.lib_dir / "libnvidia-ml.so.1"),
    )

    async def gone(allocation_id: str, why: str) -> None:
        await pool.forget(allocation_id)

    await pool.start(gone)
    uuids = [g.uuid for n in (await pool.inventory()).nodes for g in n.gpus]
    assert len(uuids) == 2
    allocation = Allocation(id="alloc-alice-1", owner=Owner("alice"), node="localhost", gpu_uuids=(uuids[0],),
                            memory_mib=1024, cores_percent=50, priority_class="default")
    await pool.record(allocation)
    holder = subprocess.Popen(["sleep", "300"], start_new_session=True)
    await pool.bind(allocation.id, str(holder.pid))
    env = node.env(pool.holder_env(allocation, 10))
    env["LD_PRELOAD"] = node.build.preload()  # the shim under test
    yield pool, node, allocation, env
    holder.kill()
    holder.wait()
    await pool.stop()
    import pynvml

    pynvml.nvmlShutdown()  # the next test's NVML is its own
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()


def start(node, env, *steps):
    proc = subprocess.Popen([str(node.build.probe), *steps, "ready", "wait"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    node.processes.append(proc)
    line = proc.stdout.readline()
    while line and "ready" not in line:
        line = proc.stdout.readline()
    assert "ready" in line, proc.stderr.read()
    return proc


async def killed_within(proc, seconds: float) -> float:
    """Seconds until ``proc`` was killed (fails after ``seconds``)."""
    import asyncio

    began = time.monotonic()
    while proc.poll() is None:
        assert time.monotonic() - began < seconds, "not stopped in time"
        await asyncio.sleep(0.05)
    assert proc.returncode == -9
    return time.monotonic() - began


async def test_over_slice_and_shim_bypassing_processes_are_killed_every_time(machine, caplog):
    pool, node, allocation, env = machine
    bound = 10  # what the issue asks (acted on in ~1-1.5 s here; the defaults' bound is 6 s)
    no_shim = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    with caplog.at_level(logging.WARNING):
        good = start(node, env, "init", "ctx", "alloc:512M")
        await killed_within(start(node, no_shim, "init", "ctx", "alloc:3000M"), bound)  # over the slice
        await killed_within(start(node, no_shim, "init", "ctx", "alloc:3000M"), bound)  # respawned
        await killed_within(start(node, no_shim, "init", "ctx", "alloc:100M"), bound)  # under it, unshimmed
        mine = node.root / "mine.conf"
        mine.write_text(f"memory_mib=4096\ncontainer_region={node.root / 'mine.region'}\n")
        await killed_within(start(node, {**env, "LIBVGPU_CONFIG": str(mine)}, "init", "ctx", "alloc:100M"), bound)
        # another GPU index: card 1, which the slice does not hold
        await killed_within(start(node, no_shim, "init", "ctx:1", "alloc:600M"), bound)
    assert good.poll() is None  # it kept to its slice through every check above
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Backstop")]
    assert len(lines) >= 5
    assert all("alice" in m and "alloc-alice-1" in m and "Killed process" in m for m in lines)
    events = [e for e in pool.events(50) if e["kind"] == "backstop"]
    assert len(events) >= 5 and all(e["user"] == "alice" for e in events)
