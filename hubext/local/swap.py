"""Swapping a local GPU kernel out and back in (single-machine mode), for ``GPUBroker.suspend`` / ``resume``.

The twin of :mod:`hubext.kubernetes.swap`: there the node agent checkpoints a kernel pod's host
pids; here the kernel's processes are this machine's, so the hub checkpoints them itself through
the driver's checkpoint API (:mod:`libvgpu.checkpoint`). Whether that is possible is known before
anything is promised (:meth:`LocalSwapMixin.capabilities`): a simulated pool has no driver, and a
driver without the API (older than 570) says so; the answer, with its reason, is probed once.
"""

from __future__ import annotations

import asyncio
import os
import time

from traitlets import Unicode
from traitlets.config import LoggingConfigurable

from libvgpu.checkpoint import CheckpointError, CheckpointUnavailable, CudaCheckpoint, ProcessState
from quotas import Allocation
from quotas.messages import swap_over_host_cap

from ..backends import Capabilities, Capability, HostMemoryFull, SuspendAsk
from ..kernels import KernelRecord
from .inventory import machine_resources, nvml_process_memory_mib
from .processes import slice_processes

#: in a kernel's directory while it is swapped out (its next cell asks for a resume first)
SWAP_FILE = "gpu-swapped"
#: in a kernel's directory, the kernel's own (0600): its resume hook writes "1" before a cell
#: and "0" after it (kernelprovider/resume.py): the hub swaps it out in a cell only for a move,
#: which it follows with the kernel's resume at once (a live move), and prefers kernels between cells
CELL_FILE = "cell"
#: beside the swap marker (0644): what the cell paused by a live move prints when it ends
#: (kernelprovider/resume.py reads ``$ELASTIC_GPU_SWAP_FILE`` + ".moved")
MOVED_FILE = SWAP_FILE + ".moved"

#: a local kernel's processes see every card of the machine: a resume may land on another one
#: (where the driver's restore takes a device map: driver 580+)
LOCAL_MOVE = Capability(True)
LOCAL_BURST = Capability(False, "local slices do not burst")


class LocalSwapMixin(LoggingConfigurable):
    """Suspend and resume of kernel processes from the hub, for :class:`LocalKernelLauncher`."""

    cuda_library = Unicode(
        "libcuda.so.1",
        config=True,
        help="""The CUDA driver library the hub checkpoints kernels through (driver 570+ has the
        checkpoint API). Default: libcuda.so.1, found as the dynamic linker finds it.""",
    )

    _checkpoint: CudaCheckpoint | None = None
    _capabilities: Capabilities | None = None

    def checkpointer(self) -> CudaCheckpoint:
        if self._checkpoint is None or self._checkpoint.library != self.cuda_library:
            self._checkpoint = CudaCheckpoint(self.cuda_library)
            self._capabilities = None
        return self._checkpoint

    def capabilities(self) -> Capabilities:
        """Probed once: simulated GPUs cannot checkpoint; a real driver can where it loads, has the
        API and answers it (``CudaCheckpoint.check``); a resume may land on another card (``move``)
        where its restore takes a device map (driver 580+: ``CudaCheckpoint.remap_unavailable``)."""
        cp = self.checkpointer()
        if self._capabilities is None:
            checkpoint, move = Capability(True), LOCAL_MOVE
            if getattr(self.pool, "simulated", False):
                checkpoint = Capability(
                    False,
                    "the GPUs are simulated (LocalPool.simulate_gpus), and a simulated card has no driver to "
                    "checkpoint it",
                )
            else:
                try:
                    cp.check()
                    why = cp.remap_unavailable()  # a resume elsewhere needs the driver's device map
                    move = Capability(False, why) if why else LOCAL_MOVE
                except CheckpointUnavailable as e:
                    checkpoint = Capability(False, e.message)
            self._capabilities = Capabilities(checkpoint=checkpoint, move=move, burst=LOCAL_BURST)
        return self._capabilities

    def resume_pins(self, record: KernelRecord) -> tuple[str, ...]:
        """Any card of its model where the driver restores onto another GPU (``capabilities().move``:
        driver 580+); else, or once such a restore of it was refused, its own card(s) only."""
        own = tuple(record.swap.get("gpu_uuids") or record.allocation.get("gpu_uuids", []))
        return own if record.swap.get("remap_refused") or not self.capabilities().move else ()

    def kernel_processes(self, record: KernelRecord) -> list[int]:
        """The kernel process, its process group and session, and their descendants."""
        pid = int(record.holder) if record.holder.isdigit() else 0
        return sorted(slice_processes("", (pid,))) if pid else []

    def host_cap_mib(self, host_memory_percent: float) -> int:
        """Host memory all swapped-out kernels of this machine may hold, MiB."""
        memory = machine_resources()[1] or 0
        return int(memory * host_memory_percent / 100)

    async def suspend(self, record: KernelRecord, ask: SuspendAsk) -> tuple[list[int], int]:
        """Checkpoint the kernel's CUDA processes from the hub: (their pids, MiB moved to host memory)."""
        capability = self.capabilities().checkpoint
        if not capability:
            raise CheckpointError(capability.why_not, 0, "suspend", 0)
        cp = self.checkpointer()
        try:
            cuda = await asyncio.to_thread(cp.cuda_processes, self.kernel_processes(record))
        except CheckpointUnavailable as e:
            raise CheckpointError(e.message, 0, "suspend", 0) from None
        host_mib = nvml_process_memory_mib(cuda) if cuda else 0
        cap = self.host_cap_mib(ask.host_memory_percent)
        if ask.swapped_here_mib + host_mib > cap:
            raise HostMemoryFull(
                swap_over_host_cap(host_mib, ask.swapped_here_mib + host_mib, cap, ask.host_memory_percent),
                host_mib,
                ask.swapped_here_mib,
                cap,
            )
        # the marker first, then the cell: a cell that begins now sees the marker and asks for its
        # GPU (its resume waits for this suspend's end, or joins the one a live move starts); one
        # that began before is seen running here: only a live move swaps it out (and resumes it)
        self.mark_swapped(record, True)
        try:
            if not ask.live and self.in_cell(record):
                raise CheckpointError("it is running a cell; it is swapped out only between cells", 0, "suspend", 0)
            await asyncio.to_thread(cp.suspend, cuda, ask.lock_timeout_ms)
        except BaseException:
            self.mark_swapped(record, False)
            raise
        return cuda, host_mib

    def prepare_cell_file(self, record: KernelRecord, uid: int, gid: int) -> None:
        """The kernel's cell file ("0": between cells), 0600 and its account's, in the hub-owned
        directory: the kernel writes it and can neither replace it nor reach another kernel's."""
        path = self.kernel_dir(record.id) / CELL_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"0")
            if uid >= 0:
                os.fchown(fd, uid, gid)
        finally:
            os.close(fd)

    def in_cell(self, record: KernelRecord) -> bool:
        try:
            fd = os.open(self.kernel_dir(record.id) / CELL_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False  # no hook (a kernel_cmd without it): the culler's idleness is all there is
        try:
            return os.read(fd, 1) == b"1"
        finally:
            os.close(fd)

    async def resume(self, record: KernelRecord, allocation: Allocation, remap: dict[str, str]) -> None:
        """Restore the kernel's checkpointed processes (remapped onto the new card) and unlock them."""
        cp = self.checkpointer()
        try:
            pids = self.kernel_processes(record)
            cuda = [p for p in pids if await asyncio.to_thread(cp.state, p) is ProcessState.CHECKPOINTED]
            await asyncio.to_thread(cp.resume, cuda, remap)
        except CheckpointUnavailable as e:
            raise CheckpointError(e.message, 0, "resume", 0, True) from None

    def tell_moved(self, record: KernelRecord, sentence: str) -> None:
        """The sentence its paused cell prints when it ends (0644, the hub's, beside the marker)."""
        note = self.kernel_dir(record.id) / MOVED_FILE
        note.write_text(sentence)
        os.chmod(note, 0o644)

    def mark_swapped(self, record: KernelRecord, swapped: bool) -> None:
        """The swap file (0644 in the kernel's 0711 directory): there while the kernel is swapped out."""
        marker = self.kernel_dir(record.id) / SWAP_FILE
        if swapped:
            marker.write_text(str(time.time()))
            os.chmod(marker, 0o644)
        else:
            marker.unlink(missing_ok=True)
