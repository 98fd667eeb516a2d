"""What a 'native' GPU pod can reach of its slice's files, run as real containers of the emulator
as the user of a Jupyter image (uid 1000, as z2jh's pods run): the pod's container region must be
one it can write (the shim's counters) but never unlink, rename or replace (a region of its own
would be a fresh limit), the node regions (every pod's entry on a card) only ones it reads (the
node agent's relay writes them), and a pod that lands on the node before the node agent
installed the shim must wait for it rather than run without it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from libvgpu.agent.install import install_shim
from libvgpu.agent.relay import Relay
from libvgpu.regions import read_node_region
from tests.kubeemu import KubeEmulator, NodeSpec
from tests.kubeemu.helpers import create_host_claim
from tests.kubeemu.images import Image
from tests.libvgpu.agent.test_agent import (
    GPU0,
    HOST_PROC,
    NODE,
    NS,
    Node,
    add_default_priority_class,
    allocation,
    gpu_node_root,
    gpu_pod,
    wait_for,
)
from tests.libvgpu.harness import Build, running

JOVYAN_UID = 1000


def pod_users_node_root(
    tmp_path_factory: pytest.TempPathFactory, name: str, **double: str
) -> tuple[Path, Build, dict[str, str]]:
    """``gpu_node_root`` whose doubles the pods' user (uid 1000) can reach and use."""
    root, build, gpu_env = gpu_node_root(tmp_path_factory, name, **double)
    state = root / "gpu.state"  # the card, shared by every pod's processes
    state.touch()
    state.chmod(0o666)
    top = Path(tempfile.gettempdir()).resolve()
    for d in (root, *root.parents):  # pytest's 0700 directories, up to the system's temp dir
        if d in (top, Path("/")):
            break
        d.chmod(d.stat().st_mode | 0o011)
    return root, build, gpu_env


def start_node(tmp_path_factory: pytest.TempPathFactory, name: str, installed: bool) -> Node:
    """A GPU node whose doubles the pods' user (uid 1000) can use; the node agent's shim
    installed on the host or (``installed=False``) not yet."""
    root, build, gpu_env = pod_users_node_root(tmp_path_factory, name)
    host_dir = root / "host"
    host_dir.mkdir()
    if installed:
        install_shim(host_dir, gpus=[GPU0])  # what the node agent does at start, for its cards
    emu = KubeEmulator(
        nodes=[NodeSpec(NODE, labels={"nvidia.com/gpu.present": "true"})], namespaces=[NS],
        pod_env={**gpu_env, "CUDA_DOUBLE_HOST_PROC": HOST_PROC},
        node_mounts=[str(root), f"/proc:{HOST_PROC}"],
        images={"jupyter/gpu*": Image()}, restart_backoff_seconds=1.0)
    emu.start()
    add_default_priority_class(emu)
    create_host_claim(emu, NS, host_dir)
    return Node(root, build, emu, host_dir, root / "proc", root / "xid", gpu_env)


@pytest.fixture
def installed_node(tmp_path_factory):
    node = start_node(tmp_path_factory, "gpu-mounts", installed=True)
    try:
        yield node
    finally:
        node.emu.stop()


@pytest.fixture
def bare_node(tmp_path_factory):
    node = start_node(tmp_path_factory, "gpu-mounts-bare", installed=False)
    try:
        yield node
    finally:
        node.emu.stop()


def user_pod(node: Node, name: str, script: str, memory_mib: int = 1024, user: str = "alice") -> dict:
    """A GPU pod of the spawner's own apply_gpu_to_pod whose container runs ``script`` as uid 1000
    (``$P``: the probe)."""
    alloc = allocation(f"alloc-{name}", user, memory_mib)
    pod = gpu_pod(node, name, alloc, ["/bin/sh", "-c", script], {"P": str(node.build.probe)})
    pod["spec"]["securityContext"] = {"runAsUser": JOVYAN_UID, "runAsGroup": JOVYAN_UID, "runAsNonRoot": True}
    return pod


@contextlib.contextmanager
def relaying(node: Node) -> Iterator[None]:
    """The node agent's relay (libvgpu.agent.relay, as the agent runs it) of the node's GPU pods'
    entries into the card's node region, in a thread; pods reach it through ``cgroup_of``."""
    relay = Relay(node.host_dir / "regions", node.proc_root)

    async def main(stop: threading.Event) -> None:
        task = asyncio.ensure_future(relay.run(lambda: [GPU0], 0.05, logging.getLogger("relay"), 0.2))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with running(lambda stop: asyncio.run(main(stop))):
        yield


def cgroup_of(node: Node, name: str) -> int:
    """The pod's process, shown to the relay with a kubelet's cgroup (these machines cannot
    make one) and its root."""
    pid = wait_for(lambda: node.emu.pod_pid(name, NS), 30, f"the process of {name}")
    node.write_cgroup(pid, node.emu.get("pods", name, NS)["metadata"]["uid"], "sh")
    return pid


def run_to_end(node: Node, pod: dict, timeout: float = 90) -> str:
    name = pod["metadata"]["name"]
    node.emu.create(pod, "pods", NS)
    done = node.emu.wait_for_pod_phase(name, ("Succeeded", "Failed"), NS, timeout=timeout)
    out = node.emu.pod_log(name, NS)
    assert done["status"]["phase"] == "Succeeded", out
    return out


TAMPER = r"""
R=/var/run/libvgpu/container.region
"$P" init ctx alloc:700M waitfile:/tmp/done > /tmp/first.out 2>&1 &
until grep -q "alloc rc=" /tmp/first.out; do sleep 0.05; done
echo "first: $(grep 'alloc rc=' /tmp/first.out)"
for attack in "mv $R $R.old" "rm -f $R" "ln -sf /dev/null $R" "cp $R /tmp/r && mv -f /tmp/r $R"; do
    if sh -c "$attack" 2>/dev/null; then echo "tamper done: $attack"; else echo "tamper refused: $attack"; fi
    echo "after $attack: $("$P" init ctx alloc:700M 2>&1 | grep 'alloc rc=')"
done
touch /tmp/done
wait
"""


def test_a_gpu_pods_user_cannot_unlink_rename_or_replace_its_region_for_a_fresh_limit(installed_node):
    """Issue 24's escape in a Kubernetes pod: with 700 MiB of a 1,024 MiB slice held, the user
    moves the container region aside (or removes or replaces it) so that the next process makes
    a region of its own with a fresh limit."""
    out = run_to_end(installed_node, user_pod(installed_node, "tamper", TAMPER))
    assert "first: alloc rc=0" in out, out
    assert "tamper done" not in out, out  # the region's directory is not the user's to write
    attempts = [line for line in out.splitlines() if line.startswith("after ")]
    assert len(attempts) == 4, out
    # the slice's one limit: 700 + 700 MiB do not fit in 1,024 MiB (CUDA_ERROR_OUT_OF_MEMORY)
    assert all(line.endswith("alloc rc=2") for line in attempts), out


def test_a_pod_that_lands_before_the_agent_installed_the_shim_waits_for_it(bare_node):
    """The node agent has not written libvgpu.so nor ld.so.preload yet when a GPU pod starts on
    the node: the pod must not run its code without the shim (a subPath of a missing file is a
    directory the kubelet makes, and ld.so ignores a directory), but get it once it is there."""
    pod = user_pod(bare_node, "early", '"$P" init ctx alloc:2000M')
    bare_node.emu.create(pod, "pods", NS)

    def started() -> bool:
        status = (bare_node.emu.get("pods", "early", NS) or {}).get("status") or {}
        inits = status.get("initContainerStatuses") or []
        return status.get("phase") in ("Running", "Succeeded", "Failed") or any(
            "running" in (s.get("state") or {}) for s in inits)

    wait_for(started, 60, "a container of the pod to start")
    install_shim(bare_node.host_dir, gpus=[GPU0])  # the agent comes up on the node
    done = bare_node.emu.wait_for_pod_phase("early", ("Succeeded", "Failed"), NS, timeout=90)
    out = bare_node.emu.pod_log("early", NS)
    assert done["status"]["phase"] == "Succeeded", out
    # 2,000 MiB on a 1,024 MiB slice: refused by the shim (CUDA_ERROR_OUT_OF_MEMORY)
    assert "alloc rc=2" in out, out


def start_bob(node: Node) -> tuple[Path, Callable[[], list | None], int]:
    """Bob's pod holding 300 MiB of the card until the returned file exists; a function giving
    his entries in the card's node region (None: no region) and his pod's process."""
    release = node.root / "bob.done"
    bob = user_pod(node, "bob", f'"$P" init ctx alloc:300M waitfile:{release}', user="bob")
    node.emu.create(bob, "pods", NS)
    region = node.host_dir / "regions" / f"{GPU0}.region"

    def bobs_entry() -> list | None:
        try:
            gpu = read_node_region(region)
        except (OSError, ValueError):
            return None
        return [c for c in gpu.containers if c.memory_used_bytes >= 300 << 20 and c.name == "alloc-bob"]

    node.proc_root.mkdir(exist_ok=True)
    return release, bobs_entry, cgroup_of(node, "bob")


NODE_TAMPER = r"""
G=/var/run/libvgpu/node/$GPU.region
for attack in "rm -f $G" "mv $G $G.old" "cp $G /tmp/g && mv -f /tmp/g $G" "ln -s /dev/null $G.new"; do
    if sh -c "$attack" 2>/dev/null; then echo "tamper done: $attack"; else echo "tamper refused: $attack"; fi
done
"""


def test_a_gpu_pod_cannot_remove_or_replace_the_node_region_another_pod_uses(installed_node):
    """The card's node region (every GPU pod on the card has its entry there: priority, memory in
    use, bursts) is mapped by bob's pod; alice's pod, running as the same uid as every z2jh
    server (1000), removes or replaces the file: bob's usage would vanish from what the node
    agent and the other pods read, and the next pods would start a node region of their own."""
    node = installed_node
    release, bobs_entry, _pid = start_bob(node)
    with relaying(node), contextlib.ExitStack() as done:
        done.callback(release.touch)
        wait_for(bobs_entry, 60, "bob's 300 MiB in the card's node region")
        alice = user_pod(node, "alice", NODE_TAMPER)
        alice["spec"]["containers"][0]["env"].append({"name": "GPU", "value": GPU0})
        out = run_to_end(node, alice)
        assert "tamper refused" in out, out
        assert "tamper done" not in out, out  # the node-region directory is the agent's
        assert bobs_entry(), "bob's entry is gone from the card's node region"
    done = node.emu.wait_for_pod_phase("bob", ("Succeeded", "Failed"), NS, timeout=60)
    assert done["status"]["phase"] == "Succeeded", node.emu.pod_log("bob", NS)


NODE_OVERWRITE = r"""
G=/var/run/libvgpu/node/$GPU.region
# every entry of the card (bob's memory in use, last launch, burst wait) zeroed in place
if dd if=/dev/zero of=$G bs=256 seek=1 count=32 conv=notrunc 2>/tmp/dd.err; then
    echo "overwrite done"
else
    echo "overwrite refused: $(cat /tmp/dd.err)"
fi
"""


def host_mounts_writable(pid: int, host_dir: Path) -> dict[str, bool]:
    """Mount point -> writable, of every mount of the agent's host directory in the process's
    mount namespace (/proc/<pid>/mountinfo: the mount's root in its filesystem, its options)."""
    out = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        root, point, options = fields[3], fields[4], fields[5].split(",")
        if root == str(host_dir) or root.startswith(f"{host_dir}/"):
            out[point] = "rw" in options
    return out


def test_a_gpu_pod_cannot_overwrite_the_entries_of_the_other_pods_on_its_card(installed_node):
    """Bob's pod holds 300 MiB of the card; alice's pod (uid 1000, as every z2jh server) zeroes
    the card's node region in place, which every GPU pod on the card mounts: bob's memory in use
    would read 0 to the other pods' shims (a burst into his request), to the agent and to the
    culler. The pods mount the node regions read-only (no mount of the agent's directory is
    writable in a running GPU pod), and bob's entry, which the agent relays from his own
    container region, stays true."""
    node = installed_node
    release, bobs_entry, bobs_pid = start_bob(node)
    region = node.host_dir / "regions" / f"{GPU0}.region"
    with relaying(node), contextlib.ExitStack() as done:
        done.callback(release.touch)
        wait_for(bobs_entry, 60, "bob's 300 MiB in the card's node region")
        mounts = host_mounts_writable(bobs_pid, node.host_dir)
        assert mounts, "bob's pod mounts nothing of the agent's directory"
        assert not any(mounts.values()), f"writable mounts of the agent's directory in a GPU pod: {mounts}"
        alice = user_pod(node, "alice", NODE_OVERWRITE)
        alice["spec"]["containers"][0]["env"].append({"name": "GPU", "value": GPU0})
        out = run_to_end(node, alice)
        assert "overwrite refused" in out and "Read-only file system" in out, out
        [entry] = bobs_entry() or [None]
        assert entry is not None and entry.alive, f"bob's entry is not what his pod holds: {read_node_region(region)}"
    done = node.emu.wait_for_pod_phase("bob", ("Succeeded", "Failed"), NS, timeout=60)
    assert done["status"]["phase"] == "Succeeded", node.emu.pod_log("bob", NS)
