"""A GPU kernel's restart keeps its slice even when the old process exits before the new one is
bound: jupyter_client sends ``shutdown_request`` to the old kernel and then asks for the restart,
so the old process may be gone while the broker still waits for the new one to be ready.

Real parts in one process: the hub's GPUAllocator with a LocalPool (its SQLite ledger), the
GPUBroker with the local launcher, real ipykernel processes, a real jupyter_client sending the
shutdown request. The pool's holder check (``LocalPool.check_holders``, every few seconds in a
hub) is run by the test at the moment of the race, before or after the new process is spawned.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from jupyter_client.asynchronous import AsyncKernelClient
from jupyterhub.utils import exponential_backoff
from traitlets.config import Config

from hubext.allocator import GPUAllocator
from hubext.backends import ServerRef
from hubext.broker import GPUBroker
from hubext.kernels import KernelRecord
from hubext.local.launcher import LocalKernelLauncher
from hubext.local.processes import process_alive
from quotas import GPURequest, Owner


class HolderCheckAtSpawn(LocalKernelLauncher):
    """The local launcher, with a hook run around the spawn of a kernel process (the test sets it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.before_spawn = None
        self.after_spawn = None

    async def _spawn(self, record, allocation):
        if self.before_spawn is not None:
            await self.before_spawn()
        pid = await super()._spawn(record, allocation)
        if self.after_spawn is not None:
            await self.after_spawn()
        return pid


@pytest.fixture()
async def broker(tmp_path):
    c = Config()
    c.GPUAllocator.pool_backend_class = "local"
    c.LocalPool.simulate_gpus = "1xH100-80GB"
    c.LocalPool.data_dir = str(tmp_path / "data")
    c.LocalPool.check_interval_seconds = 3600  # the test runs the holder check itself
    c.GPUBroker.launcher_class = HolderCheckAtSpawn
    c.GPUBroker.reconcile_interval_seconds = 3600
    c.GPUBroker.claim_timeout_seconds = 0
    broker = GPUBroker.instance(config=c)
    await broker.ensure_started()
    try:
        yield broker
    finally:
        for record in list(broker.kernels.values()):
            await broker.delete(record, "test over")
        await broker.stop()
        await broker.allocator.backend.stop()
        GPUBroker.clear_instance()
        GPUAllocator.clear_instance()


async def _start_kernel(broker: GPUBroker, home: Path) -> KernelRecord:
    """What ``GPUBroker.create`` does for a server's request: admission, launch, bind."""
    record = KernelRecord(id=uuid.uuid4().hex, user="alice", server_name="", size="gpu-10g", allocation_id="")
    request = GPURequest(owner=Owner(user="alice"), memory_mib=10240, cores_percent=25, request_id=record.id)
    allocation = await broker.allocator.allocate(request, queue=False)
    record.set_allocation(allocation)
    broker.kernels[record.id] = record
    await broker.launcher.launch(record, allocation, uuid.uuid4().hex, ServerRef(user="alice", home=str(home)))
    await broker.allocator.bind(allocation.id, record.holder)
    return record


async def _wait_dead(pid: int, log: Path | None = None) -> None:
    try:
        await exponential_backoff(lambda: not process_alive(pid), f"process {pid} to exit", timeout=30)
    except TimeoutError:
        tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else "(no log)"
        raise AssertionError(f"process {pid} did not exit within 30 s; its log ends:\n{tail}") from None


async def _ready(client: AsyncKernelClient) -> None:
    """Wait for the kernel's answer, as a JupyterLab session does before it offers the kernel: ipykernel
    7.4 hangs for ever in ``Context.term()`` when a ``shutdown_request`` reaches it while it still
    starts (``KeyError: 'N is not registered'`` in ``Kernel.start``); the broker's delete and
    restart stop such a process, but these tests are about a kernel that exits on its own."""
    reply = await client.kernel_info(reply=True, timeout=30)
    assert reply["content"]["status"] == "ok"


@pytest.mark.parametrize("check", ["before the new process is spawned", "while the new process starts"])
async def test_restart_keeps_the_slice_when_the_old_kernel_exits_first_and_the_holder_check_runs(
    broker, tmp_path, check
):
    launcher, pool = broker.launcher, broker.allocator.backend
    record = await _start_kernel(broker, tmp_path)
    old_pid, allocation_id = int(record.holder), record.allocation_id
    kernel_log = launcher.kernel_dir(record.id) / "kernel.log"
    reported: list[list[str]] = []

    async def old_exits_then_holders_checked() -> None:
        await _wait_dead(old_pid, kernel_log)  # the shutdown_request made it exit on its own
        reported.append(await pool.check_holders())

    if check.startswith("before"):
        launcher.before_spawn = old_exits_then_holders_checked
    else:
        launcher.after_spawn = old_exits_then_holders_checked

    # as jupyter_client restarts a kernel: shutdown_request(restart=True), then the provisioner's restart
    client = AsyncKernelClient()
    client.load_connection_file(str(launcher.kernel_dir(record.id) / "connection.json"))
    client.start_channels()
    try:
        await _ready(client)
        client.shutdown(restart=True)
        await broker.restart(record)
    finally:
        client.stop_channels()

    assert reported == [[allocation_id]], "the holder check must have run in the window and seen the old pid dead"
    new_pid = int(record.holder)
    assert new_pid != old_pid and record.state == "running", record.reason
    assert process_alive(new_pid), "the new kernel process must not be stopped with the old holder"
    assert broker.allocator.get(allocation_id) is not None, "the restarted kernel keeps its slice"
    assert pool.ledger.holders() == {allocation_id: str(new_pid)}
    assert await pool.check_holders() == [], "the new process holds the slice"
    # and the new kernel answers on its new ports
    client = AsyncKernelClient()
    client.load_connection_file(str(launcher.kernel_dir(record.id) / "connection.json"))
    client.start_channels()
    try:
        reply = await client.kernel_info(reply=True, timeout=30)
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
    await broker.delete(record)
    await _wait_dead(new_pid)
    assert broker.allocator.get(allocation_id) is None and pool.ledger.holders() == {}


@pytest.mark.parametrize(
    "how, cause, why",
    [
        ("shut down", "stopped", "kernel shut down by alice"),
        ("culled", "culled", "culled: idle 10 min"),
    ],
)
async def test_a_kernel_that_exits_on_its_shutdown_request_before_its_delete_is_recorded_as_stopped_or_culled(
    broker, tmp_path, how, cause, why
):
    """jupyter_client sends ``shutdown_request`` and waits for the kernel to exit before the
    provisioner deletes it, so the pool's holder check may see the process gone first. A CI run
    recorded such a stop as 'holder-gone'. The provisioner says the shutdown is coming
    (``shutdown_requested``: the broker's ``stopping``); a culled kernel was marked by the culler."""
    pool = broker.allocator.backend
    record = await _start_kernel(broker, tmp_path)
    pid, allocation_id = int(record.holder), record.allocation_id
    released: list[tuple[str, str]] = []
    broker.allocator.slice_events.subscribe(
        lambda e: released.append((e.cause.value, e.why)) if e.kind == "released" else None
    )
    if how == "culled":
        broker.mark_culled(record, "idle 10 min")
    broker.mark_stopping(record)  # what the provisioner's shutdown_requested asks for
    client = AsyncKernelClient()
    client.load_connection_file(str(broker.launcher.kernel_dir(record.id) / "connection.json"))
    client.start_channels()
    try:
        await _ready(client)
        client.shutdown(restart=False)
        await _wait_dead(pid, broker.launcher.kernel_dir(record.id) / "kernel.log")
    finally:
        client.stop_channels()
    assert await pool.check_holders() == [allocation_id]
    await exponential_backoff(lambda: bool(released), "the slice's release", timeout=10)
    assert released == [(cause, why)]
    await broker.delete(record, "kernel shut down by alice")  # the provisioner's delete, after the exit
    assert broker.allocator.get(allocation_id) is None and released == [(cause, why)]
