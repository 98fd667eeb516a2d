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


def test_gpu_check_on_the_doubles_prints_a_line_per_claim_and_a_summary():
    """The same program as on the GPU machine, against the doubles (CI runs every claim)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([str(REPO / "dev"), "gpu-check", "--doubles", "--only",
                           "slice_visible,oom_caching,bypass_getproc"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpu build ok target=doubles")
    verdicts = {line.split()[1]: line.split()[2] for line in lines[1:-1]}
    assert verdicts == {"slice_visible": "ok", "slice_visible_pidns": "ok", "oom_caching": "ok",
                        "oom_caching_pidns": "ok", "bypass_getproc": "ok"}
    assert "total_mib=1024 " in lines[1]
    assert lines[-1].startswith("gpu-check: 5 claims: 5 ok, 0 FAIL, 0 skipped (doubles, ")


def test_an_unknown_claim_is_refused_with_a_sentence():
    proc = subprocess.run([str(REPO / "dev"), "gpu-check", "--doubles", "--only", "no_such_claim"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no claim is called no_such_claim" in proc.stderr
    assert "Traceback" not in proc.stderr
