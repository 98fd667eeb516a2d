"""Small builders for admission tests: pools, configs, requests, allocations."""

from __future__ import annotations

from typing import Any

from quotas import (
    GPU,
    AdmissionState,
    Allocation,
    GPURequest,
    Mode,
    Node,
    Owner,
    Pool,
    load_config,
)

GIB = 1024

CLASSES = {
    "high": {"value": 1000, "preempt": True},
    "default": {"value": 100},
    "low": {"value": 10, "borrow": True},
    "lowest": {"value": 1},
}


def node(name: str, n: int = 2, model: str = "H100-80GB", memory_mib: int = 80 * GIB,
         **gpu: Any) -> Node:
    return Node(name, tuple(
        GPU(uuid=f"{name}-gpu{i}", model=model, memory_mib=memory_mib, index=i, **gpu)
        for i in range(n)
    ))


def pool(*nodes: Node) -> Pool:
    return Pool(nodes=tuple(nodes))


def config(workspaces: dict | None = None, **extra: Any) -> Any:
    data: dict[str, Any] = {"priority_classes": CLASSES}
    if workspaces is not None:
        data["workspaces"] = workspaces
    data.update(extra)
    return load_config(data)


def state(p: Pool, workspaces: dict | None = None, allocations=(), **extra: Any) -> AdmissionState:
    return AdmissionState(config(workspaces, **extra), p, allocations)


def req(user: str = "alice", memory_gib: float = 10, cores: int = 25, *, ws: str = "default",
        ns: str = "default", rid: str = "", **kw: Any) -> GPURequest:
    return GPURequest(Owner(user, ns, ws), int(memory_gib * GIB), cores, request_id=rid, **kw)


def alloc(aid: str, gpus: tuple[str, ...] | str, memory_gib: float = 10, cores: int = 25, *,
          user: str = "bob", ws: str = "default", ns: str = "default", pc: str = "default",
          node_name: str = "", created_at: float = 0.0, **kw: Any) -> Allocation:
    gpus = (gpus,) if isinstance(gpus, str) else gpus
    return Allocation(
        id=aid, owner=Owner(user, ns, ws), node=node_name or gpus[0].rsplit("-gpu", 1)[0],
        gpu_uuids=gpus, memory_mib=int(memory_gib * GIB), cores_percent=cores,
        priority_class=pc, created_at=created_at, **kw,
    )


def grant(st: AdmissionState, r: GPURequest, now: float = 0.0) -> Allocation:
    """Decide, assert it is granted without preemption, record it, return the allocation."""
    d = st.decide(r, now)
    assert d.kind == "grant", d.reason
    st.apply(d)
    return d.allocation


__all__ = ["GIB", "Mode", "alloc", "config", "grant", "node", "pool", "req", "state"]
