"""Domain types: the request split, pool look-ups, decisions and errors."""

import pytest

from quotas import (
    AdmissionError,
    ConfigError,
    Decision,
    GPURequest,
    InvalidRequest,
    Owner,
    PoolFull,
    QuotaExceeded,
)

from .builders import GIB, node, pool


def test_split_spreads_the_total_evenly_over_the_gpus():
    r = GPURequest.split(Owner("alice"), 18 * GIB, 240, 3, kind="kernel")
    assert (r.memory_mib, r.cores_percent, r.count) == (6 * GIB, 80, 3)
    assert r.kind == "kernel"


def test_split_rounds_down_so_the_total_is_never_exceeded():
    r = GPURequest.split(Owner("alice"), 10_000, 250, 3)
    assert r.memory_mib * 3 <= 10_000 and r.cores_percent * 3 <= 250
    assert (r.memory_mib, r.cores_percent) == (3333, 83)


@pytest.mark.parametrize("count", [0, -1, True, 1.5])
def test_split_refuses_fewer_than_one_gpu(count):
    with pytest.raises(InvalidRequest, match="at least 1 GPU"):
        GPURequest.split(Owner("alice"), GIB, 50, count)


def test_pool_finds_gpus_and_nodes_by_name():
    p = pool(node("a", 2), node("b", 1))
    assert p.gpu("b-gpu0").uuid == "b-gpu0"
    assert p.node_of("a-gpu1").name == "a"
    assert p.node("b").gpus[0].index == 0
    assert p.gpu("nope") is None and p.node("nope") is None
    assert [g.uuid for g in p.all_gpus()] == ["a-gpu0", "a-gpu1", "b-gpu0"]


def test_only_grant_and_preempt_count_as_granted():
    assert Decision("grant").granted and Decision("preempt").granted
    assert not Decision("wait").granted and not Decision("reject").granted


def test_errors_carry_a_user_message_and_an_http_status():
    assert InvalidRequest("x").status == 400
    assert QuotaExceeded("x").status == 403
    assert PoolFull("x").status == 409
    e = ConfigError("must be an integer > 0, got 'abc'", "workspaces.vision.limits.memory_mib")
    assert e.message == "workspaces.vision.limits.memory_mib: must be an integer > 0, got 'abc'"
    assert isinstance(e, AdmissionError) and isinstance(e, ValueError)
    assert str(AdmissionError("plain")) == "plain"
