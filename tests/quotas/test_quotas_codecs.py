"""The one pool codec and the allocation codec round-trip: what the local ledger, /hub/api/gpu/pool
and the CLI write is read back as the same pool or allocation (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotas import GPU, Allocation, Node, Owner, Pool, load_pool
from quotas.model import Mode

#: no per-example deadline: a loaded 2-core machine is slow, not wrong
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
ratios = st.floats(min_value=0.1, max_value=4.0, allow_nan=False, allow_infinity=False)


@st.composite
def gpus(draw, node: str, index: int) -> GPU:
    mode = draw(st.sampled_from(list(Mode)))
    return GPU(
        uuid=f"GPU-{node}-{index}",
        model=draw(st.sampled_from(["H100-80GB", "A100-40GB", "T4-16GB"])),
        memory_mib=draw(st.integers(min_value=1, max_value=200_000)),
        sm_count=draw(st.integers(min_value=0, max_value=200)),
        memory_oversub=draw(ratios),
        cores_oversub=draw(ratios),
        mode=mode,
        mig_profiles=tuple(draw(st.lists(st.sampled_from(["1g.10gb", "3g.40gb"]), max_size=2)))
        if mode is Mode.MIG
        else (),
        index=index,
    )


@st.composite
def nodes(draw, name: str) -> Node:
    count = draw(st.integers(min_value=0, max_value=4))
    return Node(
        name=name,
        gpus=tuple(draw(gpus(name, i)) for i in range(count)),
        cpu_millicores=draw(st.none() | st.integers(min_value=1, max_value=512_000)),
        host_memory_mib=draw(st.none() | st.integers(min_value=1, max_value=4_000_000)),
        cpu_requested_millicores=draw(st.integers(min_value=0, max_value=64_000)),
        host_memory_requested_mib=draw(st.integers(min_value=0, max_value=400_000)),
    )


@st.composite
def pools(draw) -> Pool:
    node_names = draw(st.lists(names, max_size=4, unique=True))
    return Pool(nodes=tuple(draw(nodes(n)) for n in node_names))


@PROPERTY
@given(pools())
def test_a_pool_reads_back_as_written_cpu_and_host_memory_included(pool):
    assert load_pool(pool.to_dict()) == pool
    assert load_pool(pool.to_dict()["nodes"]) == pool  # the list form the pool API and ledger keep


@PROPERTY
@given(
    st.builds(
        Allocation,
        id=names,
        owner=st.builds(Owner, user=names, namespace=names, workspace=names),
        node=names,
        gpu_uuids=st.lists(names, max_size=4).map(tuple),
        memory_mib=st.integers(min_value=0, max_value=200_000),
        cores_percent=st.integers(min_value=0, max_value=100),
        priority_class=names,
        whole=st.booleans(),
        borrowed=st.booleans(),
        kind=st.sampled_from(["notebook", "kernel"]),
        created_at=st.floats(min_value=0, max_value=4e9, allow_nan=False),
        cpu_millicores=st.integers(min_value=0, max_value=64_000),
        host_memory_mib=st.integers(min_value=0, max_value=400_000),
    )
)
def test_an_allocation_reads_back_as_written(allocation):
    assert Allocation.from_dict(allocation.to_dict()) == allocation
