"""Every key of the admission config (quotas.load_config) can be set from the chart's values:
the schema knows each one with load_config's types and bounds, and what the chart renders is
what load_config reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from quotas import config as C
from quotas import load_config
from tests.helm import tools

try:
    tools.helm_path()
except tools.HelmMissing as e:
    pytest.skip(str(e), allow_module_level=True)

SCHEMA = json.loads((tools.CHART / "values.schema.json").read_text())


def _resolve(node: dict) -> dict:
    """A schema node with its "#/definitions/<name>" reference merged in."""
    if "$ref" in node:
        return {**SCHEMA["definitions"][node["$ref"].rsplit("/", 1)[1]], **node}
    return node


def _object(path: str) -> dict:
    """The schema of admission.<path> ("" is admission itself; "*" is any map entry)."""
    node = _resolve(SCHEMA["properties"]["admission"])
    for part in filter(None, path.split(".")):
        node = _resolve(node["additionalProperties"] if part == "*" else node["properties"][part])
    return node


# (schema object under admission, load_config's constant listing the keys it accepts there)
SECTIONS = [
    ("", C.CONFIG_KEYS),
    ("priority_classes.*", C.CLASS_KEYS),
    ("placement", C.PLACEMENT_KEYS),
    ("preemption", C.PREEMPTION_KEYS),
    ("queue", C.QUEUE_KEYS),
    ("queue.moves", C.MOVE_KEYS),
    ("workspaces.*", C.WORKSPACE_KEYS),
    ("workspaces.*.namespaces.*", C.NAMESPACE_KEYS),
    ("workspaces.*.limits", C.LIMIT_KEYS),
]


@pytest.mark.parametrize(("path", "keys"), SECTIONS, ids=[s[0] or "admission" for s in SECTIONS])
def test_schema_knows_exactly_the_keys_load_config_accepts(path, keys):
    """A key added to quotas/config.py fails here until the chart's schema declares it (with a
    description), and the schema accepts no key that load_config would refuse."""
    node = _object(path)
    assert node.get("additionalProperties") is False, f"admission.{path} accepts unknown keys"
    assert set(node["properties"]) == set(keys), f"admission.{path}"
    undescribed = [k for k, v in node["properties"].items() if not v.get("description")]
    assert not undescribed, f"admission.{path}: no description for {undescribed}"


def test_schema_placement_choices_are_load_configs():
    for key in C.PLACEMENT_KEYS:
        assert _object(f"placement.{key}")["enum"] == list(C.STRATEGIES)


def _values_file(tmp_path: Path, values: dict) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _rendered_config(tmp_path: Path, admission: dict) -> dict:
    docs = tools.render([_values_file(tmp_path, {"admission": admission})])
    cm = tools.one(docs, "ConfigMap", f"{tools.RELEASE}-elastic-gpu-admission")
    return yaml.safe_load(cm["data"]["config.yaml"])


def test_queue_preemption_fgd_and_movable_classes_reach_the_hub_from_values(tmp_path):
    admission = {
        "priority_classes": {"low": {"value": 10, "borrow": True, "movable": True}},
        "placement": {"node": "fgd", "gpu": "fgd"},
        "preemption": {"max_candidate_nodes": 25},
        "queue": {
            "reserve_after_seconds": 30.5,
            "reserve_spots": 2,
            "hold": True,
            "moves": {"max_slices": 4, "per_hour": 20, "same_session_after_seconds": 600},
        },
    }
    rendered = _rendered_config(tmp_path, admission)
    assert rendered["queue"] == admission["queue"]
    policy = load_config(rendered).policy
    assert policy.priority_classes["low"].movable is True
    assert policy.priority_classes["default"].movable is False  # values.yaml's classes: unchanged
    assert (policy.placement.node, policy.placement.gpu) == ("fgd", "fgd")
    assert policy.max_preemption_nodes == 25
    assert policy.reserve_after_seconds == 30.5 and policy.reserve_spots == 2
    assert policy.hold_for_overdue_head is True
    assert (policy.moves.max_slices, policy.moves.per_hour) == (4, 20)
    assert policy.moves.same_session_after_seconds == 600


def test_queue_nulls_and_with_moves_survive_rendering(tmp_path):
    """null means "never reserve" / "never move"; Helm keeps a null it has no default for."""
    admission = {"queue": {"reserve_after_seconds": None, "hold": "with-moves", "moves": None}}
    policy = load_config(_rendered_config(tmp_path, admission)).policy
    assert policy.reserve_after_seconds is None
    assert policy.hold_for_overdue_head is None  # with-moves
    assert policy.moves.max_slices == 0
