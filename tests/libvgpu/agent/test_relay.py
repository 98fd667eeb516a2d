"""The node agent's relay (libvgpu.agent.relay) on its own: container regions as the shim
leaves them, a card's node region as the agent made it."""

from __future__ import annotations

import fcntl
import os
import struct

from libvgpu.agent.relay import Relay
from libvgpu.regions import (
    _FLOCK,
    LAYOUT,
    LOCK_BASE,
    NODE_ENTRIES,
    prepare_container_region,
    prepare_node_regions,
    read_node_region,
)

GPU = "GPU-d00b1e00-7369-6d2d-6770-750000000000"
MIB = 1 << 20


def live_container(path, name: str, used_mib: int) -> tuple[int, int]:
    """A container region whose one process (slot 0, its liveness lock held by the returned fd)
    uses card GPU as CUDA device 0; and a read-only fd of it for the relay."""
    prepare_container_region(path)
    L = LAYOUT
    with open(path, "r+b") as f:
        f.seek(L["container.hwm"])
        f.write(struct.pack("<I", 1))
        f.seek(4096 + L["slot.pid"])
        f.write(struct.pack("<i", 1))
        f.seek(L["container.used"])
        f.write(struct.pack("<Q", used_mib * MIB))
        f.seek(L["container.name"])
        f.write(name.encode().ljust(64, b"\0"))
        f.seek(L["container.card"] + L["card.uuid"])
        f.write(GPU.encode().ljust(48, b"\0"))
    holder = os.open(path, os.O_RDWR)
    fcntl.fcntl(holder, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, LOCK_BASE, 1, 0))
    return holder, os.open(path, os.O_RDONLY)


def test_entries_an_earlier_agent_left_behind_do_not_keep_a_new_container_out(tmp_path):
    """The agent restarted (an upgrade, an OOM kill) while its relayed containers ended: their
    entries keep their ids but nobody holds them. A card's region has 64 entries; a new
    container must still get one."""
    regions = tmp_path / "regions"
    regions.mkdir()
    prepare_node_regions(regions, [GPU])
    node = regions / f"{GPU}.region"
    with open(node, "r+b") as f:  # what the earlier agent's relayed containers left
        for i in range(NODE_ENTRIES):
            f.seek(256 + i * LAYOUT["entry.size"])
            f.write(struct.pack("<Q", 1000 + i))
    holder, fd = live_container(tmp_path / "c.region", "alloc-new", 300)
    relay = Relay(regions)
    relay.pods["new"] = fd
    try:
        relay.relay([GPU])
        [entry] = read_node_region(node).containers  # the live ones
        assert (entry.name, entry.memory_used_bytes, entry.alive) == ("alloc-new", 300 * MIB, True)
        os.close(holder)  # the container's last process ends
        relay.relay([GPU])
        assert read_node_region(node).containers == ()
    finally:
        relay.close()
