"""The sentence a waiting request gets says what really blocks it, and what this user can do.

Issue 11: a full pool was explained as the workspace quota (`elastic-gpu init` writes a workspace
quota as large as the pool); users holding nothing were told to stop a kernel; a request that only
the requester's own slices block could wait for ever (``own_only`` lets the hub refuse it at once).
"""

from quotas import PoolFull, QuotaExceeded

from .builders import GIB, grant, node, pool, req, state

POOL_SIZED = {  # as `elastic-gpu init` writes it for one 80 GiB card
    "default": {
        "limits": {"memory_mib": 80 * GIB},
        "namespaces": {"default": {"user_limits": {"memory_mib": 64 * GIB, "cores_percent": 40}}},
    }
}


def one_card(workspaces=POOL_SIZED):
    return state(pool(node("a", 1)), workspaces)


def test_a_full_pool_is_a_full_pool_even_when_the_workspace_quota_is_the_pool():
    st = one_card()
    grant(st, req("bob", 40, cores=30))
    grant(st, req("carol", 40, cores=30))
    d = st.decide(req("alice", 10, cores=10, kind="kernel"))
    assert d.kind == "wait" and isinstance(d.error, PoolFull), d.reason
    assert d.reason.startswith("No GPU has 10 GiB of memory and 10% of compute free right now"), d.reason
    assert "orkspace" not in d.reason and "quota" not in d.reason
    assert not d.error.own_only


def test_a_workspace_quota_smaller_than_the_pool_is_still_named():
    st = one_card({"default": {"limits": {"memory_mib": 50 * GIB}, "namespaces": {"default": {}}}})
    grant(st, req("bob", 40, cores=30))
    d = st.decide(req("alice", 20, cores=10))
    assert isinstance(d.error, QuotaExceeded) and d.reason.startswith("Workspace 'default' has 50 GiB"), d.reason
    # alice holds nothing here: she is not told to stop anything
    assert "Stop" not in d.reason and "wait for others in workspace 'default' to stop theirs" in d.reason
    assert not d.error.own_only


def test_only_own_slices_over_the_user_quota_mark_the_wait_as_own_only():
    st = one_card()
    grant(st, req("alice", 30, cores=30, kind="kernel"))
    d = st.decide(req("alice", 30, cores=30, kind="kernel"))
    assert d.kind == "wait" and isinstance(d.error, QuotaExceeded) and d.error.own_only
    assert d.reason.endswith("Stop one of your kernels or pick a smaller GPU kernel size."), d.reason


def test_own_notebooks_are_named_as_servers_not_kernels():
    st = one_card()
    grant(st, req("alice", 30, cores=30))
    d = st.decide(req("alice", 30, cores=30))
    assert d.error.own_only and d.reason.endswith("Stop one of your GPU servers or pick a smaller profile."), d.reason


def test_a_pool_full_of_own_slices_is_own_only_with_the_reason():
    st = one_card({"default": {"namespaces": {"default": {}}}})
    grant(st, req("alice", 40, cores=50, kind="kernel"))
    grant(st, req("alice", 30, cores=40, kind="kernel"))
    d = st.decide(req("alice", 20, cores=20, kind="kernel"))
    assert isinstance(d.error, PoolFull) and d.error.own_only, d.reason
    assert "Only your own kernels hold GPUs: stop one of them" in d.reason and "Wait for" not in d.reason


def test_someone_elses_slice_in_the_way_keeps_the_request_waiting():
    st = one_card({"default": {"namespaces": {"default": {}}}})
    grant(st, req("alice", 40, cores=50, kind="kernel"))
    grant(st, req("bob", 30, cores=40))
    d = st.decide(req("alice", 20, cores=20, kind="kernel"))
    assert isinstance(d.error, PoolFull) and not d.error.own_only
    assert d.reason.endswith("Wait for a kernel to stop or pick a smaller GPU kernel size."), d.reason
