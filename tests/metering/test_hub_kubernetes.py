"""Kubernetes mode (through the API emulator): a GPU kernel pod's slice is recorded from grant
to release in the hub's database, and the record outlives the pod."""

from __future__ import annotations

from hubext.metering.store import UsageStore
from tests.kernelprovider.helpers import kube_stack

SPEC = "elastic-gpu-gpu-10g"


def test_a_kernel_pods_slice_is_recorded_and_outlives_the_pod(tmp_path):
    with kube_stack(tmp_path) as st:
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
        status, body = alice.api("DELETE", f"/sessions/{session['id']}")
        assert status == 204, body

        def closed() -> list:
            return [r for r in store.records() if r.id == record.id and r.release_cause == "stopped"]

        hub.wait_for(closed, timeout=60, what="the record closed with cause 'stopped'")

        def pod_gone() -> bool:
            pods = st["api"].list_namespaced_pod("jhub").items
            return not [p for p in pods if record.id in str(p.metadata.annotations or {})]

        hub.wait_for(pod_gone, timeout=60, what="the kernel pod to be deleted")
        assert [r.id for r in store.records() if r.release_cause == "stopped"] == [record.id]  # its record stays
