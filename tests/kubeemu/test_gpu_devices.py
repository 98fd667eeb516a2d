"""A GPU node's cards as a container sees them: only those its NVIDIA_VISIBLE_DEVICES named at its
start (the NVIDIA runtime's device nodes, tests/kubeemu/devices.py), whatever its processes do
afterwards; the CUDA double enumerates the cards by their device nodes, as a driver does. The
doubles are the node's driver (two H100s), the pods run as a Jupyter image's user (uid 1000)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.kubeemu import KubeEmulator, NodeSpec
from tests.kubeemu.images import Image
from tests.kubeemu.test_gpu_pod_mounts import pod_users_node_root
from tests.libvgpu.agent.test_agent import GPU0, GPU1, HOST_PROC, NODE, NS

#: what a hostile kernel tries: widen its own environment, make the other card's device node,
#: then use every card the driver shows it, and one past them
PROBE = r"""
import ctypes, json, os
out = {}
os.environ["NVIDIA_VISIBLE_DEVICES"] = "all"
os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
for minor in (0, 1):
    try:
        os.mknod(f"/dev/nvidia{minor}", 0o20666, os.makedev(195, minor))
        out[f"mknod{minor}"] = "made"
    except OSError as e:
        out[f"mknod{minor}"] = e.strerror
cu = ctypes.CDLL("libcuda.so.1")
out["init"] = cu.cuInit(0)
n = ctypes.c_int(0)
cu.cuDeviceGetCount(ctypes.byref(n))
out["uuids"] = []
for i in range(n.value):
    u = ctypes.create_string_buffer(16)
    cu.cuDeviceGetUuid(u, i)
    out["uuids"].append(u.raw.hex())
ctx = ctypes.c_void_p()
out["ctx_past_them"] = cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, n.value)
# the usual devices, as its user uses them; runc makes them in the container's /dev (no mounts)
with open("/dev/null", "w") as f, open("/dev/zero", "rb") as z, open("/dev/urandom", "rb") as u:
    out["dev"] = [f.write("x"), len(z.read(4)), len(u.read(4))]
out["dev_mounts"] = [line.split()[4] for line in open("/proc/self/mountinfo")
                     if line.split()[4] in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/tty")]
print(json.dumps(out))
"""


def hex_of(uuid: str) -> str:
    return uuid.removeprefix("GPU-").replace("-", "")


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory):
    root, _, gpu_env = pod_users_node_root(tmp_path_factory, "gpu-devices", DEVICES="2")
    (root / "probe.py").write_text(PROBE)
    (root / "probe.py").chmod(0o644)
    emulator = KubeEmulator(
        nodes=[NodeSpec(NODE, labels={"nvidia.com/gpu.present": "true"})], namespaces=[NS],
        pod_env={**gpu_env, "CUDA_DOUBLE_HOST_PROC": HOST_PROC},
        node_mounts=[str(root), f"/proc:{HOST_PROC}"], gpu_uuids=[GPU0, GPU1],
        images={"jupyter/gpu*": Image()})  # fmt: skip
    emulator.start()
    try:
        yield emulator, root
    finally:
        emulator.stop()


def run_probe(emu, root: Path, name: str, visible: str | None) -> dict:
    env = [] if visible is None else [{"name": "NVIDIA_VISIBLE_DEVICES", "value": visible}]
    emu.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "securityContext": {"runAsUser": 1000, "runAsGroup": 100},
        "containers": [{"name": "kernel", "image": "jupyter/gpu", "env": env,
                        "command": [sys.executable, str(root / "probe.py")]}]}}, "pods", NS)  # fmt: skip
    done = emu.wait_for_pod_phase(name, ("Succeeded", "Failed"), NS, timeout=60)
    log = emu.pod_log(name, NS)
    assert done["status"]["phase"] == "Succeeded", log
    return json.loads(log.strip().splitlines()[-1])


def test_a_pod_uses_only_the_card_its_container_was_given(emu):
    out = run_probe(*emu, "given-card-1", GPU1)
    assert out["init"] == 0, out
    # the driver shows it its own card only (CUDA device 0 is card 1), not the node's other card
    assert out["uuids"] == [hex_of(GPU1)], out
    assert out["ctx_past_them"] != 0, out  # CUDA_ERROR_INVALID_VALUE: there is no device 1
    # its own environment and /dev give it nothing more
    assert out["mknod0"] != "made" and out["mknod1"] != "made", out
    # /dev's usual devices work for its user, and are nodes of the container's /dev as runc makes
    # them, not mounts of the node's (one call each at the start, nothing to unmount at the end)
    assert out["dev"] == [1, 4, 4] and out["dev_mounts"] == [], out


def test_a_pod_never_given_a_card_cannot_use_one(emu):
    out = run_probe(*emu, "given-none", None)
    assert out["init"] == 100 and out["uuids"] == [], out  # CUDA_ERROR_NO_DEVICE
    assert out["mknod0"] != "made", out
