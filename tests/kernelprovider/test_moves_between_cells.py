"""A GPU kernel is swapped out only between its cells: a cell already running when its kernel is
swapped out does not ask for its GPU back (the resume hook runs before a cell), so its next GPU
call would wait on the locked driver for ever (the end-to-end case: tests/kernelprovider/test_swap.py,
``test_the_queue_moves_a_kernel_only_between_its_cells…``)."""

from __future__ import annotations

import asyncio
import stat

import pytest

from hubext.allocator import GPUAllocator
from hubext.backends import Capabilities, Capability, SuspendAsk
from hubext.broker import GPUBroker
from hubext.kernels import KernelRecord
from hubext.local.launcher import LocalKernelLauncher
from hubext.local.swap import CELL_FILE, SWAP_FILE
from kernelprovider.resume import mark_cell
from libvgpu.checkpoint import CheckpointError


@pytest.fixture()
def broker():
    yield GPUBroker()
    GPUBroker.clear_instance()
    GPUAllocator.clear_instance()


def test_a_kernel_in_a_cell_is_neither_offered_for_a_move_nor_swapped_out_and_its_marker_is_taken_back(
    tmp_path, broker, monkeypatch
):
    """A running cell does not ask for its GPU back (the resume hook runs before cells), so its next GPU
    call would wait on the locked driver for ever. The kernel's hook says when a cell runs, in a file
    of the hub's directory that only it may write; the hub writes the swap marker before it reads
    that file, the hook the other way round, so one of the two always sees the other."""
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
    assert broker.movable_sessions() == {"a-c": record.id}  # between cells
    monkeypatch.setenv("ELASTIC_GPU_CELL_FILE", str(cell_file))
    mark_cell(True)  # what the hook does before a cell
    assert launcher.in_cell(record) and broker.movable_sessions() == {}
    ask = SuspendAsk(lock_timeout_ms=1000, host_memory_percent=50, swapped_here_mib=0, why="moved", model="m")
    with pytest.raises(CheckpointError, match="running a cell"):
        asyncio.run(launcher.suspend(record, ask))
    assert checkpointed == [] and not (launcher.kernel_dir(record.id) / SWAP_FILE).exists()
    mark_cell(False)  # after the cell
    assert broker.movable_sessions() == {"a-c": record.id}
    assert asyncio.run(launcher.suspend(record, ask)) == ([4242], 0)
    assert checkpointed == [([4242], True)]  # the marker was there before the checkpoint
    monkeypatch.setenv("ELASTIC_GPU_CELL_FILE", str(tmp_path / "elsewhere"))
    mark_cell(True)  # the hook makes no file: a path that is not the hub's is left alone
    assert not (tmp_path / "elsewhere").exists()
