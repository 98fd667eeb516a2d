"""A card out of service: the node agent publishes a card's fatal Xid on its Node
(libvgpu/health.py); the hub's Kubernetes pool then places no new slice on that card, its pool
view says which card and why, and the card takes slices again once an admin clears it.
Through the Kubernetes API emulator (the one shared by the process's tests)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest

from hubext.admin import hub_pool_view
from hubext.cli.render import render_pool
from libvgpu import contract as C
from libvgpu import health
from quotas import GPURequest, Owner, PoolFull
from tests.hubext.test_device_plugin_coexistence import _gpu_node, _hub
from tests.kubeemu.fixtures import kube_emulator, kube_namespace  # noqa: F401


def _request(user: str) -> GPURequest:
    return GPURequest(owner=Owner(user), memory_mib=24576, cores_percent=30)  # one per card


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_a_card_with_a_fatal_xid_takes_no_new_slice_says_why_and_returns_when_cleared(
    kube_emulator,  # noqa: F811
    kube_namespace,  # noqa: F811
    caplog,
):
    emu, ns, tag = kube_emulator, kube_namespace, uuid.uuid4().hex[:6]
    node = f"gpu-xid-{tag}"
    _gpu_node(emu, node, tag, device_plugin_gpus=0)  # two 40 GiB cards
    broken, good = f"GPU-{node}-0", f"GPU-{node}-1"
    out = health.dump({broken: health.OutOfService(79, time.time() - 60, 0)})  # as the agent writes it
    emu.patch("nodes", node, {"metadata": {"annotations": {C.NODE_GPU_HEALTH_ANNOTATION: out}}}, None)
    hub = _hub(ns, tag)
    try:
        with caplog.at_level(logging.ERROR):
            first = await hub.allocate(_request("u1"), queue=False)
            assert first.gpu_uuids == (good,)
            with pytest.raises(PoolFull) as refused:  # the other card fell off the bus: no slice goes there
                await hub.allocate(_request("u2"), queue=False)
        # the refusal says why the other card is no help, and how an admin clears it
        assert "No GPU has 24 GiB of memory and 30% of compute free right now" in refused.value.message
        assert (f"{broken} on node {node} is out of service after Xid 79 (the GPU has fallen off the bus); an admin "
                f"clears it, once the card is reset, with `kubectl annotate node {node} "
                f"{C.NODE_GPU_HEALTH_ANNOTATION}-`.") in refused.value.message
        assert f"GPU {broken} of node {node} is out of service since" in caplog.text
        assert "Xid 79 (the GPU has fallen off the bus)" in caplog.text
        view = await hub_pool_view(hub)
        cards = {g["uuid"]: g for n in view["nodes"] for g in n["gpus"]}
        assert "Xid 79 (the GPU has fallen off the bus)" in cards[broken]["out_of_service"], cards[broken]
        assert cards[good].get("out_of_service") is None
        # `elastic-gpu pool` prints the card with its sentence
        text = render_pool(view, "hub")
        card_lines = text.split(f"GPU 0  A100-40GB  {broken}", 1)[1].split("\n")[1:3]
        assert any("out of service since" in ln and "Xid 79" in ln for ln in card_lines), text
        assert text.count("out of service since") == 1, text
        # the admin resets the card and clears it: the hub sees the Node change and slices it again
        emu.patch("nodes", node, {"metadata": {"annotations": {C.NODE_GPU_HEALTH_ANNOTATION: None}}}, None)
        await _until(lambda: not hub.backend.out_of_service(), 20, "the hub to see the card cleared")
        second = await hub.allocate(_request("u2"), queue=False)
        assert second.gpu_uuids == (broken,)
    finally:
        await hub.backend.stop()
        emu.remove_node(node)
