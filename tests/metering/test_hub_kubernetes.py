"""Kubernetes mode (through the API emulator): a GPU kernel pod's slice is recorded from grant
to release in the hub's database with the activity the node agent annotates on the pod, the
record outlives the pod, a kernel pod preempted by a high-priority one is recorded so, and one
the culler reclaims is recorded as culled."""

from __future__ import annotations

import time

from hubext.metering.store import UsageStore
from libvgpu import contract as C
from libvgpu.agent.activity import PodActivity
from tests.kernelprovider.helpers import NAMESPACE, kube_stack
from tests.metering.test_hub import BIG, BIG_HIGH, METERING_ADMISSION, METERING_SIZES

SPEC = "elastic-gpu-gpu-10g"
#: the meter samples every 30 s by default; the test waits for one sample after the pod's annotation
EXTRA = """
c.UsageMeter.sample_interval_seconds = 0.5
"""


def test_a_kernel_pods_slice_is_recorded_and_outlives_the_pod(tmp_path):
    with kube_stack(tmp_path, admission=METERING_ADMISSION, sizes=METERING_SIZES, extra_config=EXTRA) as st:
        hub, alice = st["hub"], st["alice"]
        status, session = alice.start_session(SPEC)
        assert status == 201, session
        store = UsageStore(f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}")

        def held() -> list:
            return [r for r in store.records() if r.kind == "kernel" and r.released_at is None]

        (record,) = hub.wait_for(held, timeout=60, what="the kernel pod's record")
        assert (record.user, record.gpu_model, record.node, record.memory_mib) == (
            "alice",
            "H100-80GB",
            "gpu-node-1",
            10240,
        )
        # the node agent publishes the pod's GPU activity; the meter samples it (EXTRA: every 0.5 s)
        status, body = hub.api("GET", "/gpu/kernels?user=alice")
        assert status == 200, body
        pod = body["kernels"][0]["holder"]
        value = PodActivity(last_launch=time.time(), memory_used_mib=2048).annotation(time.time())
        st["api"].patch_namespaced_pod(pod, NAMESPACE, {"metadata": {"annotations": {C.A_GPU_ACTIVITY: value}}})

        def sampled() -> list:
            return [r for r in store.records() if r.id == record.id and r.activity_samples >= 1]

        (busy,) = hub.wait_for(sampled, timeout=75, what="an activity sample of the kernel pod")
        assert busy.memory_used_peak_mib == 2048 and busy.busy_seconds > 0

        status, body = alice.api("DELETE", f"/sessions/{session['id']}")
        assert status == 204, body

        def closed() -> list:
            return [r for r in store.records() if r.id == record.id and r.release_cause == "stopped"]

        hub.wait_for(closed, timeout=60, what="the record closed with cause 'stopped'")

        def pod_gone() -> bool:
            pods = st["api"].list_namespaced_pod(NAMESPACE).items
            return not [p for p in pods if record.id in str(p.metadata.annotations or {})]

        hub.wait_for(pod_gone, timeout=60, what="the kernel pod to be deleted")
        assert [r.id for r in store.records() if r.release_cause == "stopped"] == [record.id]  # its record stays

        # a high-priority kernel pod takes the card from a default one: preempted, then stopped
        status, low = alice.start_session(BIG)
        assert status == 201, low
        status, high = alice.start_session(BIG_HIGH)
        assert status == 201, high
        (preempted,) = hub.wait_for(
            lambda: [r for r in store.records() if r.memory_mib == 71680 and r.release_cause == "preempted"],
            timeout=60,
            what="the default kernel pod's record closed 'preempted'",
        )
        assert preempted.priority_class == "default" and preempted.node == "gpu-node-1"
        # the culler's way: it tells the broker, then shuts the kernel down through its server
        # the high-priority kernel once it runs (on a loaded machine the preempted one may still
        # be listed running a moment, and the high one still starting: a CI run culled the wrong one)
        def high_running() -> list[dict]:
            status, body = hub.api("GET", "/gpu/kernels?user=alice")
            return [k for k in body.get("kernels", []) if k["state"] == "running" and k.get("priority_class") == "high"]

        (running,) = hub.wait_for(high_running, timeout=60, what="the high-priority kernel running")
        status, body = hub.api("POST", f"/gpu/kernels/{running['id']}/cull", body={"reason": "idle for 600 s"})
        assert status == 204, body
        for session in (low, high):
            assert alice.api("DELETE", f"/sessions/{session['id']}")[0] in (204, 404)
        (culled,) = hub.wait_for(
            lambda: [r for r in store.records() if r.priority_class == "high" and r.released_at is not None],
            timeout=60,
            what="the high-priority kernel pod's record closed",
        )
        assert (culled.release_cause, culled.release_why) == ("culled", "culled: idle for 600 s")
