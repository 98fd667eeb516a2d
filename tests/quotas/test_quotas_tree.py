"""Quota tree: a request must fit its user, namespace and workspace; usage as plain data."""

import pytest

from quotas import InvalidRequest, QuotaExceeded

from .builders import GIB, alloc, grant, node, pool, req, state

WORKSPACES = {
    "vision": {
        "limits": {"memory_mib": 40 * GIB, "cores_percent": 300, "gpus": 6},
        "namespaces": {
            "ml": {
                "limits": {"memory_mib": 30 * GIB},
                "user_limits": {"memory_mib": 20 * GIB, "gpus": 3},
                "users": {"carol": {"memory_mib": 25 * GIB}},
            },
            "cv": {},
        },
    },
    "nlp": {},
}


def big_state(**kw):
    return state(pool(node("a", 4), node("b", 4)), WORKSPACES, **kw)


def test_the_user_level_stops_a_request_with_a_sentence_naming_used_limit_and_ask():
    st = big_state()
    grant(st, req("alice", 15, ws="vision", ns="ml", kind="kernel"))
    d = st.decide(req("alice", 10, ws="vision", ns="ml", kind="kernel"))
    assert d.kind == "wait" and isinstance(d.error, QuotaExceeded)
    assert d.reason == (
        "User 'alice' has 20 GiB of GPU memory; 15 GiB are in use, so a 10 GiB kernel does not "
        "fit. Stop one of your kernels or pick a smaller GPU kernel size."
    )
    assert (d.error.resource, d.error.used, d.error.limit, d.error.asked) == (
        "memory_mib", 15 * GIB, 20 * GIB, 10 * GIB)
    assert d.error.status == 403


def test_the_namespace_level_stops_a_request_that_fits_the_user():
    st = big_state()
    grant(st, req("alice", 20, ws="vision", ns="ml"))
    d = st.decide(req("bob", 15, ws="vision", ns="ml"))
    assert d.kind == "wait"
    assert d.reason.startswith("Namespace 'ml' of workspace 'vision' has 30 GiB of GPU memory; "
                               "20 GiB are in use, so a 15 GiB notebook does not fit.")


def test_the_workspace_level_stops_a_request_that_fits_the_namespace():
    st = big_state()
    grant(st, req("alice", 20, ws="vision", ns="ml"))
    grant(st, req("dave", 15, ws="vision", ns="cv"))
    d = st.decide(req("erin", 10, ws="vision", ns="cv"))
    assert d.kind == "wait"
    assert d.reason.startswith("Workspace 'vision' has 40 GiB of GPU memory; 35 GiB are in use")
    assert "wait for others in workspace 'vision' to stop theirs" in d.reason


def test_a_user_override_raises_that_users_cap():
    st = big_state()
    grant(st, req("carol", 25, ws="vision", ns="ml"))
    assert st.decide(req("alice", 25, ws="vision", ns="ml")).kind == "reject"


def test_the_gpu_cap_counts_vgpus_not_cards():
    st = big_state()
    grant(st, req("alice", 1, cores=10, count=2, ws="vision", ns="ml"))
    d = st.decide(req("alice", 1, cores=10, count=2, ws="vision", ns="ml"))
    assert d.kind == "wait"
    assert d.reason.startswith("User 'alice' may hold 3 vGPUs; 2 are in use, so a notebook asking "
                               "for 2 more does not fit.")


def test_the_cores_cap_sums_percent_over_gpus():
    st = big_state()
    grant(st, req("dave", 1, cores=100, count=2, ws="vision", ns="cv"))
    d = st.decide(req("dave", 1, cores=60, count=2, ws="vision", ns="cv"))
    assert d.kind == "wait"
    assert "has 300% of GPU compute; 200% are in use, so a notebook asking 120% does not fit" in d.reason


def test_a_whole_card_counts_its_full_memory_and_100_percent():
    st = big_state()
    grant(st, req("dave", whole=True, ws="nlp"))
    ws = {w["name"]: w for w in st.usage()["workspaces"]}["nlp"]
    assert ws["used"] == {"memory_mib": 80 * GIB, "cores_percent": 100, "gpus": 1}
    assert st.decide(req("dave", whole=True, ws="vision", ns="cv")).kind == "reject"


def test_a_request_above_a_levels_whole_quota_is_rejected():
    st = big_state()
    d = st.decide(req("alice", 21, ws="vision", ns="ml"))
    assert d.kind == "reject" and isinstance(d.error, QuotaExceeded)
    assert d.reason == (
        "User 'alice' has 20 GiB of GPU memory in all, so a 21 GiB notebook can never fit. "
        "Pick a smaller profile or ask an admin to raise the quota."
    )
    d = st.decide(req("dave", 5, cores=100, count=4, ws="vision", ns="cv"))
    assert d.kind == "reject" and "300% of GPU compute in all" in d.reason


def test_an_unknown_workspace_or_namespace_is_invalid_and_names_the_known_ones():
    st = big_state()
    d = st.decide(req("alice", ws="audio"))
    assert d.kind == "reject" and isinstance(d.error, InvalidRequest)
    assert "Workspace 'audio' is not configured" in d.reason and "'nlp', 'vision'" in d.reason
    with pytest.raises(InvalidRequest, match="known namespaces: 'cv', 'ml'"):
        st.validate(req("alice", ws="vision", ns="default"))


def test_usage_reports_levels_with_limits_and_cards_with_their_allocations():
    st = big_state()
    a = grant(st, req("alice", 10, cores=30, ws="vision", ns="ml", rid="k1"))
    usage = st.usage()
    assert usage["allocations"] == 1
    card = next(g for g in usage["gpus"] if g["uuid"] == a.gpu_uuids[0])
    assert card == {
        "uuid": a.gpu_uuids[0], "model": "H100-80GB", "node": a.node, "index": 0,
        "mode": "shared", "memory_used_mib": 10 * GIB, "memory_total_mib": 80 * GIB,
        "memory_capacity_mib": 80 * GIB, "cores_used_percent": 30, "cores_total_percent": 100,
        "cores_capacity_percent": 100, "whole": False, "allocations": ["k1"],
    }
    vision = {w["name"]: w for w in usage["workspaces"]}["vision"]
    assert vision["limits"] == {"memory_mib": 40 * GIB, "cores_percent": 300, "gpus": 6}
    assert vision["used"] == {"memory_mib": 10 * GIB, "cores_percent": 30, "gpus": 1}
    ml = {n["name"]: n for n in vision["namespaces"]}["ml"]
    users = {u["name"]: u for u in ml["users"]}
    assert users["alice"]["limits"] == {"memory_mib": 20 * GIB, "cores_percent": None, "gpus": 3}
    assert users["carol"]["used"]["memory_mib"] == 0  # configured users are listed too


def test_usage_lists_allocations_of_owners_the_config_no_longer_knows():
    st = big_state(allocations=[alloc("old", "a-gpu0", 5, ws="gone", user="zed")])
    gone = {w["name"]: w for w in st.usage()["workspaces"]}["gone"]
    assert gone["used"]["memory_mib"] == 5 * GIB
    assert gone["limits"] == {"memory_mib": None, "cores_percent": None, "gpus": None}


def test_messages_use_an_before_eight_and_eleven():
    st = big_state()
    grant(st, req("alice", 15, ws="vision", ns="ml"))
    d = st.decide(req("alice", 8, ws="vision", ns="ml", kind="kernel"))
    assert "so an 8 GiB kernel does not fit" in d.reason
