"""The package installs what it promises: top-level packages and the console script."""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["hubext", "kernelprovider", "culler", "quotas", "libvgpu"])
def test_top_level_package_imports(name):
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"


def test_console_script_is_installed_and_answers_help():
    exe = shutil.which("elastic-gpu") or str(Path(sys.executable).parent / "elastic-gpu")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "elastic-gpu" in out.stdout


def test_the_code_is_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed (it comes with the [test] extra)")
    out = subprocess.run([str(ruff), "check", str(REPO)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
