"""What the broker knows about a GPU kernel, and its REST model (``/hub/api/gpu/kernels/<id>``).

Both modes keep the same record; the local mode stores it in its ledger, the Kubernetes mode
rebuilds it from the kernel pod's annotations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

from jupyter_client.connect import port_names

from quotas import Allocation

STATES = ("pending", "running", "stopped", "failed")


@dataclass
class KernelRecord:
    """What the broker knows about one GPU kernel (never its key)."""

    id: str
    user: str
    server_name: str
    size: str
    allocation_id: str
    section: dict[str, Any] = field(default_factory=dict)
    state: str = "pending"
    reason: str = ""
    ip: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    transport: str = "tcp"
    signature_scheme: str = "hmac-sha256"
    server_identity: str = ""
    holder: str = ""  # a pid (local) or a pod name (Kubernetes)
    namespace: str = ""
    generation: int = 0
    created_at: float = 0.0
    exit_code: int | None = None
    cwd: str = ""
    kernel_name: str = ""
    jupyter_kernel_id: str = ""  # the kernel's id on the user's server (what the culler shuts down)
    allocation: dict[str, Any] = field(default_factory=dict)  # where the slice is (node, GPUs, limits)
    activity_file: str = ""  # local: the shim's activity record of the slice (for the culler)
    #: Kubernetes: {last_launch, memory_used_mib} from the node agent's gpu-activity pod annotation
    activity: dict[str, Any] = field(default_factory=dict)
    run_as: str = ""  # local: the unix account the kernel runs as ('' = the hub's)
    home: str = ""  # local: the user's home (HOME, default working directory)
    #: swapped out: {state: swapped|queued, since, host_mib, position, reason, ...} ({}: on its GPU)
    swap: dict[str, Any] = field(default_factory=dict)
    key_sha256: str = ""  # the connection key's digest: the kernel asking for its own resume
    #: waiting in the GPU queue for its first start: {position (requests ahead), waiting_reason} ({}: not waiting)
    queue: dict[str, Any] = field(default_factory=dict)
    #: the culler's warning: {action: swap|stop, deadline: seconds since the epoch} ({}: not warned)
    idle: dict[str, Any] = field(default_factory=dict)
    resume_url: str = ""  # where the kernel asks for its resume (the hub's API)
    #: the hub's last stop of this kernel that a restart followed (jupyter-server's restarter starts a
    #: stopped kernel afresh within seconds): {at, reason}, so its user's page still says why the
    #: variables are gone ({}: none since its last swap-out or clean restart)
    last_stop: dict[str, Any] = field(default_factory=dict)

    def model(self) -> dict[str, Any]:
        """The REST model (``GET /hub/api/gpu/kernels/<id>``)."""
        return {
            "id": self.id,
            "user": self.user,
            "server_name": self.server_name,
            "size": self.size,
            "allocation_id": self.allocation_id,
            "gpu": self.section,
            "state": self.state,
            "reason": self.reason,
            "ip": self.ip,
            "transport": self.transport,
            "signature_scheme": self.signature_scheme,
            **{name: self.ports.get(name, 0) for name in port_names},
            "generation": self.generation,
            "holder": self.holder,
            "created_at": self.created_at,
            "exit_code": self.exit_code,
            "kernel_name": self.kernel_name,
            "kernel_id": self.jupyter_kernel_id,
            "profile": self.size,
            "allocation": self.allocation,
            **{
                k: self.allocation[k]
                for k in ("memory_mib", "cores_percent", "memory_limit_mib", "cores_limit_percent", "priority_class")
                if k in self.allocation
            },
            "gpu_count": len(self.allocation.get("gpu_uuids", [])) or self.section.get("count", 1),
            "workspace": self.allocation.get("workspace", ""),
            **({"activity_file": self.activity_file} if self.activity_file else {}),
            **({"activity": self.activity} if self.activity else {}),
            "gpu_swapped": bool(self.swap),
            **({"swap": {k: v for k, v in self.swap.items() if k != "processes"}} if self.swap else {}),
            **({"queue": dict(self.queue)} if self.queue else {}),
            **(self.idle_fields() if self.idle and not self.swap else {}),
            **({"last_stop": dict(self.last_stop)} if self.last_stop else {}),
        }

    def idle_fields(self) -> dict[str, str]:
        """What the culler warned of (JupyterLab counts down from it): ``idle_action`` ('swap': swapped
        out, its variables kept; 'stop': shut down) and ``idle_deadline`` (when, ISO 8601 UTC)."""
        deadline = datetime.fromtimestamp(self.idle["deadline"], timezone.utc)
        return {"idle_action": self.idle["action"], "idle_deadline": deadline.isoformat(timespec="seconds")}

    def set_allocation(self, allocation: Allocation) -> None:
        self.allocation_id = allocation.id
        self.allocation = {
            "id": allocation.id,
            "node": allocation.node,
            "gpu_uuids": list(allocation.gpu_uuids),
            "memory_mib": allocation.memory_mib,
            "cores_percent": allocation.cores_percent,
            "memory_limit_mib": allocation.memory_ceiling_mib,
            "cores_limit_percent": allocation.cores_ceiling_percent,
            "priority_class": allocation.priority_class,
            "workspace": allocation.owner.workspace,
            "namespace": allocation.owner.namespace,
            "borrowed": allocation.borrowed,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
