"""Write the shim's activity record (``struct vgpu_activity`` in libvgpu/src/vgpu.h) as libvgpu.so does,
for tests that have no CUDA device: the culler must read it exactly as it reads the real one."""

from __future__ import annotations

import os
import struct
import time

MAGIC = b"LIBVGPU\0"
VERSION = 1
KIND_ACTIVITY = 3
SIZE = 4096


def write_activity(
    path: str,
    *,
    last_launch: float | None,
    used_mib: tuple[int, ...] = (0,),
    launches: int = 0,
    version: int = VERSION,
    in_place: bool = False,
    compute_burst_s: tuple[float, ...] = (),
) -> None:
    """Write an activity record as the shim lays it out: through a temporary file and a rename,
    or, ``in_place``, over the existing file (what a kernel can do to the file the hub made for
    its slice in a directory that is not the kernel's)."""
    buf = bytearray(SIZE)
    now_ns = time.time_ns()
    struct.pack_into("<8sIIQQ", buf, 0, MAGIC, version, KIND_ACTIVITY, SIZE, now_ns)
    last_ns = int(last_launch * 1e9) if last_launch else 0
    struct.pack_into("<QQQQ", buf, 32, 0xC0FFEE, last_ns, launches, now_ns)
    for dev, mib in enumerate(used_mib):
        struct.pack_into("<Q", buf, 64 + 8 * dev, mib * 1024 * 1024)
    for dev, seconds in enumerate(compute_burst_s):  # GPU time run above the request, so far
        struct.pack_into("<Q", buf, 192 + 8 * dev, int(seconds * 1e9))
    if in_place:
        with open(path, "r+b") as f:
            f.write(buf)
        return
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(buf)
    os.replace(tmp, path)
