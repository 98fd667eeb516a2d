"""Which bursts the broker takes back (hubext/broker/reclaim.py, pure): the shims' word checked
against the ledger, one take per burster, enough bursters to cover what the owner waits for."""

from __future__ import annotations

import dataclasses

from hubext.broker.reclaim import plan_takes, reclaim_reason
from libvgpu.elastic import Reclaim

from .test_elastic_allocation import ELASTIC

CARD = ELASTIC.gpu_uuids[0]
OWNER = dataclasses.replace(ELASTIC, id="owner", memory_limit_mib=0, cores_limit_percent=0)
OTHER = dataclasses.replace(ELASTIC, id="other")
LEDGER = {a.id: a for a in (ELASTIC, OWNER, OTHER)}


def wait(burster: str, burst: int, wanted: int = 2048, owner: str = "owner", card: str = CARD) -> Reclaim:
    return Reclaim(card_uuid=card, owner=owner, wanted_mib=wanted, since=0.0, burster=burster, burst_mib=burst)


def test_the_largest_burst_is_taken_first_and_no_more_than_the_owner_waits_for():
    takes = plan_takes([wait(ELASTIC.id, 4096), wait("other", 1024)], LEDGER)
    assert [(t.burster.id, t.owner.id, t.burst_mib) for t in takes] == [(ELASTIC.id, "owner", 4096)]
    takes = plan_takes([wait(ELASTIC.id, 1024), wait("other", 1024)], LEDGER)
    assert [t.burster.id for t in takes] == [ELASTIC.id, "other"]


def test_a_region_that_names_a_fixed_slice_or_a_slice_elsewhere_as_burster_is_not_believed():
    assert plan_takes([wait("owner", 4096, owner=ELASTIC.id)], LEDGER) == []  # 'owner' is a fixed slice
    assert plan_takes([wait(ELASTIC.id, 4096, card="GPU-elsewhere")], LEDGER) == []
    assert plan_takes([wait("gone", 4096), wait(ELASTIC.id, 4096, owner="gone")], LEDGER) == []


def test_the_reason_names_the_burst_the_guarantee_and_who_needs_it():
    [take] = plan_takes([wait(ELASTIC.id, 2048)], LEDGER)
    assert reclaim_reason(take) == (
        f"it held 2 GiB of GPU memory above its 20 GiB guarantee on {CARD}, and alice's notebook on that GPU "
        "needs memory within its own guarantee"
    )
