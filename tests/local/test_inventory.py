"""This machine's GPUs through NVML: the local pool names a card as the node agent does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quotas import parse_simulated
from tests.libvgpu.harness import CFLAGS, cc

REPO = Path(__file__).resolve().parents[2]
DOUBLE = REPO / "tests" / "libvgpu" / "double"

NAMES = """
import json
from hubext.local.inventory import detect_nvml_gpus
from libvgpu.agent.nvml import NVML
nvml = NVML()
nvml.init()
print(json.dumps({"local": [g.model for g in detect_nvml_gpus()], "agent": [g.model for g in nvml.discover()]}))
"""


@pytest.fixture(scope="module")
def nvml_double(tmp_path_factory) -> Path:
    """The NVML test double, built as libnvidia-ml.so.1 (what pynvml loads)."""
    lib = tmp_path_factory.mktemp("nvml")
    cc(*CFLAGS, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-soname,libnvidia-ml.so.1",
       "-o", lib / "libnvidia-ml.so.1", DOUBLE / "nvml_double.c")
    return lib


def test_local_pool_and_node_agent_name_a_real_h100_the_same_way(nvml_double, tmp_path):
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(nvml_double),
        "CUDA_DOUBLE_NAME": "NVIDIA H100 80GB HBM3",
        "CUDA_DOUBLE_MEMORY_MIB": "81559",
        "CUDA_DOUBLE_STATE": str(tmp_path / "double.state"),
        "PYTHONPATH": str(REPO),
    }
    result = subprocess.run([sys.executable, "-c", NAMES], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    names = json.loads(result.stdout)
    assert names["local"] == names["agent"] == ["H100-80GB"]
    # and it is the name the docs' profiles and the simulated pool use
    assert parse_simulated("1xH100-80GB").nodes[0].gpus[0].model == "H100-80GB"
