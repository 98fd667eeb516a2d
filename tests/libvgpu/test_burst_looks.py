"""The looks burst metering makes at a card (issue 27), on the NVML double, the same on one
machine (:class:`hubext.local.burst.LocalBurst`, the hub's thread) and on Kubernetes (the node
agent's ``_sample_burst``): a card whose driver keeps no per-process samples (NOT_SUPPORTED) is
warned about once and not asked again; the elastic slices on it are then not metered."""

from __future__ import annotations

import asyncio
import logging
import shutil

import pytest

from libvgpu.agent.app import NodeAgent
from libvgpu.agent.nvml import NVML
from libvgpu.agent.pods import PodInfo
from quotas import Allocation, Owner

LOOKS = 3


@pytest.fixture
def unsupported(build, make_node, tmp_path, monkeypatch):
    """A started NVML over one card of the double that answers per-process utilisation with
    NOT_SUPPORTED, and an elastic allocation on that card."""
    node = make_node(CUDA_DOUBLE_NO_PROCESS_UTIL=1)
    for key, value in node.double_env.items():
        monkeypatch.setenv(key, value)
    library = tmp_path / "nvml" / "libnvidia-ml.so.1"  # a load of its own: the double reads its env once
    library.parent.mkdir()
    shutil.copy(build.lib_dir / "libnvidia-ml.so.1", library)
    nvml = NVML(str(library))
    nvml.init()
    (gpu,) = nvml.discover()
    allocation = Allocation(
        id="el",
        owner=Owner(user="erin", workspace="vision"),
        node="n1",
        gpu_uuids=(gpu.uuid,),
        memory_mib=1024,
        cores_percent=25,
        priority_class="default",
        memory_limit_mib=4096,
        cores_limit_percent=100,
    )
    yield nvml, gpu, allocation
    import pynvml

    pynvml.nvmlShutdown()  # the next test's NVML is its own
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()


def _said(caplog: pytest.LogCaptureFixture, uuid: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if uuid in r.getMessage()]


def test_on_one_machine_a_card_without_per_process_samples_is_asked_once_and_warned_once(unsupported, caplog):
    from hubext.local.burst import LocalBurst

    nvml, gpu, allocation = unsupported
    log = logging.getLogger("test.burst.local")
    caplog.set_level(logging.DEBUG, logger=log.name)
    burst = LocalBurst(nvml, [(gpu.uuid, gpu.memory_mib)], log)
    for _ in range(LOOKS):
        assert burst.look([allocation], {}, {}) == {"el": 0.0}
    said = _said(caplog, gpu.uuid)
    assert len(said) == 1 and said[0][0] == logging.WARNING and "keeps no per-process samples" in said[0][1], said


def test_the_node_agent_asks_a_card_without_per_process_samples_once_and_warns_once(unsupported, caplog):
    nvml, gpu, allocation = unsupported
    agent = NodeAgent()
    agent.initialize(["--node-name", "n1"])
    agent.log = logging.getLogger("test.burst.agent")
    caplog.set_level(logging.DEBUG, logger=agent.log.name)
    agent.nvml, agent.gpus = nvml, [gpu]
    agent._pods = {"u1": PodInfo("kernel-erin", "jhub", "u1", "Running", allocation)}
    agent._start_burst()
    for _ in range(LOOKS):
        asyncio.run(agent._sample_burst())
    said = _said(caplog, gpu.uuid)
    assert len(said) == 1 and said[0][0] == logging.WARNING and "keeps no per-process samples" in said[0][1], said
    assert agent.burst.totals.get("el", 0.0) == 0.0
