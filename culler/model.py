"""The culler's domain: what it knows about one GPU kernel, and what it decides. Plain frozen data.

Two sources are joined per kernel:

- the **broker's record** (:class:`GPUKernel`): who owns it, its slice, its priority class and
  the GPU activity the shim recorded (last kernel launch, memory in use);
- the **Jupyter state** (:class:`JupyterState`) from the user's server: ``execution_state``,
  ``last_activity`` and the number of open websocket ``connections``.

Times are seconds since the epoch (floats); units are in the names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

#: how the user's server answered for a kernel
ServerStatus = Literal["ok", "gone", "unknown", "skipped"]
#: what the culler does with a kernel this cycle
Action = Literal["keep", "warn", "cull"]


class RecordError(ValueError):
    """A broker record the culler cannot use; the message names the field and what was expected."""


def parse_time(value: Any, field_name: str) -> float | None:
    """Epoch seconds from an epoch number or an ISO 8601 string (as JupyterHub and jupyter-server write);
    None stays None."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise RecordError(f"{field_name}: expected epoch seconds or an ISO 8601 time, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise RecordError(f"{field_name}: expected epoch seconds >= 0, got {value!r}")
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise RecordError(f"{field_name}: expected an ISO 8601 time, got {value!r}") from None
        if parsed.tzinfo is None:  # jupyter-server and JupyterHub write UTC
            parsed = parsed.replace(tzinfo=timezone.utc)
        return parsed.timestamp()
    raise RecordError(f"{field_name}: expected epoch seconds or an ISO 8601 time, got {value!r}")


def _int(record: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    value = record.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise RecordError(f"{key}: expected a number >= 0, got {value!r}")
    return int(value)


def _str(record: Mapping[str, Any], key: str, default: str = "") -> str:
    value = record.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise RecordError(f"{key}: expected a string, got {value!r}")
    return value


@dataclass(frozen=True)
class GPUKernel:
    """One GPU kernel as the broker records it (``GET /hub/api/gpu/kernels``)."""

    id: str  #: the broker's id (for ``DELETE /hub/api/gpu/kernels/<id>``)
    kernel_id: str  #: the Jupyter kernel id on the user's server ("" when the broker does not know it)
    user: str
    server_name: str = ""
    allocation_id: str = ""
    memory_mib: int = 0  #: per GPU
    gpu_count: int = 1
    cores_percent: int = 0
    priority_class: str = "default"
    profile: str = ""  #: kernelspec / size name, for per-profile policies
    workspace: str = "default"
    state: str = "running"
    created_at: float = 0.0
    #: GPU activity from the shim; None = never launched (when activity_known) or unknown
    gpu_last_launch: float | None = None
    gpu_memory_used_mib: int | None = None
    #: False when neither the broker nor the shim's records told anything about GPU activity
    activity_known: bool = False
    #: the server's URL path (e.g. "/user/ada/"), when the broker gives it
    server_url: str = ""
    #: swapped out (its GPU memory in host memory, no slice held) since this time; 0: not swapped
    swapped_since: float = 0.0
    #: why the broker cannot swap this kernel out ("" when it can); None when the broker does not say
    #: (an older hub: then only its refusal tells)
    swap_why_not: str | None = None
    #: swapped out: when the broker says it will be culled (what the culler told it); None: not told
    swap_cull_at: float | None = None

    @property
    def freed_memory_mib(self) -> int:
        """GPU memory the slice returns to the pool when this kernel stops."""
        return self.memory_mib * max(1, self.gpu_count)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> GPUKernel:
        """Read a broker record; raise RecordError naming the bad field.

        Tolerates the shapes the broker may grow: activity flat (``last_launch``,
        ``memory_used_mib``) or nested under ``activity``; allocation as ``allocation_id`` or
        ``allocation: {id, ...}``.
        """
        if not isinstance(record, Mapping):
            raise RecordError(f"a kernel record must be a JSON object, got {type(record).__name__}")
        kid = record.get("id")
        if not isinstance(kid, str) or not kid:
            raise RecordError(f"id: expected a non-empty string, got {kid!r}")
        user = record.get("user")
        if isinstance(user, Mapping):  # {"name": ...}
            user = user.get("name")
        if not isinstance(user, str) or not user:
            raise RecordError(f"kernel {kid}: user: expected a user name, got {user!r}")
        allocation = record.get("allocation")
        allocation = allocation if isinstance(allocation, Mapping) else {}
        activity = record.get("activity")
        activity = activity if isinstance(activity, Mapping) else {}
        flat_keys = {"last_launch", "gpu_last_launch", "memory_used_mib", "gpu_memory_used_mib"}
        activity_known = bool(activity) or any(k in record for k in flat_keys)
        last_launch_raw = activity.get("last_launch", record.get("last_launch", record.get("gpu_last_launch")))
        used_raw = {
            "memory_used_mib": activity.get(
                "memory_used_mib", record.get("memory_used_mib", record.get("gpu_memory_used_mib"))
            )
        }
        gpu_uuids = record.get("gpu_uuids", allocation.get("gpu_uuids"))
        count = record.get("gpu_count", record.get("count", allocation.get("count")))
        if count is None and isinstance(gpu_uuids, (list, tuple)) and gpu_uuids:
            count = len(gpu_uuids)
        merged = {**allocation, **record}
        try:
            return cls(
                id=kid,
                kernel_id=_str(record, "kernel_id"),
                user=user,
                server_name=_str(record, "server_name"),
                allocation_id=_str(record, "allocation_id") or _str(allocation, "id"),
                memory_mib=_int(merged, "memory_mib", 0) or 0,
                gpu_count=_int({"gpu_count": count}, "gpu_count", 1) or 1,
                cores_percent=_int(merged, "cores_percent", 0) or 0,
                priority_class=_str(merged, "priority_class") or "default",
                profile=_str(record, "profile") or _str(record, "kernel_name") or _str(record, "kernelspec"),
                workspace=_str(merged, "workspace") or "default",
                state=_str(record, "state") or "running",
                created_at=parse_time(merged.get("created_at"), "created_at") or 0.0,
                gpu_last_launch=parse_time(last_launch_raw, "last_launch"),
                gpu_memory_used_mib=_int(used_raw, "memory_used_mib"),
                activity_known=activity_known,
                server_url=_str(record, "server_url"),
                swapped_since=(record.get("swap") or {}).get("since") or 0.0 if record.get("gpu_swapped") else 0.0,
                swap_why_not=_why_not(record.get("swap_capability")),
                swap_cull_at=parse_time((record.get("swap") or {}).get("cull_at"), "swap.cull_at"),
            )
        except RecordError as e:
            raise RecordError(f"kernel {kid}: {e}") from None


def _why_not(capability: Any) -> str | None:
    """``swap_capability`` ({able, why_not}) as the reason it cannot ("" when it can; None: not said)."""
    if not isinstance(capability, Mapping) or not isinstance(capability.get("able"), bool):
        return None
    if capability["able"]:
        return ""
    return str(capability.get("why_not") or "the broker cannot swap it out")


@dataclass(frozen=True)
class JupyterState:
    """A kernel's state on the user's server (``GET /api/kernels``)."""

    execution_state: str
    last_activity: float
    connections: int = 0
    name: str = ""  #: kernelspec name

    @classmethod
    def from_model(cls, model: Mapping[str, Any]) -> JupyterState:
        return cls(
            execution_state=str(model.get("execution_state") or "unknown"),
            last_activity=parse_time(model.get("last_activity"), "last_activity") or 0.0,
            connections=int(model.get("connections") or 0),
            name=str(model.get("name") or ""),
        )


@dataclass(frozen=True)
class KernelView:
    """Both signals for one kernel, as gathered in one cycle."""

    gpu: GPUKernel
    jupyter: JupyterState | None = None
    #: ok: the server listed the kernel; gone: the server is not running or does not know the
    #: kernel; unknown: the server did not answer; skipped: not asked (the GPU signal rules a cull out)
    server_status: ServerStatus = "skipped"


@dataclass(frozen=True)
class GraceWarning:
    """A grace warning sent to a kernel (persisted so a restarted culler does not warn twice)."""

    warned_at: float
    #: the kernel's last_activity before the warning, and right after it (the warning itself is
    #: activity on the server; an unchanged value afterwards means nobody else used the kernel)
    activity_before: float
    activity_after: float
    due_at: float

    def to_json(self) -> dict[str, float]:
        return {
            "warned_at": self.warned_at,
            "activity_before": self.activity_before,
            "activity_after": self.activity_after,
            "due_at": self.due_at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GraceWarning:
        return cls(
            warned_at=float(data["warned_at"]),
            activity_before=float(data["activity_before"]),
            activity_after=float(data["activity_after"]),
            due_at=float(data["due_at"]),
        )


@dataclass(frozen=True)
class Waiter:
    """A request waiting in the admission queue (``GET /hub/api/gpu/pool`` → ``queue``)."""

    request_id: str
    user: str
    workspace: str
    priority_class: str
    memory_mib: int  #: per GPU
    count: int = 1
    #: "quota" when the request waits for its own workspace's quota, "pool" for room on a card,
    #: "" when the broker does not say
    blocked_by: str = ""

    @property
    def demand_mib(self) -> int:
        return self.memory_mib * max(1, self.count)

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> Waiter:
        return cls(
            request_id=str(entry.get("request_id") or entry.get("id") or ""),
            user=str(entry.get("user") or ""),
            workspace=str(entry.get("workspace") or "default"),
            priority_class=str(entry.get("priority_class") or "default"),
            memory_mib=int(entry.get("memory_mib") or 0),
            count=int(entry.get("count") or 1),
            blocked_by=str(entry.get("blocked_by") or ""),
        )


@dataclass(frozen=True)
class Verdict:
    """What to do with one kernel this cycle, and why (a short reason code plus a sentence)."""

    view: KernelView
    action: Action
    reason: str
    idle_seconds: float = 0.0
    #: when the kernel becomes cullable if nothing changes (None: never, e.g. busy or protected)
    due_at: float | None = None
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def kernel(self) -> GPUKernel:
        return self.view.gpu
