"""An elastic GPU kernel's burst is taken back when a kernel on its card needs memory within its
own guarantee (issue 27), single-machine mode: a real hub with the broker, users' real
jupyter-servers, GPU kernels through the real provisioner, the shim preloaded, and the CUDA/NVML
doubles as the driver (one 4 GiB card). alice's kernel is guaranteed 1 GiB and may grow to 4 GiB;
bob's is guaranteed 2 GiB. alice bursts to 3 GiB while the card is hers alone; then bob asks for
2 GiB within his guarantee: the broker swaps alice's kernel out (its state kept) or, where it
cannot be swapped out, stops it with a sentence that says why; bob's allocation succeeds. A
notebook server cannot be swapped out: carol's server (its profile guarantees 1 GiB, up to
4 GiB) that bursts into memory bob needs is stopped by the hub, with the sentence on her
/hub/home and in the hub's log."""

from __future__ import annotations

import html
import re
import secrets

import pytest

from tests.culler.stack import KernelTab, http
from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import doubles_stack, machine_mib

pytestmark = pytest.mark.timeout(400)

SIZES = [
    {"name": "gpu-grows", "display_name": "GPU 1 GiB, up to 4 GiB", "memory_mib": 1024, "memory_limit_mib": 4096,
     "cores_percent": 25},
    {"name": "gpu-2g", "display_name": "GPU 2 GiB", "memory_mib": 2048, "cores_percent": 25},
]
ADMISSION = {
    "priority_classes": {"default": {"value": 100, "preempt": False, "borrow": False}},
    "default_priority_class": "default",
    "placement": {"node": "binpack", "gpu": "binpack"},
    "workspaces": {"default": {"namespaces": {"default": {}}}},
}
GROWS, FIXED = "elastic-gpu-gpu-grows", "elastic-gpu-gpu-2g"
PROFILES = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {"display_name": "GPU 1 GiB, up to 4 GiB", "slug": "gpu-grows",
     "gpu": {"memory_mib": 1024, "memory_limit_mib": 4096, "cores_percent": 25}},
]


def cell(gib: int) -> str:
    return f"""
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
print("alloc", cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t({gib} << 30)))
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = f"""
c.HubUserGPUSpawner.profile_list = {PROFILES!r}
c.GPUBroker.reclaim_interval_seconds = 0.2
# JupyterHub notices a server the pool stopped at its next poll (30 s by default, docs/admission.md)
c.Spawner.poll_interval = 2
c.GPUBroker.swap_host_memory_percent = {6144 * 100 / machine_mib()!r}
c.JupyterHub.services.append({{"name": "reclaim-test", "api_token": {secrets.token_hex(16)!r}}})
"""
    work = tmp_path_factory.mktemp("reclaim")
    with doubles_stack(work, devices=1, memory_mib=4096, admission=ADMISSION, sizes=SIZES,
                       extra_config=config, gpu_servers=True) as stack:
        yield stack


def kernel_model(hub: HubRunner, kernel_id: str) -> dict:
    status, body = hub.api("GET", "/gpu/kernels")
    assert status == 200, body
    return next(k for k in body["kernels"] if k["kernel_id"] == kernel_id)


def burst_then_owner_asks(hub: HubRunner, servers: dict, extra: str = "") -> tuple:
    """alice's kernel bursts to 3 GiB (1 GiB guaranteed); bob's asks for 2 GiB of his 2 GiB guarantee."""
    status, burster = servers["alice"].start_session(GROWS)
    assert status == 201, burster
    alice = servers["alice"].connect(burster["kernel"]["id"])
    out = alice.execute(cell(3) + extra + "notes = {'answer': 42}")
    assert out["status"] == "ok" and "alloc 0" in out["text"], out  # the burst: past 1 GiB, the card is free
    status, owner = servers["bob"].start_session(FIXED)
    assert status == 201, owner  # admission counts requests: 1 + 2 GiB fit the 4 GiB card
    bob = servers["bob"].connect(owner["kernel"]["id"])
    out = bob.execute(cell(2), timeout=60)
    return alice, bob, burster, owner, out


def test_a_burster_is_swapped_out_with_its_state_kept_and_the_owner_gets_its_guarantee(stack):
    hub, servers = stack
    alice, bob, burster, owner, out = burst_then_owner_asks(hub, servers)
    assert out["status"] == "ok" and "alloc 0" in out["text"], (out, hub.log_tail(40))
    model = kernel_model(hub, burster["kernel"]["id"])
    assert model["state"] == "running" and model["gpu_swapped"], model
    assert model["swap"]["reason"].startswith("it held 2 GiB of GPU memory above its 1 GiB guarantee on "), model
    assert "bob's kernel on that GPU needs memory within its own guarantee" in model["swap"]["reason"]
    assert model["swap"]["host_mib"] == 3072, model  # its GPU state, kept in host memory
    assert not [s for n in hub.api("GET", "/gpu/pool")[1]["nodes"] for g in n["gpus"] for s in g["slices"]
                if s["user"] == "alice"]  # it holds no slice until its next cell resumes it
    bob.close()
    alice.close()
    servers["bob"].api("DELETE", f"/sessions/{owner['id']}")
    servers["alice"].api("DELETE", f"/sessions/{burster['id']}")


def test_a_burster_that_cannot_be_swapped_out_is_stopped_with_a_sentence_saying_why(stack):
    hub, servers = stack
    # memory exported through CUDA IPC: the driver (before 610) cannot checkpoint the process
    ipc = "handle = ctypes.create_string_buffer(64)\nprint('ipc', cuda.cuIpcGetMemHandle(handle, ptr))\n"
    alice, bob, burster, owner, out = burst_then_owner_asks(hub, servers, ipc)
    assert out["status"] == "ok" and "alloc 0" in out["text"], (out, hub.log_tail(40))
    model = kernel_model(hub, burster["kernel"]["id"])
    assert model["state"] == "failed" and not model["gpu_swapped"], model
    assert model["reason"].startswith(
        "stopped: it held 2 GiB of GPU memory above its 1 GiB guarantee on "
    ), model
    assert "This GPU kernel cannot be swapped out: " in model["reason"] and "so its state was lost" in model["reason"]
    alice.close()
    bob.close()
    servers["alice"].api("DELETE", f"/sessions/{burster['id']}")
    servers["bob"].api("DELETE", f"/sessions/{owner['id']}")


def test_a_notebook_server_bursting_into_an_owners_guarantee_is_stopped_with_a_sentence_on_its_home_page(stack):
    hub, servers = stack
    status, body = hub.api("POST", "/users/carol", body={})
    assert status in (201, 409), body
    status, body = hub.api("POST", "/users/carol/server", body={"profile": "gpu-grows"})
    assert status in (201, 202), body
    hub.wait_for(lambda: (hub.api("GET", "/users/carol")[1].get("servers") or {}).get("", {}).get("ready"),
                 timeout=90, what="carol's GPU server to be ready")
    status, model = http("POST", f"{hub.url}/user/carol/api/kernels", hub.admin_token, {"name": "python3"})
    assert status == 201, model
    carol = KernelTab(hub, "carol", model["id"])  # a plain kernel of her server: it holds the server's slice
    out = carol.execute(cell(3), timeout=60)
    assert "alloc 0" in out, out  # the burst: past her 1 GiB guarantee, while the card is free
    status, owner = servers["bob"].start_session(FIXED)
    assert status == 201, owner
    bob = servers["bob"].connect(owner["kernel"]["id"])
    out = bob.execute(cell(2), timeout=60)
    assert out["status"] == "ok" and "alloc 0" in out["text"], (out, hub.log_tail(40))  # bob got his guarantee
    hub.wait_for(lambda: not (hub.api("GET", "/users/carol")[1].get("servers") or {}).get(""),
                 timeout=60, what="carol's server to be stopped")
    said = ("stopped: it held 2 GiB of GPU memory above its 1 GiB guarantee on ")
    assert said in hub.log_text() and "A notebook server cannot be swapped out" in hub.log_text(), hub.log_tail(40)
    page = hub.login("carol").open(f"{hub.url}/hub/home").read().decode()
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    assert said in " ".join(text.split()), text[-3000:]
    assert "bob's kernel on that GPU needs memory within its own guarantee" in " ".join(text.split())
    carol.close()
    bob.close()
    servers["bob"].api("DELETE", f"/sessions/{owner['id']}")
