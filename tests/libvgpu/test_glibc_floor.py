"""The shim's glibc floor: libvgpu.so built against glibc 2.17 (what the Dockerfile's
manylinux2014 stage does) needs no symbol newer than GLIBC_2.17, and that build enforces a slice.

No Docker here: ``zig cc -target x86_64-linux-gnu.2.17`` (PyPI package ``ziglang``) links
against glibc 2.17's symbol versions instead. ziglang comes with the [test] extra; without it
the tests skip, except under CI (``ELASTIC_GPU_CI``), where that would hide the floor.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import Build, Node, _build

FLOOR = (2, 17)


def _glibc_versions(library: Path) -> set[tuple[int, ...]]:
    out = subprocess.run(["objdump", "-T", str(library)], capture_output=True, text=True, check=True).stdout
    return {tuple(int(x) for x in v.split(".")) for v in re.findall(r"GLIBC_([0-9.]+)\)?\s", out)}


@pytest.fixture(scope="module")
def old_glibc_build(build: Build, tmp_path_factory: pytest.TempPathFactory) -> Build:
    tools = (("ziglang (zig cc)", importlib.util.find_spec("ziglang")), ("objdump", shutil.which("objdump")))
    missing = [what for what, found in tools if not found]
    if missing:
        if os.environ.get("ELASTIC_GPU_CI"):
            pytest.fail(f"{', '.join(missing)} not installed, but CI installs them (the [test] extra, binutils)")
        pytest.skip(f"{', '.join(missing)} not installed (pip install ziglang; binutils)")
    root = tmp_path_factory.mktemp("glibc-2.17")
    zcc = root / "zcc"
    zcc.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ziglang cc -target x86_64-linux-gnu.2.17 "$@"\n')
    zcc.chmod(0o755)
    _build.build(root / "shim", cc=str(zcc))
    return Build(root, root / "shim", build.lib_dir, build.bin_dir)


def test_the_shim_built_for_glibc_2_17_needs_nothing_newer(old_glibc_build):
    for name in ("libvgpu.so", "libvgpu-cuda.so", "libvgpu-nvml.so"):
        newest = max(_glibc_versions(old_glibc_build.shim_dir / name), default=(0,))
        assert newest <= FLOOR, f"{name} needs GLIBC_{'.'.join(map(str, newest))}"


def test_the_glibc_2_17_build_enforces_a_slice(old_glibc_build, tmp_path):
    node = Node(old_glibc_build, tmp_path / "node")
    try:
        box = node.container("c", "memory_mib=1024")
        r = box.run("init", "ctx", "alloc:1G", "alloc:1", "info")
        assert r.returncode == 0, r.stderr
        assert r.rcs("alloc") == [0, 2]  # the second allocation is over the slice: out of memory
        assert int(r.one("info")["total"]) == 1024 << 20
    finally:
        node.cleanup()
