"""Two hubs share one GPU node through the cluster-wide claims ledger (the Kubernetes API emulator).

Each hub is a real ``GPUAllocator`` with a real ``KubernetesPool`` in its own namespace, in one
process (the same race between two JupyterHub processes, through the broker's REST API:
test_claims_two_hub_processes.py). Both race 100 GPU requests each on one node with two cards,
one of which carries a slice of each hub through the race (so the race's grants certainly meet
the other hub's there); what the cards carry is checked from the pods of both namespaces and
from the claims objects, never from either hub's view.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import pytest
from traitlets.config import Config

from hubext.admin import gpu_bars, hub_pool_view
from hubext.allocator import GPUAllocator
from hubext.backends import ClaimConflict
from hubext.kubernetes.claims import CLAIMS_LABEL
from libvgpu import contract as C
from quotas import Allocation, GPURequest, Owner, PoolFull
from tests.kubeemu.fixtures import kube_emulator, kube_namespace  # noqa: F401
from tests.kubeemu.helpers import pod as pod_manifest
from tests.kubeemu.helpers import py

CARD_MIB = 40960
SIZES = [(4096, 10), (8192, 25), (10240, 25), (20480, 50)]


def _namespace(emu, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    emu.create({"metadata": {"name": name}}, "namespaces")
    return name


def _node(emu, tag: str) -> tuple[str, list[str]]:
    node = f"gpu-claims-{tag}"
    uuids = [f"GPU-{tag}-{i}" for i in range(2)]
    gpus = [{"uuid": u, "model": "A100-40GB", "memory_mib": CARD_MIB, "index": i} for i, u in enumerate(uuids)]
    emu.add_node(
        node,
        labels={C.NODE_GPU_LABEL: "true", "claims-test": tag},
        annotations={C.NODE_GPUS_ANNOTATION: json.dumps(gpus)},
        allocatable={"cpu": "64", "memory": "512Gi"},
    )
    return node, uuids


def _hub(namespace: str, claims_namespace: str, tag: str, ttl: float = 30.0, pod: str = "") -> GPUAllocator:
    """A hub's allocator; ``pod``: the hub process runs in that pod of ``namespace``."""
    c = Config()
    if pod:
        c.KubernetesPool.hub_pod_name = pod
        c.KubernetesPool.hub_pod_namespace = namespace
    c.GPUAllocator.pool_backend_class = "kubernetes"
    c.KubernetesPool.namespace = namespace
    c.KubernetesPool.claims_namespace = claims_namespace
    c.KubernetesPool.node_label_selector = f"claims-test={tag}"
    c.KubernetesPool.reconcile_interval_seconds = 0.1
    c.KubernetesPool.claims_ttl_seconds = ttl
    return GPUAllocator(config=c)


async def _tear_down(emu, node: str, namespaces: tuple[str, ...], *hubs: GPUAllocator | None) -> None:
    """Stop the hubs' pools (those that were made), then remove the node and the namespaces."""
    for hub in hubs:
        if hub is not None:
            await hub.backend.stop()
    emu.remove_node(node)
    for ns in namespaces:
        emu.delete("namespaces", ns, None)


def _over(emu, namespaces: list[str], claims_namespace: str) -> tuple[list[str], set[str]]:
    """What overbooks a card, counted from the pods and from the claims objects; and the cards
    both hubs use at this moment (their pods or their claims)."""
    problems: list[str] = []
    held: dict[str, list[tuple[str, int, int, bool]]] = {}
    # one snapshot of every namespace (listing them one after another saw a pod deleted in one
    # and its successor created in the other as both there); a pod being deleted no longer holds
    # its slice, as the pools count (its kernel was shut down; its delete grace is 2 s)
    # (sharing is seen on every pod, being deleted or not: the pods hold their cards for moments)
    on_card: dict[str, set[str]] = {}
    for pod in emu.list("pods", None, label_selector=f"{C.MANAGED}=true"):
        ns = pod["metadata"]["namespace"]
        if ns not in namespaces:
            continue
        a = C.allocation_from_metadata(pod["metadata"].get("labels"), pod["metadata"].get("annotations"))
        for u in a.gpu_uuids:
            on_card.setdefault(u, set()).add(ns)
            if not pod["metadata"].get("deletionTimestamp"):
                held.setdefault(u, []).append((ns, a.memory_mib, a.cores_percent, a.whole))
    shared = {u for u, spaces in on_card.items() if len(spaces) > 1}
    for u, on in held.items():
        if any(w for *_, w in on) and len(on) > 1:
            problems.append(f"pods: {u} whole and shared: {on}")
        elif sum(m for _, m, _, w in on if not w) > CARD_MIB or sum(c for _, _, c, w in on if not w) > 100:
            problems.append(f"pods: {u} over capacity: {on}")
    claimed: dict[str, list[tuple[int, int, bool]]] = {}
    hubs_on: dict[str, set[str]] = {}
    for cm in emu.list("configmaps", claims_namespace, label_selector=f"{CLAIMS_LABEL}=true"):
        for key, raw in (cm.get("data") or {}).items():
            for claim in json.loads(raw)["claims"].values():
                for u in claim["gpus"]:
                    claimed.setdefault(u, []).append((claim["memory_mib"], claim["cores_percent"], claim["whole"]))
                    hubs_on.setdefault(u, set()).add(key)
    shared.update(u for u, keys in hubs_on.items() if len(keys) > 1)
    for u, on in claimed.items():
        if any(w for *_, w in on) and len(on) > 1:
            problems.append(f"claims: {u} whole and shared: {on}")
        elif sum(m for m, _, w in on if not w) > CARD_MIB or sum(c for _, c, w in on if not w) > 100:
            problems.append(f"claims: {u} over capacity: {on}")
    return problems, shared


def _pod(emu, allocation: Allocation, namespace: str) -> str:
    """The pod a spawner would start for ``allocation`` (labelled and annotated as ours)."""
    pod = f"p-{allocation.id}"[:63].lower()
    emu.create(
        {
            "metadata": {
                "name": pod,
                "labels": C.allocation_labels(allocation),
                "annotations": C.allocation_annotations(allocation),
            },
            "spec": {"nodeName": allocation.node, "containers": [{"name": "main", "image": "registry.invalid/none:1"}]},
        },
        "pods",
        namespace,
    )
    return pod


def _claims_of(emu, claims_namespace: str, hub: str) -> set[str]:
    """The allocation ids ``hub`` holds in the claims objects."""
    return {
        aid
        for cm in emu.list("configmaps", claims_namespace, label_selector=f"{CLAIMS_LABEL}=true")
        for key, raw in (cm.get("data") or {}).items()
        if key == f"hub.{hub}"
        for aid in json.loads(raw)["claims"]
    }


async def _use(emu, hub: GPUAllocator, namespace: str, request: GPURequest, rng: random.Random) -> Allocation:
    """What a spawner does: take a slice, run a pod holding it a moment, stop the pod, release.
    Requests arrive within half a second (a burst), so both hubs queue and hold slices at once."""
    await asyncio.sleep(rng.uniform(0.0, 0.5))
    # what this test checks is safety (no card overbooked, no claim left), not how long a request
    # waits: 200 requests through two hubs on a machine loaded 7x over its cores (CI run on
    # 341ca89, load 13-15) had a whole-card request wait 22 s; 90 s still catches one starved
    allocation = await hub.allocate(request, timeout=90)
    pod = f"p-{allocation.id}"[:63].lower()
    emu.create(
        {
            "metadata": {
                "name": pod,
                "labels": C.allocation_labels(allocation),
                "annotations": C.allocation_annotations(allocation),
            },
            "spec": {"nodeName": allocation.node, "containers": [{"name": "main", "image": "registry.invalid/none:1"}]},
        },
        "pods",
        namespace,
    )
    await asyncio.sleep(rng.uniform(0.01, 0.06))
    emu.delete("pods", pod, namespace, grace_period_seconds=0)
    await hub.release(allocation.id)
    return allocation


async def test_two_hubs_racing_for_one_node_never_overbook_a_card_and_a_dead_hub_leaves_no_claim(
    kube_emulator,  # noqa: F811
):
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node, uuids = _node(emu, tag)
    ns_a, ns_b, ns_claims = _namespace(emu, "hub-a"), _namespace(emu, "hub-b"), _namespace(emu, "claims")
    hub_a, hub_b = _hub(ns_a, ns_claims, tag, ttl=3.0), _hub(ns_b, ns_claims, tag, ttl=3.0)
    rng = random.Random(15)
    try:
        await asyncio.gather(hub_a.ensure_started(), hub_b.ensure_started())
        # one card both hubs hold through the whole race, by construction (binpack): A's slice goes
        # on the first card of the empty node, B's beside it (the tightest card it fits, or the
        # first if B has not read A's claim yet); the race's slices then meet the other hub's there
        held_a = await hub_a.allocate(GPURequest(owner=Owner("held-a"), memory_mib=4096, cores_percent=10))
        held_b = await hub_b.allocate(GPURequest(owner=Owner("held-b"), memory_mib=4096, cores_percent=10))
        assert held_a.gpu_uuids == held_b.gpu_uuids, (held_a, held_b)
        held_pods = [(_pod(emu, held_a, ns_a), ns_a), (_pod(emu, held_b, ns_b), ns_b)]
        requests = []
        for i in range(200):
            hub, ns = (hub_a, ns_a) if i % 2 == 0 else (hub_b, ns_b)
            whole = i % 25 == 7
            memory, cores = rng.choice(SIZES)
            request = GPURequest(
                owner=Owner(user=f"u{i % 7}"), memory_mib=memory, cores_percent=cores, whole=whole, request_id=f"r{i}"
            )
            requests.append(_use(emu, hub, ns, request, rng))
        problems: list[str] = []
        shared_seen: set[str] = set()
        samples = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal samples
            while not done.is_set():
                found, shared = _over(emu, [ns_a, ns_b], ns_claims)
                problems.extend(found)
                shared_seen.update(shared)
                samples += 1
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        granted = await asyncio.gather(*requests)
        done.set()
        await watcher
        assert problems == []
        # the race really raced: writes met a newer object (409) or a claim was refused and decided again
        raced = hub_a.backend.claims.stats + hub_b.backend.claims.stats
        assert raced["stale"] + raced["refused"] > 0, raced
        assert len(granted) == 200 and hub_a.queue() == [] and hub_b.queue() == []
        assert samples > 20 and held_a.gpu_uuids[0] in shared_seen, "both hubs held one card through the race"
        # the race placed slices on the card both hubs held: an overbooking there would have shown
        assert any(held_a.gpu_uuids[0] in a.gpu_uuids for a in granted), "no race grant on the shared card"
        assert {a.node for a in granted} == {node}
        for pod, ns in held_pods:
            emu.delete("pods", pod, ns, grace_period_seconds=0)
        await hub_a.release(held_a.id)
        await hub_b.release(held_b.id)

        # the last slice: hub B holds one card whole and 30 GiB of the other; A may not take 20 GiB
        big = await hub_b.allocate(GPURequest(owner=Owner("b"), memory_mib=30720, cores_percent=50))
        whole = await hub_b.allocate(GPURequest(owner=Owner("b"), memory_mib=0, cores_percent=0, whole=True))
        assert {big.gpu_uuids[0], whole.gpu_uuids[0]} == set(uuids)
        try:
            await hub_a.allocate(GPURequest(owner=Owner("a"), memory_mib=20480, cores_percent=10), queue=False)
            raise AssertionError("hub A was granted a slice hub B holds")
        except PoolFull as e:
            assert "GPU" in e.message or "memory" in e.message
        assert {c["hub"] for c in hub_a.backend.held_elsewhere()} == {ns_b}
        # A's admin page shows B's slices as held by hub B, counted as used, never as A's slices
        view = await hub_pool_view(hub_a)
        cards = {g["uuid"]: g for n in view["nodes"] for g in n["gpus"]}
        held = cards[big.gpu_uuids[0]]["held_elsewhere"]
        assert [(h["hub"], h["memory_mib"], h["whole"]) for h in held] == [(ns_b, 30720, False)]
        assert cards[whole.gpu_uuids[0]]["used_memory_mib"] == CARD_MIB
        assert all(g["slices"] == [] for g in cards.values())
        labels = [seg["label"] for bar in gpu_bars(view) for seg in bar["memory"]]
        assert f"held by hub {ns_b}: 30 GiB" in labels

        # hub B dies (no release, no more renewal) while its 30 GiB notebook pod still runs
        held_pod = _pod(emu, big, ns_b)
        await hub_b.backend.stop()
        loop = asyncio.get_running_loop()

        async def b_claims_become(expected: set[str]) -> set[str]:
            deadline = loop.time() + 15
            while True:
                left = _claims_of(emu, ns_claims, ns_b)
                if left == expected or loop.time() > deadline:
                    return left
                await asyncio.sleep(0.1)

        # after the TTL, A's reconcile drops B's claims without a pod; the running pod keeps its own
        assert await b_claims_become({big.id}) == {big.id}
        # so the card B held whole is A's again, and A never gets the card B's pod still uses
        got = await hub_a.allocate(GPURequest(owner=Owner("a"), memory_mib=0, cores_percent=0, whole=True), timeout=5)
        assert got.gpu_uuids == whole.gpu_uuids
        # a pod B created as it died, for a grant whose claim never reached the ledger, is claimed
        # on B's behalf from the pod itself: the pods are the truth, not B's last write
        late = Allocation(
            id="late-b-1",
            owner=Owner("b"),
            node=node,
            gpu_uuids=big.gpu_uuids,
            memory_mib=4096,
            cores_percent=10,
            priority_class="default",
        )
        late_pod = _pod(emu, late, ns_b)
        assert await b_claims_become({big.id, late.id}) == {big.id, late.id}
        # the pods end: their claims go too
        emu.delete("pods", held_pod, ns_b, grace_period_seconds=0)
        emu.delete("pods", late_pod, ns_b, grace_period_seconds=0)
        assert await b_claims_become(set()) == set()
    finally:
        await _tear_down(emu, node, (ns_a, ns_b, ns_claims), hub_a, hub_b)


async def test_a_claim_that_would_overbook_a_card_is_refused_with_the_card_and_the_hubs(
    kube_emulator,  # noqa: F811
):
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node, uuids = _node(emu, tag)
    ns_a, ns_b, ns_claims = _namespace(emu, "hub-a"), _namespace(emu, "hub-b"), _namespace(emu, "claims")
    hub_a, hub_b = _hub(ns_a, ns_claims, tag), _hub(ns_b, ns_claims, tag)
    try:
        await asyncio.gather(hub_a.ensure_started(), hub_b.ensure_started())
        # both decide on a fresh view: B's grant is claimed first; A's stale view still shows room
        await hub_a.backend.inventory()
        b = await hub_b.allocate(GPURequest(owner=Owner("b"), memory_mib=0, cores_percent=0, whole=True))
        stale = Allocation(
            id="a-1",
            owner=Owner("a"),
            node=node,
            gpu_uuids=b.gpu_uuids,
            memory_mib=1024,
            cores_percent=10,
            priority_class="default",
        )
        try:
            await hub_a.backend.record(stale)
            raise AssertionError("a claim on a card held whole elsewhere was taken")
        except ClaimConflict as e:
            assert e.message == f"GPU {b.gpu_uuids[0]} is held whole by hub {ns_b}."
        # the other card is free: A's claim there lands
        other = next(u for u in uuids if u not in b.gpu_uuids)
        await hub_a.backend.record(
            Allocation(
                id="a-2",
                owner=Owner("a"),
                node=node,
                gpu_uuids=(other,),
                memory_mib=1024,
                cores_percent=10,
                priority_class="default",
            )
        )
        [cm] = emu.list("configmaps", ns_claims, label_selector=f"{CLAIMS_LABEL}=true")
        assert set(cm["data"]) == {f"hub.{ns_a}", f"hub.{ns_b}"}
        assert set(json.loads(cm["data"][f"hub.{ns_a}"])["claims"]) == {"a-2"}
    finally:
        await _tear_down(emu, node, (ns_a, ns_b, ns_claims), hub_a, hub_b)


async def test_a_restarted_hub_claims_again_what_its_pods_hold_and_a_gone_pod_frees_its_claim(
    kube_emulator,  # noqa: F811
):
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node, uuids = _node(emu, tag)
    ns_a, ns_claims = _namespace(emu, "hub-a"), _namespace(emu, "claims")
    first = _hub(ns_a, ns_claims, tag)
    second = None

    def claimed() -> set[str]:
        return {
            aid
            for cm in emu.list("configmaps", ns_claims, label_selector=f"{CLAIMS_LABEL}=true")
            for raw in (cm.get("data") or {}).values()
            for aid in json.loads(raw)["claims"]
        }

    try:
        allocation = await first.allocate(GPURequest(owner=Owner("a"), memory_mib=8192, cores_percent=20))
        pod = f"p-{allocation.id}"[:63].lower()
        emu.create(
            {
                "metadata": {
                    "name": pod,
                    "labels": C.allocation_labels(allocation),
                    "annotations": C.allocation_annotations(allocation),
                },
                "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.invalid/none:1"}]},
            },
            "pods",
            ns_a,
        )
        # the hub process ends without releasing; its successor rebuilds the ledger from the pods
        await first.backend.stop()
        second = _hub(ns_a, ns_claims, tag)
        await second.ensure_started()
        assert second.get(allocation.id) is not None
        assert second.backend.claims.mine.keys() == {allocation.id}
        assert claimed() == {allocation.id}
        # the first stopped cleanly (handed its entry over): the successor with its hub id claims
        # at once, without waiting for the TTL (30 s here)
        more = await second.allocate(GPURequest(owner=Owner("a"), memory_mib=4096, cores_percent=10), queue=False)
        assert claimed() == {allocation.id, more.id}
        await second.release(more.id)
        # the pod goes: the allocation is released and its claim leaves the ledger
        emu.delete("pods", pod, ns_a, grace_period_seconds=0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while claimed() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert claimed() == set() and second.get(allocation.id) is None
    finally:
        await _tear_down(emu, node, (ns_a, ns_claims), first, second)


async def test_a_missing_claims_namespace_refuses_the_grant_with_a_sentence(kube_emulator):  # noqa: F811
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node, _ = _node(emu, tag)
    ns_a = _namespace(emu, "hub-a")
    hub_a = _hub(ns_a, f"no-such-{tag}", tag)
    try:
        with pytest.raises(PoolFull, match=f"The GPU claims namespace 'no-such-{tag}' does not exist"):
            await hub_a.allocate(GPURequest(owner=Owner("a"), memory_mib=1024, cores_percent=10), queue=False)
        assert hub_a.state.allocations == {}
    finally:
        await _tear_down(emu, node, (ns_a,), hub_a)


async def test_two_hub_processes_with_one_hub_id_never_both_grant_and_the_second_takes_over_once_the_first_is_silent(
    kube_emulator,  # noqa: F811
    caplog,
):
    """A second hub process with the same hub id (a Deployment with 2 replicas, a second hub
    started by mistake): it must not grant from the shared pool while the first renews its
    entry, says why, and takes over by itself once the first has been silent for the TTL."""
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node, uuids = _node(emu, tag)
    ns_a, ns_claims = _namespace(emu, "hub-a"), _namespace(emu, "claims")
    ttl = 3.0
    first, second = _hub(ns_a, ns_claims, tag, ttl=ttl), _hub(ns_a, ns_claims, tag, ttl=ttl)
    loop = asyncio.get_running_loop()
    try:
        await first.ensure_started()
        held = await first.allocate(GPURequest(owner=Owner("a"), memory_mib=0, cores_percent=0, whole=True))
        await second.ensure_started()
        # the second process may not grant a card: one card is the first's, and its own view of
        # the ledger cannot tell its grants from the first's
        whole = GPURequest(owner=Owner("b"), memory_mib=0, cores_percent=0, whole=True)
        for _ in range(2):
            with pytest.raises(PoolFull, match=f"another hub process uses hub id {ns_a} in namespace {ns_a}"):
                await second.allocate(whole, queue=False)
        assert second.state.allocations == {}
        assert _claims_of(emu, ns_claims, ns_a) == {held.id}, "the first's claim was overwritten"
        assert "c.KubernetesPool.hub_id" in caplog.text
        # the first keeps granting; this grant's pod starts after the second process did
        later = await first.allocate(GPURequest(owner=Owner("a"), memory_mib=4096, cores_percent=10))
        assert later.gpu_uuids != held.gpu_uuids
        later_pod = _pod(emu, later, ns_a)
        # the first process dies (no hand-over); it renewed last at most a reconcile ago
        first.backend._task.cancel()
        await first.backend.reflector.stop()
        died = loop.time()
        # the second grants within the TTL of the first's last renewal (waiting, not refused): the
        # card the first held without a pod; the first's running pod keeps its claim
        got = await second.allocate(whole, timeout=ttl + 5)
        assert loop.time() - died <= ttl + 1.5, loop.time() - died
        assert got.gpu_uuids == held.gpu_uuids
        assert _claims_of(emu, ns_claims, ns_a) == {got.id, later.id}
        # that pod ends: its claim goes
        emu.delete("pods", later_pod, ns_a, grace_period_seconds=0)
        deadline = loop.time() + 5
        while _claims_of(emu, ns_claims, ns_a) != {got.id} and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert _claims_of(emu, ns_claims, ns_a) == {got.id}
    finally:
        await _tear_down(emu, node, (ns_a, ns_claims), first, second)


async def test_two_processes_of_one_hub_id_racing_for_their_first_claim_get_one_grant(
    kube_emulator,  # noqa: F811
):
    """Both start with an empty ledger and claim at once: the compare-and-swap lets one write
    land; the other reads it again, sees another instance's entry and refuses."""
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node, uuids = _node(emu, tag)
    ns_a, ns_claims = _namespace(emu, "hub-a"), _namespace(emu, "claims")
    one, two = _hub(ns_a, ns_claims, tag), _hub(ns_a, ns_claims, tag)
    try:
        await asyncio.gather(one.ensure_started(), two.ensure_started())
        whole = GPURequest(owner=Owner("a"), memory_mib=0, cores_percent=0, whole=True)
        results = await asyncio.gather(
            one.allocate(whole, queue=False), two.allocate(whole, queue=False), return_exceptions=True
        )
        granted = [r for r in results if isinstance(r, Allocation)]
        refused = [r for r in results if isinstance(r, PoolFull)]
        assert len(granted) == 1 and len(refused) == 1, results
        assert f"another hub process uses hub id {ns_a}" in refused[0].message
        assert _claims_of(emu, ns_claims, ns_a) == {granted[0].id}
    finally:
        await _tear_down(emu, node, (ns_a, ns_claims), one, two)


async def test_a_restarted_hub_whose_old_pod_is_gone_claims_at_once_and_one_whose_old_pod_runs_waits(
    kube_emulator,  # noqa: F811
):
    """A hub Deployment's restart (strategy Recreate: the old pod is gone before the new one
    starts; JupyterHub's shutdown stops no pool, so the old entry names a live-looking instance):
    the new process finds the old instance's pod gone and takes over at once, well within the
    TTL. While the old instance's pod still runs (two replicas), the new one is refused."""
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node, uuids = _node(emu, tag)
    ns_a, ns_claims = _namespace(emu, "hub-a"), _namespace(emu, "claims")
    ttl = 30.0

    def hub_in_pod(pod: str) -> GPUAllocator:
        emu.create(pod_manifest(pod, py("import time; time.sleep(600)"), nodeName=node), "pods", ns_a)
        emu.wait_for_pod_phase(pod, "Running", ns_a, timeout=20)
        return _hub(ns_a, ns_claims, tag, ttl=ttl, pod=pod)

    first = hub_in_pod("hub-old")
    second = third = fourth = None
    loop = asyncio.get_running_loop()
    try:
        held = await first.allocate(GPURequest(owner=Owner("a"), memory_mib=0, cores_percent=0, whole=True))
        # two replicas: the old pod runs, so the second is refused as before
        second = hub_in_pod("hub-replica")
        whole = GPURequest(owner=Owner("b"), memory_mib=0, cores_percent=0, whole=True)
        with pytest.raises(PoolFull, match=f"another hub process uses hub id {ns_a}"):
            await second.allocate(whole, queue=False)
        assert second.state.allocations == {}
        await second.backend.stop()
        emu.delete("pods", "hub-replica", ns_a, grace_period_seconds=0)
        # the restart: the old process dies without stopping its pool, its pod is deleted, the
        # new pod's process starts and grants the card the old one held (no pod) at once
        first.backend._task.cancel()
        await first.backend.reflector.stop()
        died = loop.time()
        emu.delete("pods", "hub-old", ns_a, grace_period_seconds=0)
        third = hub_in_pod("hub-new")
        got = await third.allocate(whole, queue=False)
        assert loop.time() - died < ttl / 3, loop.time() - died
        assert got.gpu_uuids == held.gpu_uuids
        assert _claims_of(emu, ns_claims, ns_a) == {got.id}
        # a StatefulSet's restart: a new pod of the same name (another uid) replaces the old one
        third.backend._task.cancel()
        await third.backend.reflector.stop()
        await third.release(got.id)
        died = loop.time()
        emu.delete("pods", "hub-new", ns_a, grace_period_seconds=0)
        emu.wait_for(lambda: emu.get("pods", "hub-new", ns_a) is None, message="hub-new deleted")
        fourth = hub_in_pod("hub-new")
        again = await fourth.allocate(whole, queue=False)
        assert loop.time() - died < ttl / 3, loop.time() - died
        assert _claims_of(emu, ns_claims, ns_a) == {again.id}
    finally:
        await _tear_down(emu, node, (ns_a, ns_claims), first, second, third, fourth)


def test_the_hub_pod_is_hostname_and_pod_namespace_in_a_pod_and_none_outside(monkeypatch):
    from hubext.kubernetes.pool import KubernetesPool

    monkeypatch.setenv("HOSTNAME", "hub-7d9f-abcde")
    monkeypatch.setenv("POD_NAMESPACE", "jhub")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert KubernetesPool().hub_pod_name == "", "outside a pod, HOSTNAME is the machine's name"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    pool = KubernetesPool(namespace="users")
    assert (pool.hub_pod_name, pool.hub_pod_namespace) == ("hub-7d9f-abcde", "jhub")
    monkeypatch.delenv("POD_NAMESPACE")
    assert KubernetesPool(namespace="users").hub_pod_namespace == "users"


async def test_a_hub_that_stalled_past_the_ttl_does_not_write_back_a_claim_another_hub_gave_out(
    kube_emulator,  # noqa: F811
):
    """A live hub whose event loop stalls longer than the TTL (a loaded machine) renews nothing;
    another hub drops its claims that no pod backs yet (as if it had died) and gives that room out.
    When the stalled hub wakes, its launcher creates the pod for its grant and its next renewal
    wrote the lapsed claim back unchecked: the card's claims overbooked (seen in a CI run of
    test_claims_two_hub_processes.py: five claims, 56 GiB of 40 GiB). A lapsed claim is a new claim:
    checked like one, and where it no longer fits, the grant is lost: its pod is deleted with an
    event that says why and the allocator releases it."""
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node, uuids = _node(emu, tag)
    ns_a, ns_b, ns_claims = _namespace(emu, "hub-a"), _namespace(emu, "hub-b"), _namespace(emu, "claims")
    hub_a, hub_b = _hub(ns_a, ns_claims, tag, ttl=1.5), _hub(ns_b, ns_claims, tag, ttl=1.5)
    loop = asyncio.get_running_loop()

    async def until(what: str, done, seconds: float = 15.0) -> None:
        deadline = loop.time() + seconds
        while not done():
            assert loop.time() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    try:
        await asyncio.gather(hub_a.ensure_started(), hub_b.ensure_started())
        # B runs a small kernel (its pod backs its claim) and is granted a large one
        small = await hub_b.allocate(GPURequest(owner=Owner("b"), memory_mib=4096, cores_percent=10), queue=False)
        _pod(emu, small, ns_b)
        lapsed = await hub_b.allocate(GPURequest(owner=Owner("b"), memory_mib=20480, cores_percent=50), queue=False)
        # B stalls: its reconcile (which renews its claims) does not run
        hub_b.backend._task.cancel()
        await until("A to rebuild B's claims from its pods", lambda: _claims_of(emu, ns_claims, ns_b) == {small.id})
        taken = []
        while True:  # A gives out every card, the room B's lapsed claim held among it
            try:
                taken.append(
                    await hub_a.allocate(GPURequest(owner=Owner("a"), memory_mib=20480, cores_percent=50), queue=False)
                )
            except PoolFull:
                break
        assert len(taken) == 3, taken
        problems: list[str] = []

        def watch() -> None:
            found, _ = _over(emu, [ns_a, ns_b], ns_claims)
            problems.extend(p for p in found if p.startswith("claims"))

        # B's launcher creates the pod of its lapsed grant while B's claims are still A's to rebuild:
        # A lists it among B's pods, and leaves it out (its room is A's now)
        pod = _pod(emu, lapsed, ns_b)
        created = time.time()
        ledger_a = hub_a.backend.claims

        listed: list[float] = []

        def listed_again() -> bool:  # A listed the late pod, and synced once more after that
            watch()
            if lapsed.id in (ledger_a.running or {}) and ledger_a.running_at > created:
                listed.append(ledger_a.running_at)
            return bool(listed) and ledger_a.running_at > listed[0]

        await until("A to list B's pods again since the late pod", listed_again)
        assert _claims_of(emu, ns_claims, ns_b) == {small.id} and problems == [], problems[:2]
        hub_b.backend._task = asyncio.ensure_future(hub_b.backend._reconcile_forever())

        def settled() -> bool:
            watch()
            gone = emu.get("pods", pod, ns_b)
            return hub_b.get(lapsed.id) is None and (gone is None or bool(gone["metadata"].get("deletionTimestamp")))

        try:
            await until("B to give its lapsed grant up and delete its pod", settled)
        except AssertionError as e:
            raise AssertionError(f"{e}; the claims meanwhile: {problems[:2]}") from None
        for _ in range(10):  # and B never writes the claim back afterwards
            settled()
            await asyncio.sleep(0.1)
        assert problems == [], problems[:3]
        assert _claims_of(emu, ns_claims, ns_b) == {small.id} and hub_b.get(small.id) is not None
        events = [e for e in emu.list("events", ns_b) if e.get("involvedObject", {}).get("name") == pod]
        assert any("claims_ttl_seconds" in e.get("message", "") for e in events), events
        # once the pod is gone, B forgets the lapsed grant within a TTL: a hub that stalls now and
        # then does not keep every grant it ever lost (each reconcile scanned its pods per lost grant)
        await until("the lapsed grant's pod to be gone", lambda: emu.get("pods", pod, ns_b) is None, 30)
        await until("B to forget the lapsed grant", lambda: lapsed.id not in hub_b.backend.claims.lost)
        assert lapsed.id not in hub_b.backend._lapsed_told
    finally:
        await _tear_down(emu, node, (ns_a, ns_b, ns_claims), hub_a, hub_b)


async def test_a_grant_the_ledger_refuses_is_not_offered_again_on_the_view_it_was_refused_on(
    kube_emulator,  # noqa: F811
):
    """Hub B has not yet seen that hub A holds both cards whole. Ten of B's requests arrive at
    once: the first pass over B's queue grants two of them on what B last read, and the ledger
    refuses both. The pool was re-read only after the pass had let go of the allocator's lock, so
    every other caller's pass came first and was refused again on the same stale view (seen in the
    two-hub-process test: one grant taken back 50 times in 0.4 s, a GET of the claims each).
    Re-read under the same lock, only the first pass meets the refusals."""
    emu, tag = kube_emulator, uuid.uuid4().hex[:6]
    node, uuids = _node(emu, tag)
    ns_a, ns_b, ns_claims = _namespace(emu, "hub-a"), _namespace(emu, "hub-b"), _namespace(emu, "claims")
    hub_a, hub_b = _hub(ns_a, ns_claims, tag), _hub(ns_b, ns_claims, tag)
    hub_b.backend.reconcile_interval_seconds = 60  # B reads the others' claims only when refused
    try:
        await asyncio.gather(hub_a.ensure_started(), hub_b.ensure_started())
        for _ in uuids:
            await hub_a.allocate(GPURequest(owner=Owner("a"), memory_mib=CARD_MIB, cores_percent=100, whole=True))
        # ten requests arrive while a pass holds B's allocator (as under load: many callers queue on it)
        async with hub_b._lock:
            calls = [
                asyncio.ensure_future(
                    hub_b.allocate(GPURequest(owner=Owner(f"b{i}"), memory_mib=4096, cores_percent=10), timeout=2)
                )
                for i in range(10)
            ]
            await asyncio.sleep(0.1)
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, PoolFull) for r in results), results
        refused = hub_b.backend.claims.stats["refused"]
        assert refused <= 2, f"{refused} grants refused by the ledger, on a view known to be stale after the first"
    finally:
        await _tear_down(emu, node, (ns_a, ns_b, ns_claims), hub_a, hub_b)
