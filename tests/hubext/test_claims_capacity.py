"""What other hubs' claims do to this hub's admission (pure: claims -> inventory -> decisions),
and the claims ledger's own checks."""

from __future__ import annotations

import logging

import pytest

from hubext.kubernetes.claimroom import Claim, overbooked, without
from hubext.kubernetes.claims import ClaimsLedger, parse, valid_hub_id
from hubext.kubernetes.pool import KubernetesPool
from quotas import ConfigError, PoolFull
from tests.quotas.builders import GIB, alloc, node, pool, req, state


def _held(pool_, *claims: Claim):
    return pool(*without(list(pool_.nodes), list(claims)))


def _claim(gpu: str, memory_gib: int = 40, cores: int = 50, whole: bool = False, hub: str = "research") -> Claim:
    return Claim(hub, f"{hub}-{gpu}-{memory_gib}", "a", (gpu,), memory_gib * GIB, cores, whole)


def test_a_request_that_fits_the_card_waits_for_room_another_hub_holds_it_is_not_rejected():
    st = state(_held(pool(node("a", 1)), _claim("a-gpu0", 60, 80)))
    d = st.decide(req(memory_gib=40, cores=10))
    assert d.kind == "wait" and isinstance(d.error, PoolFull)
    # what is left beside the other hub's claim is granted
    assert st.decide(req(memory_gib=20, cores=20)).kind == "grant"
    # and waiting is not blamed on the requester's own slices
    st.add(alloc("mine", "a-gpu0", 10, 10, user="alice"))
    assert not getattr(st.decide(req(memory_gib=20, cores=20)).error, "own_only", False)


def test_a_whole_card_request_never_lands_on_a_card_another_hub_slices_or_holds():
    st = state(_held(pool(node("a", 2)), _claim("a-gpu0", 4, 5), _claim("a-gpu1", whole=True)))
    assert st.decide(req(whole=True)).kind == "wait"
    st = state(_held(pool(node("a", 2)), _claim("a-gpu0", 4, 5)))
    d = st.decide(req(whole=True))
    assert d.kind == "grant" and d.allocation.gpu_uuids == ("a-gpu1",)


def test_another_hubs_claims_are_never_preemption_victims():
    st = state(_held(pool(node("a", 1)), _claim("a-gpu0", 80, 100)))
    d = st.decide(req(priority_class="high"))
    assert d.kind == "wait" and d.victims == ()
    # this hub's own lower-priority slice beside them is still a victim
    st = state(
        _held(pool(node("a", 1)), _claim("a-gpu0", 40, 50)), allocations=[alloc("low1", "a-gpu0", 40, 50, pc="low")]
    )
    d = st.decide(req(memory_gib=20, cores=20, priority_class="high"))
    assert d.kind == "preempt" and [v.id for v in d.victims] == ["low1"]


def test_another_hubs_claims_count_against_no_quota_of_this_hub():
    workspaces = {"default": {"limits": {"memory_mib": 30 * GIB}, "namespaces": {"default": {}}}}
    st = state(_held(pool(node("a", 2)), _claim("a-gpu0", 70, 90)), workspaces)
    assert st.decide(req(memory_gib=30, cores=10)).kind == "grant"


def test_the_ledger_check_names_the_card_and_the_hub():
    gpus = {g.uuid: g for g in node("a", 1).gpus}
    mine = Claim("teaching", "t1", "a", ("a-gpu0",), 50 * GIB, 20, False)
    theirs = _claim("a-gpu0", 40, 50)
    assert overbooked(gpus, [theirs, mine], mine) == (
        "GPU a-gpu0 has no room left: hubs research, teaching together claim 90 GiB of 80 GiB "
        "and 70 of 100 % of its compute."
    )
    whole = Claim("teaching", "t2", "a", ("a-gpu0",), 0, 0, True)
    assert overbooked(gpus, [theirs, whole], whole) == (
        "GPU a-gpu0 holds slices of hub research, so it cannot be given out whole."
    )
    small = Claim("teaching", "t3", "a", ("a-gpu0",), 1024, 20, False)
    assert overbooked(gpus, [theirs, small], small) is None


def test_a_damaged_entry_is_skipped_not_fatal():
    obj = {
        "data": {
            "hub.ok": '{"renewed_at": 5, "claims": {"x": {"gpus": ["g"], "memory_mib": 1, "cores_percent": 2}}}',
            "hub.bad": "{not json",
            "other": "1",
        }
    }
    assert parse(obj, "n") == {"ok": (5.0, [Claim("ok", "x", "n", ("g",), 1, 2, False)])}


async def test_a_hub_id_that_cannot_name_a_key_is_refused_with_a_sentence():
    assert valid_hub_id("teaching-hub_1.x") and not valid_hub_id("teaching hub")
    p = KubernetesPool(namespace="ns", claims_namespace="claims", hub_id="teaching hub")
    with pytest.raises(ConfigError, match="KubernetesPool.hub_id 'teaching hub' cannot name a claims entry"):
        await p.start(lambda *_: None)


def test_a_silent_hubs_entry_is_rebuilt_only_from_a_pod_list_made_after_it_went_silent():
    """A claim taken between two syncs rewrites the node's object with the last pod list. If that
    list predates the other hub's silence it may lack the pods that hub started since; an empty
    rebuild dropped its entry, and with it the namespace that lets its pods be found: its running
    pods then went unclaimed for good (seen in the two-hub-process test under CI load)."""
    ledger = ClaimsLedger(None, "claims", "teaching", ttl_seconds=6, timeout=5, log=logging.getLogger("t"))
    theirs = Claim("research", "r-new", "a", ("a-gpu0",), 10 * GIB, 20, False)
    hubs = {"research": (100.0, [theirs])}
    where = {"research": "research-ns"}
    # never listed yet (a claim before this hub's first sync): kept as it is
    assert ledger._others_live(hubs, 110.0, "a", where) == {"research": (100.0, [theirs])}
    # listed at 90 s, before research went silent (at 106 s): its pod r-new is not in the list
    ledger.running, ledger.running_at = {}, 90.0
    assert ledger._others_live(hubs, 110.0, "a", where) == {"research": (100.0, [theirs])}
    # listed after it went silent: what its pods hold is the truth (none here: the entry goes)
    ledger.running_at = 107.0
    assert ledger._others_live(hubs, 110.0, "a", where) == {}
    running_pod = ("research-ns", Claim("", "r-new", "a", ("a-gpu0",), 10 * GIB, 20, False))
    ledger.running = {"r-new": running_pod}
    assert ledger._others_live(hubs, 110.0, "a", where) == {"research": (110.0, [theirs])}
    # asked after it went silent but this hub may not list pods cluster-wide: the TTL decides
    ledger.running = None
    assert ledger._others_live(hubs, 110.0, "a", where) == {}
