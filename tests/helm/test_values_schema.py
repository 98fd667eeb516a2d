"""values.schema.json: a bad value fails helm lint / template / install with a message naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helm import tools

try:
    tools.helm_path()
except tools.HelmMissing as e:
    pytest.skip(str(e), allow_module_level=True)


def _values_file(tmp_path: Path, values: dict) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


# (values, the key path helm's error must name, a fragment of what is allowed)
BAD_VALUES = [
    ({"admission": {"placement": {"node": 5}}}, "/admission/placement/node", "want string"),
    ({"admission": {"placement": {"gpu": "roundrobin"}}}, "/admission/placement/gpu", "'binpack', 'spread'"),
    ({"nodeAgent": {"metricsPort": "x"}}, "/nodeAgent/metricsPort", "want integer"),
    ({"nodeAgent": {"metricsPort": 70000}}, "/nodeAgent/metricsPort", "maximum"),
    ({"gpuBackend": "vgpu"}, "/gpuBackend", "'native', 'hami', 'mig', 'whole'"),
    ({"nodeAgent": {"metricPort": 9400}}, "/nodeAgent", "'metricPort' not allowed"),
    (
        {"admission": {"priority_classes": {"high": {"value": "top"}}}},
        "/admission/priority_classes/high/value",
        "integer",
    ),
    (
        {"admission": {"priority_classes": {"high": {"value": 2000000000}}}},
        "/admission/priority_classes/high/value",
        "maximum",
    ),
    (
        {"admission": {"workspaces": {"default": {"limits": {"memory_mib": 0}}}}},
        "/admission/workspaces/default/limits/memory_mib",
        "minimum",
    ),
    (
        {"admission": {"workspaces": {"default": {"limits": {"memory_gib": 80}}}}},
        "/admission/workspaces/default/limits",
        "'memory_gib' not allowed",
    ),
    (
        {"admission": {"workspaces": {"v": {"namespaces": {"r": {"users": {"bob": {"gpus": 1.5}}}}}}}},
        "/admission/workspaces/v/namespaces/r/users/bob/gpus",
        "integer",
    ),
    ({"culler": {"enabled": "yes"}}, "/culler/enabled", "want boolean"),
    (
        {"monitoring": {"serviceMonitor": {"interval": "often"}}},
        "/monitoring/serviceMonitor/interval",
        "does not match",
    ),
    ({"userNamespace": "Jupyter_Users"}, "/userNamespace", ""),
    ({"nodeAgent": {"hostLibDir": "var/lib/x"}}, "/nodeAgent/hostLibDir", "does not match"),
    (
        {"metering": {"prices": {"H100-80GB": {"gpu_hour": -1}}}},
        "/metering/prices/H100-80GB/gpu_hour",
        "minimum",
    ),
    (
        {"metering": {"prices": {"H100-80GB": {"gpu_hour": "3 EUR"}}}},
        "/metering/prices/H100-80GB/gpu_hour",
        "want number",
    ),
    (
        {"metering": {"prices": {"H100-80GB": {"per_hour": 3}}}},
        "/metering/prices/H100-80GB",
        "'per_hour' not allowed",
    ),
    ({"metering": {"currency": ""}}, "/metering/currency", "does not match"),
    # the queue and movable classes (quotas.load_config's queue.*, priority_classes.*.movable)
    ({"admission": {"queue": {"hold": "sometimes"}}}, "/admission/queue/hold", "'with-moves'"),
    (
        {"admission": {"priority_classes": {"low": {"value": 10, "movable": "yes"}}}},
        "/admission/priority_classes/low/movable",
        "want boolean",
    ),
    ({"admission": {"queue": {"reserve_spots": 0}}}, "/admission/queue/reserve_spots", "minimum"),
    (
        {"admission": {"queue": {"reserve_after_seconds": -1}}},
        "/admission/queue/reserve_after_seconds",
        "minimum",
    ),
    ({"admission": {"queue": {"moves": {"per_hour": -1}}}}, "/admission/queue/moves/per_hour", "minimum"),
    (
        {"admission": {"queue": {"moves": {"max_slice": 2}}}},
        "/admission/queue/moves",
        "'max_slice' not allowed",
    ),
    (
        {"admission": {"preemption": {"max_candidate_nodes": 0}}},
        "/admission/preemption/max_candidate_nodes",
        "minimum",
    ),
]


@pytest.mark.parametrize(("values", "key", "allowed"), BAD_VALUES, ids=[b[1] for b in BAD_VALUES])
def test_bad_value_fails_template_naming_the_key(tmp_path, values, key, allowed):
    proc = tools.template([_values_file(tmp_path, values)])
    assert proc.returncode != 0, f"accepted {values}"
    assert f"at '{key}'" in proc.stderr, proc.stderr
    assert allowed in proc.stderr, proc.stderr
    assert "panic" not in proc.stderr and "goroutine" not in proc.stderr


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"admission": {"placement": {"node": 5}}}, "/admission/placement/node"),
        ({"admission": {"queue": {"hold": "sometimes"}}}, "/admission/queue/hold"),
    ],
)
def test_bad_value_fails_lint_naming_the_key(tmp_path, values, key):
    proc = tools.lint([_values_file(tmp_path, values)])
    assert proc.returncode != 0
    assert key in proc.stdout + proc.stderr


def test_bad_value_fails_helm_install_naming_the_key(tmp_path):
    """`helm install` (client-side dry run: no cluster here) runs the same schema check."""
    bad = _values_file(tmp_path, {"nodeAgent": {"metricsPort": "x"}})
    proc = tools.helm(
        "install", tools.RELEASE, str(tools.CHART), "--namespace", tools.NAMESPACE,
        "--dry-run=client", "--values", str(bad),
    )  # fmt: skip
    assert proc.returncode != 0
    assert "INSTALLATION FAILED" in proc.stderr and "at '/nodeAgent/metricsPort'" in proc.stderr
    ok = tools.helm("install", tools.RELEASE, str(tools.CHART), "--namespace", tools.NAMESPACE, "--dry-run=client")
    assert ok.returncode == 0, ok.stderr


def test_wrong_type_given_with_set_is_rejected_too():
    proc = tools.template(set_values=["nodeAgent.metricsPort=x"])
    assert proc.returncode != 0 and "at '/nodeAgent/metricsPort'" in proc.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"admission": {"default_priority_class": "gold"}},
            'admission.default_priority_class: "gold" is not one of admission.priority_classes (default, high, low)',
        ),
        (
            {"culler": {"apiToken": {"existingSecret": {"name": ""}}}},
            "culler.apiToken: set culler.apiToken.value or culler.apiToken.existingSecret.name",
        ),
        (
            {"admission": {"priority_classes": {"Gold_Class": {"value": 5}}}},
            'admission.priority_classes: class name "Gold_Class" must be lower-case letters',
        ),
        (
            {"priorityClasses": {"prefix": "system-"}},
            "priorityClasses.prefix: PriorityClass names may not start with 'system-'",
        ),
    ],
)
def test_cross_field_errors_name_the_key(tmp_path, values, message):
    proc = tools.template([_values_file(tmp_path, values)])
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_schema_covers_every_default_value():
    """Every key in values.yaml is declared in the schema (additionalProperties is false at the
    top and in every section, so an undeclared default would make the chart fail to render)."""
    schema = json.loads((tools.CHART / "values.schema.json").read_text())
    values = yaml.safe_load((tools.CHART / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    assert set(values) <= set(schema["properties"])
    for section, body in values.items():
        if isinstance(body, dict):
            declared = schema["properties"][section]
            if "$ref" not in declared:
                assert declared.get("additionalProperties") is False, section
                assert set(body) <= set(declared["properties"]), section


def test_chart_renders_as_a_subchart_with_globals(tmp_path):
    """A parent chart passes `global`; the strict schema must still accept it."""
    proc = tools.template([_values_file(tmp_path, {"global": {"imageRegistry": "x"}})])
    assert proc.returncode == 0, proc.stderr


def _keys_without_description(schema: dict, values: dict, root: dict, path: str = "") -> list[str]:
    """Paths of values.yaml keys whose schema property has no description (free-form maps such
    as nodeSelector or the admission config are described once, at their own key)."""
    missing = []
    for key, value in values.items():
        prop = schema.get("properties", {}).get(key)
        where = f"{path}.{key}" if path else key
        if prop is None:
            continue  # test_schema_covers_every_default_value catches unknown keys
        if not prop.get("description"):
            missing.append(where)
        if "$ref" in prop:  # "#/definitions/<name>"
            prop = {**root["definitions"][prop["$ref"].rsplit("/", 1)[1]], **prop}
        if isinstance(value, dict) and "properties" in prop:
            missing += _keys_without_description(prop, value, root, where)
    return missing


def test_every_values_key_has_a_description():
    schema = json.loads((tools.CHART / "values.schema.json").read_text())
    values = yaml.safe_load((tools.CHART / "values.yaml").read_text())
    missing = _keys_without_description(schema, values, schema)
    assert not missing, f"values.schema.json has no description for: {', '.join(missing)}"
