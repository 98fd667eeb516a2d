"""The cluster-wide ledger of GPU claims: one ConfigMap per GPU node, changed by compare-and-swap.

Every hub that slices a node's cards writes its claims on that node into one ConfigMap
(``elastic-gpu-claims.<node>`` in a namespace all hubs share), under its own key
``hub.<hub id>``: ``{"renewed_at": <unix time>, "claims": {<allocation id>: {"gpus": [...],
"memory_mib": .., "cores_percent": .., "whole": ..}}}``. A claim is taken by replacing the
object with the ``resourceVersion`` last read (the API server refuses a stale one with 409
Conflict); on a conflict the object is read again and the check repeated, so of two hubs
racing for the last slice exactly one write lands and the other sees the winner's claim.

The check is the physical one: on every card of the claim, all hubs' claims together stay
within the card's memory and compute capacity, and a whole-card claim shares its card with
nothing. A hub renews its key; any hub drops the key of a hub that did not renew for
``ttl`` seconds (so a hub that died leaves nothing behind after the others' next sync).
Each entry also names the namespace of its hub's pods (``"namespace"``): when a hub went
silent, the others rebuild its claims from its pods that still run there (a dead hub's
notebooks still use the cards, whatever its last write held).

Each hub process also writes its random ``"instance"`` id (new at every start) in its entries.
Two processes with one hub id (two replicas, a second hub started with the same config) would
each take the other's claims for their own and overwrite them; so a process that finds its hub
id's entry written by another instance that renewed it within ``ttl`` writes nothing and grants
nothing (:class:`HubIdInUse`) until that instance has been silent for ``ttl``. A process that
stops cleanly removes its instance id from its entries (:meth:`ClaimsLedger.hand_over`), so its
successor takes over at once; so does one that finds the other instance's pod gone (:mod:`.hubpod`).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import replace
from logging import Logger
from typing import Any
from uuid import uuid4

from kubernetes_asyncio.client.rest import ApiException

from libvgpu import contract as C
from quotas import GPU

from ..backends import ClaimConflict
from .claimroom import Claim, lapsed_out, overbooked
from .hubpod import entry_pods, own_pod, why_gone
from .rest import call_json

#: label of every claims object (the hubs list them by it)
CLAIMS_LABEL = C.PREFIX + "gpu-claims"
#: key prefix of one hub's entry in a claims object
HUB_KEY = "hub."
#: seconds between two reads of the pod of another live instance of this hub id
POD_RECHECK_SECONDS = 2.0
_HUB_ID = re.compile(r"^[-._a-zA-Z0-9]{1,200}$")


def valid_hub_id(hub_id: str) -> bool:
    """Whether ``hub_id`` can be part of a ConfigMap key (letters, digits, '-', '_', '.')."""
    return bool(_HUB_ID.match(hub_id))


def object_name(node: str) -> str:
    """The claims object of a node (node names are DNS subdomains, so this is one too)."""
    return f"elastic-gpu-claims.{node}"[:253]


class HubIdInUse(ClaimConflict):
    """Another live hub process writes this hub's id: this process may not claim (see the
    module docstring); ``message`` names the hub id, the other instance and what to change."""


def _field(obj: Mapping[str, Any] | None, name: str) -> dict[str, str]:
    """Per hub: the string ``name`` of its entry in a claims object (entries without it left out)."""
    found = {}
    for key, raw in ((obj or {}).get("data") or {}).items():
        try:
            value = json.loads(raw).get(name) if key.startswith(HUB_KEY) else None
        except (ValueError, AttributeError):
            continue
        if isinstance(value, str) and value:
            found[key[len(HUB_KEY) :]] = value
    return found


def namespaces(obj: Mapping[str, Any] | None) -> dict[str, str]:
    """Per hub: the namespace of its pods, as its entry in a claims object names it."""
    return _field(obj, "namespace")


def instances(obj: Mapping[str, Any] | None) -> dict[str, str]:
    """Per hub: the instance id of the hub process that last wrote its entry (none: an entry
    handed over by a process that stopped, or written before instance ids existed)."""
    return _field(obj, "instance")


def parse(obj: Mapping[str, Any] | None, node: str) -> dict[str, tuple[float, list[Claim]]]:
    """Per hub: (renewed_at, claims) from a claims object; malformed entries are skipped."""
    hubs: dict[str, tuple[float, list[Claim]]] = {}
    for key, raw in ((obj or {}).get("data") or {}).items():
        if not key.startswith(HUB_KEY):
            continue
        hub = key[len(HUB_KEY) :]
        try:
            entry = json.loads(raw)
            claims = [
                Claim(
                    hub,
                    str(aid),
                    node,
                    tuple(str(u) for u in c["gpus"]),
                    int(c["memory_mib"]),
                    int(c["cores_percent"]),
                    bool(c.get("whole")),
                )
                for aid, c in (entry.get("claims") or {}).items()
            ]
            hubs[hub] = (float(entry.get("renewed_at", 0)), claims)
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return hubs


class ClaimsLedger:
    """This hub's side of the cluster-wide ledger (see the module docstring). Not thread-safe;
    one asyncio loop."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        hub_id: str,
        ttl_seconds: float,
        timeout: float,
        log: Logger,
        pod_namespace: str = "",
        instance: str = "",
    ) -> None:
        self.api, self.namespace, self.hub_id = api, namespace, hub_id
        #: this process's id in its entries (random per start: tells two processes of one hub id apart)
        self.instance = instance or uuid4().hex[:12]
        #: (instance, node, renewed_at) of another live process writing this hub id, as last read
        self.rival: tuple[str, str, float] | None = None
        #: where this hub's pods live (written in its entry, for the others to check its pods)
        self.pod_namespace = pod_namespace
        self.ttl, self.timeout, self.log = ttl_seconds, timeout, log
        #: the last claims object seen per node (what a compare-and-swap starts from)
        self._objects: dict[str, dict[str, Any]] = {}
        #: this hub's claims by allocation id
        self.mine: dict[str, Claim] = {}
        self._renewed: dict[str, float] = {}
        self._lock = asyncio.Lock()
        #: what the writes met: 'written', 'stale' (409/404: read again), 'refused' (ClaimConflict)
        self.stats: Counter[str] = Counter()
        #: allocation id -> (namespace, claim with no hub) of every GPU pod running anywhere in the
        #: cluster, as last listed (None: unknown, then a silent hub's claims go after the TTL
        #: whatever runs)
        self.running: dict[str, tuple[str, Claim]] | None = None
        #: when ``running`` was last asked for (a silent hub is rebuilt, or expired where pods
        #: cannot be listed, only after a list asked for since it went silent: an older list may
        #: lack its newer pods, and an empty rebuild drops its entry and with it the namespace
        #: that lets its pods be found later)
        self.running_at = 0.0
        #: set by hand_over: this process's entries no longer name it
        self._leaving = False
        #: allocation ids of the pods that run in this hub's namespace (set by the pool): when this
        #: process takes over its hub id's entry from another process, it keeps that process's
        #: claims whose pods still run (``adopted``) until they end
        self.pods_here: Callable[[], Collection[str]] | None = None
        self.adopted: set[str] = set()
        #: the pod this process runs in (namespace, name, uid), written in its entries (set by
        #: :meth:`find_own_pod`; None: not in a pod, or its pod could not be read)
        self.pod: dict[str, str] | None = None
        #: other instances of this hub id whose pod is gone: their entries are this process's to take
        self._gone: set[str] = set()
        #: instance -> when its pod was last read and found running
        self._pod_checked: dict[str, float] = {}
        #: the cards' capacities (set by the pool from its inventory): what a lapsed claim is checked against
        self.gpus: Mapping[str, GPU] = {}
        #: allocation id -> why: grants whose claims lapsed and no longer fit (:func:`.claimroom.lapsed_out`);
        #: the pool deletes their pods and releases them
        self.lost: dict[str, str] = {}

    # ---- reading ------------------------------------------------------------------------

    async def _call(self, method: Callable, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await call_json(method, *args, timeout=self.timeout, **kwargs)

    async def _read(self, node: str) -> dict[str, Any]:
        try:
            return await self._call(self.api.read_namespaced_config_map, object_name(node), self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            return {"metadata": {}, "data": {}}  # no resourceVersion: the write creates it

    async def refresh(self) -> None:
        """Read every claims object (one list call)."""
        async with self._lock:
            await self._refresh()

    async def _refresh(self) -> None:
        result = await self._call(
            self.api.list_namespaced_config_map, self.namespace, label_selector=f"{CLAIMS_LABEL}=true"
        )
        objects = {}
        for obj in result.get("items", []):
            node = ((obj.get("metadata") or {}).get("annotations") or {}).get(CLAIMS_LABEL)
            if node:
                objects[node] = obj
        self._objects = objects
        for node, obj in sorted(objects.items()):
            await self._rival_gone(node, obj)
        self._find_rival(time.time())

    async def find_own_pod(self, name: str, namespace: str) -> None:
        """Called by the pool's ``start`` when the hub runs in a pod: its uid goes in this
        process's entries (:mod:`.hubpod`); a pod that cannot be read is not written."""
        try:
            self.pod = await own_pod(self.api, name, namespace, self.timeout)
        except (ApiException, asyncio.TimeoutError) as e:
            self.log.warning(
                "Cannot read this hub's pod %s/%s (%s): a hub process replacing this one waits "
                "claims_ttl_seconds (%.0f s) before it grants GPUs.",
                *(namespace, name, getattr(e, "reason", None) or type(e).__name__, self.ttl),
            )

    async def _rival_gone(self, node: str, obj: Mapping[str, Any]) -> bool:
        """Whether the other instance that renewed this hub id's entry on ``node`` within the TTL
        is provably gone (:func:`.hubpod.why_gone`); then this process takes the entry over now."""
        now = time.time()
        rival, pod = self._rival_on(node, obj, now), entry_pods(obj, HUB_KEY).get(self.hub_id)
        if rival is None or pod is None or now - self._pod_checked.get(rival[0], 0.0) < POD_RECHECK_SECONDS:
            return False
        where = f"{pod['namespace']}/{pod['name']}"
        try:
            why = await why_gone(self.api, pod, self.timeout)
        except (ApiException, asyncio.TimeoutError) as e:
            why = ""
            self.log.warning("Cannot read pod %s of hub id %s's other instance: %s", where, self.hub_id, e)
        if not why:
            self._pod_checked[rival[0]] = now
            return False
        self._gone.add(rival[0])
        self.log.warning(
            "Hub id %s: the pod %s of instance %s %s; this hub process (instance %s) takes over its "
            "claims entries now.",
            *(self.hub_id, where, rival[0], why, self.instance),
        )
        return True

    def _rival_on(self, node: str, obj: Mapping[str, Any], now: float) -> tuple[str, str, float] | None:
        """(instance, node, renewed_at) when this hub id's entry on ``node`` was renewed within
        the TTL by another process."""
        entry = parse(obj, node).get(self.hub_id)
        other = instances(obj).get(self.hub_id, "")
        if entry is not None and other and other not in (self.instance, *self._gone) and now - entry[0] <= self.ttl:
            return (other, node, entry[0])
        return None

    def _find_rival(self, now: float) -> None:
        """Update :attr:`rival` from the objects as last read; say so when it appears or goes."""
        found = next(
            (r for node, obj in sorted(self._objects.items()) if (r := self._rival_on(node, obj, now))), None
        )
        if found and not self.rival:
            self.log.error("%s", self.rival_message(found, now))
        elif self.rival and not found and self.rival[0] not in self._gone:
            self.log.warning(
                "Hub id %s: instance %s has been silent for %.0f s; this hub process (instance %s) "
                "claims GPUs again.",
                self.hub_id,
                self.rival[0],
                now - self.rival[2],
                self.instance,
            )
        self.rival = found

    def rival_message(self, rival: tuple[str, str, float], now: float | None = None) -> str:
        """The sentence a refused grant and the log carry while another process uses this hub id."""
        now = time.time() if now is None else now
        instance, node, renewed_at = rival
        return (
            f"another hub process uses hub id {self.hub_id} in namespace {self.pod_namespace} "
            f"(instance {instance}, last seen {max(0.0, now - renewed_at):.0f} s ago on node {node}; "
            f"this is instance {self.instance}); give each hub its own c.KubernetesPool.hub_id or "
            f"run one replica. This hub process grants no GPU until the other has been silent for "
            f"{self.ttl:.0f} s."
        )

    def _others_live(
        self, hubs: dict[str, tuple[float, list[Claim]]], now: float, node: str, where: Mapping[str, str]
    ) -> dict[str, tuple[float, list[Claim]]]:
        """Other hubs' entries that still hold: renewed within the TTL; or, for a hub that went
        silent, what its pods on ``node`` that still run hold (``running``; ``where`` names each
        hub's namespace), renewed on its behalf: the pods are the truth, and a dead hub's running
        notebooks still use the cards. A pod its entry does not claim (a grant that lapsed while
        that hub stalled, whose pod came late) is added only where it fits beside every other
        claim: its room went to others, and that hub gives it up when it wakes."""
        live, unclaimed = {}, {}
        for hub, (renewed_at, claims) in hubs.items():
            if hub == self.hub_id:
                continue
            if now - renewed_at <= self.ttl:
                live[hub] = (renewed_at, claims)
            elif self.running_at <= renewed_at + self.ttl:
                # no pod list made since it went silent (a claim taken between two syncs, or
                # before the first): keep its entry as it is; the next sync lists and decides
                live[hub] = (renewed_at, claims)
            elif self.running is not None:
                if where.get(hub):
                    pods = [
                        replace(claim, hub=hub)
                        for namespace, claim in self.running.values()
                        if namespace == where[hub] and claim.node == node
                    ]
                else:  # an entry that does not name its namespace: keep what still has a pod
                    pods = [replace(c, hub=hub) for c in claims if c.allocation_id in self.running]
                held = {c.allocation_id for c in claims}
                live[hub] = (now, [c for c in pods if c.allocation_id in held])
                unclaimed[hub] = [c for c in pods if c.allocation_id not in held]
        for hub, pods in sorted(unclaimed.items()):
            others = [c for _, claims in live.values() for c in claims]
            others += [c for c in self.mine.values() if c.node == node]
            left_out = lapsed_out(self.gpus, others, pods, (), self.ttl)
            live[hub][1].extend(c for c in pods if c.allocation_id not in left_out)
        return {
            hub: (renewed_at, sorted(claims, key=lambda c: c.allocation_id))
            for hub, (renewed_at, claims) in live.items()
            if claims
        }

    def silent_hubs(self, now: float | None = None) -> set[str]:
        """Other hubs whose entries (as last read) were not renewed within the TTL."""
        now = time.time() if now is None else now
        return {
            hub
            for node, obj in self._objects.items()
            for hub, (renewed_at, _) in parse(obj, node).items()
            if hub != self.hub_id and now - renewed_at > self.ttl
        }

    def others(self, now: float | None = None) -> list[Claim]:
        """Live claims of other hubs (as last read), on every node; and those taken over from
        another process of this hub id (``adopted``: this process's allocator does not hold them)."""
        now = time.time() if now is None else now
        return [
            c
            for node, obj in self._objects.items()
            for _, claims in self._others_live(parse(obj, node), now, node, namespaces(obj)).values()
            for c in claims
        ] + [self.mine[a] for a in sorted(self.adopted) if a in self.mine]

    # ---- writing ------------------------------------------------------------------------

    def _body(
        self, node: str, obj: Mapping[str, Any], hubs: dict[str, tuple[float, list[Claim]]], where: Mapping[str, str]
    ) -> dict:
        meta: dict[str, Any] = {
            "name": object_name(node),
            "namespace": self.namespace,
            "labels": {CLAIMS_LABEL: "true"},
            "annotations": {CLAIMS_LABEL: node},
        }
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            meta["resourceVersion"] = version
        where = {**where, self.hub_id: self.pod_namespace}
        who = {**instances(obj), self.hub_id: "" if self._leaving else self.instance}
        their_pods: dict[str, Any] = {**entry_pods(obj, HUB_KEY), self.hub_id: None if self._leaving else self.pod}
        data = {
            HUB_KEY + hub: json.dumps(
                {
                    "renewed_at": renewed_at,
                    "claims": {c.allocation_id: c.to_json() for c in claims},
                    **({"namespace": where[hub]} if where.get(hub) else {}),
                    **({"instance": who[hub]} if who.get(hub) else {}),
                    **({"pod": their_pods[hub]} if their_pods.get(hub) else {}),
                },
                sort_keys=True,
            )
            for hub, (renewed_at, claims) in sorted(hubs.items())
            if claims
        }
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}

    async def _swap(
        self, node: str, check: Callable[[list[Claim]], None] | None = None, force: bool = False, taking: str = ""
    ) -> bool:
        """Write this hub's claims on ``node`` (and drop expired hubs) by compare-and-swap; ``check``
        sees every live claim after the change and raises ClaimConflict to refuse it (``taking``:
        the allocation id of the claim it checks). A claim of this hub that the object does not
        hold (it lapsed) is written back only where it still fits (:func:`.claimroom.lapsed_out`).
        Returns whether it wrote."""
        for attempt in range(50):
            obj = self._objects.get(node)
            cached = obj is not None
            if obj is None:
                obj = self._objects[node] = await self._read(node)
            now = time.time()
            rival = self._rival_on(node, obj, now)
            if rival is not None:
                if cached:
                    self._objects.pop(node, None)  # seen in what we last read: read it fresh first
                    continue
                if await self._rival_gone(node, obj):
                    continue  # its pod is gone: take its entry over
                if not self.rival:
                    self.log.error("%s", self.rival_message(rival, now))
                self.rival = rival
                self.stats["refused"] += 1
                raise HubIdInUse(self.rival_message(rival, now))
            hubs, where = parse(obj, node), namespaces(obj)
            live = self._others_live(hubs, now, node, where)
            if self.hub_id in hubs and instances(obj).get(self.hub_id, "") != self.instance:
                self._adopt(hubs[self.hub_id][1])
            mine = [c for c in self.mine.values() if c.node == node]
            held = {c.allocation_id for c in hubs.get(self.hub_id, (0.0, []))[1]} | {taking}
            others = [c for _, claims in live.values() for c in claims]
            lost = lapsed_out(self.gpus, others, mine, held, self.ttl)
            if lost and cached:
                self._objects.pop(node, None)  # decided on what we last saw: read it fresh first
                continue
            for allocation_id, why in lost.items():
                self.mine.pop(allocation_id, None)
                self.adopted.discard(allocation_id)
                self.lost[allocation_id] = why
                self.log.warning("%s", why)
            mine = [c for c in mine if c.allocation_id not in lost]
            if check is not None:
                try:
                    check(others + mine)
                except ClaimConflict:
                    if not cached:
                        self.stats["refused"] += 1
                        raise
                    self._objects.pop(node, None)  # refused on what we last saw: read it fresh first
                    continue
            new = dict(live)
            new[self.hub_id] = (now, mine)
            old_mine = hubs.get(self.hub_id, (0.0, []))[1]
            if (
                not force
                and (not mine or instances(obj).get(self.hub_id, "") == ("" if self._leaving else self.instance))
                and all(hubs.get(h) == v for h, v in live.items())
                and live.keys() == hubs.keys() - {self.hub_id}
                and sorted(old_mine, key=lambda c: c.allocation_id) == sorted(mine, key=lambda c: c.allocation_id)
            ):
                return False  # nothing to change (renewal is forced by the caller when due)
            body = self._body(node, obj, new, where)
            exists = bool((obj.get("metadata") or {}).get("resourceVersion"))
            try:
                if exists:
                    written = await self._call(
                        self.api.replace_namespaced_config_map, object_name(node), self.namespace, body
                    )
                else:
                    written = await self._call(self.api.create_namespaced_config_map, self.namespace, body)
            except ApiException as e:
                if e.status == 404 and not exists:  # a create in a namespace that is not there
                    raise ClaimConflict(
                        f"The GPU claims namespace {self.namespace!r} does not exist; create it (the chart "
                        "does) or set KubernetesPool.claims_namespace to an existing namespace."
                    ) from None
                if e.status in (404, 409):  # someone else wrote (or deleted) it first: read again
                    self._objects.pop(node, None)
                    self.stats["stale"] += 1
                    # a random pause, so two hubs that keep colliding fall out of step
                    await asyncio.sleep(random.uniform(0, 0.001 * min(attempt, 20)))
                    continue
                raise
            self._objects[node] = written
            self._renewed[node] = now
            self.stats["written"] += 1
            return True
        raise ClaimConflict(f"The claims on node {node} changed 50 times while this hub tried to write; try again.")

    def _adopt(self, claims: list[Claim]) -> None:
        """Taking over this hub id's entry from another process (silent past the TTL, or handed
        over): its claims whose pods still run in this hub's namespace stay claimed, as this
        process's, until their pods end (the pool drops them then)."""
        running = set(self.pods_here()) if self.pods_here is not None else set()
        for claim in claims:
            if claim.allocation_id in running and claim.allocation_id not in self.mine:
                self.mine[claim.allocation_id] = claim
                self.adopted.add(claim.allocation_id)

    async def take(self, claim: Claim) -> None:
        """Add ``claim`` to the cluster ledger (checked against :attr:`gpus`), or raise
        ClaimConflict (nothing written)."""

        def check(claims: list[Claim]) -> None:
            why = overbooked(self.gpus, claims, claim)
            if why:
                raise ClaimConflict(why)

        async with self._lock:
            self._find_rival(time.time())
            if self.rival is not None:  # on any node: this process's view of its hub's claims is not its own
                self.stats["refused"] += 1
                raise HubIdInUse(self.rival_message(self.rival))
            self.mine[claim.allocation_id] = claim
            try:
                await self._swap(claim.node, check, force=True, taking=claim.allocation_id)
            except BaseException:
                self.mine.pop(claim.allocation_id, None)
                raise

    async def drop(self, allocation_id: str) -> None:
        """Release this hub's claim of an allocation (idempotent). Nothing is written now: the
        release reaches the ledger with this hub's next claim on that node or its next
        :meth:`sync`, whichever comes first (half the writes, so hubs collide less)."""
        self.mine.pop(allocation_id, None)

    async def sync(self, running: Callable[[], Awaitable[dict[str, tuple[str, Claim]] | None]] | None = None) -> None:
        """Re-read every claims object, renew this hub's entries that are due, and drop the
        entries of hubs that stopped renewing (and this hub's stale ones). ``running`` lists
        the allocations that have pods; it is asked only when some hub went silent."""
        async with self._lock:
            await self._refresh()
            if running is not None and self.silent_hubs():
                listed_at = time.time()
                self.running = await running()
                self.running_at = listed_at
            if self.rival is not None:
                return  # another process writes this hub id: write nothing over its entries
            now = time.time()
            nodes = set(self._objects) | {c.node for c in self.mine.values()}
            for node in sorted(nodes):
                due = now - self._renewed.get(node, 0.0) >= self.ttl / 3
                mine_here = any(c.node == node for c in self.mine.values())
                try:
                    await self._swap(node, force=due and mine_here)
                except (ApiException, ClaimConflict, asyncio.TimeoutError) as e:
                    self.log.warning("Could not update the GPU claims of node %s: %s", node, e)

    async def hand_over(self) -> None:
        """Called by the pool's ``stop``: write this hub's entries once more without this
        process's instance id, so a successor with the same hub id claims at once instead of
        waiting for the TTL. The claims stay (its pods may still run)."""
        async with self._lock:
            self._leaving = True
            for node, obj in sorted(self._objects.items()):
                if instances(obj).get(self.hub_id) != self.instance:
                    continue
                try:
                    await self._swap(node, force=True)
                except (ApiException, ClaimConflict, asyncio.TimeoutError) as e:
                    self.log.warning("Could not hand over the GPU claims of node %s: %s", node, e)

