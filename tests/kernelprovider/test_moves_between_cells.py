"""A GPU kernel running a cell is swapped out only by a live move: a cell already running when its
kernel is swapped out does not ask for its GPU back (the resume hook runs before a cell), so its
next GPU call waits on the locked driver until the hub resumes the kernel, which it does at once
after a move (the end-to-end case: tests/kernelprovider/test_swap.py,
``test_a_kernel_in_a_cell_is_moved_live…``). Every other suspend of it is refused."""

from __future__ import annotations

import asyncio
import stat
import time

import pytest

from hubext.allocator import GPUAllocator
from hubext.backends import Capabilities, Capability, SuspendAsk
from hubext.broker import GPUBroker
from hubext.broker.sizes import BrokerError
from hubext.kernels import KernelRecord
from hubext.local.launcher import LocalKernelLauncher
from hubext.local.swap import CELL_FILE, MOVED_FILE, SWAP_FILE
from kernelprovider.resume import mark_cell, moved_note
from libvgpu.checkpoint import CheckpointError


@pytest.fixture()
def broker():
    yield GPUBroker()
    GPUBroker.clear_instance()
    GPUAllocator.clear_instance()


def test_a_kernel_in_a_cell_is_offered_as_such_swapped_out_only_by_a_live_move_and_its_marker_is_taken_back(
    tmp_path, broker, monkeypatch
):
    """The kernel's hook says when a cell runs, in a file of the hub's directory that only it may
    write; the hub writes the swap marker before it reads that file, the hook the other way round,
    so one of the two always sees the other. A kernel in a cell is offered for a move, said to be
    in a cell (the queue prefers others: a live move pauses the cell); only a move swaps it out
    there, and the culler's or a user's suspend is refused with the marker taken back."""
    launcher = LocalKernelLauncher(state_dir=str(tmp_path), cuda_library="libcuda-missing.so.1")
    able = Capabilities(checkpoint=Capability(True), move=Capability(True), burst=Capability(False, "n/a"))
    launcher.capabilities = lambda: able
    checkpointed: list[tuple[list[int], bool]] = []

    class Driver:  # what the driver's checkpoint API would be asked
        library = launcher.cuda_library

        def cuda_processes(self, pids):
            return [4242]

        def suspend(self, pids, timeout_ms):
            checkpointed.append((pids, (launcher.kernel_dir(record.id) / SWAP_FILE).exists()))

    launcher._checkpoint = Driver()
    monkeypatch.setattr("hubext.local.swap.nvml_process_memory_mib", lambda pids: 0)
    record = KernelRecord(
        id="c" * 32,
        user="u",
        server_name="",
        size="s",
        allocation_id="a-c",
        state="running",
        allocation={"node": "n", "gpu_uuids": ["GPU-1"]},
    )
    launcher.kernel_dir(record.id).mkdir(parents=True)
    launcher.prepare_cell_file(record, -1, -1)
    cell_file = launcher.kernel_dir(record.id) / CELL_FILE
    assert stat.S_IMODE(cell_file.stat().st_mode) == 0o600
    broker.launcher, broker.kernels = launcher, {record.id: record}
    movable = broker.movable_sessions()
    assert movable == {"a-c": record.id} and broker.cells_running(movable) == set()  # between cells
    monkeypatch.setenv("ELASTIC_GPU_CELL_FILE", str(cell_file))
    mark_cell(True)  # what the hook does before a cell
    assert launcher.in_cell(record)
    movable = broker.movable_sessions()
    assert movable == {"a-c": record.id} and broker.cells_running(movable) == {"a-c"}
    ask = SuspendAsk(lock_timeout_ms=1000, host_memory_percent=50, swapped_here_mib=0, why="idle", model="m")
    with pytest.raises(CheckpointError, match="running a cell"):
        asyncio.run(launcher.suspend(record, ask))
    assert checkpointed == [] and not (launcher.kernel_dir(record.id) / SWAP_FILE).exists()
    live = SuspendAsk(lock_timeout_ms=1000, host_memory_percent=50, why="moved", model="m", live=True)
    assert asyncio.run(launcher.suspend(record, live)) == ([4242], 0)
    assert checkpointed == [([4242], True)]  # the marker was there before the checkpoint
    launcher.mark_swapped(record, False)
    mark_cell(False)  # after the cell
    movable = broker.movable_sessions()
    assert movable == {"a-c": record.id} and broker.cells_running(movable) == set()
    assert asyncio.run(launcher.suspend(record, ask)) == ([4242], 0)
    assert checkpointed[-1] == ([4242], True)
    monkeypatch.setenv("ELASTIC_GPU_CELL_FILE", str(tmp_path / "elsewhere"))
    mark_cell(True)  # the hook makes no file: a path that is not the hub's is left alone
    assert not (tmp_path / "elsewhere").exists()


def test_the_line_a_live_move_leaves_is_printed_by_the_cell_it_paused_only(tmp_path, monkeypatch):
    """The hub leaves the sentence beside the swap marker, readable by the kernel (0644); the hook
    prints it when a cell ends if it was written since that cell began, never in a later cell."""
    launcher = LocalKernelLauncher(state_dir=str(tmp_path), cuda_library="libcuda-missing.so.1")
    record = KernelRecord(id="d" * 32, user="u", server_name="", size="s", allocation_id="a-d", state="running")
    launcher.kernel_dir(record.id).mkdir(parents=True)
    monkeypatch.setenv("ELASTIC_GPU_SWAP_FILE", str(launcher.kernel_dir(record.id) / SWAP_FILE))
    assert moved_note(0.0) == ""  # never moved
    launcher.tell_moved(record, "This cell paused 2.0 s while its kernel was moved.")
    note = launcher.kernel_dir(record.id) / MOVED_FILE
    assert stat.S_IMODE(note.stat().st_mode) == 0o644
    written = note.stat().st_mtime
    assert moved_note(written) == "This cell paused 2.0 s while its kernel was moved."
    assert moved_note(written + 1) == ""  # a cell that began after it was written


def test_a_live_moves_resume_that_fails_is_asked_again_while_its_cell_waits_and_left_to_the_next_cell(
    tmp_path, broker, monkeypatch
):
    """A cell paused by a live move waits on the locked GPU until its kernel is back, and no hook asks
    for it: a resume that fails (the queue's wait ran out, the driver refused the card) is asked
    again while that cell runs; once it ended, the next cell's hook asks, as after any swap-out."""
    launcher = LocalKernelLauncher(state_dir=str(tmp_path), cuda_library="libcuda-missing.so.1")
    record = KernelRecord(id="e" * 32, user="u", server_name="", size="s", allocation_id="a-e", state="running")
    launcher.kernel_dir(record.id).mkdir(parents=True)
    launcher.prepare_cell_file(record, -1, -1)
    monkeypatch.setenv("ELASTIC_GPU_CELL_FILE", str(launcher.kernel_dir(record.id) / CELL_FILE))
    broker.launcher, broker.kernels = launcher, {record.id: record}
    monkeypatch.setattr("hubext.broker.swap.LIVE_RETRY_SECONDS", 0.0)
    asks: list[str] = []

    async def resume_asked(r: KernelRecord) -> None:  # the queue's and the driver's answers: no, then yes
        asks.append(r.swap["state"])
        if len(asks) == 1:
            raise BrokerError("The GPU of this kernel is still swapped out after 600 s in the GPU queue.", 409)
        r.swap = {}

    monkeypatch.setattr(broker, "_resume_asked", resume_asked)
    mark_cell(True)  # the paused cell
    record.swap = {"state": "swapped", "moved": True, "live": time.time()}
    asyncio.run(broker._resume(record))
    assert asks == ["swapped", "swapped"] and record.swap == {}
    asks.clear()
    mark_cell(False)  # that cell ended without a GPU call
    record.swap = {"state": "swapped", "moved": True, "live": time.time()}
    with pytest.raises(BrokerError, match="still swapped out"):
        asyncio.run(broker._resume(record))
    assert asks == ["swapped"] and record.swap["state"] == "swapped"


def test_a_hub_restarted_during_a_live_move_resumes_the_kernel_whose_cell_waits(tmp_path, broker, monkeypatch):
    """The hub that moved a kernel live may stop before the kernel is back: its paused cell asks
    nobody. The broker that starts next resumes such a kernel at once (a kernel swapped out
    between cells waits for its next cell's hook, as before)."""
    launcher = LocalKernelLauncher(state_dir=str(tmp_path), cuda_library="libcuda-missing.so.1")
    paused = KernelRecord(id="f" * 32, user="u", server_name="", size="s", allocation_id="a-f", state="running")
    idle = KernelRecord(id="9" * 32, user="v", server_name="", size="s", allocation_id="a-9", state="running")
    for record in (paused, idle):
        launcher.kernel_dir(record.id).mkdir(parents=True)
        launcher.prepare_cell_file(record, -1, -1)
    paused.swap = {"state": "queued", "moved": True, "live": time.time() - 30}  # its resume was waiting
    idle.swap = {"state": "swapped", "moved": True}
    (launcher.kernel_dir(paused.id) / CELL_FILE).write_text("1")  # its cell waits on the locked GPU

    class Restarted(LocalKernelLauncher):  # the kernels the state dir lists at start
        async def start(self) -> list[KernelRecord]:
            return [paused, idle]

    async def nothing(*args: object) -> None:
        return None

    broker.launcher_class = Restarted
    broker.config.LocalKernelLauncher.state_dir = str(tmp_path)
    broker.config.LocalKernelLauncher.cuda_library = "libcuda-missing.so.1"
    monkeypatch.setattr(broker.allocator, "ensure_started", nothing)
    monkeypatch.setattr(broker, "reconcile", nothing)
    asked: list[str] = []

    async def resume_asked(r: KernelRecord) -> None:
        asked.append(r.id)
        r.swap = {}

    monkeypatch.setattr(broker, "_resume_asked", resume_asked)

    async def restart() -> None:
        await broker._start()
        for task in (broker._task, broker._reclaim_task):
            task.cancel()
        deadline = time.monotonic() + 10
        while not asked and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(restart())
    assert asked == [paused.id] and paused.swap == {} and idle.swap["state"] == "swapped", (asked, idle.swap)
