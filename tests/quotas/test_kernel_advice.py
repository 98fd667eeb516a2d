"""A GPU kernel has no profile: the advice to ask for less names what a kernel's user picks, a
GPU kernel size (issue 26: "pick a smaller profile" was said of kernels); notebooks keep theirs."""

from quotas import PoolFull, QuotaExceeded

from .builders import GIB, grant, node, pool, req, state

USER_CAPPED = {"default": {"namespaces": {"default": {"user_limits": {"memory_mib": 32 * GIB}}}}}


def test_a_kernel_waiting_on_its_users_quota_is_told_to_pick_a_smaller_kernel_size():
    st = state(pool(node("a", 1)), USER_CAPPED)
    grant(st, req("alice", 30, cores=30, kind="kernel"))
    d = st.decide(req("alice", 10, cores=10, kind="kernel"))
    assert isinstance(d.error, QuotaExceeded), d.reason
    assert "profile" not in d.reason and d.reason.endswith("or pick a smaller GPU kernel size."), d.reason


def test_a_kernel_waiting_for_a_card_is_told_to_pick_a_smaller_kernel_size():
    st = state(pool(node("a", 1)), {"default": {"namespaces": {"default": {}}}})
    grant(st, req("bob", 75, cores=50))
    d = st.decide(req("alice", 10, cores=10, kind="kernel"))
    assert isinstance(d.error, PoolFull), d.reason
    assert d.reason.endswith("Wait for a kernel to stop or pick a smaller GPU kernel size."), d.reason


def test_a_kernel_over_a_whole_quota_is_told_to_pick_a_smaller_kernel_size():
    st = state(pool(node("a", 1)), USER_CAPPED)
    d = st.decide(req("alice", 40, cores=10, kind="kernel"))
    assert d.kind == "reject", d.reason
    assert "profile" not in d.reason and "Pick a smaller GPU kernel size or ask an admin" in d.reason, d.reason


def test_a_notebook_is_still_told_to_pick_a_smaller_profile():
    st = state(pool(node("a", 1)), USER_CAPPED)
    grant(st, req("alice", 30, cores=30))
    d = st.decide(req("alice", 10, cores=10))
    assert d.reason.endswith("or pick a smaller profile."), d.reason


def test_a_kernel_larger_than_any_card_is_told_to_pick_a_smaller_kernel_size():
    st = state(pool(node("a", 1)), {"default": {"namespaces": {"default": {}}}})
    d = st.decide(req("alice", 90, cores=10, kind="kernel"))
    assert d.kind == "reject" and d.reason.endswith("Pick a smaller GPU kernel size."), d.reason


def test_a_kernel_no_node_can_give_its_cpus_is_told_to_pick_a_smaller_kernel_size():
    from .test_quotas_node_resources import cpu_node

    st = state(pool(cpu_node("a", 4000, 32, n=1)))
    d = st.decide(req(memory_gib=10, cpu_millicores=96000, kind="kernel"))
    assert d.kind == "reject" and "Pick a smaller GPU kernel size or ask an admin for larger nodes." in d.reason, (
        d.reason
    )
