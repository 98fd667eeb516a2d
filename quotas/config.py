"""Loading the admission config and the GPU inventory from plain data (YAML, JSON, Helm values).

Every problem raises :class:`ConfigError` naming the key path and what is allowed, e.g.
``workspaces.vision.limits.memory_mib: must be an integer > 0, got 'abc'``. Unknown keys are
errors too, so a typo never silently means "unlimited".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError
from .model import GPU, Mode, Node, Pool
from .policy import (
    DEFAULT_PRIORITY_CLASSES,
    RESERVE_AFTER_SECONDS,
    STRATEGIES,
    AdmissionConfig,
    MovePolicy,
    Placement,
    Policy,
    PriorityClass,
)
from .tree import Limits, NamespaceQuota, QuotaTree, WorkspaceQuota

CONFIG_KEYS = (
    "priority_classes", "default_priority_class", "placement", "workspaces", "preemption", "queue",
)
QUEUE_KEYS = ("reserve_after_seconds", "reserve_spots", "hold", "moves")
MOVE_KEYS = ("max_slices", "per_hour", "same_session_after_seconds")
CLASS_KEYS = ("value", "preempt", "borrow", "movable")
PLACEMENT_KEYS = ("node", "gpu")
PREEMPTION_KEYS = ("max_candidate_nodes",)
WORKSPACE_KEYS = ("limits", "namespaces")
NAMESPACE_KEYS = ("limits", "user_limits", "users")
LIMIT_KEYS = ("memory_mib", "cores_percent", "gpus")
POOL_KEYS = ("nodes", "simulated")
NODE_KEYS = (
    "name", "gpus", "mode", "memory_oversub", "cores_oversub", "cpu_millicores", "host_memory_mib",
    "cpu_requested_millicores", "host_memory_requested_mib",
)
GPU_KEYS = (
    "uuid", "model", "memory_mib", "sm_count", "memory_oversub", "cores_oversub", "mode",
    "mig_profiles", "index",
)
MODES = tuple(m.value for m in Mode)


# ---- small checkers ----------------------------------------------------------------------


def _join(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _shown(value: object) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


def _mapping(value: Any, path: str, allowed: tuple[str, ...] | None = None) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        what = f" with keys {', '.join(allowed)}" if allowed else ""
        raise ConfigError(f"must be a mapping{what}, got {_shown(value)}", path or "config")
    if allowed is not None:
        for key in value:
            if key not in allowed:
                raise ConfigError(
                    f"unknown key; allowed keys: {', '.join(allowed)}", _join(path, key)
                )
    return value


def _names(value: Mapping, path: str, what: str) -> None:
    for key in value:
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(f"{what} names must be non-empty strings, got {key!r}", path)


def _int(value: Any, path: str, minimum: int = 1, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"must be an integer >= {minimum}, got {_shown(value)}"
                          if minimum != 1 else f"must be an integer > 0, got {_shown(value)}",
                          path)
    return value


def _any_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"must be an integer, got {_shown(value)}", path)
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"must be true or false, got {_shown(value)}", path)
    return value


def _positive(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"must be a number > 0 (1.0 = no oversubscription), got "
                          f"{_shown(value)}", path)
    return float(value)


def _text(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"must be a non-empty string, got {_shown(value)}", path)
    return value


def _choice(value: Any, path: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"must be one of {', '.join(allowed)}, got {_shown(value)}", path)
    return value


# ---- the admission config -----------------------------------------------------------------


def load_limits(value: Any, path: str) -> Limits:
    """``{memory_mib, cores_percent, gpus}``, each optional (absent or null = unlimited)."""
    data = _mapping(value, path, LIMIT_KEYS)
    return Limits(**{k: _int(data.get(k), _join(path, k), allow_none=True) for k in LIMIT_KEYS})


def _load_classes(value: Any) -> dict[str, PriorityClass]:
    if value is None:
        return dict(DEFAULT_PRIORITY_CLASSES)
    data = _mapping(value, "priority_classes")
    if not data:
        raise ConfigError("must define at least one priority class", "priority_classes")
    _names(data, "priority_classes", "priority class")
    classes = {}
    for name, body in data.items():
        path = _join("priority_classes", name)
        body = _mapping(body, path, CLASS_KEYS)
        if "value" not in body:
            raise ConfigError("is required (an integer; higher wins)", _join(path, "value"))
        classes[name] = PriorityClass(
            name=name,
            value=_any_int(body["value"], _join(path, "value")),
            preempt=_bool(body.get("preempt", False), _join(path, "preempt")),
            borrow=_bool(body.get("borrow", False), _join(path, "borrow")),
            movable=_bool(body.get("movable", False), _join(path, "movable")),
        )
    return classes


def _hold(value: Any) -> bool | None:
    """``queue.hold``: true, false, or 'with-moves' (None: hold where slices can move too)."""
    if value == "with-moves":
        return None
    if not isinstance(value, bool):
        raise ConfigError(f"must be true, false or 'with-moves', got {_shown(value)}", "queue.hold")
    return value


def _load_moves(value: Any) -> MovePolicy:
    """``queue.moves``: ``{max_slices, per_hour, same_session_after_seconds}``; null: never move."""
    if value is None:
        return MovePolicy(max_slices=0)
    data = _mapping(value, "queue.moves", MOVE_KEYS)
    default = MovePolicy()
    after = data.get("same_session_after_seconds", default.same_session_after_seconds)
    if isinstance(after, bool) or not isinstance(after, (int, float)) or after < 0:
        raise ConfigError(f"must be a number of seconds >= 0, got {_shown(after)}",
                          "queue.moves.same_session_after_seconds")
    return MovePolicy(
        max_slices=_int(data.get("max_slices", default.max_slices), "queue.moves.max_slices",
                        minimum=0),
        per_hour=_int(data.get("per_hour", default.per_hour), "queue.moves.per_hour", minimum=0),
        same_session_after_seconds=float(after),
    )


def _load_workspaces(value: Any) -> QuotaTree:
    if value is None:
        return QuotaTree.unlimited()
    data = _mapping(value, "workspaces")
    if not data:
        raise ConfigError("must define at least one workspace", "workspaces")
    _names(data, "workspaces", "workspace")
    workspaces = {}
    for ws_name, ws_body in data.items():
        ws_path = _join("workspaces", ws_name)
        ws_body = _mapping(ws_body, ws_path, WORKSPACE_KEYS)
        limits = load_limits(ws_body.get("limits"), _join(ws_path, "limits"))
        ns_path = _join(ws_path, "namespaces")
        if "namespaces" not in ws_body:
            namespaces = {"default": NamespaceQuota("default")}
        else:
            ns_data = _mapping(ws_body["namespaces"], ns_path)
            if not ns_data:
                raise ConfigError("must define at least one namespace (or leave the key out "
                                  "for a single 'default' namespace)", ns_path)
            _names(ns_data, ns_path, "namespace")
            namespaces = {}
            for ns_name, ns_body in ns_data.items():
                path = _join(ns_path, ns_name)
                ns_body = _mapping(ns_body, path, NAMESPACE_KEYS)
                users_path = _join(path, "users")
                users_data = _mapping(ns_body.get("users"), users_path)
                _names(users_data, users_path, "user")
                namespaces[ns_name] = NamespaceQuota(
                    name=ns_name,
                    limits=load_limits(ns_body.get("limits"), _join(path, "limits")),
                    user_limits=load_limits(ns_body.get("user_limits"), _join(path, "user_limits")),
                    users={
                        user: load_limits(body, _join(users_path, user))
                        for user, body in users_data.items()
                    },
                )
        workspaces[ws_name] = WorkspaceQuota(ws_name, limits, namespaces)
    return QuotaTree(workspaces)


def load_config(data: Mapping | None) -> AdmissionConfig:
    """Validate and load the admission config (see docs/admission.md for the format).

    Every key is optional: no ``priority_classes`` gives high/default/low; no ``workspaces``
    gives one unlimited 'default' workspace with a 'default' namespace.
    """
    if isinstance(data, AdmissionConfig):
        return data
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(
            f"the admission config must be a mapping with keys {', '.join(CONFIG_KEYS)}, got "
            f"{_shown(data)}"
        )
    data = _mapping(data, "", CONFIG_KEYS)
    classes = _load_classes(data.get("priority_classes"))
    if "default_priority_class" in data:
        default = _text(data["default_priority_class"], "default_priority_class")
        if default not in classes:
            raise ConfigError(
                f"names no defined priority class; defined: {', '.join(classes)}, got "
                f"{default!r}",
                "default_priority_class",
            )
    elif "default" in classes:
        default = "default"
    elif len(classes) == 1:
        default = next(iter(classes))
    else:
        raise ConfigError(
            f"is required when no priority class is named 'default'; defined: "
            f"{', '.join(classes)}",
            "default_priority_class",
        )
    placement_data = _mapping(data.get("placement"), "placement", PLACEMENT_KEYS)
    placement = Placement(
        node=_choice(placement_data.get("node", Placement.node), "placement.node", STRATEGIES),
        gpu=_choice(placement_data.get("gpu", Placement.gpu), "placement.gpu", STRATEGIES),
    )
    preemption = _mapping(data.get("preemption"), "preemption", PREEMPTION_KEYS)
    max_nodes = _int(preemption.get("max_candidate_nodes", 100),
                     "preemption.max_candidate_nodes")
    queue = _mapping(data.get("queue"), "queue", QUEUE_KEYS)
    reserve_after = queue.get("reserve_after_seconds", RESERVE_AFTER_SECONDS)
    if reserve_after is not None and (
        isinstance(reserve_after, bool) or not isinstance(reserve_after, (int, float))
        or reserve_after < 0
    ):
        raise ConfigError(
            f"must be a number of seconds >= 0, or null to never reserve, got "
            f"{_shown(reserve_after)}",
            "queue.reserve_after_seconds",
        )
    policy = Policy(
        priority_classes=classes,
        default_priority_class=default,
        placement=placement,
        max_preemption_nodes=max_nodes,
        reserve_after_seconds=None if reserve_after is None else float(reserve_after),
        reserve_spots=_int(queue.get("reserve_spots", 1), "queue.reserve_spots"),
        hold_for_overdue_head=_hold(queue.get("hold", "with-moves")),
        moves=_load_moves(queue.get("moves", {})),
    )
    return AdmissionConfig(policy=policy, quotas=_load_workspaces(data.get("workspaces")))


# ---- the inventory ------------------------------------------------------------------------


def load_gpus(value: Any, path: str = "gpus", defaults: Mapping | None = None) -> tuple[GPU, ...]:
    """A list of GPU objects (the node agent's annotation format). ``defaults`` holds a node's
    ``mode`` / ``memory_oversub`` / ``cores_oversub`` for GPUs that do not set their own."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"must be a list of GPUs ({{uuid, model, memory_mib, ...}}), got {_shown(value)}", path
        )
    defaults = defaults or {}
    gpus: list[GPU] = []
    indexes: set[int] = set()
    for i, item in enumerate(value):
        p = _join(path, i)
        body = _mapping(item, p, GPU_KEYS)
        for key in ("uuid", "model", "memory_mib"):
            if key not in body:
                raise ConfigError("is required", _join(p, key))
        mode = _choice(body.get("mode", defaults.get("mode", "shared")), _join(p, "mode"), MODES)
        profiles = body.get("mig_profiles", [])
        if not isinstance(profiles, (list, tuple)) or not all(
            isinstance(x, str) and x for x in profiles
        ):
            raise ConfigError(f"must be a list of MIG profile names, got {_shown(profiles)}",
                              _join(p, "mig_profiles"))
        if profiles and mode != "mig":
            raise ConfigError(f"only allowed with mode 'mig', got mode {mode!r}",
                              _join(p, "mig_profiles"))
        index = _int(body.get("index", i), _join(p, "index"), minimum=0)
        if index in indexes:
            raise ConfigError(f"is used by two GPUs of the same node, got {index}",
                              _join(p, "index"))
        indexes.add(index)
        gpus.append(
            GPU(
                uuid=_text(body["uuid"], _join(p, "uuid")),
                model=_text(body["model"], _join(p, "model")),
                memory_mib=_int(body["memory_mib"], _join(p, "memory_mib")),
                sm_count=_int(body.get("sm_count", 0), _join(p, "sm_count"), minimum=0),
                memory_oversub=_positive(
                    body.get("memory_oversub", defaults.get("memory_oversub", 1.0)),
                    _join(p, "memory_oversub"),
                ),
                cores_oversub=_positive(
                    body.get("cores_oversub", defaults.get("cores_oversub", 1.0)),
                    _join(p, "cores_oversub"),
                ),
                mode=Mode(mode),
                mig_profiles=tuple(profiles),
                index=index,
            )
        )
    return tuple(gpus)


def _load_node(body: Any, path: str, name: str | None = None) -> Node:
    if isinstance(body, (list, tuple)) and name is not None:
        body = {"gpus": body}
    body = _mapping(body, path, NODE_KEYS)
    if name is None:
        if "name" not in body:
            raise ConfigError("is required", _join(path, "name"))
        name = _text(body["name"], _join(path, "name"))
    elif "name" in body and body["name"] != name:
        raise ConfigError(f"differs from the node's key {name!r}, got {_shown(body['name'])}",
                          _join(path, "name"))
    defaults: dict[str, Any] = {}
    if "mode" in body:
        defaults["mode"] = _choice(body["mode"], _join(path, "mode"), MODES)
    for key in ("memory_oversub", "cores_oversub"):
        if key in body:
            defaults[key] = _positive(body[key], _join(path, key))
    node: dict[str, Any] = {}
    for key in ("cpu_millicores", "host_memory_mib"):
        if body.get(key) is not None:
            node[key] = _int(body[key], _join(path, key))
    for key in ("cpu_requested_millicores", "host_memory_requested_mib"):
        if key in body:
            node[key] = _int(body[key], _join(path, key), minimum=0)
    return Node(name=name, gpus=load_gpus(body.get("gpus", []), _join(path, "gpus"), defaults),
                **node)


def load_pool(data: Mapping | list | str | Pool) -> Pool:
    """The static or simulated inventory.

    Accepted: a list of nodes ``[{name, gpus: [...], mode?, memory_oversub?, cores_oversub?}]``;
    a mapping ``{nodes: <that list> or {name: {gpus...} or [gpus]}, simulated: "2xH100-80GB"}``;
    or a simulated spec string.
    """
    if isinstance(data, Pool):
        return data
    if isinstance(data, str):
        return parse_simulated(data)
    nodes: list[Node] = []
    if isinstance(data, (list, tuple)):
        nodes = [_load_node(body, _join("nodes", i)) for i, body in enumerate(data)]
    else:
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"the GPU inventory must be a list of nodes or a mapping with keys "
                f"{', '.join(POOL_KEYS)}, got {_shown(data)}"
            )
        body = _mapping(data, "", POOL_KEYS)
        raw = body.get("nodes", [])
        if isinstance(raw, Mapping):
            _names(raw, "nodes", "node")
            nodes = [_load_node(b, _join("nodes", n), name=n) for n, b in raw.items()]
        elif isinstance(raw, (list, tuple)):
            nodes = [_load_node(b, _join("nodes", i)) for i, b in enumerate(raw)]
        else:
            raise ConfigError(f"must be a list of nodes or a mapping of node name to node, got "
                              f"{_shown(raw)}", "nodes")
        if body.get("simulated"):
            nodes.extend(parse_simulated(_text(body["simulated"], "simulated")).nodes)
    names: set[str] = set()
    uuids: set[str] = set()
    for i, node in enumerate(nodes):
        if node.name in names:
            raise ConfigError(f"node {node.name!r} appears twice", _join("nodes", i))
        names.add(node.name)
        for j, gpu in enumerate(node.gpus):
            if gpu.uuid in uuids:
                raise ConfigError(f"GPU uuid {gpu.uuid!r} appears twice in the pool",
                                  _join(_join(_join("nodes", i), "gpus"), j))
            uuids.add(gpu.uuid)
    return Pool(nodes=tuple(nodes))


# ---- simulated GPUs -----------------------------------------------------------------------

#: memory (GiB) and SM count of common models, for specs without a size ("1xT4")
KNOWN_MODELS: dict[str, tuple[float, int]] = {
    "T4": (16, 40), "L4": (24, 58), "A10": (24, 72), "A10G": (24, 80), "L40": (48, 142),
    "L40S": (48, 142), "V100": (16, 80), "A100": (40, 108), "H100": (80, 132),
    "H200": (141, 132), "B200": (180, 148),
}
_ITEM = re.compile(r"^\s*(\d+)\s*[xX×]\s*([A-Za-z0-9][A-Za-z0-9_.-]*)\s*$")
_SIZE = re.compile(r"-(\d+(?:\.\d+)?)\s*(?:GB|GIB|G)$", re.IGNORECASE)


def parse_simulated(spec: str, node: str = "localhost") -> Pool:
    """``"2xH100-80GB"`` or ``"2xH100-80GB,1xA100-40GB"`` -> one node with fake GPUs
    (uuids ``GPU-sim-0000``...). Sizes are GiB; a known model may leave the size out (``1xT4``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            f"simulated GPUs: expected COUNTxMODEL-SIZE items separated by commas, e.g. "
            f"'2xH100-80GB,1xA100-40GB', got {_shown(spec)}"
        )
    gpus: list[GPU] = []
    for item in spec.split(","):
        match = _ITEM.match(item)
        if not match:
            raise ConfigError(
                f"simulated GPUs: {item.strip()!r} is not COUNTxMODEL-SIZE, e.g. '2xH100-80GB'"
            )
        count, model = int(match.group(1)), match.group(2)
        if not 1 <= count <= 64:
            raise ConfigError(f"simulated GPUs: {item.strip()!r}: the count must be 1 to 64")
        base = model.split("-")[0].upper()
        size = _SIZE.search(model)
        if size:
            memory_mib = round(float(size.group(1)) * 1024)
        elif base in KNOWN_MODELS:
            memory_mib = round(KNOWN_MODELS[base][0] * 1024)
        else:
            raise ConfigError(
                f"simulated GPUs: {item.strip()!r} has no memory size; write it as "
                f"MODEL-<N>GB, e.g. '{model}-16GB' (known models without a size: "
                f"{', '.join(KNOWN_MODELS)})"
            )
        if memory_mib <= 0:
            raise ConfigError(f"simulated GPUs: {item.strip()!r}: the size must be above 0")
        sm_count = KNOWN_MODELS.get(base, (0, 0))[1]
        for _ in range(count):
            i = len(gpus)
            gpus.append(GPU(uuid=f"GPU-sim-{i:04d}", model=model, memory_mib=memory_mib,
                            sm_count=sm_count, index=i))
    return Pool(nodes=(Node(name=node, gpus=tuple(gpus)),))
