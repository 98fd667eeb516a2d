"""``./dev gpu-check`` exists and, where there is no NVIDIA GPU, says so in one line and
succeeds without running anything."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from .harness import REPO


def test_gpu_check_skips_with_one_line_without_a_gpu(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: ./dev gpu-check would really run")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([str(REPO / "dev"), "gpu-check"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "gpu-check: skipped: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no GPU)"
    ]
    assert proc.stderr == ""
