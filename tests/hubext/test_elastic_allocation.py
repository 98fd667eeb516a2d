"""An elastic slice's request and limit survive every place an allocation is written down."""

from __future__ import annotations

from libvgpu import contract as C
from quotas.model import Allocation, Owner

ELASTIC = Allocation(
    id="nb-alice-default-e1",
    owner=Owner(user="alice", namespace="vision-dev", workspace="vision"),
    node="gpu-node-1",
    gpu_uuids=("GPU-aaaa",),
    memory_mib=20480,
    cores_percent=25,
    priority_class="default",
    created_at=1700000000.5,
    memory_limit_mib=40960,
    cores_limit_percent=100,
)


def test_request_and_limit_round_trip_through_the_ledger_codec():
    assert Allocation.from_dict(ELASTIC.to_dict()) == ELASTIC
    assert ELASTIC.to_dict()["memory_limit_mib"] == 40960
    assert ELASTIC.to_dict()["cores_limit_percent"] == 100


def test_request_and_limit_round_trip_through_pod_annotations():
    labels = {C.MANAGED: "true"}
    assert C.allocation_from_metadata(labels, C.allocation_annotations(ELASTIC)) == ELASTIC


def test_a_record_written_before_limits_existed_reads_as_a_fixed_slice():
    data = ELASTIC.to_dict()
    del data["memory_limit_mib"], data["cores_limit_percent"]
    old = Allocation.from_dict(data)
    assert (old.memory_limit_mib, old.cores_limit_percent) == (0, 0)
    assert (old.memory_ceiling_mib, old.cores_ceiling_percent) == (20480, 25)
    assert not old.elastic
    assert ELASTIC.elastic
    assert (ELASTIC.memory_ceiling_mib, ELASTIC.cores_ceiling_percent) == (40960, 100)
