"""The node agent gives a running container another card, and takes cards back
(libvgpu/agent/cards.py): the device node in the container's own /dev, the device cgroup rule on
cgroup v1; on cgroup v2 it says it cannot. A container's /dev it cannot trust (a link a root
container put there) is refused, nothing made where the link points."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from libvgpu.agent.cards import NVIDIA_MAJOR, CardAccess, CardAccessError

PID = 4242


def container(tmp_path: Path, v1: bool = True) -> tuple[Path, Path, Path]:
    """A host /proc with one process whose root is a container's (its /dev root-owned), and the
    host's cgroup filesystem (v1 with a devices controller, or v2)."""
    proc, cgroup, root = tmp_path / "proc", tmp_path / "cgroup", tmp_path / "rootfs"
    (root / "dev").mkdir(parents=True)
    (proc / str(PID)).mkdir(parents=True)
    (proc / str(PID) / "root").symlink_to(root)
    path = "/kubepods/burstable/pod1234/ab12"
    if v1:
        (cgroup / "devices" / path.lstrip("/")).mkdir(parents=True)
        (proc / str(PID) / "cgroup").write_text(f"12:memory:{path}\n11:devices:{path}\n")
    else:
        cgroup.mkdir()
        (cgroup / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        (proc / str(PID) / "cgroup").write_text(f"0::{path}\n")
    return proc, cgroup, root


def test_a_card_is_granted_before_the_restore_and_the_old_one_taken_back_after(tmp_path):
    proc, cgroup, root = container(tmp_path)
    access = CardAccess(proc, cgroup)
    assert access.why_not() is None
    os.mknod(root / "dev" / "nvidia0", stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, 0))  # its own card
    seen = []

    def restore() -> None:  # the driver restores while both cards are there
        seen.append(sorted(p.name for p in (root / "dev").iterdir()))

    access.move([PID], {"GPU-a": "GPU-b"}, {"GPU-a": 0, "GPU-b": 1}, restore)
    assert seen == [["nvidia0", "nvidia1"]]
    node = (root / "dev" / "nvidia1").stat()
    assert stat.S_ISCHR(node.st_mode) and os.major(node.st_rdev) == NVIDIA_MAJOR and os.minor(node.st_rdev) == 1
    assert stat.S_IMODE(node.st_mode) == 0o666
    assert sorted(p.name for p in (root / "dev").iterdir()) == ["nvidia1"]  # the old card is gone
    devices = cgroup / "devices" / "kubepods/burstable/pod1234/ab12"
    assert (devices / "devices.allow").read_text() == "c 195:1 rw\n"
    assert (devices / "devices.deny").read_text() == "c 195:0 rw\n"


def test_a_refused_restore_takes_the_new_card_back(tmp_path):
    proc, cgroup, root = container(tmp_path)
    os.mknod(root / "dev" / "nvidia0", stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, 0))

    def refused() -> None:
        raise RuntimeError("the driver refused")

    with pytest.raises(RuntimeError):
        CardAccess(proc, cgroup).move([PID], {"GPU-a": "GPU-b"}, {"GPU-a": 0, "GPU-b": 1}, refused)
    assert sorted(p.name for p in (root / "dev").iterdir()) == ["nvidia0"]  # its own card only
    devices = cgroup / "devices" / "kubepods/burstable/pod1234/ab12"
    assert (devices / "devices.deny").read_text() == "c 195:1 rw\n"


def test_a_container_dev_that_is_a_link_is_refused(tmp_path):
    proc, cgroup, root = container(tmp_path)
    elsewhere = tmp_path / "host-dir"
    elsewhere.mkdir()
    (root / "dev").rmdir()
    (root / "dev").symlink_to(elsewhere)  # a container that made its /dev a link (it would need root)
    with pytest.raises(CardAccessError, match="no directory"):
        CardAccess(proc, cgroup).grant([PID], 1)
    assert list(elsewhere.iterdir()) == []


def test_a_cgroup_v2_node_says_it_cannot_give_a_running_container_a_card(tmp_path):
    proc, cgroup, _ = container(tmp_path, v1=False)
    assert "cgroup v2" in CardAccess(proc, cgroup).why_not()
