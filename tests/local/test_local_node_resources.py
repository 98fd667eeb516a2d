"""The local pool gives admission the machine's CPUs and memory, and the ledger keeps what each
allocation holds of them across hub restarts."""

from __future__ import annotations

import os

from hubext.local.ledger import Ledger
from hubext.local.pool import LocalPool
from quotas import AdmissionConfig, AdmissionState, Allocation, GPURequest, Owner


async def test_local_inventory_carries_the_machines_cpus_and_memory(tmp_path):
    pool = LocalPool(simulate_gpus="1xH100-80GB", data_dir=str(tmp_path))

    async def noop(allocation_id: str, why: str) -> None:
        pass

    await pool.start(noop)
    try:
        node = (await pool.inventory()).nodes[0]
        cpus = len(os.sched_getaffinity(0))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        assert (node.cpu_millicores, node.host_memory_mib) == (cpus * 1000, memory)
        state = AdmissionState(AdmissionConfig(), await pool.inventory())
        ask = dict(owner=Owner("alice"), memory_mib=10240, cores_percent=25)
        assert state.decide(GPURequest(**ask, cpu_millicores=cpus * 1000 + 1)).kind == "reject"
        assert state.decide(GPURequest(**ask, cpu_millicores=cpus * 1000)).kind == "grant"
    finally:
        await pool.stop()


def test_the_ledger_keeps_an_allocations_cpu_and_memory(tmp_path):
    a = Allocation(id="nb-1", owner=Owner("alice"), node="localhost", gpu_uuids=("GPU-sim-0000",),
                   memory_mib=10240, cores_percent=25, priority_class="default",
                   cpu_millicores=1500, host_memory_mib=4096)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.insert(a)
    ledger.close()
    reopened = Ledger(tmp_path / "ledger.sqlite")  # as a restarted hub reads it
    try:
        assert reopened.allocations() == [a]
    finally:
        reopened.close()
