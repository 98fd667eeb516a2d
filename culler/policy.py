"""Cull policy and the decision: pure functions of plain data and a clock the caller passes in.

A kernel is **idle** only when it is idle on both signals: Jupyter (``execution_state`` is
``idle`` and ``last_activity`` is old) and GPU (no kernel launch recently). Its idle time is
measured from the later of the two. **Busy kernels are never culled**, for any reason: a kernel
that is executing, or that launched GPU work within ``gpu_busy_window_seconds``, is kept.

Policies are resolved per kernel: the defaults, then its priority class's overrides, then its
profile's overrides (the profile wins).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .model import GPUKernel, GraceWarning, KernelView, Verdict, Waiter

#: Jupyter execution states during which a kernel is never culled. Others ("idle", and "starting"
#: for a kernel no client ever connected to) are judged on last_activity, as jupyter-server's culler does.
BUSY_STATES = frozenset({"busy", "restarting", "autorestarting"})


class PolicyError(ValueError):
    """Bad cull policy configuration; the message names the key path and what is allowed."""


@dataclass(frozen=True)
class Policy:
    """How long a kernel of one priority class / profile may stay idle, and how it is warned."""

    #: cull a kernel idle (on both signals) this long; 0 disables idle culling
    idle_timeout_seconds: float = 3600.0
    #: cull a kernel this old at its first non-busy moment; 0 = no age limit
    max_age_seconds: float = 0.0
    #: whether a kernel with an open websocket (a browser tab) may be culled
    cull_connected: bool = True
    #: warn a connected kernel this long before its cull (0 = no warning)
    warning_seconds: float = 300.0
    #: under pressure (requests waiting), kernels idle this long may be reclaimed before their
    #: timeout; None = never reclaimed early
    pressure_min_idle_seconds: float | None = 600.0
    #: with GPUCuller.swap_idle_kernels: cull a kernel swapped out this long; 0 = never
    cull_swapped_after_seconds: float = 0.0


POLICY_KEYS: dict[str, str] = {
    "idle_timeout_seconds": "a number of seconds >= 0",
    "max_age_seconds": "a number of seconds >= 0",
    "cull_connected": "true or false",
    "warning_seconds": "a number of seconds >= 0",
    "pressure_min_idle_seconds": "a number of seconds >= 0, or null for never",
    "cull_swapped_after_seconds": "a number of seconds >= 0",
}


def _check_value(key: str, value: Any, where: str) -> Any:
    if key == "cull_connected":
        if not isinstance(value, bool):
            raise PolicyError(f"{where}.{key} must be {POLICY_KEYS[key]}, got {value!r}")
        return value
    if key == "pressure_min_idle_seconds" and value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not ok:
        raise PolicyError(f"{where}.{key} must be {POLICY_KEYS[key]}, got {value!r}")
    return float(value)


def check_overrides(overrides: Any, where: str) -> dict[str, Any]:
    """Validate one override mapping (e.g. a priority class's); raise PolicyError naming the key."""
    if not isinstance(overrides, Mapping):
        raise PolicyError(f"{where} must be a mapping of policy keys ({', '.join(POLICY_KEYS)}), got {overrides!r}")
    unknown = sorted(set(overrides) - set(POLICY_KEYS))
    if unknown:
        raise PolicyError(
            f"{where} has unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(POLICY_KEYS)}"
        )
    return {key: _check_value(key, value, where) for key, value in overrides.items()}


@dataclass(frozen=True)
class PolicyBook:
    """The default policy plus overrides per priority class and per profile."""

    default: Policy = field(default_factory=Policy)
    by_priority_class: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    by_profile: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def for_kernel(self, kernel: GPUKernel) -> Policy:
        return self.resolve(kernel.priority_class, kernel.profile)

    def resolve(self, priority_class: str, profile: str = "") -> Policy:
        policy = self.default
        over = self.by_priority_class.get(priority_class)
        if over:
            policy = replace(policy, **over)
        over = self.by_profile.get(profile) if profile else None
        if over:
            policy = replace(policy, **over)
        return policy

    @classmethod
    def build(
        cls,
        default: Mapping[str, Any],
        by_priority_class: Mapping[str, Any] | None = None,
        by_profile: Mapping[str, Any] | None = None,
        where: str = "GPUCuller",
    ) -> PolicyBook:
        """Validate config (traits) into a book; raise PolicyError naming the bad key path."""
        base = check_overrides(default, where)
        classes = {
            str(name): check_overrides(over, f"{where}.priority_class_policies.{name}")
            for name, over in _mapping(by_priority_class, f"{where}.priority_class_policies").items()
        }
        profiles = {
            str(name): check_overrides(over, f"{where}.profile_policies.{name}")
            for name, over in _mapping(by_profile, f"{where}.profile_policies").items()
        }
        return cls(default=Policy(**base), by_priority_class=classes, by_profile=profiles)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PolicyError(f"{where} must be a mapping of name -> policy overrides, got {value!r}")
    return value


@dataclass(frozen=True)
class Rules:
    """Everything a decision depends on besides the kernels, the clock and the queue."""

    book: PolicyBook = field(default_factory=PolicyBook)
    #: a GPU launch within this many seconds makes a kernel busy (never culled, for any reason)
    gpu_busy_window_seconds: float = 60.0
    #: a kernel whose GPU activity is unknown: True = never cull it; False = judge it on Jupyter alone
    require_gpu_activity: bool = True
    #: reclaim kernels whose server is gone or does not know them, once idle on the GPU for the timeout
    cull_orphans: bool = True
    #: priority class -> value (higher wins); unknown classes count as 0
    priority_values: Mapping[str, int] = field(default_factory=dict)
    #: whether a kernel keeps its state when reclaimed (it is swapped out, not shut down): its
    #: warning then does not delay the reclaim past its timeout (None: no kernel does)
    keeps_state: Callable[[GPUKernel], bool] | None = None

    def priority(self, name: str) -> int:
        return int(self.priority_values.get(name, 0))


# ---- the GPU side alone (used to skip asking servers about kernels that cannot be culled) --------


def gpu_busy(kernel: GPUKernel, rules: Rules, now: float) -> bool:
    """True when the shim saw a kernel launch within the busy window."""
    return (
        kernel.activity_known
        and kernel.gpu_last_launch is not None
        and now - kernel.gpu_last_launch < rules.gpu_busy_window_seconds
    )


def gpu_idle_since(kernel: GPUKernel) -> float | None:
    """Since when the GPU has been idle (the last launch, or the start if it never launched);
    None when the GPU activity is unknown."""
    if not kernel.activity_known:
        return None
    if kernel.gpu_last_launch is None:
        return kernel.created_at
    return max(kernel.gpu_last_launch, kernel.created_at)


def needs_jupyter_state(
    kernel: GPUKernel,
    rules: Rules,
    now: float,
    *,
    pressure: bool = False,
    warned: bool = False,
) -> bool:
    """Whether this cycle must ask the user's server about ``kernel``: False when the GPU signal
    alone rules out a warning or a cull (so a busy cluster costs few server calls)."""
    if not kernel.kernel_id or gpu_busy(kernel, rules, now):
        return False
    if not kernel.activity_known and rules.require_gpu_activity:
        return False
    if warned:
        return True
    first = gpu_side_due(kernel, rules, pressure=pressure)
    return first is not None and now >= first


def gpu_side_due(kernel: GPUKernel, rules: Rules, *, pressure: bool = False) -> float | None:
    """The earliest moment the kernel could be warned or culled, judging by its GPU signal and age alone."""
    policy = rules.book.for_kernel(kernel)
    since = gpu_idle_since(kernel)
    if since is None:
        since = kernel.created_at
    lead = policy.warning_seconds
    candidates = []
    if policy.idle_timeout_seconds > 0:
        candidates.append(since + policy.idle_timeout_seconds - lead)
    if policy.max_age_seconds > 0:
        candidates.append(kernel.created_at + policy.max_age_seconds - lead)
    if pressure and policy.pressure_min_idle_seconds is not None:
        candidates.append(since + max(policy.pressure_min_idle_seconds, rules.gpu_busy_window_seconds))
    return min(candidates) if candidates else None


# ---- the decision ----------------------------------------------------------------------------


#: activity this close after the culler's own warning is taken for the warning's (the server
#: records the warning's last output a moment after the culler reads it back)
WARNING_ACTIVITY_SLACK_SECONDS = 2.0


def effective_last_activity(last_activity: float, warning: GraceWarning | None) -> tuple[float, bool]:
    """The kernel's Jupyter activity with the culler's own warning taken out.

    Returns (last activity, warning still valid). ``last_activity`` unchanged since right after
    the warning (within a short slack) means nobody used the kernel since: its activity is what
    it was before the warning.
    """
    if warning is None:
        return last_activity, False
    if last_activity <= warning.activity_after + WARNING_ACTIVITY_SLACK_SECONDS:
        return min(last_activity, warning.activity_before), True
    return last_activity, False


def decide(
    views: Iterable[KernelView],
    rules: Rules,
    now: float,
    *,
    waiting: Sequence[Waiter] = (),
    warnings: Mapping[str, GraceWarning] | None = None,
    pressure_credit: Mapping[str, int] | None = None,
) -> list[Verdict]:
    """One verdict per kernel: keep, warn or cull, with the reason.

    ``warnings``: grace warnings already sent, by Jupyter kernel id. ``waiting``: the admission
    queue, in its order; when it is not empty, idle kernels may be reclaimed before their
    timeout (pressure mode), lower priorities first, only as many as the waiting requests need.
    ``pressure_credit``: MiB already freed for a waiting request by earlier cycles.
    """
    warnings = warnings or {}
    verdicts = [_judge(view, rules, now, warnings) for view in views]
    if waiting:
        verdicts = _pressure(verdicts, rules, waiting, pressure_credit or {})
    return verdicts


def _judge(view: KernelView, rules: Rules, now: float, warnings: Mapping[str, GraceWarning]) -> Verdict:
    k = view.gpu
    policy = rules.book.for_kernel(k)
    if gpu_busy(k, rules, now):
        return Verdict(view, "keep", "gpu-active", detail="launched GPU work within the busy window")
    if not k.activity_known and rules.require_gpu_activity:
        return Verdict(view, "keep", "gpu-activity-unknown", detail="no GPU activity record for this kernel")
    if not k.kernel_id:
        return Verdict(view, "keep", "no-kernel-id", detail="the broker does not know its Jupyter kernel id")
    gpu_since = gpu_idle_since(k)
    if view.server_status == "skipped":
        return Verdict(view, "keep", "gpu-recent", idle_seconds=_idle(now, gpu_since), due_at=gpu_side_due(k, rules))
    if view.server_status == "unknown":
        return Verdict(view, "keep", "server-unreachable", detail="the user's server did not answer")
    if view.server_status == "gone" or view.jupyter is None:
        since = gpu_since if gpu_since is not None else k.created_at
        idle = now - since
        if not rules.cull_orphans or policy.idle_timeout_seconds <= 0:
            return Verdict(view, "keep", "orphan-kept", idle_seconds=idle)
        due = max(since, k.created_at) + policy.idle_timeout_seconds
        if now >= due:
            return Verdict(
                view,
                "cull",
                "orphan",
                idle_seconds=idle,
                due_at=due,
                detail="its server is gone or does not know it, and its GPU is idle",
            )
        return Verdict(view, "keep", "orphan-waiting", idle_seconds=idle, due_at=due)

    j = view.jupyter
    if j.execution_state in BUSY_STATES:
        return Verdict(view, "keep", "executing", detail=f"execution_state is {j.execution_state}")
    warning = warnings.get(k.kernel_id)
    last_activity, warned = effective_last_activity(j.last_activity, warning)
    extra: dict[str, Any] = {}
    if warning is not None and not warned:
        extra["warning_void"] = True  # used since the warning: forget it
    idle_since = max(last_activity, gpu_since if gpu_since is not None else 0.0)
    idle = max(0.0, now - idle_since)
    if j.connections > 0 and not policy.cull_connected:
        return Verdict(
            view,
            "keep",
            "connected",
            idle_seconds=idle,
            extra=extra,
            detail=f"{j.connections} connection(s) open and cull_connected is off",
        )
    due, reason = None, ""
    if policy.idle_timeout_seconds > 0:
        due, reason = idle_since + policy.idle_timeout_seconds, "idle-timeout"
    if policy.max_age_seconds > 0:
        age_due = k.created_at + policy.max_age_seconds
        if due is None or age_due < due:
            due, reason = age_due, "max-age"
    if due is None:
        return Verdict(view, "keep", "no-limit", idle_seconds=idle, extra=extra)
    extra["pressure_eligible"] = True
    needs_warning = policy.warning_seconds > 0 and j.connections > 0
    # a swap keeps the kernel's state: its warning is a courtesy, never a reason to hold the slice longer
    grace = 0.0 if rules.keeps_state is not None and rules.keeps_state(k) else policy.warning_seconds
    if needs_warning and not warned:
        if now >= due - policy.warning_seconds:
            return Verdict(view, "warn", reason, idle_seconds=idle, due_at=max(due, now + grace), extra=extra)
        extra["check_at"] = due - policy.warning_seconds  # the moment to warn
        return Verdict(view, "keep", "idle", idle_seconds=idle, due_at=due, extra=extra)
    if warned and warning is not None:
        due = max(due, warning.warned_at + grace)
    if now >= due:
        return Verdict(view, "cull", reason, idle_seconds=idle, due_at=due, extra=extra)
    return Verdict(view, "keep", "warned" if warned else "idle", idle_seconds=idle, due_at=due, extra=extra)


def _idle(now: float, since: float | None) -> float:
    return 0.0 if since is None else max(0.0, now - since)


def _pressure(
    verdicts: list[Verdict], rules: Rules, waiting: Sequence[Waiter], credit: Mapping[str, int]
) -> list[Verdict]:
    """Pick idle kernels to reclaim early for the waiting requests: lowest priority first, then
    the longest idle; never a kernel of higher priority than the request it frees room for."""
    culling = [i for i, v in enumerate(verdicts) if v.action == "cull"]
    candidates = []
    for i, v in enumerate(verdicts):
        if v.action == "cull":
            continue
        policy = rules.book.for_kernel(v.kernel)
        if policy.pressure_min_idle_seconds is None:
            continue
        min_idle = max(policy.pressure_min_idle_seconds, rules.gpu_busy_window_seconds)
        eligible = v.extra.get("pressure_eligible") or v.reason in ("orphan-waiting",)
        if eligible and v.idle_seconds >= min_idle:
            candidates.append(i)
    candidates.sort(key=lambda i: (rules.priority(verdicts[i].kernel.priority_class), -verdicts[i].idle_seconds))
    assigned: set[int] = set()
    out = list(verdicts)
    for waiter in waiting:
        need = waiter.demand_mib - int(credit.get(waiter.request_id, 0))
        for i in culling:
            if need <= 0:
                break
            if i not in assigned and _fits(verdicts[i].kernel, waiter):
                assigned.add(i)
                need -= verdicts[i].kernel.freed_memory_mib
        for i in candidates:
            if need <= 0:
                break
            k = verdicts[i].kernel
            if i in assigned or not _fits(k, waiter):
                continue
            if rules.priority(k.priority_class) > rules.priority(waiter.priority_class):
                continue
            assigned.add(i)
            need -= k.freed_memory_mib
            v = verdicts[i]
            out[i] = replace(
                v,
                action="cull",
                reason="pressure",
                detail=f"reclaimed early for {waiter.user}'s waiting {waiter.priority_class}-priority request",
                extra={**v.extra, "request_id": waiter.request_id},
            )
    return out


def _fits(kernel: GPUKernel, waiter: Waiter) -> bool:
    """Whether freeing ``kernel`` can help ``waiter`` (a quota-bound request needs its own workspace's slices)."""
    if waiter.blocked_by == "quota":
        return kernel.workspace == waiter.workspace
    return True


def policy_fields() -> list[str]:
    return [f.name for f in fields(Policy)]
