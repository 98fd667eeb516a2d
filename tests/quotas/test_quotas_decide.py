"""The decision: invalid requests, reject (never fits) versus wait (fits once others stop)."""

import pytest

from quotas import GPU, AdmissionState, InvalidRequest, Mode, Node, Owner, Pool, PoolFull, load_config

from .builders import GIB, alloc, grant, node, pool, req, state


@pytest.fixture
def st():
    return state(pool(node("a", 2), node("b", 4, "A100-40GB", 40 * GIB)))


@pytest.mark.parametrize(
    "request_kw, part",
    [
        ({"memory_gib": 0}, "GPU memory must be a whole number of MiB above 0; got 0."),
        ({"memory_gib": -1}, "got -1024"),
        ({"cores": 0}, "GPU compute must be a whole percentage from 1 to 100 per GPU; got 0."),
        ({"cores": 101}, "got 101"),
        ({"count": 0}, "Ask for at least 1 GPU; got 0."),
        ({"priority_class": "urgent"},
         "Priority class 'urgent' does not exist (known: 'default', 'high', 'low', 'lowest')"),
        ({"model": "V100"}, "No GPU of model 'V100' is in the pool (models: 'A100-40GB', "
                            "'H100-80GB')"),
        ({"memory_gib": 90}, "A 90 GiB slice is larger than any GPU in the pool (the largest "
                             "holds 80 GiB)"),
        ({"memory_gib": 50, "model": "a100-40gb"}, "larger than any A100-40GB GPU"),
        ({"count": 5}, "No node has 5 GPUs that can hold 10 GiB and 25% each; the most on one "
                       "node is 4. Ask for fewer GPUs"),
        ({"count": 3, "memory_gib": 50}, "the most on one node is 2"),
        ({"count": 5, "whole": True}, "No node has 5 GPUs that can be given out whole"),
    ],
)
def test_an_invalid_request_is_rejected_with_a_clear_reason(st, request_kw, part):
    d = st.decide(req(**request_kw))
    assert d.kind == "reject" and isinstance(d.error, InvalidRequest), d.reason
    assert part in d.reason
    assert d.error.status == 400
    with pytest.raises(InvalidRequest):
        st.validate(req(**request_kw))


def test_a_whole_request_ignores_memory_and_cores():
    st = state(pool(node("a", 1)))
    d = st.decide(req(memory_gib=0, cores=0, whole=True))
    assert d.kind == "grant"


def test_an_empty_pool_rejects_with_a_reason():
    st = state(pool())
    d = st.decide(req())
    assert d.kind == "reject" and "has no GPUs" in d.reason


def test_only_mig_cards_cannot_serve_slices_or_whole_cards():
    mig = Pool((Node("m", (GPU("g", "A100", 40 * GIB, mode=Mode.MIG),)),))
    st = state(mig)
    assert "takes shared slices" in st.decide(req()).reason
    assert "can be given out whole" in st.decide(req(whole=True)).reason


def test_a_request_that_fits_once_others_stop_waits():
    st = state(pool(node("a", 1)), allocations=[alloc("x", "a-gpu0", 75)])
    d = st.decide(req(memory_gib=10))
    assert d.kind == "wait" and isinstance(d.error, PoolFull) and d.error.status == 409
    assert "the most free on one card is 5 GiB and 75%" in d.reason
    assert not d.granted and d.allocation is None


def test_a_model_filtered_wait_names_the_model():
    st = state(pool(node("a", 1, "A100-40GB", 40 * GIB), node("h", 1)),
               allocations=[alloc("x", "a-gpu0", 40)])
    d = st.decide(req(model="A100-40GB"))
    assert d.kind == "wait" and d.reason.startswith("No A100-40GB GPU has 10 GiB")


def test_a_whole_request_waits_for_an_empty_card():
    st = state(pool(node("a", 2)), allocations=[alloc("x", "a-gpu0", 1), alloc("y", "a-gpu1", 1)])
    d = st.decide(req(whole=True, count=2))
    assert d.kind == "wait"
    assert d.reason.startswith("No node has 2 free GPUs to give out whole right now (at most 0")


def test_one_whole_gpu_waiting_is_not_told_to_ask_for_fewer_gpus():
    st = state(pool(node("a", 1)), allocations=[alloc("x", "a-gpu0", 1)])
    d = st.decide(req(whole=True, count=1))
    assert d.kind == "wait"
    assert "fewer GPUs" not in d.reason and "ask for a slice of a GPU instead" in d.reason, d.reason


def test_deciding_does_not_change_the_state():
    st = state(pool(node("a", 1)))
    before = st.usage()
    for _ in range(3):
        assert st.decide(req(rid="k")).kind == "grant"
    assert st.usage() == before and not st.allocations


def test_the_grant_records_the_request_id_owner_class_kind_and_time():
    st = state(pool(node("a", 1)))
    a = st.decide(req("carol", 12, 30, rid="kernel-7", kind="kernel", ns="default"), now=42.5).allocation
    assert (a.id, a.owner, a.priority_class, a.kind, a.created_at) == (
        "kernel-7", Owner("carol"), "default", "kernel", 42.5)
    assert (a.memory_mib, a.cores_percent, a.node, a.gpu_uuids) == (12 * GIB, 30, "a", ("a-gpu0",))
    anonymous = st.decide(req()).allocation
    assert anonymous.id.startswith("alloc-")


def test_the_default_priority_class_applies_when_none_is_given():
    cfg = load_config({"priority_classes": {"std": {"value": 1}}})
    st = AdmissionState(cfg, pool(node("a", 1)))
    assert st.decide(req()).allocation.priority_class == "std"


def test_a_request_never_fits_the_quota_is_rejected_even_when_the_pool_is_full():
    st = state(pool(node("a", 1)), {"v": {"limits": {"gpus": 1}}},
               allocations=[alloc("x", "a-gpu0", 80, ws="v")])
    d = st.decide(req(count=2, ws="v"))
    assert d.kind == "reject"


def test_grants_are_repeatable_up_to_capacity():
    st = state(pool(node("a", 1)))
    for _ in range(8):
        grant(st, req(memory_gib=10, cores=12))
    assert st.decide(req(memory_gib=1, cores=1)).kind == "wait"


def test_requests_no_card_or_node_can_hold_are_refused_with_the_catalogues_whole_sentences():
    """The never-fits refusals read as quotas.messages writes them, sizes by mib."""
    mig = state(Pool((Node("m", (GPU("g", "A100", 40 * GIB, mode=Mode.MIG),)),)))
    assert mig.decide(req(whole=True)).reason == (
        "No GPU in the pool can be given out whole (they are all MIG). Ask for a slice instead.")
    st = state(pool(node("a", 2)))
    assert st.decide(req(whole=True, count=3)).reason == (
        "No node has 3 GPUs that can be given out whole; the most on one node is 2. Ask for fewer GPUs.")
    assert st.decide(req(memory_gib=50, count=2, model="H100-80GB")).kind == "grant"
    assert st.decide(req(memory_gib=1.5, cores=60, count=3)).reason == (
        "No node has 3 GPUs that can hold 1.5 GiB and 60% each; the most on one node is 2. "
        "Ask for fewer GPUs or a smaller slice.")
    capped = state(pool(node("c", 1, cores_oversub=0.5)))
    assert capped.decide(req(cores=60, kind="kernel")).reason == (
        "60% of compute is more than any GPU in the pool offers (50% at most). "
        "Pick a smaller GPU kernel size.")
