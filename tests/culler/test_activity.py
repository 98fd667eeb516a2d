"""The culler reads the shim's activity record (binary layout of libvgpu/src/vgpu.h, via libvgpu.regions)."""

from __future__ import annotations

import time

from culler.activity import regions_activity
from tests.culler.shimrecord import write_activity


def test_activity_record_gives_last_launch_and_memory_in_use(tmp_path):
    path = str(tmp_path / "activity")
    now = time.time()
    write_activity(path, last_launch=now, used_mib=(2048, 1024))
    activity = regions_activity({"activity_file": path})
    assert abs(activity["last_launch"] - now) < 1e-3 and activity["memory_used_mib"] == 3072


def test_missing_record_means_the_kernel_never_used_cuda(tmp_path):
    assert regions_activity({"activity_file": str(tmp_path / "none")}) == {"last_launch": None, "memory_used_mib": 0}


def test_record_in_another_layout_version_or_truncated_is_unknown_not_misread(tmp_path):
    path = tmp_path / "activity"
    write_activity(str(path), last_launch=time.time(), version=2)
    assert regions_activity({"activity_file": str(path)}) is None
    path.write_bytes(b"LIBVGPU\0short")
    assert regions_activity({"activity_file": str(path)}) is None


def test_record_without_an_activity_file_is_unknown():
    assert regions_activity({"id": "k"}) is None
