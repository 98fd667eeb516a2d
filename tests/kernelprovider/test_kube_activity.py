"""Kubernetes mode: a GPU kernel's GPU activity reaches the culler through the broker.

The node agent publishes each GPU pod's activity as the ``elastic-gpu.jupyter.org/gpu-activity``
annotation (see tests/libvgpu/agent/test_agent_activity.py); here the test writes that annotation on a
kernel pod the way the agent does (same value, a merge patch of that key) and reads the broker's
kernel records (``GET /hub/api/gpu/kernels`` and ``.../<id>``) with the culler's own parser.
Real JupyterHub + broker + KubeSpawner against the Kubernetes API emulator (helpers.kube_stack).
"""

from __future__ import annotations

import time

import pytest

from culler.model import GPUKernel
from libvgpu import contract as L
from libvgpu.agent.activity import PodActivity
from tests.kernelprovider.helpers import NAMESPACE, kube_stack

SPEC = "elastic-gpu-gpu-10g"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with kube_stack(tmp_path_factory.mktemp("gpu-kernels-activity")) as st:
        yield st["hub"], st["api"], st["alice"]


def annotate(api, pod: str, value: str | None) -> None:
    api.patch_namespaced_pod(pod, NAMESPACE, {"metadata": {"annotations": {L.A_GPU_ACTIVITY: value}}})


def test_kernel_pod_activity_annotation_shows_in_the_broker_record_and_the_culler_reads_it(cluster):
    hub, api, alice = cluster
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    try:
        status, body = hub.api("GET", "/gpu/kernels?user=alice")
        assert status == 200, body
        [record] = body["kernels"]
        pod, kid = record["holder"], record["id"]
        # no annotation yet: no activity in the record, unknown to the culler
        status, record = hub.api("GET", f"/gpu/kernels/{kid}")
        assert status == 200, record
        assert "activity" not in record and "last_launch" not in record
        assert GPUKernel.from_record(record).activity_known is False

        launched = time.time() - 42.5
        annotate(api, pod, PodActivity(last_launch=launched, memory_used_mib=2048).annotation(time.time()))
        status, record = hub.api("GET", f"/gpu/kernels/{kid}")
        assert status == 200, record
        assert record["activity"] == {"last_launch": round(launched, 3), "memory_used_mib": 2048}
        kernel = GPUKernel.from_record(record)
        assert kernel.activity_known is True
        assert kernel.gpu_last_launch == pytest.approx(launched, abs=0.001)
        assert kernel.gpu_memory_used_mib == 2048
        # the list the culler polls carries it too
        status, body = hub.api("GET", "/gpu/kernels?user=alice")
        assert status == 200 and body["kernels"][0]["activity"]["memory_used_mib"] == 2048

        # a kernel that never launched (null) is known and idle
        annotate(api, pod, PodActivity(last_launch=None, memory_used_mib=0).annotation(time.time()))
        status, record = hub.api("GET", f"/gpu/kernels/{kid}")
        kernel = GPUKernel.from_record(record)
        assert (kernel.activity_known, kernel.gpu_last_launch, kernel.gpu_memory_used_mib) == (True, None, 0)

        # something that is not what the agent writes reads as unknown, not as idle
        annotate(api, pod, '{"last_launch": "yesterday"}')
        status, record = hub.api("GET", f"/gpu/kernels/{kid}")
        assert status == 200 and "activity" not in record
        assert GPUKernel.from_record(record).activity_known is False
    finally:
        status, body = alice.api("DELETE", f"/sessions/{session['id']}")
        assert status == 204, body
