"""The cull decision as a pure function: both signals, busy never culled, per-class policies, warnings, pressure."""

from __future__ import annotations

import pytest

from culler.model import GPUKernel, GraceWarning, JupyterState, KernelView, RecordError, Waiter
from culler.policy import PolicyBook, PolicyError, Rules, decide, needs_jupyter_state

NOW = 1_000_000.0
H = 3600.0


def kernel(kid="k1", *, launch=None, known=True, created=NOW - 10 * H, cls="default", mib=10240, user="ada", **kw):
    return GPUKernel(
        id=f"b-{kid}",
        kernel_id=kid,
        user=user,
        memory_mib=mib,
        priority_class=cls,
        created_at=created,
        gpu_last_launch=launch,
        activity_known=known,
        **kw,
    )


def view(k, *, state="idle", activity=NOW - 2 * H, connections=0, status="ok"):
    j = JupyterState(state, activity, connections, "python3") if status == "ok" else None
    return KernelView(k, j, status)


def rules(**policy):
    base = {"idle_timeout_seconds": H, "warning_seconds": 0, "pressure_min_idle_seconds": 600}
    base.update(policy.pop("default", {}))
    book = PolicyBook.build(base, policy.pop("classes", {}), policy.pop("profiles", {}))
    return Rules(book=book, priority_values={"high": 1000, "default": 100, "low": 10}, **policy)


def one(v, r=None, **kw):
    [verdict] = decide([v], r or rules(), NOW, **kw)
    return verdict


# ---- both signals ----------------------------------------------------------------------------


def test_kernel_idle_on_both_signals_past_timeout_is_culled():
    v = one(view(kernel(launch=NOW - 2 * H), activity=NOW - 1.5 * H))
    assert (v.action, v.reason) == ("cull", "idle-timeout")
    assert v.idle_seconds == pytest.approx(1.5 * H)


def test_kernel_launching_gpu_work_with_no_browser_is_kept_though_jupyter_looks_idle():
    v = one(view(kernel(launch=NOW - 5), activity=NOW - 5 * H))
    assert (v.action, v.reason) == ("keep", "gpu-active")


def test_recent_gpu_work_outside_busy_window_still_counts_as_activity():
    # launched 30 min ago: not "busy", but the kernel has been idle only 30 min
    v = one(view(kernel(launch=NOW - 1800), activity=NOW - 5 * H))
    assert v.action == "keep" and v.idle_seconds == pytest.approx(1800)
    assert v.due_at == pytest.approx(NOW + 1800)


def test_executing_kernel_is_never_culled_even_past_timeout_max_age_and_pressure():
    r = rules(default={"max_age_seconds": 60, "pressure_min_idle_seconds": 0})
    waiting = [Waiter("r1", "bob", "default", "high", 10240)]
    v = one(view(kernel(launch=NOW - 5 * H), state="busy", activity=NOW - 5 * H), r, waiting=waiting)
    assert (v.action, v.reason) == ("keep", "executing")


def test_kernel_never_connected_to_stays_starting_and_is_judged_on_its_last_activity():
    # jupyter-server reports "starting" until a client connects; such a kernel did nothing since
    assert one(view(kernel(launch=None, created=NOW - 2 * H), state="starting", activity=NOW - 2 * H)).action == "cull"
    assert one(view(kernel(launch=None, created=NOW - 60), state="starting", activity=NOW - 60)).action == "keep"
    assert one(view(kernel(launch=None), state="restarting", activity=NOW - 2 * H)).reason == "executing"


def test_recent_jupyter_activity_keeps_a_gpu_idle_kernel():
    v = one(view(kernel(launch=None), activity=NOW - 60))
    assert v.action == "keep" and v.reason == "idle" and v.idle_seconds == pytest.approx(60)


def test_kernel_that_never_launched_is_idle_since_it_started():
    v = one(view(kernel(launch=None, created=NOW - 2 * H), activity=NOW - 2 * H))
    assert v.action == "cull"


def test_unknown_gpu_activity_is_kept_unless_configured_to_judge_on_jupyter_alone():
    k = kernel(known=False)
    assert one(view(k)).reason == "gpu-activity-unknown"
    assert one(view(k), rules(require_gpu_activity=False)).action == "cull"


# ---- connections, warnings ---------------------------------------------------------------------


def test_tab_open_without_work_is_culled_when_cull_connected_allows_and_kept_otherwise():
    v = view(kernel(launch=NOW - 2 * H), connections=1)
    assert one(v).action == "cull"
    kept = one(v, rules(classes={"default": {"cull_connected": False}}))
    assert (kept.action, kept.reason) == ("keep", "connected")


def test_connected_kernel_is_warned_before_its_timeout_then_culled_after_the_grace():
    r = rules(default={"warning_seconds": 300})
    k = kernel(launch=NOW - 2 * H)
    early = decide([view(k, activity=NOW - H + 400, connections=1)], r, NOW)[0]
    assert early.action == "keep"
    due = decide([view(k, activity=NOW - H + 200, connections=1)], r, NOW)[0]
    # warned inside the lead time: the user still gets the full grace period
    assert due.action == "warn" and due.due_at == pytest.approx(NOW + 300)
    # the warning itself moved last_activity; the culler recorded before/after
    w = GraceWarning(warned_at=NOW, activity_before=NOW - H + 200, activity_after=NOW + 0.5, due_at=NOW + 200)
    later = NOW + 250
    v = decide([view(k, activity=NOW + 0.5, connections=1)], r, later, warnings={k.kernel_id: w})[0]
    assert (v.action, v.reason) == ("keep", "warned")
    v = decide([view(k, activity=NOW + 0.5, connections=1)], r, NOW + 301, warnings={k.kernel_id: w})[0]
    assert (v.action, v.reason) == ("cull", "idle-timeout")


def test_a_warning_does_not_delay_a_swap_that_keeps_the_kernels_state_past_its_timeout():
    # a 60 s swap timeout with the default 300 s warning: warned at once, swapped at the timeout
    r = rules(default={"idle_timeout_seconds": 60, "warning_seconds": 300}, keeps_state=lambda k: True)
    k = kernel(launch=NOW - 2 * H)
    first = one(view(k, activity=NOW - 10, connections=1), r)
    assert first.action == "warn" and first.due_at == pytest.approx(NOW + 50)
    w = GraceWarning(warned_at=NOW, activity_before=NOW - 10, activity_after=NOW + 0.5, due_at=first.due_at)
    v = decide([view(k, activity=NOW + 0.5, connections=1)], r, NOW + 61, warnings={k.kernel_id: w})[0]
    assert v.action == "cull"
    # a kernel that would lose its state still gets the whole grace period
    r = rules(default={"idle_timeout_seconds": 60, "warning_seconds": 300}, keeps_state=lambda k: False)
    assert one(view(k, activity=NOW - 10, connections=1), r).due_at == pytest.approx(NOW + 300)


def test_activity_after_a_warning_cancels_it():
    r = rules(default={"warning_seconds": 300})
    k = kernel(launch=NOW - 2 * H)
    w = GraceWarning(warned_at=NOW - 400, activity_before=NOW - 2 * H, activity_after=NOW - 399, due_at=NOW - 100)
    v = decide([view(k, activity=NOW - 100, connections=1)], r, NOW, warnings={k.kernel_id: w})[0]
    assert v.action == "keep" and v.extra.get("warning_void") is True
    assert v.idle_seconds == pytest.approx(100)


def test_unconnected_kernel_is_culled_at_its_timeout_without_a_warning():
    v = one(view(kernel(launch=NOW - 2 * H)), rules(default={"warning_seconds": 300}))
    assert v.action == "cull"


# ---- policies per class and profile --------------------------------------------------------------


def test_priority_class_and_profile_overrides_apply_profile_last():
    r = rules(
        classes={"high": {"idle_timeout_seconds": 4 * H}, "low": {"idle_timeout_seconds": 600}},
        profiles={"gpu-80g": {"idle_timeout_seconds": 300}},
    )
    idle_1h = dict(activity=NOW - 3000)
    assert one(view(kernel(cls="high", launch=NOW - 3000), **idle_1h), r).action == "keep"
    assert one(view(kernel(cls="low", launch=NOW - 3000), **idle_1h), r).action == "cull"
    assert one(view(kernel(cls="high", profile="gpu-80g", launch=NOW - 3000), **idle_1h), r).action == "cull"


def test_max_age_culls_an_old_kernel_at_its_first_non_busy_moment():
    r = rules(default={"max_age_seconds": 8 * H, "idle_timeout_seconds": 0})
    v = one(view(kernel(launch=NOW - 120, created=NOW - 9 * H), activity=NOW - 120), r)
    assert (v.action, v.reason) == ("cull", "max-age")
    busy = one(view(kernel(launch=NOW - 1, created=NOW - 9 * H), activity=NOW - 120), r)
    assert busy.action == "keep"


def test_bad_policy_config_names_the_key_and_what_is_allowed():
    with pytest.raises(PolicyError, match=r"priority_class_policies\.low has unknown key\(s\) idle_timeout; allowed"):
        PolicyBook.build({}, {"low": {"idle_timeout": 5}})
    with pytest.raises(PolicyError, match=r"profile_policies\.big\.cull_connected must be true or false"):
        PolicyBook.build({}, {}, {"big": {"cull_connected": "yes"}})
    with pytest.raises(PolicyError, match=r"idle_timeout_seconds must be a number of seconds >= 0, got -1"):
        PolicyBook.build({"idle_timeout_seconds": -1})


# ---- server answers ---------------------------------------------------------------------------------


def test_unreachable_server_keeps_the_kernel_and_orphans_are_culled_after_gpu_idle_timeout():
    k = kernel(launch=NOW - 2 * H)
    assert one(KernelView(k, None, "unknown")).reason == "server-unreachable"
    assert (one(KernelView(k, None, "gone")).action, one(KernelView(k, None, "gone")).reason) == ("cull", "orphan")
    young = kernel(launch=None, created=NOW - 60)
    assert one(KernelView(young, None, "gone")).action == "keep"
    assert one(KernelView(k, None, "gone"), rules(cull_orphans=False)).action == "keep"


def test_servers_are_only_asked_about_kernels_the_gpu_signal_does_not_rule_out():
    r = rules(default={"warning_seconds": 300})
    assert not needs_jupyter_state(kernel(launch=NOW - 5), r, NOW)  # busy
    assert not needs_jupyter_state(kernel(launch=NOW - 1000), r, NOW)  # idle 17 min < 60-5
    assert needs_jupyter_state(kernel(launch=NOW - 3400), r, NOW)  # within the warning lead
    assert needs_jupyter_state(kernel(launch=NOW - 1000), r, NOW, pressure=True)  # pressure: min idle 600
    assert not needs_jupyter_state(kernel(known=False), r, NOW)


# ---- pressure mode -------------------------------------------------------------------------------------


def test_pressure_reclaims_lowest_priority_longest_idle_first_only_as_much_as_needed():
    r = rules(default={"idle_timeout_seconds": 10 * H})
    views = [
        view(kernel("default-old", cls="default", launch=NOW - 3 * H), activity=NOW - 3 * H),
        view(kernel("low-new", cls="low", launch=NOW - 900), activity=NOW - 900),
        view(kernel("low-old", cls="low", launch=NOW - 2 * H), activity=NOW - 2 * H),
        view(kernel("low-fresh", cls="low", launch=NOW - 100), activity=NOW - 100),  # below min idle
    ]
    waiting = [Waiter("r1", "bob", "default", "default", 10240)]
    out = {v.kernel.kernel_id: v for v in decide(views, r, NOW, waiting=waiting)}
    assert [k for k, v in out.items() if v.action == "cull"] == ["low-old"]
    assert out["low-old"].reason == "pressure" and out["low-old"].extra["request_id"] == "r1"
    # a bigger request takes the next lowest priority, never the one idle for less than the minimum
    big = [Waiter("r2", "bob", "default", "default", 25000)]
    culled = sorted(v.kernel.kernel_id for v in decide(views, r, NOW, waiting=big) if v.action == "cull")
    assert culled == ["default-old", "low-new", "low-old"]


def test_pressure_never_reclaims_a_higher_priority_kernel_for_a_lower_priority_request():
    r = rules(default={"idle_timeout_seconds": 10 * H})
    views = [view(kernel("high", cls="high", launch=NOW - 3 * H), activity=NOW - 3 * H)]
    out = decide(views, r, NOW, waiting=[Waiter("r1", "bob", "default", "low", 10240)])
    assert out[0].action == "keep"


def test_pressure_counts_regular_culls_and_earlier_credit_against_the_demand():
    r = rules(default={"idle_timeout_seconds": H})
    views = [
        view(kernel("timed-out", launch=NOW - 2 * H), activity=NOW - 2 * H),
        view(kernel("idle-20min", launch=NOW - 1200), activity=NOW - 1200),
    ]
    waiting = [Waiter("r1", "bob", "default", "default", 10240)]
    out = {v.kernel.kernel_id: v.action for v in decide(views, r, NOW, waiting=waiting)}
    assert out == {"timed-out": "cull", "idle-20min": "keep"}
    views = views[1:]
    assert decide(views, r, NOW, waiting=waiting, pressure_credit={"r1": 10240})[0].action == "keep"
    assert decide(views, r, NOW, waiting=waiting)[0].action == "cull"


def test_quota_bound_request_only_reclaims_its_own_workspace():
    r = rules(default={"idle_timeout_seconds": 10 * H})
    views = [
        view(kernel("other-ws", workspace="physics", launch=NOW - 3 * H), activity=NOW - 3 * H),
        view(kernel("same-ws", workspace="vision", launch=NOW - 2 * H), activity=NOW - 2 * H),
    ]
    waiting = [Waiter("r1", "bob", "vision", "default", 10240, blocked_by="quota")]
    culled = [v.kernel.kernel_id for v in decide(views, r, NOW, waiting=waiting) if v.action == "cull"]
    assert culled == ["same-ws"]


def test_class_exempt_from_pressure_is_only_culled_at_its_timeout():
    r = rules(default={"idle_timeout_seconds": 10 * H}, classes={"low": {"pressure_min_idle_seconds": None}})
    views = [view(kernel("low", cls="low", launch=NOW - 3 * H), activity=NOW - 3 * H)]
    assert decide(views, r, NOW, waiting=[Waiter("r1", "bob", "default", "high", 1)])[0].action == "keep"


# ---- broker records --------------------------------------------------------------------------------


def test_broker_records_in_flat_or_nested_shapes_are_read_and_bad_ones_named():
    flat = GPUKernel.from_record(
        {
            "id": "a1",
            "kernel_id": "k1",
            "user": "ada",
            "memory_mib": 2048,
            "gpu_uuids": ["g0", "g1"],
            "created_at": "2026-01-01T00:00:00Z",
            "last_launch": None,
            "memory_used_mib": 0,
        }
    )
    assert flat.activity_known and flat.gpu_last_launch is None and flat.freed_memory_mib == 4096
    assert flat.created_at == pytest.approx(1767225600.0)
    nested = GPUKernel.from_record(
        {
            "id": "a2",
            "user": "ada",
            "allocation": {"id": "al-2", "memory_mib": 1024, "priority_class": "low"},
            "activity": {"last_launch": 1767225700.5, "memory_used_mib": 900},
        }
    )
    assert (nested.kernel_id, nested.allocation_id, nested.priority_class) == ("", "al-2", "low")
    assert nested.gpu_memory_used_mib == 900 and nested.gpu_last_launch == 1767225700.5
    assert not GPUKernel.from_record({"id": "a3", "user": "ada"}).activity_known
    with pytest.raises(RecordError, match=r"kernel a4: created_at: expected an ISO 8601 time, got 'yesterday'"):
        GPUKernel.from_record({"id": "a4", "user": "ada", "created_at": "yesterday"})
    with pytest.raises(RecordError, match=r"kernel a5: user: expected a user name"):
        GPUKernel.from_record({"id": "a5"})


def test_verdicts_say_when_to_look_again_so_the_loop_can_act_at_the_due_moment():
    r = rules(default={"warning_seconds": 300})
    k = kernel(launch=NOW - 1800)
    # skipped on the GPU signal alone: look again when it could be warned
    [v] = decide([KernelView(k)], r, NOW)
    assert v.reason == "gpu-recent" and v.due_at == pytest.approx(NOW - 1800 + H - 300)
    # connected, idle 40 min: warn at timeout - warning, cull at the timeout
    [v] = decide([view(k, activity=NOW - 2400, connections=1)], r, NOW)
    assert v.action == "keep" and v.due_at == pytest.approx(NOW + 1800)
    assert v.extra["check_at"] == pytest.approx(NOW + 1500)


def test_how_long_a_kernel_stays_swapped_out_is_set_per_priority_class_and_profile():
    book = PolicyBook.build(
        {"idle_timeout_seconds": 600, "cull_swapped_after_seconds": 3600},
        {"low": {"cull_swapped_after_seconds": 600}},
        {"gpu-80g": {"cull_swapped_after_seconds": 0}},
    )
    assert book.resolve("default").cull_swapped_after_seconds == 3600
    assert book.resolve("low").cull_swapped_after_seconds == 600
    assert book.resolve("low", "gpu-80g").cull_swapped_after_seconds == 0  # never: the profile wins
    with pytest.raises(PolicyError, match="cull_swapped_after_seconds must be a number of seconds >= 0"):
        PolicyBook.build({}, {"low": {"cull_swapped_after_seconds": -1}})
