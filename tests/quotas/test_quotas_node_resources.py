"""Node CPU and host memory: a request never goes where the node lacks them; unknown = unlimited."""

from __future__ import annotations

import pytest

from quotas import GPU, ConfigError, InvalidRequest, Node, PoolFull, load_pool

from .builders import GIB, alloc, grant, pool, req, state


def cpu_node(name: str, cpu: int | None, hmem_gib: int | None = None, n: int = 2, **kw) -> Node:
    gpus = tuple(GPU(f"{name}-gpu{i}", "H100-80GB", 80 * GIB, index=i) for i in range(n))
    hmem = None if hmem_gib is None else hmem_gib * GIB
    return Node(name, gpus, cpu_millicores=cpu, host_memory_mib=hmem, **kw)


def test_binpack_skips_the_fuller_node_that_lacks_the_cpu():
    st = state(pool(cpu_node("a", 4000), cpu_node("b", 64000)),
               allocations=[alloc("x", "a-gpu0", 40)])
    # binpack would pick "a" (fuller); it has 4 CPUs, the request asks 8
    a = grant(st, req(memory_gib=10, cpu_millicores=8000))
    assert a.node == "b" and a.cpu_millicores == 8000


def test_host_memory_and_what_other_pods_request_count_too():
    st = state(pool(cpu_node("a", 64000, 512, host_memory_requested_mib=500 * GIB),
                    cpu_node("b", 64000, 512)), allocations=[alloc("x", "a-gpu0", 40)])
    assert grant(st, req(memory_gib=10, host_memory_mib=16 * GIB)).node == "b"


@pytest.mark.parametrize("placement", ["binpack", "spread", "fgd"])
def test_granted_cpu_is_held_until_the_allocation_is_removed(placement):
    st = state(pool(cpu_node("a", 10000)), placement={"node": placement, "gpu": placement})
    grant(st, req(memory_gib=10, cpu_millicores=6000, rid="one"))
    d = st.decide(req(memory_gib=10, cpu_millicores=6000, rid="two"))
    assert d.kind == "wait" and isinstance(d.error, PoolFull)
    assert d.reason == (
        "GPUs have room for 10 GiB and 25% of a GPU, but no node with that room has 6 CPUs free "
        "right now. Wait for a server to stop or pick a smaller profile."
    )
    st.remove("one")
    assert st.decide(req(memory_gib=10, cpu_millicores=6000, rid="two")).kind == "grant"


def test_a_node_without_numbers_never_refuses_for_cpu_or_memory():
    st = state(pool(cpu_node("a", None)))
    assert grant(st, req(memory_gib=10, cpu_millicores=10**9, host_memory_mib=10**9)).node == "a"


def test_requests_without_cpu_or_memory_fit_a_node_with_numbers():
    st = state(pool(cpu_node("a", 1000, 1)))
    assert grant(st, req(memory_gib=10)).node == "a"


def test_cpu_no_node_with_room_for_the_gpus_has_is_rejected_with_a_sentence():
    st = state(pool(cpu_node("a", 4000, 32, n=1), cpu_node("b", 64000, 512, n=1)))
    d = st.decide(req(memory_gib=10, count=1, cpu_millicores=96000, host_memory_mib=64 * GIB))
    assert d.kind == "reject" and isinstance(d.error, InvalidRequest)
    assert d.reason == (
        "No node with room for 10 GiB and 25% of a GPU has 96 CPUs and 64 GiB of host memory "
        "to give (such nodes offer at most 64 CPUs and 512 GiB of host memory). Pick a smaller "
        "profile or ask an admin for larger nodes."
    )
    # the CPU is on one node and the cards on another: never fits either
    st = state(pool(cpu_node("a", 4000, n=2), cpu_node("b", 64000, n=1)))
    assert st.decide(req(memory_gib=10, count=2, cpu_millicores=8000)).kind == "reject"


def test_negative_cpu_is_an_invalid_request():
    d = state(pool(cpu_node("a", 4000))).decide(req(cpu_millicores=-1))
    assert d.kind == "reject"
    assert d.reason == ("The CPU (millicores) a GPU request asks of its node must be a whole "
                        "number of 0 or more; got -1.")


def test_preemption_only_places_where_the_victims_leave_enough_cpu():
    # node a: a low-priority slice holds 8 of its 10 CPUs; node b: cards full with a
    # default-priority slice that leaves no CPU question. A high request needing 4 CPUs and a
    # whole card must evict on a where the victim gives the CPU back.
    st = state(pool(cpu_node("a", 10000, n=1), cpu_node("b", 2000, n=1)), allocations=[
        alloc("lo", "a-gpu0", 70, pc="lowest", cpu_millicores=8000),
        alloc("lo2", "b-gpu0", 70, pc="lowest", created_at=5.0),  # newer: preferred victim
    ])
    d = st.decide(req(memory_gib=20, cpu_millicores=4000, priority_class="high"))
    assert d.kind == "preempt"
    assert d.allocation.node == "a" and [v.id for v in d.victims] == ["lo"]


def test_the_inventory_reads_node_cpu_and_memory():
    p = load_pool([{"name": "n", "cpu_millicores": 32000, "host_memory_mib": 131072,
                    "cpu_requested_millicores": 1500,
                    "gpus": [{"uuid": "g", "model": "L4", "memory_mib": 24576}]}])
    n = p.nodes[0]
    assert (n.cpu_millicores, n.host_memory_mib, n.cpu_requested_millicores) == (32000, 131072, 1500)
    assert load_pool(p.to_dict()) == p
    with pytest.raises(ConfigError) as e:
        load_pool([{"name": "n", "cpu_millicores": "32", "gpus": []}])
    assert str(e.value) == "nodes[0].cpu_millicores: must be an integer > 0, got '32'"
