"""CUDA_VISIBLE_DEVICES as the CUDA driver reads it, on the CUDA double: the single-machine pool
hands each process its card(s) this way (hubext/local/pool.py), so a double that ignored it let a
kernel granted the second card allocate on the first one (CI: the backstop then killed it as a
process "on a card it holds no slice of"). NVML ignores the variable, as the real library does.

The driver's rules: a comma-separated list of ordinals or ``GPU-`` uuids (or unique prefixes of them), in the
order given; the list ends at the first entry that names no device; an empty value hides every
device (``cuInit`` answers CUDA_ERROR_NO_DEVICE)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .harness import Node

GPU0 = "GPU-d00b1e00-7369-6d2d-6770-750000000000"
GPU1 = "GPU-d00b1e00-7369-6d2d-6770-750000000001"
CUDA_ERROR_NO_DEVICE = 100

#: the cards the process sees (uuids, CUDA order) and, after 1 GiB on its ordinal 0, the memory
#: NVML shows in use per physical card
PROBE = r"""
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
out = {"init": cu.cuInit(0), "uuids": []}
if out["init"] == 0:
    n = ctypes.c_int(0)
    cu.cuDeviceGetCount(ctypes.byref(n))
    for i in range(n.value):
        u = ctypes.create_string_buffer(16)
        cu.cuDeviceGetUuid(u, i)
        h = u.raw.hex()
        out["uuids"].append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxSetCurrent(ctx)
    out["alloc"] = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 30))
nvml = ctypes.CDLL("libnvidia-ml.so.1")
nvml.nvmlInit_v2()
count = ctypes.c_uint(0)
nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
out["nvml_used_mib"] = {}
for i in range(count.value):
    h, uuid = ctypes.c_void_p(), ctypes.create_string_buffer(96)
    nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h))
    nvml.nvmlDeviceGetUUID(h, uuid, 96)
    mem = (ctypes.c_ulonglong * 3)()
    nvml.nvmlDeviceGetMemoryInfo(h, mem)
    out["nvml_used_mib"][uuid.value.decode()] = mem[2] >> 20
print(json.dumps(out))
"""


def probe(node: Node, visible: str | None) -> dict:
    env = node.env()
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("visible", [GPU1, "1", " 1 "])
def test_a_process_given_the_second_card_uses_the_second_card(make_node, visible):
    node = make_node(CUDA_DOUBLE_DEVICES=2)
    out = probe(node, visible)
    assert (out["init"], out["uuids"], out["alloc"]) == (0, [GPU1], 0), out
    # the memory is on the card it was given, as NVML (which ignores the variable) shows it
    assert out["nvml_used_mib"] == {GPU0: 0, GPU1: 1024}, out


def test_the_cards_come_in_the_order_given_and_the_list_ends_at_an_unknown_entry(make_node):
    node = make_node(CUDA_DOUBLE_DEVICES=2)
    assert probe(node, f"{GPU1},{GPU0}")["uuids"] == [GPU1, GPU0]
    assert probe(node, "1,7,0")["uuids"] == [GPU1]
    assert probe(node, None)["uuids"] == [GPU0, GPU1]


def test_an_empty_list_hides_every_card(make_node):
    out = probe(make_node(CUDA_DOUBLE_DEVICES=2), "")
    assert out["init"] == CUDA_ERROR_NO_DEVICE and out["uuids"] == [], out
