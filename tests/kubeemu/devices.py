"""A node's GPUs as its NVIDIA container runtime hands them to containers.

On a real node the runtime (nvidia-container-toolkit) reads the container's
``NVIDIA_VISIBLE_DEVICES`` once, at its start, and creates in the container's /dev the control
node ``/dev/nvidiactl`` and ``/dev/nvidia<minor>`` for those cards only (and allows them in the
container's device cgroup); the driver then enumerates the cards whose device node the process
can reach. A process cannot widen that set afterwards: its environment is read by no one, and
/dev is root's. The emulator does the same with ``KubeEmulator(gpu_uuids=...)``: the kubelet
picks the minors here, ``runtime.py`` gives the container a /dev of its own holding them, and
the CUDA double enumerates the cards by their device nodes (tests/libvgpu/double/double_state.h).
"""

from __future__ import annotations

from collections.abc import Sequence

#: the NVIDIA character devices' major number (``/proc/devices``: nvidia-frontend)
NVIDIA_MAJOR = 195
#: ``/dev/nvidiactl``'s minor
CONTROL_MINOR = 255


def visible_minors(value: str | None, uuids: Sequence[str]) -> list[int]:
    """The minors of the cards ``NVIDIA_VISIBLE_DEVICES=value`` names on a node whose cards are
    ``uuids`` (minor order); ValueError with the runtime's message when it names an unknown card."""
    if value is None or value.strip() in ("", "void", "none"):
        return []
    if value.strip() == "all":
        return list(range(len(uuids)))
    minors = []
    for item in (v.strip() for v in value.split(",")):
        if item.isdigit() and int(item) < len(uuids):
            minor = int(item)
        elif item in uuids:
            minor = uuids.index(item)
        else:
            raise ValueError(f"nvidia-container-cli: device error: {item}: unknown device")
        if minor not in minors:
            minors.append(minor)
    return sorted(minors)
