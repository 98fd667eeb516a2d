"""Kubernetes mode: a GPU kernel pod is swapped out through the node agent and resumes by itself
on its next cell, also after the hub restarted, waiting in the GPU queue (position shown) when its
card has no room.

Real JupyterHub + broker + KubeSpawner + the user's jupyter-server against the Kubernetes API
emulator (helpers.kube_stack); the kernel pod's cells use the CUDA double as a CUDA program
does (a swapped-out process's CUDA calls block until it is restored); the node agent (``python
-m libvgpu.agent``) runs beside it as the DaemonSet does, with the double as the node's driver and
the chart's host directory (the one the kernel pods' claim mounts). The hub asks the agent by
annotating the pod; the agent checkpoints the pod's host processes (found through their cgroup,
written by the test into the agent's ``proc_root`` as in tests/libvgpu/agent/test_agent.py:
these machines cannot create cgroups).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from culler.app import GPUCuller
from culler.model import GPUKernel
from libvgpu import contract as L
from tests.culler.stack import page_text
from tests.kernelprovider.helpers import (
    ADMISSION,
    CUDA_CELL,
    GPU_UUID,
    NAMESPACE,
    NODE,
    SIZES,
    Server,
    kube_stack,
    start_server,
)
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


@contextmanager
def kube_swap_stack(
    work: Path, devices: int = 1, gpus: list[dict] | None = None, inventory_interval_seconds: float = 60
) -> Iterator[tuple]:
    """kube_stack with the node agent beside it and the CUDA double (``devices`` cards of one model)
    as the node's driver: (stack, proc_root, agent log, host dir, agent)."""
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
        "CUDA_DOUBLE_DEVICES": str(devices),
        "CUDA_DOUBLE_NAME": "NVIDIA H100 80GB HBM3",
        "CUDA_DOUBLE_MEMORY_MIB": "16384",
        "CUDA_DOUBLE_CONTEXT_MIB": "0",
    }
    # the double's state is shared with the agent: the work directory is mounted, not copied on write
    # each container gets the device nodes of the cards its NVIDIA_VISIBLE_DEVICES names (the node's
    # cards as its agent publishes them, in index order), as the NVIDIA runtime makes them at its
    # start (tests/kubeemu/devices.py); the double sees only those
    options = {
        "pod_env": {**double, "CUDA_DOUBLE_HOST_PROC": HOST_PROC},
        "node_mounts": [str(work), f"/proc:{HOST_PROC}"],
        "gpu_uuids": [g["uuid"] for g in sorted(gpus or [{"uuid": GPU_UUID, "index": 0}], key=lambda g: g["index"])],
    }
    # bob's large kernel fills the card, so alice's resume must wait for it (a user's own kernels
    # are no reason to wait: admission refuses those at once)
    limits = {"user_limits": {"memory_mib": 81920}}
    admission = {**ADMISSION, "workspaces": {"default": {"namespaces": {"default": limits}}}}
    sizes = [
        *SIZES,
        {"name": "gpu-75g", "display_name": "GPU 75 GiB", "memory_mib": 76800, "cores_percent": 50},
        # an elastic slice (issue 27): 1 GiB guaranteed, it may grow to 15 GiB of the double's 16 GiB
        {"name": "gpu-grows", "display_name": "GPU 1 GiB, up to 15 GiB", "memory_mib": 1024,
         "memory_limit_mib": 15360, "cores_percent": 10},
    ]
    # KubernetesKernelLauncher.swap_kernels: on by default
    with kube_stack(work / "stack", emulator_options=options, admission=admission, sizes=sizes, gpus=gpus) as st:
        host = work / "stack" / "host-elastic-gpu"  # the chart's host directory (kube_stack's claim of it)
        (host / "regions").mkdir(exist_ok=True)
        (host / "regions").chmod(0o1777)  # as the agent's shim install leaves it
        proc_root = work / "proc"
        proc_root.mkdir()
        # the emulated node's cgroup filesystem: its runtime gives containers no device cgroup (their
        # device nodes alone say which cards they reach: tests/kubeemu/devices.py)
        cgroup_root = work / "cgroup"
        cgroup_root.mkdir()
        (work / "agent.yaml").write_text(
            f"NodeAgent:\n  proc_root: {proc_root}\n  cgroup_root: {cgroup_root}\n  pod_namespace: {NAMESPACE}\n"
            "  publish_inventory: false\n"
            "  install_shim: false\n  publish_activity: false\n  swap_interval_seconds: 30\n"
            f"  inventory_interval_seconds: {inventory_interval_seconds}\n"
            "  metrics_ip: 127.0.0.1\nBackstop:\n  action: report\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "KUBERNETES_"))}
        env.update(double, **st["emulator"].env(), PYTHONPATH=str(REPO))
        agent = NodeAgentProcess(
            [sys.executable, "-m", "libvgpu.agent", "--node-name", NODE, "--metrics-port", str(free_port()),
             "--config", str(work / "agent.yaml"), "--host-lib-dir", str(host)],
            env, work / "agent.log", st["hub"],
        )  # fmt: skip
        try:
            agent.start()
            yield st, proc_root, agent.log, host, agent
        finally:
            agent.stop()


#: the double's card as its NVML names it (the agent publishes the driver's uuids; the shim names
#: the card's node region by it, and the hub matches a reclaim's card with its slices' cards)
CARD = "GPU-d00b1e00-7369-6d2d-6770-750000000000"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    gpus = [{"uuid": CARD, "model": "H100-80GB", "memory_mib": 81920, "sm_count": 132, "index": 0}]
    with kube_swap_stack(tmp_path_factory.mktemp("kube-swap"), gpus=gpus) as found:
        yield found


class NodeAgentProcess:
    """The node agent as the DaemonSet runs it (``python -m libvgpu.agent``); started again with
    another environment as a node whose driver differs (a restarted agent probes it again)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, hub) -> None:
        self.argv, self.env, self.log, self.hub = argv, env, log, hub
        self.process: subprocess.Popen | None = None

    def start(self, **more_env: str) -> None:
        self.process = subprocess.Popen(
            self.argv, env={**self.env, **more_env}, cwd=REPO, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )
        agent = self.process
        self.hub.wait_for(lambda: agent.poll() is not None or "GPU(s)" in self.log.read_text(), 90, 0.1, "the agent")
        assert agent.poll() is None, self.log.read_text()

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def pod_cgroups(emu, proc_root: Path, pod: str) -> None:
    """The kubelet's cgroup of the pod's processes, as the agent reads it from its proc_root (and
    their root, through which the agent reaches the container's /dev)."""
    uid = emu.get("pods", pod, NAMESPACE)["metadata"]["uid"].replace("-", "_")
    for pid in descendants(emu.pod_pid(pod, NAMESPACE)):
        (proc_root / str(pid)).mkdir(exist_ok=True)
        (proc_root / str(pid) / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/"
            f"cri-containerd-{'ab' * 32}.scope\n"
        )
        root = proc_root / str(pid) / "root"  # the container's root, as the host's /proc shows it
        if not root.is_symlink():
            root.symlink_to(f"/proc/{pid}/root")


def close_sessions(kernel, *sessions: tuple) -> None:
    """Close the kernel connection and delete each (server, session) that was started."""
    kernel.close()
    for server, session in sessions:
        if session is not None:
            status, body = server.api("DELETE", f"/sessions/{session['id']}")
            assert status == 204, body


def slices(hub) -> list[str]:
    status, pool = hub.api("GET", "/gpu/pool")
    assert status == 200, pool
    return [s["allocation_id"] for n in pool["nodes"] for g in n["gpus"] for s in g["slices"]]


def test_a_swapped_out_kernel_pod_resumes_on_its_next_cell_after_a_hub_restart_waiting_in_the_queue(stack):
    st, proc_root, log, host, _ = stack
    hub, emu, alice = st["hub"], st["emulator"], st["alice"]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kernel = alice.connect(session["kernel"]["id"])
    bob, second = None, None
    try:
        out = kernel.execute(CUDA_CELL + "notes = {'answer': 42}")
        assert out["status"] == "ok" and "alloc 0" in out["text"], out
        status, body = hub.api("GET", "/gpu/kernels?user=alice")
        [record] = body["kernels"]
        pod = record["holder"]
        pod_cgroups(emu, proc_root, pod)

        # the agent looks for requests every 30 s here: its watch of the node's pods must carry it
        asked_at = time.monotonic()
        status, model = hub.api("POST", f"/gpu/kernels/{record['id']}/suspend?reason=idle", timeout=90)
        freed_after = time.monotonic() - asked_at
        assert status == 200 and model["gpu_swapped"] is True, (status, model, log.read_text())
        assert freed_after < 2.0, f"the slice was freed {freed_after:.1f} s after the suspend was asked"
        assert model["swap"]["host_mib"] >= 1024, (model["swap"], log.read_text())
        assert slices(hub) == []  # the slice is back in the pool; the pod runs on without it
        assert emu.get("pods", pod, NAMESPACE)["status"]["phase"] == "Running"
        marker = host / "regions" / L.SWAP_MARKER_DIR / record["id"]
        assert marker.exists()  # what the kernel looks for before each cell
        asked = json.loads(emu.get("pods", pod, NAMESPACE)["metadata"]["annotations"][L.A_SWAP])
        assert asked["host_memory_percent"] == 50  # the node agent's cap (GPUBroker.swap_host_memory_percent)

        # the hub restarts: the swapped-out kernel is still known as swapped out (from its pod)
        kernel.close()
        hub.restart()
        status, body = hub.api("GET", "/gpu/kernels?user=alice")
        [again] = body["kernels"]
        assert again["gpu_swapped"] is True and again["swap"]["host_mib"] == model["swap"]["host_mib"], again
        assert slices(hub) == []

        # alice's own second kernel takes 75 of the card's 80 GiB: her resume cannot wait for her own
        # kernels (refused at once), so the cell is not run, rather than hang on its locked GPU
        status, own = alice.start_session("elastic-gpu-gpu-75g")
        assert status == 201, own
        kernel = alice.connect(session["kernel"]["id"])
        out = kernel.execute(CUDA_CELL + "print(notes)", timeout=60)
        assert out["status"] == "error" and out["ename"] == "InputRejected", out
        assert "Stop one of your kernels" in out["text"] and "alloc" not in out["text"], out
        status, body = alice.api("DELETE", f"/sessions/{own['id']}")
        assert status == 204, body

        # bob's kernel takes 75 of the card's 80 GiB: the resume (10 GiB, on this card only) must wait
        bob = Server(hub, "bob", hub.user_token("bob"))
        start_server(hub, "bob", bob.token)
        status, second = bob.start_session("elastic-gpu-gpu-75g")
        assert status == 201, second
        asked_at = time.monotonic()
        msg_id = kernel.execute_async(CUDA_CELL + "print(notes)")
        assert kernel.wait_for_output(msg_id, "position 1 in the GPU queue", timeout=60), hub.log_tail()
        print(f"queue position printed {time.monotonic() - asked_at:.2f} s after the cell (kernel pod)")
        status, body = bob.api("DELETE", f"/sessions/{second['id']}")
        assert status == 204, body
        second = None

        out = kernel.collect(msg_id, timeout=90)
        assert out["status"] == "ok" and "GPU resumed after" in out["text"], (out, log.read_text())
        assert "alloc 0" in out["text"] and "{'answer': 42}" in out["text"], out  # its Python state survived
        status, model = hub.api("GET", f"/gpu/kernels/{record['id']}")
        assert model["gpu_swapped"] is False and model["allocation"]["gpu_uuids"] == record["allocation"]["gpu_uuids"]
        new_id = model["allocation"]["id"]
        assert new_id != record["allocation"]["id"] and slices(hub) == [new_id]
        labels = emu.get("pods", pod, NAMESPACE)["metadata"]["labels"]
        assert labels[L.ALLOCATION_ID] == L.label_value(new_id)  # the pod names the slice it holds now
        assert not marker.exists()
        out = kernel.execute("print(notes['answer'] + 1)")  # the next cell runs at once
        assert out["status"] == "ok" and out["text"].strip() == "43", out
    finally:
        close_sessions(kernel, (alice, session), (bob, second))


def test_a_kernel_pod_on_a_node_whose_driver_cannot_checkpoint_is_promised_no_swap(stack):
    # the node agent probes its driver's checkpoint API and publishes the answer on the Node; the
    # hub promises a swap (state kept) only on a node that says it can, and says why not elsewhere
    st, _, log, _, agent = stack
    hub, emu, alice = st["hub"], st["emulator"], st["alice"]
    culler = GPUCuller(swap_idle_kernels=True)  # what the culler warns and does at the timeout

    def published() -> dict:
        return json.loads(emu.get("nodes", NODE)["metadata"]["annotations"].get(L.NODE_CHECKPOINT_ANNOTATION, "{}"))

    status, session = alice.start_session(SPEC)
    assert status == 201, session
    try:
        status, body = hub.api("GET", "/gpu/kernels?user=alice")
        [record] = body["kernels"]
        assert published()["able"] is True, (published(), log.read_text())
        assert record["swap_capability"] == {"able": True}, record
        status, pool = hub.api("GET", "/gpu/pool")
        assert [n["swap_capability"] for n in pool["nodes"] if n["name"] == NODE] == [{"able": True}], pool
        assert culler.will_swap(GPUKernel.from_record(record))
        home = page_text(hub, "alice", "/hub/home")
        assert "it can be swapped out to host memory (its variables kept)" in home, home

        # the same node with a driver that answers CUDA_ERROR_NOT_SUPPORTED (the agent restarts, probes again)
        agent.stop()
        agent.start(CUDA_DOUBLE_CHECKPOINT="unsupported")
        hub.wait_for(lambda: published().get("able") is False, 30, 0.2, "the node to say it cannot checkpoint")
        assert "CUDA_ERROR_NOT_SUPPORTED" in published()["why_not"], published()

        def cannot() -> dict | None:
            status, model = hub.api("GET", f"/gpu/kernels/{record['id']}")
            return model if model["swap_capability"]["able"] is False else None

        model = hub.wait_for(cannot, 30, 0.2, "the hub to read the node's answer")
        why = model["swap_capability"]["why_not"]
        assert f"on node {NODE}" in why and "CUDA_ERROR_NOT_SUPPORTED" in why, model
        status, pool = hub.api("GET", "/gpu/pool")  # the admin's view of each node
        [node] = [n for n in pool["nodes"] if n["name"] == NODE]
        assert node["swap_capability"] == {"able": False, "why_not": why}, node
        assert not culler.will_swap(GPUKernel.from_record(model))  # the warning says it will be shut down
        home = page_text(hub, "alice", "/hub/home")
        assert "it is shut down and its variables are lost (it cannot be swapped out: on node" in home, home
        assert "variables kept" not in home, home
        status, refused = hub.api("POST", f"/gpu/kernels/{record['id']}/suspend?reason=idle", timeout=90)
        assert status == 409 and "CUDA_ERROR_NOT_SUPPORTED" in json.dumps(refused), (status, refused)
        assert emu.get("pods", record["holder"], NAMESPACE)["metadata"]["annotations"].get(L.A_SWAP) is None
    finally:
        agent.stop()
        agent.start()  # the node as the other tests of this module expect it
        status, body = alice.api("DELETE", f"/sessions/{session['id']}")
        assert status == 204, body


GROWS = "elastic-gpu-gpu-grows"


def alloc_cell(gib: int) -> str:
    return CUDA_CELL.replace("ctypes.c_size_t(1 << 30)", f"ctypes.c_size_t({gib} << 30)")


@contextmanager
def shim_on_node(host: Path) -> Iterator[None]:
    """The shim installed in the node's host directory as the node agent installs it (lib/,
    ld.so.preload, the card's node region): GPU pods started meanwhile run under it (this module's
    other tests run their kernels without it)."""
    from libvgpu.agent.install import install_shim

    install_shim(host, gpus=[CARD])
    try:
        yield
    finally:
        (host / "ld.so.preload").write_text("")


def burst_then_owner_asks(stack) -> tuple:
    """alice's elastic kernel pod bursts to 8 GiB of the 16 GiB card (1 GiB guaranteed) while the
    card is hers alone; then bob's kernel pod asks for 9 GiB of its 10 GiB guarantee, of which the
    burst holds 1 GiB (8 GiB of state: under the swap's cap of half this machine's memory).
    Returns (alice's kernel, her session, her record, bob's server, his session, his cell's output)."""
    st, proc_root, log, host, _ = stack
    hub, emu, alice = st["hub"], st["emulator"], st["alice"]
    status, session = alice.start_session(GROWS)
    assert status == 201, session
    kernel = alice.connect(session["kernel"]["id"])
    out = kernel.execute(alloc_cell(8) + "notes = {'answer': 42}")
    assert out["status"] == "ok" and "alloc 0" in out["text"], out  # past 1 GiB: the card is free
    status, body = hub.api("GET", "/gpu/kernels?user=alice")
    [record] = [k for k in body["kernels"] if k["kernel_id"] == session["kernel"]["id"]]
    pod_cgroups(emu, proc_root, record["holder"])  # the agent finds the pod's processes through them
    bob = Server(hub, "bob", hub.user_token("bob"))
    start_server(hub, "bob", bob.token)
    status, owner = bob.start_session(SPEC)
    assert status == 201, owner  # admission counts requests: 1 + 10 GiB fit the card
    status, body = hub.api("GET", "/gpu/kernels?user=bob")
    [bob_pod] = [k["holder"] for k in body["kernels"] if k["kernel_id"] == owner["kernel"]["id"]]
    pod_cgroups(emu, proc_root, bob_pod)  # the agent relays the pod's wait from its own region
    bob_kernel = bob.connect(owner["kernel"]["id"])
    out = bob_kernel.execute(alloc_cell(9), timeout=90)
    bob_kernel.close()
    return kernel, session, record, bob, owner, out


def swapped_model(hub, kernel_record_id: str) -> dict | None:
    """The hub's model of a kernel once it reads as swapped out, else None."""
    status, model = hub.api("GET", f"/gpu/kernels/{kernel_record_id}")
    return model if status == 200 and model.get("gpu_swapped") else None


def test_an_elastic_kernel_pod_bursting_into_a_guarantee_is_swapped_out_and_resumes_when_room_returns(stack):
    st, _, log, host, _ = stack
    hub, alice = st["hub"], st["alice"]
    with shim_on_node(host):
        kernel, session, record, bob, owner, out = burst_then_owner_asks(stack)
    try:
        # the owner's allocation waited for the burst and got it: never the owner's memory taken
        assert out["status"] == "ok" and "alloc 0" in out["text"], (out, hub.log_tail(40), log.read_text())
        # the owner's allocation goes on as soon as the burst's memory is freed, a moment before
        # the hub has recorded the swap-out that freed it
        model = hub.wait_for(lambda: swapped_model(hub, record["id"]), 30, 0.2, "alice's kernel swapped out")
        assert model["state"] == "running", model
        reason = model["swap"]["reason"]
        assert reason.startswith("it held 7 GiB of GPU memory above its 1 GiB guarantee on "), model
        assert "bob's kernel on that GPU needs memory within its own guarantee" in reason, model
        assert model["swap"]["host_mib"] >= 8192, model  # its GPU state, kept in the node's host memory
        # no slice until it resumes (the kernel reads as swapped out a moment before its release is done)
        hub.wait_for(lambda: record["allocation"]["id"] not in slices(hub), 30, 0.2, "alice's slice released")

        # room returns (bob's kernel ends, its pod gone): alice's next cell resumes her kernel, its
        # state kept
        status, body = hub.api("GET", "/gpu/kernels?user=bob")
        [bob_pod] = [k["holder"] for k in body["kernels"] if k["kernel_id"] == owner["kernel"]["id"]]
        status, body = bob.api("DELETE", f"/sessions/{owner['id']}")
        assert status == 204, body
        owner = None
        hub.wait_for(lambda: st["emulator"].get("pods", bob_pod, NAMESPACE) is None, 60, 0.2, "bob's pod to go")
        out = kernel.execute(alloc_cell(1) + "print(notes)", timeout=90)
        assert out["status"] == "ok" and "alloc 0" in out["text"], (out, log.read_text())
        assert "{'answer': 42}" in out["text"], out  # its Python state survived
        status, model = hub.api("GET", f"/gpu/kernels/{record['id']}")
        assert model["gpu_swapped"] is False and model["allocation"]["id"] in slices(hub), model
        assert "resume of pod " in log.read_text()  # its GPU state restored by the node agent
    finally:
        close_sessions(kernel, (alice, session), (bob, owner))


def test_an_elastic_kernel_pod_bursting_where_the_node_cannot_checkpoint_is_stopped_with_a_sentence(stack):
    st, _, log, _, agent = stack
    hub, emu, alice = st["hub"], st["emulator"], st["alice"]

    def cannot() -> bool:
        published = emu.get("nodes", NODE)["metadata"]["annotations"].get(L.NODE_CHECKPOINT_ANNOTATION, "{}")
        return json.loads(published).get("able") is False

    agent.stop()
    agent.start(CUDA_DOUBLE_CHECKPOINT="unsupported")  # a driver that cannot checkpoint
    kernel = session = bob = owner = None
    try:
        hub.wait_for(cannot, 30, 0.2, "the node to say it cannot checkpoint")
        with shim_on_node(stack[3]):
            kernel, session, record, bob, owner, out = burst_then_owner_asks(stack)
        assert out["status"] == "ok" and "alloc 0" in out["text"], (out, hub.log_tail(40), log.read_text())
        status, model = hub.api("GET", f"/gpu/kernels/{record['id']}")
        assert not model["gpu_swapped"], model
        # stopped with the sentence (failed, as a preempted kernel); jupyter-server's restarter then
        # starts it afresh within seconds, and the record keeps the stop for the user's page
        hub.wait_for(
            lambda: hub.api("GET", f"/gpu/kernels/{record['id']}")[1]["state"] in ("pending", "running"),
            60, 0.2, "jupyter-server's restarter to start the stopped kernel afresh",
        )
        model = hub.api("GET", f"/gpu/kernels/{record['id']}")[1]
        reason = (model.get("last_stop") or {}).get("reason", "")
        assert reason.startswith("stopped: it held 7 GiB of GPU memory above its 1 GiB guarantee on "), model
        assert "This GPU kernel cannot be swapped out: " in reason, reason
        assert "so its state was lost" in reason, reason
        assert re.search(rf"GPU kernel {record['id']} of alice stopped: it held 7 GiB", hub.log_tail(400))
    finally:
        agent.stop()
        agent.start()  # the node as the other tests of this module expect it
        if kernel is not None:
            kernel.close()
            alice.api("DELETE", f"/sessions/{session['id']}")  # its kernel is gone (jupyter-server answers 500)
            close_sessions(kernel, (bob, owner))
