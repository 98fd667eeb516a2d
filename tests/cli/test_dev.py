"""`./dev up` and `./dev test` install only when what they install changed: on an up-to-date
checkout they go straight to the command (no pip, no setuptools banner); a changed
pyproject.toml, package-lock.json or shim source installs again.

The checkout here is a copy of the files the stamp covers, with the real venv's programs linked
in: an install it decides on stops at the missing pip, before anything is written anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAMPED = ["setup.py", "pyproject.toml", "package.json", "package-lock.json", "libvgpu/Makefile", "libvgpu/_build.py"]


@pytest.fixture()
def checkout(tmp_path) -> Path:
    root = tmp_path / "checkout"
    (root / "libvgpu").mkdir(parents=True)
    shutil.copy2(REPO / "dev", root / "dev")
    for name in STAMPED:
        shutil.copy2(REPO / name, root / name)
    shutil.copytree(REPO / "libvgpu" / "src", root / "libvgpu" / "src")
    shutil.copy2(REPO / "libvgpu" / "libvgpu.so", root / "libvgpu" / "libvgpu.so")
    (root / ".venv" / "bin").mkdir(parents=True)
    for program in ("python", "elastic-gpu"):
        (root / ".venv" / "bin" / program).symlink_to(REPO / ".venv" / "bin" / program)
    (root / "node_modules" / ".bin").mkdir(parents=True)
    proxy = "node_modules/.bin/configurable-http-proxy"
    (root / proxy).symlink_to(REPO / proxy)
    shutil.copytree(REPO / "labextension" / "jupyter-config", root / "labextension" / "jupyter-config")
    lab = root / ".venv" / "share" / "jupyter" / "labextensions" / "@elastic-gpu"
    lab.mkdir(parents=True)
    (lab / "jupyterlab").symlink_to(REPO / "kernelprovider" / "labextension")
    stamp = dev(root, "stamp")
    assert stamp.returncode == 0 and len(stamp.stdout.strip()) == 64, stamp
    (root / ".venv" / ".dev-install-stamp").write_text(stamp.stdout)
    return root


def dev(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return subprocess.run(
        ["bash", str(root / "dev"), *args], capture_output=True, text=True, timeout=120, cwd=root, env=env
    )


def test_an_up_to_date_checkout_goes_straight_to_the_command(checkout):
    result = dev(checkout, "up", "--help")
    assert result.returncode == 0, result.stderr
    assert "installed and up to date" in result.stdout and "usage: elastic-gpu up" in result.stdout, result.stdout
    assert "installing" not in result.stdout + result.stderr and "setuptools" not in result.stderr


@pytest.mark.parametrize("changed", ["pyproject.toml", "package-lock.json", "libvgpu/src/hooks.c"])
def test_a_changed_input_installs_again(checkout, changed):
    with (checkout / changed).open("a") as f:
        f.write("\n")
    result = dev(checkout, "up", "--help")
    assert "installing the Python package" in result.stdout, (result.stdout, result.stderr)
    assert not (checkout / ".venv" / ".dev-install-stamp").exists()  # until an install succeeds
