"""The culler's Prometheus series as a dashboard reads them: a swap-out is not a cull, and freed
memory is in bytes (Prometheus's base unit). A real hub with the broker on the CUDA/NVML doubles
(one 16 GiB card, where kernels can be checkpointed), a user's real jupyter-server and GPU kernel,
and the real culler process swapping the idle kernel out."""

from __future__ import annotations

import re
import secrets

import pytest

from culler import service_role
from tests.culler.stack import CullerProcess, KernelTab
from tests.kernelprovider.helpers import CUDA_CELL, doubles_stack

SIZES = [{"name": "gpu-4g", "display_name": "GPU 4 GiB", "memory_mib": 4096, "cores_percent": 25}]
ADMISSION = {
    "priority_classes": {"default": {"value": 100}},
    "default_priority_class": "default",
    "workspaces": {"default": {"namespaces": {"default": {}}}},
}
TOKEN = secrets.token_hex(16)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = f"""
c.JupyterHub.services.append({{"name": "metrics-culler", "api_token": {TOKEN!r}}})
c.JupyterHub.load_roles.append({service_role("metrics-culler", ["custom:elastic-gpu:admin"])!r})
"""
    work = tmp_path_factory.mktemp("culler-metrics")
    with doubles_stack(work, devices=1, memory_mib=16384, admission=ADMISSION, sizes=SIZES,
                       extra_config=config) as (hub, servers):  # fmt: skip
        yield hub, servers, work


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of one series in Prometheus text format: (labels, value)."""
    return [
        (dict(re.findall(r'(\w+)="([^"]*)"', m[1] or "")), float(m[2]))
        for m in re.finditer(rf"^{name}(\{{.*\}})? (\S+)$", text, flags=re.M)
    ]


def test_a_swapped_out_kernel_counts_as_a_swap_out_not_a_cull_and_frees_bytes(stack):
    hub, servers, work = stack
    status, session = servers["alice"].start_session("elastic-gpu-gpu-4g")
    assert status == 201, session
    kernel_id = session["kernel"]["id"]
    tab = KernelTab(hub, "alice", kernel_id)
    try:
        assert "alloc 0" in tab.execute(CUDA_CELL)
    finally:
        tab.close()
    culler = CullerProcess(
        hub, work, TOKEN, name="metrics-culler", swap_idle_kernels=True, idle_timeout_seconds=2, warning_seconds=0
    ).start()
    try:
        culler.wait_log(rf"Swapped out GPU kernel {kernel_id} of alice .*", timeout=60)
        text = culler.metrics()
        # a dashboard's "kernels culled" (sum of culls_total) must not count it: the kernel lives on
        culled = [s for s in samples(text, "elastic_gpu_culler_culls_total") if s[1]]
        assert not culled, f"a swap-out was counted as a cull: {culled}"
        swaps = samples(text, "elastic_gpu_culler_swap_outs_total")
        assert swaps == [({"reason": "idle-timeout", "priority_class": "default"}, 1.0)], swaps
        freed = samples(text, "elastic_gpu_culler_freed_memory_bytes_total")
        labels = {"reason": "idle-timeout", "priority_class": "default", "action": "swapped"}
        assert freed == [(labels, 4096 * 2**20)], freed
    finally:
        culler.stop()
        servers["alice"].api("DELETE", f"/sessions/{session['id']}")
