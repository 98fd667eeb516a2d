"""Kubernetes mode: a swapped-out kernel pod whose own card is taken comes back on another card of
its node, of the same model, its state kept (the driver restores it there: cuda-checkpoint's
device map, driver 580+, same chip type), instead of waiting for its own card.

The stack of test_kube_swap (real hub, broker, KubeSpawner, jupyter-server, the node agent) on a
node with two cards of one model; the CUDA double as the node's driver (its restore takes a device
map onto a card of the same name, and refuses another model: tests/libvgpu/test_checkpoint.py).
"""

from __future__ import annotations

import time

import pytest

from libvgpu import contract as L
from tests.kernelprovider.helpers import CUDA_CELL, NAMESPACE, Server, start_server
from tests.kernelprovider.test_kube_swap import SPEC, close_sessions, kube_swap_stack, pod_cgroups, slices

#: the double's cards as NVML names them (nvml_double.c), as the node agent publishes them
CARDS = [f"GPU-d00b1e00-7369-6d2d-6770-7500000000{i:02x}" for i in range(2)]
GPUS = [
    {"uuid": uuid, "model": "H100-80GB", "memory_mib": 81920, "sm_count": 132, "index": i}
    for i, uuid in enumerate(CARDS)
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with kube_swap_stack(tmp_path_factory.mktemp("kube-remap"), devices=2, gpus=GPUS) as found:
        yield found


def test_a_swapped_out_kernel_pod_whose_card_is_taken_resumes_on_another_card_of_its_node(stack):
    st, proc_root, log, _, _ = stack
    hub, emu, alice = st["hub"], st["emulator"], st["alice"]
    bob = Server(hub, "bob", hub.user_token("bob"))
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kernel = alice.connect(session["kernel"]["id"])
    second = None
    try:
        out = kernel.execute(CUDA_CELL + "notes = {'answer': 42}")
        assert out["status"] == "ok" and "alloc 0" in out["text"], out
        status, body = hub.api("GET", "/gpu/kernels?user=alice")
        [record] = body["kernels"]
        # the kernel's CUDA device 0 is the double's first card: the slice the hub granted on it
        assert record["allocation"]["gpu_uuids"] == [CARDS[0]], record
        pod = record["holder"]
        pod_cgroups(emu, proc_root, pod)
        status, model = hub.api("POST", f"/gpu/kernels/{record['id']}/suspend?reason=idle", timeout=90)
        assert status == 200 and model["gpu_swapped"] is True, (status, model, log.read_text())

        # bob's kernel takes 75 of the 80 GiB of alice's card (binpack: the first of two empty cards)
        start_server(hub, "bob", bob.token)
        status, second = bob.start_session("elastic-gpu-gpu-75g")
        assert status == 201, second
        status, body = hub.api("GET", "/gpu/kernels?user=bob")
        assert [k["allocation"]["gpu_uuids"] for k in body["kernels"]] == [[CARDS[0]]], body

        # alice's next cell: her kernel comes back at once on the other card, its variables kept
        asked_at = time.monotonic()
        msg_id = kernel.execute_async(
            CUDA_CELL.replace("alloc", "again") + "print('answer', notes['answer'] + 1)"
        )
        out = kernel.collect(msg_id, timeout=60)
        assert out["status"] == "ok", (out, hub.log_tail(30), log.read_text())
        assert "position" not in out["text"], out  # it never waited in the GPU queue (so says nothing of it)
        assert "answer 43" in out["text"] and "again 0" in out["text"], out
        print(f"resumed on the other card {time.monotonic() - asked_at:.2f} s after the cell")
        status, model = hub.api("GET", f"/gpu/kernels/{record['id']}")
        assert model["gpu_swapped"] is False and model["allocation"]["gpu_uuids"] == [CARDS[1]], model
        assert sorted(slices(hub)) == sorted([model["allocation"]["id"], body["kernels"][0]["allocation"]["id"]])
        annotations = emu.get("pods", pod, NAMESPACE)["metadata"]["annotations"]
        assert annotations[L.A_GPU_UUIDS] == CARDS[1]  # the pod names the card it holds now
        assert f"(moved from {CARDS[0]})" in hub.log_tail(200)
    finally:
        close_sessions(kernel, (alice, session), (bob, second))
