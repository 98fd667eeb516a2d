"""Kubernetes mode: a swapped-out kernel pod whose own card is taken comes back on another card of
its node, of the same model, its state kept (the driver restores it there: cuda-checkpoint's
device map, driver 580+, same chip type), instead of waiting for its own card.

The stack of test_kube_swap (real hub, broker, KubeSpawner, jupyter-server, the node agent) on a
node with two cards of one model; the CUDA double as the node's driver (its restore takes a device
map onto a card of the same name, and refuses another model: tests/libvgpu/test_checkpoint.py).
As on a real node, a container reaches only the cards its NVIDIA_VISIBLE_DEVICES named at its start
(the emulator's device nodes, tests/kubeemu/devices.py): the node agent gives the kernel's
container its new card before the restore and takes the old one back (libvgpu/agent/cards.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from libvgpu import contract as L
from tests.kernelprovider.helpers import CUDA_CELL, NAMESPACE, NODE, Server, start_server
from tests.kernelprovider.test_kube_swap import SPEC, close_sessions, kube_swap_stack, pod_cgroups, slices

#: the double's cards as NVML names them (nvml_double.c), as the node agent publishes them
CARDS = [f"GPU-d00b1e00-7369-6d2d-6770-7500000000{i:02x}" for i in range(2)]
GPUS = [
    {"uuid": uuid, "model": "H100-80GB", "memory_mib": 81920, "sm_count": 132, "index": i}
    for i, uuid in enumerate(CARDS)
]
AGAIN = CUDA_CELL.replace("alloc", "again") + "print('answer', notes['answer'] + 1)"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # the agent republishes its Node's checkpoint answer each inventory interval: not within these tests
    work = tmp_path_factory.mktemp("kube-remap")
    with kube_swap_stack(work, devices=2, gpus=GPUS, inventory_interval_seconds=3600) as found:
        yield found


def pod_cards(emu, pod: str) -> list[str]:
    """The cards' device nodes in the pod's container (its /dev, as the host's /proc shows it)."""
    return sorted(n for n in os.listdir(f"/proc/{emu.pod_pid(pod, NAMESPACE)}/root/dev") if n[6:].isdigit()
                  and n.startswith("nvidia"))  # fmt: skip


@contextmanager
def swapped_out_behind_carol(stack) -> Iterator[tuple]:
    """Alice's kernel ran a CUDA cell on card 0 (``notes`` set) and was swapped out; bob's 75 GiB
    kernel went to card 1 (card 0's room is kept for alice's resume: quotas/reserve.py), then
    carol's took card 0 (nothing else fit). Yields (kernel client, alice's record, stop: a function
    stopping bob's or carol's kernel by name, carol's kernel record). Every session is closed at the
    end, also when the test failed."""
    st, proc_root, log, _, _ = stack
    hub, emu, alice = st["hub"], st["emulator"], st["alice"]
    others = {name: Server(hub, name, hub.user_token(name)) for name in ("bob", "carol")}
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kernel = alice.connect(session["kernel"]["id"])
    started: dict[str, dict] = {}

    def stop(name: str) -> None:
        status, body = others[name].api("DELETE", f"/sessions/{started.pop(name)['id']}")
        assert status == 204, body

    try:
        out = kernel.execute(CUDA_CELL + "notes = {'answer': 42}")
        assert out["status"] == "ok" and "alloc 0" in out["text"], out
        status, body = hub.api("GET", "/gpu/kernels?user=alice")
        [record] = body["kernels"]
        # the kernel's CUDA device 0 is the double's first card: the slice the hub granted on it
        assert record["allocation"]["gpu_uuids"] == [CARDS[0]], record
        assert pod_cards(emu, record["holder"]) == ["nvidia0"]  # its container reaches that card only
        pod_cgroups(emu, proc_root, record["holder"])
        status, model = hub.api("POST", f"/gpu/kernels/{record['id']}/suspend?reason=idle", timeout=90)
        assert status == 200 and model["gpu_swapped"] is True, (status, model, log.read_text())

        # bob's 75 GiB kernel goes to the empty card 1, not into alice's room on card 0 (binpack alone
        # would take card 0, the first of two empty cards); carol's then takes card 0: nothing else fits
        held = {}
        for name, card in (("bob", CARDS[1]), ("carol", CARDS[0])):
            start_server(hub, name, others[name].token)
            status, started[name] = others[name].start_session("elastic-gpu-gpu-75g")
            assert status == 201, started[name]
            status, body = hub.api("GET", f"/gpu/kernels?user={name}")
            assert [k["allocation"]["gpu_uuids"] for k in body["kernels"]] == [[card]], (name, body)
            held[name] = body["kernels"][0]
        yield kernel, record, stop, held["carol"]
    finally:
        close_sessions(kernel, (alice, session), *((others[n], s) for n, s in started.items()))


def test_a_swapped_out_kernel_pod_whose_card_is_taken_resumes_on_another_card_of_its_node(stack):
    st, _, log, _, _ = stack
    hub, emu = st["hub"], st["emulator"]
    with swapped_out_behind_carol(stack) as (kernel, record, stop, carols):
        stop("bob")  # card 1 is free again; alice's own card is carol's
        # alice's next cell: her kernel comes back at once on the other card, its variables kept
        asked_at = time.monotonic()
        out = kernel.collect(kernel.execute_async(AGAIN), timeout=60)
        assert out["status"] == "ok", (out, hub.log_tail(30), log.read_text())
        assert "position" not in out["text"], out  # it never waited in the GPU queue (so says nothing of it)
        assert "answer 43" in out["text"] and "again 0" in out["text"], out
        print(f"resumed on the other card {time.monotonic() - asked_at:.2f} s after the cell")
        status, model = hub.api("GET", f"/gpu/kernels/{record['id']}")
        assert model["gpu_swapped"] is False and model["allocation"]["gpu_uuids"] == [CARDS[1]], model
        assert sorted(slices(hub)) == sorted([model["allocation"]["id"], carols["allocation"]["id"]])
        annotations = emu.get("pods", record["holder"], NAMESPACE)["metadata"]["annotations"]
        assert annotations[L.A_GPU_UUIDS] == CARDS[1]  # the pod names the card it holds now
        assert f"(moved from {CARDS[0]})" in hub.log_tail(200)
        # the agent gave its container the new card and took back the old one, now carol's
        assert pod_cards(emu, record["holder"]) == ["nvidia1"]


def test_a_restore_the_driver_refuses_leaves_the_kernel_swapped_out_with_its_variables(stack):
    # a node whose agent says its driver restores onto another card, but whose driver refuses (here a
    # driver before 580): the kernel stays swapped out, its variables kept, and comes back to its own card
    st, _, log, _, agent = stack
    hub, emu = st["hub"], st["emulator"]

    def published() -> dict:
        return json.loads(emu.get("nodes", NODE)["metadata"]["annotations"].get(L.NODE_CHECKPOINT_ANNOTATION, "{}"))

    agent.stop()
    agent.start(CUDA_DOUBLE_DRIVER_VERSION="12080")
    try:
        hub.wait_for(lambda: published().get("remap") is False, 30, 0.2, "the node to say it cannot restore elsewhere")
        assert "needs driver 580" in published()["remap_why_not"], published()
        # the Node claims what its driver cannot do (the agent republishes only each inventory interval);
        # the hub follows the Node through its watch, long before the resume below asks
        emu.patch("nodes", NODE, {"metadata": {"annotations": {
            L.NODE_CHECKPOINT_ANNOTATION: json.dumps({**published(), "remap": True})}}})  # fmt: skip
        with swapped_out_behind_carol(stack) as (kernel, record, stop, carols):
            stop("bob")  # card 1 is free again; alice's own card is carol's
            pod = record["holder"]
            before = emu.get("pods", pod, NAMESPACE)["metadata"]
            out = kernel.execute(AGAIN, timeout=90)
            assert out["status"] == "error" and out["ename"] == "InputRejected", (out, hub.log_tail(30),
                                                                                  log.read_text())  # fmt: skip
            assert f"the driver refused to restore it on {CARDS[1]}" in out["text"], out
            assert "Its variables are kept" in out["text"] and "for its own card" in out["text"], out
            after = emu.get("pods", pod, NAMESPACE)["metadata"]
            assert L.swapped_out(after["annotations"]), after["annotations"]  # it holds no slice
            for key in (L.A_SWAP, L.A_SWAP_STATUS, L.A_GPU_UUIDS, L.ALLOCATION_ID):  # as before the resume
                assert after["annotations"].get(key) == before["annotations"].get(key), key
            assert sorted(slices(hub)) == [carols["allocation"]["id"]]  # carol's only
            assert pod_cards(emu, pod) == ["nvidia0"]  # the card granted for the restore was taken back
            status, model = hub.api("GET", f"/gpu/kernels/{record['id']}")
            assert model["gpu_swapped"] is True and model["state"] == "running", model

            # carol's kernel stops: alice's next cell comes back on her own card, her variables kept
            stop("carol")
            out = kernel.execute(AGAIN, timeout=90)
            assert out["status"] == "ok" and "answer 43" in out["text"] and "again 0" in out["text"], out
            status, model = hub.api("GET", f"/gpu/kernels/{record['id']}")
            assert model["gpu_swapped"] is False and model["allocation"]["gpu_uuids"] == [CARDS[0]], model
    finally:
        agent.stop()
        agent.start()  # the node as it was
