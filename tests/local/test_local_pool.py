"""LocalPool: simulated inventory, the SQLite ledger across hub restarts, dead holders, eviction,
and the read-only limits file a holder gets."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from hubext.local.ledger import Ledger
from hubext.local.pool import LocalPool
from hubext.local.processes import process_alive
from libvgpu.contract import model_name
from libvgpu.priorities import read_priority_table
from quotas import Allocation, ConfigError, Owner


def alloc(aid: str, user: str = "alice", memory: int = 20480, kind: str = "notebook") -> Allocation:
    return Allocation(
        id=aid,
        owner=Owner(user=user),
        node="localhost",
        gpu_uuids=("GPU-sim-0000",),
        memory_mib=memory,
        cores_percent=25,
        priority_class="default",
        kind=kind,
        created_at=time.time(),
    )


def sleeper(seconds: float = 60) -> subprocess.Popen:
    """A holder process in its own process group, as LocalProcessSpawner starts servers."""
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], start_new_session=True)


async def started_pool(tmp_path, on_gone=None, **traits) -> LocalPool:
    pool = LocalPool(simulate_gpus="2xH100-80GB", data_dir=str(tmp_path), check_interval_seconds=0.1, **traits)

    async def noop(allocation_id: str, why: str) -> None:
        pass

    await pool.start(on_gone or noop)
    return pool


async def test_simulated_inventory_is_marked_simulated_and_named_after_the_node(tmp_path):
    pool = await started_pool(tmp_path, node_name="workstation")
    try:
        inventory = await pool.inventory()
        assert pool.simulated is True
        assert [n.name for n in inventory.nodes] == ["workstation"]
        gpus = inventory.nodes[0].gpus
        assert [(g.model, g.memory_mib, g.index) for g in gpus] == [("H100-80GB", 81920, 0), ("H100-80GB", 81920, 1)]
        saved = Ledger(pool.ledger_path).inventory()
        assert saved is not None and saved[1] is True and len(saved[0][0]["gpus"]) == 2
    finally:
        await pool.stop()


async def test_bad_simulated_spec_names_the_trait_and_the_format(tmp_path):
    pool = LocalPool(simulate_gpus="two big GPUs", data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"LocalPool.simulate_gpus: .*2xH100-80GB"):
        await pool.start(lambda *_: None)


async def test_restart_keeps_running_holders_and_drops_dead_and_unbound_ones(tmp_path):
    live, dead = sleeper(), sleeper(0)
    dead.wait()
    kept = alloc("live", memory=30720)
    try:
        pool = await started_pool(tmp_path)
        for a in (kept, alloc("dead"), alloc("never-bound")):
            await pool.record(a)
        await pool.bind("live", str(live.pid))
        await pool.bind("dead", str(dead.pid))
        await pool.stop()  # the hub stops (or crashes) here

        restarted = await started_pool(tmp_path)
        try:
            assert await restarted.allocations() == [kept]
        finally:
            await restarted.stop()
    finally:
        live.kill()
        live.wait()


async def test_a_holder_that_exits_is_reported_gone_and_its_files_removed(tmp_path):
    gone: list[tuple[str, str]] = []

    async def on_gone(allocation_id: str, why: str) -> None:
        gone.append((allocation_id, why))
        await pool.forget(allocation_id)

    pool = await started_pool(tmp_path, on_gone=on_gone)
    try:
        a = alloc("nb-1")
        await pool.record(a)
        env = pool.holder_env(a, priority_value=100)
        node_regions = pool.regions_dir / "node"
        assert read_priority_table(node_regions) == {"nb-1": 100}  # the shim believes this, not the region
        holder = sleeper(0.3)
        await pool.bind(a.id, str(holder.pid))
        holder.wait()  # reaped, as the spawner's poll does
        for _ in range(50):
            if gone:
                break
            await asyncio.sleep(0.1)
        assert gone == [("nb-1", f"process {holder.pid} exited")]
        assert await pool.allocations() == []
        assert not os.path.exists(env["LIBVGPU_CONFIG"])
        assert read_priority_table(node_regions) == {}
    finally:
        await pool.stop()


async def test_a_holder_bound_again_while_the_check_reports_another_is_not_reported_gone(tmp_path):
    """One holder check finds two dead holders; while the first is reported, the second allocation
    gets a live holder (a restarted kernel's new process): the check must not release it."""
    reported: list[str] = []
    replacement = sleeper()

    async def on_gone(allocation_id: str, why: str) -> None:
        reported.append(allocation_id)
        other = "k-2" if allocation_id == "k-1" else "k-1"
        await pool.bind(other, str(replacement.pid))  # the restart binds its new process meanwhile
        await pool.forget(allocation_id)

    pool = LocalPool(simulate_gpus="2xH100-80GB", data_dir=str(tmp_path), check_interval_seconds=3600)
    await pool.start(on_gone)
    try:
        for aid in ("k-1", "k-2"):
            await pool.record(alloc(aid, kind="kernel"))
            old = sleeper(0)
            old.wait()  # exited and reaped before the check
            await pool.bind(aid, str(old.pid))
        gone = await pool.check_holders()
        assert gone == reported and len(gone) == 1, gone
        [kept] = {"k-1", "k-2"} - set(gone)
        assert pool.ledger.holders() == {kept: str(replacement.pid)}
        assert await pool.check_holders() == []
    finally:
        replacement.kill()
        replacement.wait()
        await pool.stop()


async def test_a_zombie_holder_counts_as_exited():
    holder = sleeper(0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # exited but not reaped: a zombie
        with open(f"/proc/{holder.pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.05)
    try:
        assert process_alive(holder.pid) is False
    finally:
        holder.wait()


async def test_evict_stops_the_holders_whole_process_group(tmp_path):
    pool = await started_pool(tmp_path, evict_grace_seconds=5)
    # a holder with a child in its group, like a server and its kernels
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
        ],
        start_new_session=True,
    )
    try:
        a = alloc("victim", user="bob")
        await pool.record(a)
        await pool.bind(a.id, str(holder.pid))
        await asyncio.sleep(0.3)
        await pool.evict(a, "preempted by a high-priority request of alice")
        holder.wait(10)
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.killpg(holder.pid, 0)  # the child is gone too
                await asyncio.sleep(0.1)
        events = pool.events()
        assert events[0]["user"] == "bob" and "preempted by" in events[0]["reason"]
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        await pool.stop()


async def test_limits_file_is_read_only_in_a_hub_owned_directory(tmp_path):
    pool = await started_pool(tmp_path)
    try:
        a = Allocation(
            id="nb-2",
            owner=Owner("alice"),
            node="localhost",
            gpu_uuids=("GPU-sim-0001", "GPU-sim-0000"),
            memory_mib=10240,
            cores_percent=30,
            priority_class="high",
        )
        env = pool.holder_env(a, priority_value=1000)
        path = env["LIBVGPU_CONFIG"]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o444
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o755
        assert os.stat(path).st_uid == os.geteuid() == os.stat(os.path.dirname(path)).st_uid
        text = open(path).read()
        # indices are process-relative: the holder sees only its GPUs, in CUDA_VISIBLE_DEVICES order
        for line in ("memory_mib.0=10240", "memory_mib.1=10240", "cores_percent.1=30", "priority=1000"):
            assert line in text.splitlines()
        assert f"container_region={env['LIBVGPU_CONTAINER_REGION']}" in text
        assert env["CUDA_VISIBLE_DEVICES"] == "GPU-sim-0001,GPU-sim-0000"
        assert "LD_PRELOAD" not in env or env["LD_PRELOAD"].endswith(".so")
        pool.holder_env(a, priority_value=10)  # rewritten in place, still read-only
        assert "priority=10" in open(path).read().splitlines()
    finally:
        await pool.stop()


def test_allocation_round_trips_through_the_ledger_format():
    a = alloc("x", user="carol", kind="kernel")
    assert Allocation.from_dict(a.to_dict()) == a


@pytest.mark.parametrize(
    "nvml,memory_mib,model",
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("Tesla T4", 15360, "T4-16GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
    ],
)
def test_nvml_names_become_the_pools_model_names(nvml, memory_mib, model):
    assert model_name(nvml, memory_mib) == model


def test_a_gpu_process_is_traced_to_its_slice_by_ancestry_or_by_the_id_it_carries():
    from hubext.local.processes import allocations_of, process_cmdline
    from libvgpu.contract import ENV_ALLOCATION_ID

    scrubbed = {k: v for k, v in os.environ.items() if k != ENV_ALLOCATION_ID}
    # a holder whose child dropped the id, and a detached process that carries one
    holder = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], env=scrubbed, start_new_session=True)
    carrier = subprocess.Popen(["sleep", "30"], env={**scrubbed, ENV_ALLOCATION_ID: "nb-2"}, start_new_session=True)
    try:
        children = f"/proc/{holder.pid}/task/{holder.pid}/children"
        deadline = time.monotonic() + 10
        while not open(children).read().split() and time.monotonic() < deadline:
            time.sleep(0.02)
        # Popen returns when exec closes its error pipe, which the kernel does before it sets up
        # the new program's arguments and environment: until then /proc/<pid>/environ reads
        # empty. Wait for the exec to finish (its command line is the new program's).
        while process_cmdline(carrier.pid) != ["sleep", "30"] and time.monotonic() < deadline:
            time.sleep(0.02)
        (child,) = map(int, open(children).read().split())
        found = allocations_of([child, carrier.pid, os.getpid()], {holder.pid: "nb-1"})
        assert found == {child: "nb-1", carrier.pid: "nb-2"}
    finally:
        for p in (holder, carrier):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
