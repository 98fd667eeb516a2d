"""Kubernetes mode: a GPU kernel pod is swapped out and back in through the node agent.

Real JupyterHub + broker + KubeSpawner + the user's jupyter-server against the Kubernetes API
emulator (helpers.kube_stack); the kernel pod's cells use the CUDA double as a CUDA program
does; the node agent (``python -m libvgpu.agent``) runs beside it as the DaemonSet does, with the
double as the node's driver. The hub asks the agent by annotating the pod; the agent
checkpoints the pod's host processes (found through their cgroup, written by the test into the
agent's ``proc_root`` as in tests/libvgpu/agent/test_agent.py: these machines cannot create
cgroups).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hubext import contract as L
from tests.kernelprovider.helpers import CUDA_CELL, NAMESPACE, NODE, kube_stack
from tests.libvgpu.harness import CFLAGS, cc

REPO = Path(__file__).resolve().parents[2]
DOUBLE = REPO / "tests" / "libvgpu" / "double"
HOST_PROC = "/run/host-proc"  # where pods see the host's /proc (the double knows host pids)
SPEC = "elastic-gpu-gpu-10g"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            todo += [int(c) for c in task.read_text().split()]
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("kube-swap")
    lib = work / "lib"
    lib.mkdir()
    for src, soname in (("cuda_double.c", "libcuda.so.1"), ("nvml_double.c", "libnvidia-ml.so.1")):
        cc(*CFLAGS, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-Bsymbolic-functions",
           f"-Wl,-soname,{soname}", "-o", lib / soname, DOUBLE / src)  # fmt: skip
    state = work / "gpu.state"  # the card, shared by the agent (root) and the kernel (jovyan)
    state.touch()
    state.chmod(0o666)
    # the kernel's user (jovyan) reaches the double through pytest's 0700 dirs: every one of them,
    # up to the system's temp dir (under xdist the tree is one level deeper: pytest-N/popen-gwK)
    top = Path(tempfile.gettempdir()).resolve()
    for d in (work, *work.parents):
        if d in (top, Path("/")):
            break
        d.chmod(d.stat().st_mode | 0o011)
    double = {
        "LD_LIBRARY_PATH": str(lib),
        "CUDA_DOUBLE_STATE": str(state),
        "CUDA_DOUBLE_DEVICES": "1",
        "CUDA_DOUBLE_NAME": "NVIDIA H100 80GB HBM3",
        "CUDA_DOUBLE_MEMORY_MIB": "16384",
        "CUDA_DOUBLE_CONTEXT_MIB": "0",
    }
    # the double's state is shared with the agent: the work directory is mounted, not copied on write
    options = {
        "pod_env": {**double, "CUDA_DOUBLE_HOST_PROC": HOST_PROC},
        "node_mounts": [str(work), f"/proc:{HOST_PROC}"],
    }
    config = "c.KubernetesKernelLauncher.swap_kernels = True\n"
    with kube_stack(work / "stack", emulator_options=options, extra_config=config) as st:
        proc_root = work / "proc"
        proc_root.mkdir()
        (work / "agent.yaml").write_text(
            f"NodeAgent:\n  proc_root: {proc_root}\n  pod_namespace: {NAMESPACE}\n  publish_inventory: false\n"
            "  install_shim: false\n  publish_activity: false\n  swap_interval_seconds: 0.2\n"
            "  metrics_ip: 127.0.0.1\nBackstop:\n  action: report\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "KUBERNETES_"))}
        env.update(double, **st["emulator"].env(), PYTHONPATH=str(REPO))
        log = work / "agent.log"
        agent = subprocess.Popen(
            [sys.executable, "-m", "libvgpu.agent", "--node-name", NODE, "--metrics-port", str(free_port()),
             "--config", str(work / "agent.yaml"), "--host-lib-dir", str(work / "host")],
            env=env, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            st["hub"].wait_for(lambda: agent.poll() is not None or "GPU(s)" in log.read_text(), 30, 0.1, "the agent")
            assert agent.poll() is None, log.read_text()
            yield st, proc_root, log
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


def test_a_kernel_pod_is_swapped_out_by_the_node_agent_its_slice_freed_and_resumed_with_its_state(stack):
    st, proc_root, log = stack
    hub, emu, alice = st["hub"], st["emulator"], st["alice"]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kernel = alice.connect(session["kernel"]["id"])
    try:
        out = kernel.execute(CUDA_CELL + "notes = {'answer': 42}")
        assert out["status"] == "ok" and "alloc 0" in out["text"], out
        status, body = hub.api("GET", "/gpu/kernels?user=alice")
        [record] = body["kernels"]
        pod = record["holder"]
        uid = emu.get("pods", pod, NAMESPACE)["metadata"]["uid"].replace("-", "_")
        for pid in descendants(emu.pod_pid(pod, NAMESPACE)):  # the kubelet's cgroup of the pod's processes
            (proc_root / str(pid)).mkdir()
            (proc_root / str(pid) / "cgroup").write_text(
                f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/"
                f"cri-containerd-{'ab' * 32}.scope\n"
            )

        status, model = hub.api("POST", f"/gpu/kernels/{record['id']}/suspend?reason=idle", timeout=90)
        assert status == 200 and model["gpu_swapped"] is True, (status, model, log.read_text())
        assert model["swap"]["host_mib"] >= 1024, (model["swap"], log.read_text())
        # the slice is back in the pool; the pod runs on without it
        status, pool = hub.api("GET", "/gpu/pool")
        assert [s for n in pool["nodes"] for g in n["gpus"] for s in g["slices"]] == [], pool
        assert emu.get("pods", pod, NAMESPACE)["status"]["phase"] == "Running"
        assert L.swapped_out(emu.get("pods", pod, NAMESPACE)["metadata"]["annotations"])
        # its Python state is untouched (a cell without the GPU runs while it is swapped out)
        out = kernel.execute("print(notes['answer'])")
        assert out["status"] == "ok" and out["text"].strip() == "42", out

        status, model = hub.api("POST", f"/gpu/kernels/{record['id']}/resume?wait=30", timeout=90)
        assert status == 200 and model["gpu_swapped"] is False, (status, model, log.read_text())
        new_id = model["allocation"]["id"]
        assert new_id != record["allocation"]["id"]
        status, pool = hub.api("GET", "/gpu/pool")
        assert [s["allocation_id"] for n in pool["nodes"] for g in n["gpus"] for s in g["slices"]] == [new_id], pool
        labels = emu.get("pods", pod, NAMESPACE)["metadata"]["labels"]
        assert labels[L.ALLOCATION_ID] == L.label_value(new_id)  # the pod names the slice it holds now
        out = kernel.execute(CUDA_CELL + "print(notes)")
        assert out["status"] == "ok" and "alloc 0" in out["text"] and "{'answer': 42}" in out["text"], out
    finally:
        kernel.close()
        status, body = alice.api("DELETE", f"/sessions/{session['id']}")
        assert status == 204, body
