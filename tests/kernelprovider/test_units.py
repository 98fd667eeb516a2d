"""Unit tests: broker size config, kernelspecs and their installer, the kernel pod's objects, the
in-pod bootstrap, the local launcher's sweep, and the provisioner outside a hub."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import kubernetes_validate.utils
import pytest

from hubext.allocator import GPUAllocator
from hubext.backends import Capabilities, Capability, ServerRef
from hubext.broker import BrokerError, validate_sizes
from hubext.kernels import KernelRecord
from hubext.kubernetes.launcher import KubernetesKernelLauncher
from hubext.kubernetes.objects import bootstrap_source, make_kernel_secret
from hubext.local.launcher import LocalKernelLauncher
from hubext.local.ledger import Ledger
from hubext.local.pool import LocalPool
from kernelprovider.kernelspecs import install, kernelspec, kernelspec_name
from libvgpu import contract as L
from quotas import Allocation, Owner

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def no_allocator():
    yield
    GPUAllocator.clear_instance()


# ---- sizes and kernelspecs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ({"name": "x"}, "must be a list"),
        ([{"name": "Big GPU", "memory_mib": 1, "cores_percent": 1}], "kernel_sizes[0].name"),
        ([{"name": "a", "memory_mib": 1024, "cores_percent": 10, "colour": "red"}], "unknown key(s) colour"),
        ([{"name": "a", "memory_mib": "1GiB", "cores_percent": 10}], "gpu.memory_mib must be int"),
        ([{"name": "a", "memory_mib": 1024, "cores_percent": 150}], "cores_percent in 1..100"),
        (
            [{"name": "a", "memory_mib": 1, "cores_percent": 1}, {"name": "a", "memory_mib": 1, "cores_percent": 1}],
            "kernel_sizes[1].name 'a' is used twice",
        ),
        ([{"name": "a", "memory_mib": 1, "cores_percent": 1, "allowed_groups": "staff"}], "allowed_groups"),
    ],
)
def test_bad_kernel_sizes_are_refused_naming_the_entry_and_key(sizes, expected):
    with pytest.raises(BrokerError) as e:
        validate_sizes(sizes)
    assert expected in e.value.message
    assert e.value.status == 500


def test_sizes_get_a_display_name_and_their_gpu_section():
    [size] = validate_sizes([{"name": "gpu-20g", "memory_mib": 20480, "cores_percent": 50, "count": 2}])
    assert size["display_name"] == "2x GPU 20 GiB"
    assert size["gpu"] == {"memory_mib": 20480, "cores_percent": 50, "count": 2}


def test_kernelspec_of_a_size_uses_the_provisioner_and_message_interrupts():
    spec = kernelspec({"name": "gpu-10g", "display_name": "GPU 10 GiB", "memory_mib": 10240})
    assert spec["display_name"] == "Python 3 (GPU 10 GiB)"
    assert spec["interrupt_mode"] == "message"
    assert spec["metadata"]["kernel_provisioner"]["config"] == {"size": "gpu-10g"}
    assert "{connection_file}" in spec["argv"]
    assert kernelspec_name("GPU 10g!") == "elastic-gpu-gpu-10g"


def test_install_replaces_stale_gpu_kernelspecs(tmp_path):
    sizes = [{"name": "gpu-10g", "display_name": "GPU 10 GiB"}, {"name": "gpu-4g", "display_name": "GPU 4 GiB"}]
    install(sizes, prefix=str(tmp_path))
    kernels = tmp_path / "share/jupyter/kernels"
    assert sorted(p.name for p in kernels.iterdir()) == ["elastic-gpu-gpu-10g", "elastic-gpu-gpu-4g"]
    (kernels / "python3").mkdir()  # not ours: must stay
    install(sizes[:1], prefix=str(tmp_path))
    assert sorted(p.name for p in kernels.iterdir()) == ["elastic-gpu-gpu-10g", "python3"]


def test_installed_kernelspecs_are_readable_by_every_account(tmp_path):
    (path,) = install([{"name": "gpu-10g", "display_name": "GPU 10 GiB"}], prefix=str(tmp_path))
    assert os.stat(path).st_mode & 0o777 == 0o755
    assert os.stat(os.path.join(path, "kernel.json")).st_mode & 0o777 == 0o644


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    return subprocess.run(
        [sys.executable, "-m", "kernelprovider", *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=REPO,
        timeout=60,
    )


def test_installer_says_what_is_missing_without_a_traceback():
    result = run_cli("install-kernelspecs")
    assert result.returncode == 2 and "--hub-url" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("install-kernelspecs", "--hub-url", "http://127.0.0.1:9")
    assert result.returncode == 2 and "--token" in result.stderr
    result = run_cli("install-kernelspecs", "--hub-url", "http://127.0.0.1:9", "--token", "t")
    assert result.returncode == 1 and "Cannot read GPU kernel sizes" in result.stderr
    assert "Traceback" not in result.stderr


# ---- Kubernetes objects --------------------------------------------------------------------------


def _kube_objects():
    launcher = KubernetesKernelLauncher(namespace="jhub", image="kernel:1")
    record = KernelRecord(
        id="0123456789abcdef0123456789abcdef",
        user="Alice@Example.org",
        server_name="gpu",
        size="gpu-10g",
        allocation_id="kernel-alice-01234567-0",
        section={"memory_mib": 10240, "cores_percent": 25},
        namespace="jhub",
        ports={"shell_port": 50001, "iopub_port": 50002, "stdin_port": 50003, "control_port": 50004, "hb_port": 50005},
        server_identity="uid-1/0",
        created_at=1.0,
    )
    allocation = Allocation(
        id=record.allocation_id,
        owner=Owner(user=record.user),
        node="gpu-node-1",
        gpu_uuids=("GPU-1",),
        memory_mib=10240,
        cores_percent=25,
        priority_class="default",
        kind="kernel",
    )
    server = ServerRef(
        user=record.user,
        name="gpu",
        identity="uid-1/0",
        pod_name="jupyter-alice-40example-2eorg--gpu",
        pod_uid="uid-1",
        namespace="jhub",
        pod_labels={"component": "singleuser-server", "hub.jupyter.org/username": "alice", "app": "jupyterhub"},
    )
    key = "s3cr3t-key-" + "x" * 32
    pod = _manifest(launcher._pod(record, allocation, server))
    secret = _manifest(make_kernel_secret(record, key, launcher._owners(server)))
    policy = _manifest(launcher._network_policy(record, server))
    return record, key, pod, secret, policy


def _manifest(obj) -> dict:
    """A client model as the JSON the API server receives (camelCase, no nulls)."""

    def prune(value):
        if isinstance(value, dict):
            return {k: prune(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [prune(v) for v in value]
        return value

    return prune(obj.to_dict(serialize=True))


def test_kernel_pod_secret_and_network_policy_are_valid_kubernetes_objects(no_allocator):
    record, key, pod, secret, policy = _kube_objects()
    version = kubernetes_validate.utils.latest_version()
    for obj in (pod, secret, policy):
        kubernetes_validate.validate(obj, version, strict=True)
    # the pod: our labels, the slice, no API token, owned by the server pod, key only in the Secret
    assert pod["metadata"]["labels"][L.KIND] == "kernel" and pod["metadata"]["labels"][L.KERNEL_ID] == record.id
    assert pod["metadata"]["annotations"][L.A_MEMORY_MIB] == "10240"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["restartPolicy"] == "Never"
    [term] = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-1"]}]}
    assert pod["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "jupyter-alice-40example-2eorg--gpu",
            "uid": "uid-1",
            "blockOwnerDeletion": False,
        }
    ]
    assert key not in json.dumps(pod)
    [volume] = [v for v in pod["spec"]["volumes"] if v.get("secret")]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert oct(volume["secret"]["defaultMode"]) == "0o400"
    assert json.loads(__import__("base64").b64decode(secret["data"]["connection.json"]))["key"] == key
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # the policy: only the user's server pod may reach this kernel, on its ports
    assert policy["spec"]["podSelector"] == {"matchLabels": {L.KERNEL_ID: record.id}}
    [rule] = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"component": "singleuser-server", "hub.jupyter.org/username": "alice"}}}
    ]
    assert sorted(p["port"] for p in rule["ports"]) == [*range(50001, 50006), *range(50011, 50016)]


def test_pod_bootstrap_builds_a_private_connection_file_from_the_secret(tmp_path):
    secret = tmp_path / "connection.json"
    secret.write_text(json.dumps({"key": "k" * 32, "signature_scheme": "hmac-sha256", "transport": "tcp"}))
    ports = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}
    show = (
        "import json, os, sys, elastic_gpu_resume as hook; p = sys.argv[1]; "
        "print(json.dumps([json.load(open(p)), oct(os.stat(p).st_mode & 0o777), hook.HOOK]))"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            bootstrap_source(),
            str(secret),
            json.dumps(ports),
            "HOOK = 'the resume hook'",  # the kernel imports it (kernel_cmd: --ext=elastic_gpu_resume)
            sys.executable,
            "-c",
            show,
            "{connection_file}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "POD_IP": "10.1.2.3", "TMPDIR": str(tmp_path)},
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    info, mode, hook = json.loads(result.stdout)
    assert info == {"key": "k" * 32, "signature_scheme": "hmac-sha256", "transport": "tcp", "ip": "10.1.2.3", **ports}
    assert mode == "0o600" and hook == "the resume hook"


# ---- the local launcher ---------------------------------------------------------------------------


def test_local_sweep_stops_kernel_processes_nobody_knows(tmp_path, no_allocator):
    launcher = LocalKernelLauncher(state_dir=str(tmp_path / "kernels"))
    root = tmp_path / "kernels"
    stray, kept = root / ("a" * 32), root / ("b" * 32)
    for d in (stray, kept):
        d.mkdir(parents=True)
        (d / "connection.json").write_text("{}")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", str(stray / "connection.json")], start_new_session=True
    )
    try:
        time.sleep(0.2)
        swept = asyncio.run(launcher.sweep({"b" * 32}))
        assert swept == ["a" * 32]
        assert proc.wait(10) is not None, "the stray kernel process must be stopped"
        assert not stray.exists() and kept.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def _local_launcher(tmp_path) -> LocalKernelLauncher:
    """A local launcher over the pool's one ledger (what the broker builds), without the pool's watch."""
    pool = LocalPool(data_dir=str(tmp_path))
    pool.ledger = Ledger(pool.ledger_path)
    return LocalKernelLauncher(pool=pool, state_dir=str(tmp_path))


def test_local_ledger_survives_a_restart_and_notices_dead_kernels(tmp_path, no_allocator):
    launcher = _local_launcher(tmp_path)
    conn = tmp_path / ("c" * 32) / "connection.json"  # a kernel is recognised by its connection file
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(conn)], start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        records = [
            KernelRecord(
                id="c" * 32,
                user="u",
                server_name="",
                size="s",
                allocation_id="a1",
                state="running",
                holder=str(alive.pid),
            ),
            KernelRecord(
                id="d" * 32, user="u", server_name="", size="s", allocation_id="a2", state="running", holder="999999"
            ),
            # a live pid that is not this kernel (the pid was reused): not taken for the kernel
            KernelRecord(
                id="e" * 32,
                user="u",
                server_name="",
                size="s",
                allocation_id="a3",
                state="running",
                holder=str(other.pid),
            ),
        ]
        launcher.persist(records)
        # one ledger for allocations and kernels, readable by the hub's account only
        assert not (tmp_path / "kernels.json").exists()
        assert stat.S_IMODE(os.stat(launcher.pool.ledger_path).st_mode) == 0o600
        loaded = {r.id: r for r in asyncio.run(_local_launcher(tmp_path).start())}
        assert loaded["c" * 32].state == "running" and loaded["c" * 32].holder == str(alive.pid)
        assert loaded["d" * 32].state == "stopped" and "while the hub was down" in loaded["d" * 32].reason
        assert loaded["e" * 32].state == "stopped"
    finally:
        alive.kill()
        other.kill()


def test_broker_configure_wires_handlers_scopes_and_server_tokens():
    from traitlets.config import Config

    from hubext.broker import BROKER_HANDLERS, CUSTOM_SCOPES, configure

    c = Config()
    c.Spawner.server_token_scopes = ["access:servers!server", "users:activity!user", "read:users:name!user"]
    configure(c)
    assert c.JupyterHub.extra_handlers == BROKER_HANDLERS
    assert set(c.JupyterHub.custom_scopes) == set(CUSTOM_SCOPES)
    # the user role (JupyterHub 5 has no extra_user_scopes)
    assert c.JupyterHub.load_roles == [{"name": "user", "scopes": ["self", "custom:elastic-gpu:kernels!user"]}]
    # a user role the config defines keeps its scopes
    c2 = Config()
    c2.JupyterHub.load_roles = [{"name": "user", "scopes": ["self", "shares!user"]}, {"name": "x", "scopes": []}]
    configure(c2)
    assert c2.JupyterHub.load_roles[0]["scopes"] == ["self", "shares!user", "custom:elastic-gpu:kernels!user"]
    assert c2.JupyterHub.load_roles[1] == {"name": "x", "scopes": []}
    assert c.Spawner.server_token_scopes == sorted(
        ["access:servers!server", "users:activity!user", "read:users:name!user", "custom:elastic-gpu:kernels!user"]
    )


def test_a_kernel_request_asks_for_the_kernel_pods_cpu_and_memory(no_allocator):
    """Admission places a kernel pod where its CPU and memory requests fit (kube-scheduler would
    otherwise leave it Pending while it holds its slice)."""
    from hubext.broker import GPUBroker
    from quotas import Owner as QOwner

    launcher = KubernetesKernelLauncher(namespace="jhub", cpu_request="500m", memory_request="1Gi")
    assert launcher.node_resources() == (500, 1024)
    broker = GPUBroker()
    broker.launcher = launcher
    record = KernelRecord(id="f" * 32, user="u", server_name="", size="s", allocation_id="", section={"memory_mib": 1})
    request = broker._request(record, QOwner(user="u"))
    assert (request.cpu_millicores, request.host_memory_mib) == (500, 1024)
    GPUBroker.clear_instance()


def test_the_broker_offers_for_moves_only_running_kernels_whose_resume_may_land_on_another_card(
    tmp_path, no_allocator
):
    """Moving a slice (docs/admission.md, "The queue") swaps its kernel out; a kernel pod can only
    come back to its own card, so it would just wait for the card it made room on."""
    from hubext.broker import GPUBroker

    def record(kid: str, state: str = "running", **kw) -> KernelRecord:
        return KernelRecord(id=kid, user="u", server_name="", size="s", allocation_id=f"a-{kid}", state=state,
                            allocation={"node": "n", "gpu_uuids": ["GPU-1"]}, **kw)

    broker = GPUBroker()
    try:
        broker.kernels = {k.id: k for k in (record("k1"), record("k2", "pending"), record("k3", swap={"state": "x"}))}
        broker.launcher = LocalKernelLauncher(state_dir=str(tmp_path), cuda_library="libcuda-missing.so.1")
        assert not broker.can_move() and broker.movable_sessions() == {}  # no driver here: nothing can checkpoint
        able = Capabilities(checkpoint=Capability(True), move=Capability(True), burst=Capability(False, "n/a"))
        broker.launcher.capabilities = lambda: able  # a card whose driver can checkpoint
        assert broker.can_move() and broker.movable_sessions() == {"a-k1": "k1"}  # the session key: the kernel
        broker.swap_host_memory_percent = 0
        assert not broker.can_move() and broker.movable_sessions() == {}  # swapping is off
        broker.swap_host_memory_percent = 50
        broker.launcher = KubernetesKernelLauncher(namespace="jhub")
        assert not broker.can_move() and broker.movable_sessions() == {}  # its resume is pinned to GPU-1
    finally:
        GPUBroker.clear_instance()


def wait_for_kernel(client, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the kernel answers kernel_info. ``wait_for_ready`` gives up ("Kernel died") while
    the heartbeat has not yet beaten, which a kernel still starting on a loaded machine is."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the kernel exited ({proc.returncode})"
        try:
            client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise


@pytest.mark.parametrize("resume_hook", [False, True], ids=["hami-mig-whole", "native"])
def test_a_kernel_pods_command_starts_its_kernel_without_a_traceback(resume_hook, tmp_path):
    """The kernel container's command as make_kernel_pod writes it with the launcher's default
    kernel_cmd, run here (this venv's python for the image's, the Secret at a local path): the
    kernel answers, and loads the resume hook only where the bootstrap installed it. Without
    the hook (hami/mig/whole backends) the kernel used to log a ModuleNotFoundError traceback
    for --ext=elastic_gpu_resume."""
    import socket

    from jupyter_client import BlockingKernelClient

    from hubext.kubernetes.objects import SECRET_FILE, SECRET_MOUNT, make_kernel_pod

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    ports = {n: port() for n in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")}
    record = KernelRecord(id="k" * 32, user="alice", server_name="", size="small", allocation_id="a-1",
                          namespace="jhub", ports=ports, resume_url="http://hub:8081/hub/api/gpu/kernels/k/resume")
    kernel_cmd = KubernetesKernelLauncher._default_kernel_cmd(None)
    pod = make_kernel_pod(record, image="kernel", image_pull_policy="IfNotPresent", kernel_cmd=kernel_cmd,
                          resume_hook=resume_hook)
    secret = tmp_path / SECRET_FILE
    secret.write_text(json.dumps({"key": "s" * 32, "signature_scheme": "hmac-sha256", "transport": "tcp"}))
    local = {"python": sys.executable, f"{SECRET_MOUNT}/{SECRET_FILE}": str(secret)}
    command = [local.get(a, a) for a in pod.spec.containers[0].command]
    env = {**os.environ, "POD_IP": "127.0.0.1", "TMPDIR": str(tmp_path)}
    env.update({e.name: e.value for e in pod.spec.containers[0].env if e.value is not None})
    log = tmp_path / "kernel.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    client = BlockingKernelClient()
    client.load_connection_info({**ports, "ip": "127.0.0.1", "key": "s" * 32, "transport": "tcp",
                                 "signature_scheme": "hmac-sha256"})  # fmt: skip
    try:
        client.start_channels()
        wait_for_kernel(client, proc)
        reply = client.execute_interactive("import sys; print('elastic_gpu_resume' in sys.modules)", timeout=60,
                                           output_hook=lambda m: None)  # fmt: skip
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
        proc.kill()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "Traceback" not in text and "ModuleNotFoundError" not in text, text


def test_a_kernel_pod_is_promised_a_swap_only_on_a_node_whose_agent_said_its_driver_can_checkpoint():
    """Each node's agent publishes its checkpoint capability on the Node; the launcher answers per
    kernel from its node's answer (tests/kernelprovider/test_kube_swap.py runs it end to end)."""
    from kubernetes_asyncio.client import V1Node, V1ObjectMeta

    from hubext.kubernetes.pool import KubernetesPool

    pool = KubernetesPool(namespace="jhub")
    launcher = KubernetesKernelLauncher(namespace="jhub", pool=pool)

    def kernel(node: str) -> KernelRecord:
        return KernelRecord(id=f"k-{node}", user="u", server_name="", size="s", allocation_id=f"a-{node}",
                            allocation={"node": node, "gpu_uuids": ["GPU-1"]}, resume_url="http://hub/resume")

    assert not launcher.capabilities().checkpoint  # no node has said anything yet: nothing is promised
    said = {
        "able": {"able": True, "driver": "570.86"},
        "old": {"able": False, "why_not": "the CUDA driver (CUDA 12.4) has no checkpoint API", "driver": "550.1"},
        "garbled": "not JSON",
    }
    for name, value in said.items():
        text = value if isinstance(value, str) else json.dumps(value)
        annotations = {L.NODE_CHECKPOINT_ANNOTATION: text}
        pool.checkpoints.update(V1Node(metadata=V1ObjectMeta(name=name, annotations=annotations)))
    pool.checkpoints.update(V1Node(metadata=V1ObjectMeta(name="silent")))
    assert launcher.capabilities().checkpoint  # some node can
    assert launcher.checkpoint_capability(kernel("able")) == Capability(True)
    old = launcher.checkpoint_capability(kernel("old"))
    assert not old and old.why_not == "on node old, the CUDA driver (CUDA 12.4) has no checkpoint API", old
    for name in ("garbled", "silent", "gone"):
        why = launcher.checkpoint_capability(kernel(name)).why_not
        assert why.startswith(f"the node agent on {name} has not said whether its driver can checkpoint"), why
    launcher.swap_kernels = False
    assert "swapping kernel pods is off" in launcher.checkpoint_capability(kernel("able")).why_not


def test_a_kernel_pods_resume_goes_onto_another_card_only_where_its_nodes_driver_says_it_can():
    """The node agent publishes whether its driver restores onto another card (driver 580+:
    ``remap``); a kernel pod's resume may go there only then, and not after such a restore of it
    was refused (it comes back to its own card)."""
    from kubernetes_asyncio.client import V1Node, V1ObjectMeta

    from hubext.kubernetes.launcher import KubernetesKernelLauncher
    from hubext.kubernetes.pool import KubernetesPool
    from quotas import Allocation, Owner

    pool = KubernetesPool(namespace="jhub")
    launcher = KubernetesKernelLauncher(namespace="jhub", pool=pool)
    said = {
        "new": {"able": True, "remap": True, "driver": "580.65"},
        "old": {"able": True, "remap": False, "driver": "570.86",
                "remap_why_not": "the CUDA driver (CUDA 12.8) restores a process only onto its own GPUs"},
        "before": {"able": True, "driver": "570.86"},  # an agent that does not say
        "cannot": {"able": False, "why_not": "no checkpoint API", "remap": True},
    }  # fmt: skip
    for name, value in said.items():
        annotations = {L.NODE_CHECKPOINT_ANNOTATION: json.dumps(value)}
        pool.checkpoints.update(V1Node(metadata=V1ObjectMeta(name=name, annotations=annotations)))

    def kernel(node: str, **swap) -> KernelRecord:
        return KernelRecord(id=f"k-{node}", user="u", server_name="", size="s", allocation_id=f"a-{node}",
                            allocation={"node": node, "gpu_uuids": ["GPU-1"]}, swap={"gpu_uuids": ["GPU-1"], **swap})

    assert launcher.resume_remap(kernel("new")) == Capability(True)
    old = launcher.resume_remap(kernel("old"))
    assert not old and old.why_not.startswith("on node old, the CUDA driver (CUDA 12.8) restores"), old
    for name in ("before", "cannot", "gone"):
        assert not launcher.resume_remap(kernel(name)), name
    refused = kernel("new", remap_refused="the driver refused to restore it onto GPU-2")
    assert launcher.resume_remap(refused).why_not == "the driver refused to restore it onto GPU-2"

    def on(node: str, card: str) -> Allocation:
        return Allocation(id="n", owner=Owner("u"), node=node, gpu_uuids=(card,), memory_mib=1, cores_percent=1,
                          priority_class="default")

    assert launcher.restorable_on(kernel("new"), on("new", "GPU-2")) == ""
    assert launcher.restorable_on(kernel("old"), on("old", "GPU-1")) == ""
    why = launcher.restorable_on(kernel("old"), on("old", "GPU-2"))
    assert "only the card(s) it started on (GPU-1 on node old)" in why, why
    assert launcher.restorable_on(refused, on("new", "GPU-2"))
    assert launcher.restorable_on(kernel("new"), on("other", "GPU-2"))


def test_a_kernel_created_while_the_sweep_lists_pods_is_known_to_it(tmp_path, no_allocator):
    """The sweep lists kernel pods (an API call the hub awaits); a kernel the broker records during
    that call is known, not a stray. A snapshot of the known ids taken before the call swept the
    new kernel's pod 9 ms after it was created (CI, JupyterHub 5 pass under load: 'Swept 1 GPU
    kernel(s) nobody knew about'), and its start never finished."""
    from hubext.broker import GPUBroker

    broker = GPUBroker()
    try:
        broker.launcher = _local_launcher(tmp_path)
        new = KernelRecord(id="e" * 32, user="u", server_name="", size="s", allocation_id="a-e")
        seen: list[bool] = []

        async def sweep(known) -> list[str]:
            broker.kernels[new.id] = new  # created by a request while the pod list was on its way
            seen.append(new.id in known)
            return []

        broker.launcher.sweep = sweep
        asyncio.run(broker.reconcile())
        assert seen == [True]
    finally:
        GPUBroker.clear_instance()
