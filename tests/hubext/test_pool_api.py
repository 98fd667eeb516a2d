"""/hub/api/gpu/pool as an admin reads it from a real hub: each node with its GPUs and with the
CPU and host memory admission counts (the pool codec is quotas' own, so nothing is dropped)."""

from __future__ import annotations

import os
import textwrap

from tests.hubrunner import HubRunner


def test_the_pool_api_returns_each_nodes_cpu_and_host_memory(tmp_path):
    config = textwrap.dedent(
        f"""
        from hubext.hubconfig import configure_hub
        configure_hub(c, mode="local", simulate_gpus="1xH100-80GB", data_dir={str(tmp_path / "data")!r},
                      culler=False, metering=False)
        """
    )
    with HubRunner(tmp_path, config) as hub:
        status, pool = hub.api("GET", "/gpu/pool")
    assert status == 200, pool
    [node] = pool["nodes"]
    cpus = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    assert node["cpu_millicores"] == cpus * 1000, node.keys()
    assert node["host_memory_mib"] == memory, node.keys()
    assert [g["model"] for g in node["gpus"]] == ["H100-80GB"]
