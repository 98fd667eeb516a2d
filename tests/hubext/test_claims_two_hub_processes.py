"""Two JupyterHub processes share one GPU node through the cluster-wide claims ledger.

Each hub is a real JupyterHub (with its proxy) in its own namespace of one Kubernetes API
emulator, with the GPU broker on; two users per hub run a notebook server pod. 200 GPU kernel
requests (100 per hub, from the users' own tokens, through ``POST /hub/api/gpu/kernels``) arrive
within a second on one node with two 40 GiB cards; each kernel is held a moment and shut down
(a request is decided either way: granted, or refused at once when only the requester's own
kernels fill the cards, as on a single hub).
A watcher reads the pods of both namespaces and the claims objects every few milliseconds:
no card is ever over its memory or compute. Hub B is killed (SIGKILL) mid-run: after A's
reconcile B's claims are exactly what B's remaining pods hold (no claim without a pod); B comes
back while A's requests still arrive and wait, and shuts its leftover kernels down: then A's queue
drains, and B holds no claim at all. (B's leftover kernel pods keep their cards while B is down, as
a real kernel would; A's larger requests may only get in once B has shut them down, so B comes
back during the run: a CI run failed with A's 20 GiB requests waiting out their 150 s behind the
pods B left.)

The kernel pods use an image the emulator cannot pull: a pod holds its slice from its creation
(the ledger is the pods, not their processes), so 200 kernels cost API calls, not 200 Python
processes. The broker's own reconcile (which fails a kernel that cannot pull) runs every 60 s,
after the run.
"""

from __future__ import annotations

import json
import random
import secrets
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from libvgpu import contract as C
from tests.hubext.test_claims_two_hubs import CARD_MIB, _claims_of, _over
from tests.hubrunner import HubRunner, http
from tests.kubeemu import KubeEmulator
from tests.kubeemu.helpers import create_host_claim

TAG = uuid.uuid4().hex[:6]
NODE = "gpu-shared-1"
NS_A, NS_B, NS_CLAIMS = f"teach-{TAG}", f"research-{TAG}", f"gpu-claims-{TAG}"
USERS = {NS_A: ("ada", "alan"), NS_B: ("bea", "bob")}
TTL_S = 6
OWN_ONLY = "Only your own kernels hold GPUs"
SIZES = [
    {"name": "g4", "display_name": "GPU 4 GiB", "memory_mib": 4096, "cores_percent": 10},
    {"name": "g8", "display_name": "GPU 8 GiB", "memory_mib": 8192, "cores_percent": 25},
    {"name": "g20", "display_name": "GPU 20 GiB", "memory_mib": 20480, "cores_percent": 50},
]
ADMISSION = {
    "priority_classes": {"default": {"value": 100, "preempt": False, "borrow": False}},
    "default_priority_class": "default",
    "placement": {"node": "binpack", "gpu": "binpack"},
    "workspaces": {"default": {"namespaces": {"default": {}}}},
}


def _hub_config(work: Path, namespace: str) -> str:
    singleuser = Path(sys.executable).parent / "jupyterhub-singleuser"
    host_dir = work / "host-elastic-gpu"
    (host_dir / "lib").mkdir(parents=True, exist_ok=True)
    (host_dir / "ld.so.preload").write_text("")
    (work / "admission.yaml").write_text(yaml.safe_dump(ADMISSION))
    return textwrap.dedent(
        f"""
        from hubext.hubconfig import configure_hub
        from hubext.broker import grant_user_scopes, start_with_hub
        configure_hub(c, mode="kubernetes", admission_config_file={str(work / "admission.yaml")!r}, culler=False)
        grant_user_scopes(c)
        start_with_hub()
        c.JupyterHub.cleanup_servers = False
        c.KubeSpawner.namespace = {namespace!r}
        c.KubernetesPool.namespace = {namespace!r}
        c.KubernetesPool.claims_namespace = {NS_CLAIMS!r}
        c.KubernetesPool.claims_ttl_seconds = {TTL_S}
        c.KubernetesPool.reconcile_interval_seconds = 0.25
        c.KubeSpawner.image = "quay.io/jupyter/base-notebook:emulated"
        c.KubeSpawner.cmd = [{str(singleuser)!r}]
        c.KubeSpawner.ip = "$(POD_IP)"
        c.KubeSpawner.environment = {{"POD_IP": {{"valueFrom": {{"fieldRef": {{"fieldPath": "status.podIP"}}}}}}}}
        c.KubeSpawner.start_timeout = 120
        c.KubeSpawner.http_timeout = 90
        c.KubernetesKernelLauncher.network_policy = False
        c.KubernetesKernelLauncher.image = "registry.invalid/elastic-gpu-kernel:never"
        c.GPUBroker.kernel_sizes = {SIZES!r}
        c.GPUBroker.max_queue_seconds = 150
        c.GPUBroker.reconcile_interval_seconds = 60
        c.GPUBroker.claim_timeout_seconds = 600
        """
    )


@pytest.fixture(scope="module")
def two_hubs(tmp_path_factory):
    work = tmp_path_factory.mktemp("two-hubs")
    gpus = [{"uuid": f"GPU-{TAG}-{i}", "model": "A100-40GB", "memory_mib": CARD_MIB, "index": i} for i in range(2)]
    emu = KubeEmulator(
        nodes=[
            {
                "name": NODE,
                "labels": {C.NODE_GPU_LABEL: "true", "kubernetes.io/hostname": NODE},
                "annotations": {C.NODE_GPUS_ANNOTATION: json.dumps(gpus)},
                "allocatable": {"cpu": "256", "memory": "2Ti", "pods": "1000"},
            }
        ],
        namespaces=[NS_A, NS_B, NS_CLAIMS],
        data_dir=work / "emulator",
    )
    emu.start()
    hubs: dict[str, HubRunner] = {}
    try:
        emu.create(
            {
                "apiVersion": "node.k8s.io/v1",
                "kind": "RuntimeClass",
                "metadata": {"name": "nvidia"},
                "handler": "nvidia",
            }
        )
        emu.create(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": "elastic-gpu-default"},
                "value": 100,
            }
        )
        for ns in (NS_A, NS_B):
            hubs[ns] = HubRunner(work / ns, _hub_config(work / ns, ns), env=emu.env())
            create_host_claim(emu, ns, work / ns / "host-elastic-gpu")  # the chart's claim of the agent's directory
        starts = [threading.Thread(target=h.start) for h in hubs.values()]
        for t in starts:
            t.start()
        for t in starts:
            t.join()
        tokens = {}
        for ns, hub in hubs.items():
            assert hub.proc is not None and hub.proc.poll() is None, hub.log_tail()
            for user in USERS[ns]:
                tokens[user] = hub.user_token(user)
                status, body = hub.api("POST", f"/users/{user}/server")
                assert status in (201, 202), (status, body)
        for ns, hub in hubs.items():
            for user in USERS[ns]:
                hub.wait_for(
                    lambda h=hub, u=user: (
                        (h.api("GET", f"/users/{u}")[1].get("servers") or {}).get("", {}).get("ready")
                    ),
                    timeout=150,
                    what=f"{user}'s server",
                )
        yield emu, hubs, tokens
    finally:
        for hub in hubs.values():
            hub.stop()
        emu.stop()


def _ledger(emu) -> dict[str, object]:
    """Every hub's entry in the claims objects, as stored."""
    return {
        f"{cm['metadata']['name']}/{key}": json.loads(raw)
        for cm in emu.list("configmaps", NS_CLAIMS)
        for key, raw in (cm.get("data") or {}).items()
    }


def _pods(emu) -> list[tuple[str, str, str | None, str | None]]:
    """(namespace, allocation id, phase, deletionTimestamp) of every GPU pod."""
    return [
        (
            p["metadata"]["namespace"],
            (p["metadata"].get("annotations") or {}).get(C.ALLOCATION_ID, ""),
            (p.get("status") or {}).get("phase"),
            p["metadata"].get("deletionTimestamp"),
        )
        for p in emu.list("pods", None, label_selector=f"{C.MANAGED}=true")
    ]


def _story(problems: list[str], first: dict[str, object], marks: list[tuple[float, str]], hubs: dict) -> str:
    """What a failure needs to be understood: the first overbooking, when it was seen against B's
    kill and restart, what the ledger and the pods held then, and the hubs' claims log lines."""
    at = float(first.get("at", 0.0))  # type: ignore[arg-type]
    when = ", ".join(f"{what} {t - at:+.2f} s" for t, what in marks)
    logs = "\n".join(
        f"{ns}: {line}"
        for ns, hub in hubs.items()
        for line in hub.log_tail(4000).splitlines()
        if "claim" in line.lower() or "hub id" in line.lower()
    )
    return (
        f"{len(problems)} samples overbooked, first: {problems[0]}\nrelative to it: {when}\n"
        f"ledger: {json.dumps(first.get('ledger'), indent=1)}\npods: {first.get('pods')}\nlogs:\n{logs}"
    )


def test_two_hub_processes_share_one_node_without_overbooking_and_a_killed_hub_leaves_no_claim(two_hubs):
    emu, hubs, tokens = two_hubs
    hub_a, hub_b = hubs[NS_A], hubs[NS_B]
    rng = random.Random(15)
    plan = []
    for i in range(200):
        ns = NS_A if i % 2 == 0 else NS_B
        plan.append(
            (ns, USERS[ns][(i // 2) % 2], rng.choice(SIZES)["name"], rng.uniform(0, 1.0), rng.uniform(0.05, 0.4))
        )
    problems: list[str] = []
    shared_seen: set[str] = set()
    samples = 0
    done = threading.Event()
    b_killed = threading.Event()
    results: dict[str, list[str]] = {NS_A: [], NS_B: []}
    b_finished = 0
    lock = threading.Lock()

    marks: list[tuple[float, str]] = []  # when B was killed and came back (for a failure's story)
    first: dict[str, object] = {}  # what the ledger and the pods held when a card was first overbooked

    def watch() -> None:
        nonlocal samples
        while not done.is_set():
            found, shared = _over(emu, [NS_A, NS_B], NS_CLAIMS)
            if found and not first:
                first.update(at=time.monotonic(), ledger=_ledger(emu), pods=_pods(emu))
            problems.extend(found)
            shared_seen.update(shared)
            samples += 1
            time.sleep(0.01)

    def use(ns: str, user: str, size: str, delay: float, hold: float) -> None:
        """What a user's server does: start a GPU kernel (waiting in the queue), use it, shut it down.
        Once hub B is killed, its proxy answers 503 and its connections break: those are 'lost'."""
        nonlocal b_finished
        hub = hubs[ns]

        def outcome(what: str, status: int | None = None, body: object = None) -> None:
            lost = ns == NS_B and b_killed.is_set() and status in (None, 503)
            with lock:
                results[ns].append("lost" if lost else f"{what} {status}: {body}")

        time.sleep(delay)
        try:
            status, body = http(
                "POST", f"{hub.hub_api}/gpu/kernels", tokens[user], {"key": secrets.token_hex(16), "size": size}, 170
            )
            if status == 409 and OWN_ONLY in str(body):
                # decided, not stuck: the requester's own kernels fill every card, so waiting
                # cannot help (only when no other hub holds any room: then it would wait)
                with lock:
                    results[ns].append("own-only")
                return None
            if status != 201:
                return outcome("refused", status, body)
            time.sleep(hold)
            status, _ = http("DELETE", f"{hub.hub_api}/gpu/kernels/{body['id']}", tokens[user], None, 60)
            if status != 204:
                return outcome("delete", status)
        except OSError as e:
            return outcome("error", None, e)
        with lock:
            results[ns].append("ok")
            if ns == NS_B:
                b_finished += 1
                if b_finished == 40:
                    b_killed.set()
                    marks.append((time.monotonic(), "B killed"))
                    hub_b.kill()  # mid-run: no release, no more renewal, its requests in flight lost

    def b_pods() -> set[str]:
        return {
            p["metadata"]["annotations"][C.ALLOCATION_ID]
            for p in emu.list("pods", NS_B, label_selector=f"{C.MANAGED}=true")
            if not p["metadata"].get("deletionTimestamp")
        }

    recovery: list[str] = []  # what went wrong while B came back (raised in the test's thread)

    def b_comes_back() -> None:
        b_killed.wait(240)
        # once B is silent for the TTL, A's reconcile makes B's claims what B's running pods hold:
        # grants without a pod are dropped, the kernel pods B left keep (or get) theirs (they still
        # use the cards)
        try:
            hub_a.wait_for(
                lambda: _claims_of(emu, NS_CLAIMS, NS_B) == b_pods(), 4 * TTL_S + 10, 0.2, "B's claims = pods"
            )
        except AssertionError:
            claimed, running = _claims_of(emu, NS_CLAIMS, NS_B), b_pods()
            recovery.append(f"claims without pods {claimed - running}, pods without claims {running - claimed}")
        # B comes back: it claims again what its pods hold, and its reconcile drops what is gone;
        # it shuts down the kernels it left, which lets A's waiting requests in
        marks.append((time.monotonic(), "B restarting"))
        hub_b.start()
        marks.append((time.monotonic(), "B restarted"))
        status, listed = hub_b.api("GET", "/gpu/kernels")
        if status != 200:
            recovery.append(f"B's kernels after its restart: {status} {listed}")
            return
        for kernel in listed["kernels"]:
            hub_b.api("DELETE", f"/gpu/kernels/{kernel['id']}")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    comeback = threading.Thread(target=b_comes_back, daemon=True)
    comeback.start()
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=200) as pool:
        list(pool.map(lambda p: use(*p), plan))
    run_s = time.monotonic() - started
    assert b_killed.is_set()
    comeback.join(300)
    assert not comeback.is_alive() and recovery == [], recovery
    done.set()
    watcher.join()
    assert problems == [], _story(problems, first, marks, hubs)
    assert samples > 50 and shared_seen, "both hubs should have shared a card at some moment"
    assert len(results[NS_A]) == 100 and set(results[NS_A]) <= {"ok", "own-only"}, sorted(set(results[NS_A]))
    assert 40 <= results[NS_B].count("ok") < 100, results[NS_B]
    assert set(results[NS_B]) <= {"ok", "lost", "own-only"} and "lost" in results[NS_B], sorted(set(results[NS_B]))
    status, pool_a = hub_a.api("GET", "/gpu/pool")
    assert status == 200 and pool_a["queue"] == []
    hub_a.wait_for(lambda: _claims_of(emu, NS_CLAIMS, NS_A) == set(), 10, 0.2, "A's claims released")
    # shutting down the kernels B left leaves no claim of B behind
    hub_b.wait_for(lambda: b_pods() == set(), 30, 0.2, "B's kernel pods gone")
    hub_b.wait_for(lambda: _claims_of(emu, NS_CLAIMS, NS_B) == set(), 4 * TTL_S + 10, 0.2, "no claim of B left")
    status, pool_b = hub_b.api("GET", "/gpu/pool")
    assert status == 200 and pool_b["queue"] == []
    counts = {ns: {r: results[ns].count(r) for r in set(results[ns])} for ns in results}
    print(f"200 requests on 2 cards, 2 hub processes: {run_s:.1f} s; watcher samples {samples}; {counts}")
